"""The batched loop on a static target cache (`dcoco_hf/runtime/target_cache.py`) is as exact as on the dynamic one.

Greedy: token for token plain batched `generate()` and the dynamic-cache run (tiny Llama and Qwen3 targets, ragged
left-padded batches, fitted and scrambled correctors), with rows ending on EOS and leaving the batch, compaction
after every cycle and compaction forced by a full buffer, sliding-window targets, and through
`target.generate(custom_generate=...)`. The buffers are allocated once per layer per call. Sampling: the empirical
distribution of a batch of samples matches the exact one. Which kind a call uses, and what is refused.
"""

from __future__ import annotations

import pytest
import test_batched
import torch
from conftest import scrambled
from test_batched import (  # noqa: F401
    CASES,
    N_SAMPLES,
    PAD,
    SETTINGS,
    left_padded,
    sample_batch,
    sampling_models,
)
from test_reliability import _left_padded, sliding  # noqa: F401
from sampling_reference import exact_distribution, histogram, iid_tv_quantiles, total_variation
from transformers import GenerationConfig

import dcoco_hf.runtime.generation as generation
import dcoco_hf.runtime.target_cache as target_cache
from dcoco_hf import speculative_generate
from dcoco_hf.runtime.target_cache import StaticTargetLayer


@pytest.fixture
def allocations(monkeypatch) -> list[StaticTargetLayer]:
    """Every static layer that allocated its buffers during the test (once per layer per call)."""
    allocated = []
    allocate = StaticTargetLayer.lazy_initialization

    def recording(layer, key_states, value_states):
        allocated.append(layer)
        return allocate(layer, key_states, value_states)

    monkeypatch.setattr(StaticTargetLayer, "lazy_initialization", recording)
    return allocated


def both_kinds(target, drafter, ids, **common) -> torch.LongTensor:
    """The static run's sequences, after checking they equal plain generate()'s and the dynamic run's."""
    expected = target.generate(ids, **common)
    dynamic = speculative_generate(target, ids, drafter=drafter, cache_implementation="dynamic", **common)
    static = speculative_generate(target, ids, drafter=drafter, cache_implementation="static", **common)
    assert static.sequences.tolist() == expected.tolist()
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    assert [s.accepted for s in static.stats] == [s.accepted for s in dynamic.stats]  # the same cycles
    return static.sequences


@pytest.mark.parametrize("seed,lengths,max_new_tokens", [CASES[1], CASES[3], CASES[5], CASES[7]])
@pytest.mark.parametrize("variant", ["fitted", "scrambled"])
def test_static_greedy_equals_plain_and_dynamic(fitted, arch, variant, seed, lengths, max_new_tokens, allocations):
    target, drafter = fitted
    if variant == "scrambled":
        drafter = scrambled(drafter, seed=seed)
    ids, mask = left_padded(seed, lengths)
    both_kinds(target, drafter, ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
               pad_token_id=PAD)
    layers = target.config.num_hidden_layers
    assert len(allocations) == layers  # one allocation per layer for the whole call: no per-cycle reallocation


def test_static_rows_leave_on_eos(fitted, arch):
    """Rows ending on EOS at different cycles leave the static buffers (their rows copied away) exactly."""
    target, drafter = fitted
    for seed in range(3):
        ids, mask = left_padded(100 + seed, [7, 3, 10, 5, 8, 2][: 4 + seed])
        free = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
        eos = int(free[seed % ids.shape[0], ids.shape[1] + 9])
        got = both_kinds(target, drafter, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         pad_token_id=PAD, eos_token_id=eos)
        assert (got[:, ids.shape[1]:] == eos).any(1).any()


def _counting_compactions(monkeypatch) -> list[int]:
    calls = []
    compact = generation.compact
    monkeypatch.setattr(generation, "compact", lambda *args: calls.append(1) or compact(*args))
    return calls


def test_static_compaction_every_cycle(fitted, monkeypatch):
    target, drafter = fitted
    monkeypatch.setattr(generation, "COMPACT_WASTE", -1.0)
    calls = _counting_compactions(monkeypatch)
    ids, mask = left_padded(*CASES[7][:2])
    free = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    for eos in (None, int(free[0, ids.shape[1] + 4])):
        both_kinds(target, drafter, ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                   eos_token_id=eos)
    assert len(calls) > 6


def test_static_compaction_when_the_buffer_is_full(fitted, monkeypatch):
    """Without headroom for holes and never compacting for waste, the loop packs only when the next block would not
    fit in the buffers: it does, and the output stays exact."""
    target, drafter = fitted
    monkeypatch.setattr(target_cache, "STATIC_HEADROOM", 0.0)
    monkeypatch.setattr(generation, "COMPACT_WASTE", 2.0)
    calls = _counting_compactions(monkeypatch)
    ids, mask = left_padded(*CASES[7][:2])
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, cache_implementation="static", **common)
    assert got.sequences.tolist() == expected.tolist()
    assert calls  # the buffer filled up with holes, and packing made room


