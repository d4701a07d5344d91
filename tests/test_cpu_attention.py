"""The "sdpa_cpu_gqa" attention (dcoco_hf/runtime/cpu_attention.py): same numbers as transformers' "sdpa", without the
key/value expansion in masked multi-row forwards, and plain 1-token decoding untouched."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import transformers
import transformers.integrations.sdpa_attention as hf_sdpa
from conftest import PROMPT_LEN, make_target

from dcoco_hf import CPU_GQA_ATTENTION, speculative_generate
from dcoco_hf.cli.common import resolve_attn
from dcoco_hf.runtime.hf_compat import cache_kwargs, output_cache


@contextmanager
def attention(model, implementation: str):
    saved = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


@pytest.fixture
def expansions(monkeypatch) -> list[int]:
    """Counts transformers' repeat_kv calls (one per key or value tensor it expands)."""
    calls: list[int] = []
    original = hf_sdpa.repeat_kv

    def counting(hidden_states, n_rep):
        calls.append(n_rep)
        return original(hidden_states, n_rep)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counting)
    return calls


def _cached_forwards(target, new_rows: int) -> list[torch.Tensor]:
    """Logits of a left-padded 2-row prefill, then of one forward of `new_rows` tokens per row on its cache."""
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (2, 9), generator=generator)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding: the mask is never all-visible
    new = torch.randint(0, vocab, (2, new_rows), generator=generator)
    with torch.no_grad():
        first = target(input_ids=prompt, attention_mask=mask, use_cache=True)
        full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        second = target(input_ids=new, attention_mask=full_mask, **cache_kwargs(output_cache(first)), use_cache=True)
    return [first.logits, second.logits]


@pytest.mark.parametrize("arch_name", ["llama", "qwen3"])
def test_masked_multi_row_forwards_match_sdpa_without_expanding_keys(arch_name, expansions):
    target = make_target(arch_name)  # 4 query heads, 2 key/value heads
    reference = _cached_forwards(target, new_rows=3)
    assert expansions, "transformers' sdpa no longer expands keys/values here: this test no longer tests anything"
    expansions.clear()
    with attention(target, CPU_GQA_ATTENTION):
        got = _cached_forwards(target, new_rows=3)
    assert expansions == []
    for ours, theirs in zip(got, reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_one_token_steps_stay_bit_identical(expansions):
    target = make_target("llama")
    reference = _cached_forwards(target, new_rows=1)
    with attention(target, CPU_GQA_ATTENTION):
        got = _cached_forwards(target, new_rows=1)
    assert torch.equal(got[1], reference[1])  # decoding goes through transformers' own function


def test_speculative_greedy_with_cpu_gqa_attention_equals_plain_sdpa(fitted):
    target, drafter = fitted
    accepted = 0
    for seed in range(4):
        ids = torch.randint(0, target.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        with attention(target, CPU_GQA_ATTENTION):
            got = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        accepted += sum(drafter.generation_stats(got).accepted)
    assert accepted > 10  # accepted drafts: the verify forwards' rows beyond the first were used, not only computed


def test_from_pretrained_accepts_the_name(tmp_path):
    make_target("qwen3").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=CPU_GQA_ATTENTION)
    assert model.config._attn_implementation == CPU_GQA_ATTENTION


def test_cli_loads_sdpa_and_leaves_the_cpu_switch_to_attach():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attn(None, cpu, torch.float32) == "sdpa"  # attach() switches it to sdpa_cpu_gqa on CPU
    assert resolve_attn("sdpa", cpu, torch.float32) == "sdpa"
    assert resolve_attn(None, cuda, torch.float32) == "sdpa"


def test_batched_speculation_on_it_is_exact_and_never_expands_keys(fitted, expansions):
    """Left padding masks every forward of a batch: prefill, verify and the drafter's block forwards all take the
    masked-GQA path, and the output stays plain batched generate()'s."""
    target, drafter = fitted
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, target.config.vocab_size, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :2] = 0, 0
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, **common)
    with attention(target, CPU_GQA_ATTENTION), attention(drafter, CPU_GQA_ATTENTION):
        expansions.clear()
        got = speculative_generate(target, ids, drafter=drafter, **common)
    assert got.sequences.tolist() == expected.tolist()
    assert sum(sum(stats.accepted) for stats in got.stats) > 0
    assert expansions == []