def test_static_one_host_sync_per_cycle(fitted, monkeypatch):
    """Writing, cropping, selecting rows and packing in the static buffers read nothing on the host: still one sync
    per cycle, compaction and rows leaving included."""
    monkeypatch.setattr(generation, "static_cache_wanted", lambda config, device: True)
    test_batched.test_one_host_sync_per_cycle(fitted, "context_bigrams", [7, 7], True, "constant", 0, monkeypatch)
    test_batched.test_one_host_sync_per_cycle(fitted, "context_bigrams", [7, 7], True, "constant", 6, monkeypatch)


@pytest.mark.parametrize("seed,lengths,max_new_tokens", [(0, [3, 9, 6, 1], 24), (1, [7, 2], 13)])
def test_static_sliding_window_targets(sliding, seed, lengths, max_new_tokens, monkeypatch):  # noqa: F811
    """Sliding-window layers keep every column in the static buffers too; the window is in the masks."""
    target, drafter = sliding
    # Whole blocks every cycle: the cost-aware schedule learns across calls, so two runs would propose differently.
    monkeypatch.setattr(drafter.generation_config, "num_assistant_tokens_schedule", "constant")
    ids, mask = _left_padded(seed, lengths)
    both_kinds(target, drafter, ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
               pad_token_id=PAD)


def test_static_through_custom_generate(fitted, allocations):
    """`target.generate(custom_generate=speculative_generate, cache_implementation="static")`, the transformers way
    (generate() also prepares its own static cache, which stays unallocated: the loop sizes its own)."""
    target, drafter = fitted
    ids, mask = left_padded(50, [5, 9, 2])
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = target.generate(ids, custom_generate=speculative_generate, drafter=drafter, cache_implementation="static",
                          **common)
    assert got.tolist() == expected.tolist()
    assert len(allocations) == target.config.num_hidden_layers
    config = GenerationConfig(**{**target.generation_config.to_dict(), "cache_implementation": "static"})
    got = target.generate(ids, custom_generate=speculative_generate, drafter=drafter, generation_config=config,
                          **common)
    assert got.tolist() == expected.tolist()
    assert len(allocations) == 2 * target.config.num_hidden_layers


def test_cache_kind_choice():
    """Unset: static on CUDA, dynamic elsewhere; named: as named (transformers' older static names too)."""
    unset = GenerationConfig()
    assert generation.static_cache_wanted(unset, torch.device("cuda"))
    assert not generation.static_cache_wanted(unset, torch.device("cpu"))
    for kind, static in (("static", True), ("hybrid", True), ("dynamic", False)):
        for device in ("cpu", "cuda"):
            assert generation.static_cache_wanted(
                GenerationConfig(cache_implementation=kind), torch.device(device)
            ) is static
    with pytest.raises(ValueError, match=r"cache_implementation='offloaded' is not supported.*\"static\" or"):
        generation.static_cache_wanted(GenerationConfig(cache_implementation="offloaded"), torch.device("cpu"))


def test_other_cache_kinds_are_refused_clearly(fitted):
    target, drafter = fitted
    ids, mask = left_padded(60, [4, 6])
    # use_cache=False: generate() then builds no cache of its own before the loop (an offloaded one needs a GPU
    # stream, a quantized one its package); the loop keeps its own cache either way and reads the kind asked for.
    for kind in ("offloaded_static", "quantized"):
        with pytest.raises(ValueError, match=f"'{kind}' is not supported by speculative_generate"):
            speculative_generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=5,
                                 pad_token_id=PAD, cache_implementation=kind, use_cache=False)


def test_static_layer_refuses_to_outgrow_its_buffers():
    layer = StaticTargetLayer(capacity=4)
    states = torch.zeros(2, 1, 3, 8)  # [B, heads, n, D]
    keys, _ = layer.update(states, states)
    assert keys.shape == (2, 1, 3, 8) and layer.get_mask_sizes(1) == (4, 0)
    with pytest.raises(RuntimeError, match="holds 4 columns; this write needs 6"):
        layer.update(states, states)
    with pytest.raises(ValueError, match="minus the number"):
        layer.crop(1)


@pytest.mark.parametrize("setting", ["t07-k4-p09"])
def test_static_sampling_matches_exact_distribution(sampling_models, setting):  # noqa: F811
    target, drafter = sampling_models
    probs = exact_distribution(target, SETTINGS[setting])
    q99 = iid_tv_quantiles(probs, N_SAMPLES)[1]
    torch.manual_seed(2024)
    out = sample_batch(target, drafter, {**SETTINGS[setting], "cache_implementation": "static"}, N_SAMPLES)
    tv = total_variation(histogram(out.sequences), probs)
    assert tv < q99, (tv, q99)
