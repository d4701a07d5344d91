"""bitsandbytes 8-bit and 4-bit targets keep the guarantees: greedy output equals plain `generate()` of the same
quantized target token for token, sampling is distributed exactly like it, on both paths (`target.generate(...,
assistant_model=drafter)` and the batched `speculative_generate`). (On real models bitsandbytes' rounding of each
activation row can still part greedy paths at a near-tie, as half precision does: docs/quantized.md. These tiny
targets have no such near-ties on the tested prompts.)

Tiny random-weight Llama targets are saved in fp32 and loaded back quantized, exactly as a user loads a Hub model;
the drafter is fitted to the fp32 target (conftest's), so its drafts are often accepted by the quantized one. The 8-bit
target uses the CLI's config (rows quantized on their own, no outlier columns), the 4-bit one nf4 computing in float32.
Also: the CPU few-rows layouts never touch a quantized linear, the tap records the quantized model's own hidden states,
and `dcoco-hf generate --quantize` runs end to end.
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
import torch
from conftest import _FITTED, VOCAB, fit_drafter, make_target, scrambled
from sampling_reference import (
    PROMPT,
    T,
    V,
    exact_distribution,
    histogram,
    iid_tv_quantiles,
    random_drafter,
    total_variation,
)
from test_half_precision import attach_log
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dcoco_hf import DCOCODrafter, speculative_generate
from dcoco_hf.cli.common import quantization_config
from dcoco_hf.runtime.cpu_attention import CPU_GQA_ATTENTION
from dcoco_hf.runtime.cpu_linear import (
    FewRowsLinear,
    few_rows_plan,
    restore_linear,
    use_few_rows_linear,
)
from dcoco_hf.runtime.precision import (
    describe_quantization,
    precision_notes,
    quantized_linears,
    target_compute_dtype,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed: pip install 'dcoco-hf[bnb]' (CI installs it with .[test])",
)

QUANTIZATIONS = ["8bit", "4bit"]
LAYERS = 4
PAD = 0


def peaked_target(vocab: int, seed: int) -> LlamaForCausalLM:
    """A tiny Llama target with peaked but non-degenerate next-token distributions (the lm_head stays
    unquantized); 64 wide, so that it also fits bitsandbytes' AVX512-BF16 layout of 4-bit weights (blocks of 64)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def load_quantized(folder, quantization: str) -> LlamaForCausalLM:
    config = quantization_config(quantization, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map={"": "cpu"})
    pin_exact_kernels(model)
    return model.eval().requires_grad_(False)


def pin_exact_kernels(model) -> None:
    """Keep 4-bit products in float32 (dequantize, then F.linear) on every CPU.

    On CPUs with AVX512-BF16, bitsandbytes' Linear4bit otherwise repacks its weight at the first inference forward
    and rounds each input row to bfloat16. That rounding makes float32 differences of 1e-7 between a verify forward
    and a 1-token step (attention over a different number of rows) into bfloat16-sized ones, so greedy paths can part
    at a near-tie exactly as in half precision (docs/quantized.md), and which CPU runs the test would decide whether
    it passes. The float32 path is the one CPUs without AVX512-BF16 take anyway.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def attached(drafter: DCOCODrafter, target) -> DCOCODrafter:
    """A copy of `drafter` attached to `target` (untuned: the CPU tuning is tested on its own below)."""
    return copy.deepcopy(drafter).attach(target, tune=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder of conftest's fp32 tiny Llama target, the drafter fitted to it), the fitting shared with the other
    test modules of the session."""
    if "llama" not in _FITTED:
        target = make_target("llama")
        _FITTED["llama"] = (target, fit_drafter(target))
    target, drafter = _FITTED["llama"]
    folder = tmp_path_factory.mktemp("quantized") / "target"
    target.save_pretrained(folder)
    return folder, drafter


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def quantized(request, saved):
    """(quantization, quantized target, fitted drafter attached to it)."""
    folder, drafter = saved
    target = load_quantized(folder, request.param)
    return request.param, target, attached(drafter, target)


def _prompt(seed: int, length: int, vocab: int = VOCAB) -> torch.LongTensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# What attach meets in a quantized target
# ----------------------------------------------------------------------------------------------------------------


def test_precision_helpers_describe_the_quantized_target(quantized):
    quantization, target, drafter = quantized
    assert target_compute_dtype(target) == torch.float32  # the embedding's dtype: the hidden states' dtype
    assert drafter.dtype == torch.float32
    expected = {
        "8bit": "8-bit bitsandbytes (LLM.int8(), outlier threshold 0.0)",
        "4bit": "4-bit nf4 bitsandbytes, compute float32",
    }[quantization]
    assert describe_quantization(target) == expected
    assert quantized_linears(target) == 7 * LAYERS  # q, k, v, o, gate, up, down per layer; lm_head stays fp32
    note = f"target {expected}: its {7 * LAYERS} quantized linears keep their own kernels"
    assert precision_notes(drafter, target) == [note]
    assert attach_log(copy.deepcopy(drafter), target) == [note]  # attach says what it met


def test_cpu_layouts_never_swap_quantized_linears(quantized):
    """bitsandbytes' Linear8bitLt / Linear4bit subclass nn.Linear; the few-rows layouts must leave them alone (their
    weights are int8 or packed 4-bit) and take only the plain fp32 lm_head."""
    _, target, _ = quantized
    classes = {name: type(m) for name, m in target.named_modules()}
    try:
        use_few_rows_linear(target, max_rows=8, layout="transposed")
        swapped = {name for name, m in target.named_modules() if type(m) is FewRowsLinear}
        assert swapped == {"lm_head"}
        assert all(type(m) is classes[name] for name, m in target.named_modules() if name != "lm_head")
        assert few_rows_plan(target) == {rows: "transposed" for rows in range(2, 9)}
    finally:
        assert restore_linear(target) == 1


def test_plain_linear_with_a_non_float_weight_is_left_alone():
    """A plain nn.Linear holding a quantized (integer) weight, as some quantizers leave it, is not taken either."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    use_few_rows_linear(model, max_rows=4, layout="transposed")
    assert [type(m) for m in model] == [FewRowsLinear, torch.nn.Linear]
    restore_linear(model)


def test_tap_reads_the_quantized_models_hidden_states(quantized):
    _, target, drafter = quantized
    ids = _prompt(5, 9)
    tap = drafter.tap
    tap.listen()
    try:
        with torch.no_grad():  # as in generate(): bitsandbytes picks its kernels by grad mode
            target(ids)
        (recorded,) = tap.drain()
    finally:
        tap.stop()
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    assert recorded.ids.tolist() == ids.tolist()
    assert torch.equal(recorded.states, expected)


# ----------------------------------------------------------------------------------------------------------------
# Greedy: token for token equal to plain generate() of the quantized target
# ----------------------------------------------------------------------------------------------------------------

# (prompt seed, prompt length, max_new_tokens): around and far from the block boundary (block 8 = 7 slots)
CASES = [(0, 6, 7), (1, 3, 16), (2, 12, 30), (3, 6, 40)]


@pytest.mark.parametrize("variant", ["fitted", "scrambled"])
def test_assisted_greedy_equals_plain_generate(quantized, variant):
    _, target, drafter = quantized
    if variant == "scrambled":
        drafter = scrambled(drafter, seed=1)
    accepted = []
    for seed, length, new in CASES:
        ids = _prompt(seed, length)
        expected = target.generate(ids, max_new_tokens=new, do_sample=False)
        got = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), (seed, length, new)
        accepted += drafter.generation_stats(got).accepted
    if variant == "fitted":
        # Not vacuous: drafts were accepted, beyond a block's first token too. How many is not asserted: the drafter
        # was fitted to the fp32 target, and how far the quantized one departs from it depends on how bitsandbytes'
        # kernels round on this CPU (14 of 77 drafts accepted on an AVX2-only EPYC, 28 of 62 with AVX-512).
        assert max(accepted) >= 2, accepted


def test_batched_greedy_equals_plain_generate(quantized):
    """Ragged left-padded batch: the verify forward carries several rows' blocks at once."""
    _, target, drafter = quantized
    lengths = [6, 2, 11, 4]
    generator = torch.Generator().manual_seed(7)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, ids.shape[1] - length :] = 1
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    for model in (drafter, scrambled(drafter, seed=2)):
        got = speculative_generate(target, ids, drafter=model, **common)
        assert got.sequences.tolist() == expected.tolist()
    assert sum(sum(s.accepted) for s in got.stats) > 0


def test_cpu_tuning_keeps_greedy_exact(quantized):
    """With what attach's CPU tuning applies (few-rows layouts on target and drafter, the GQA-aware attention),
    outputs are unchanged."""
    _, target, drafter = quantized
    before = target.config._attn_implementation
    ids = _prompt(11, 7)
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    try:
        target.set_attn_implementation(CPU_GQA_ATTENTION)
        for model in (target, drafter):
            use_few_rows_linear(model, max_rows=16)
        got = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        batched = speculative_generate(target, ids.expand(2, -1), drafter=drafter, max_new_tokens=30, do_sample=False)
    finally:
        restore_linear(target)
        restore_linear(drafter)
        target.set_attn_implementation(before)
    assert got.tolist() == expected.tolist()
    assert batched.sequences.tolist() == expected.expand(2, -1).tolist()


# ----------------------------------------------------------------------------------------------------------------
# Sampling: distributed exactly like plain generate() of the quantized target
# ----------------------------------------------------------------------------------------------------------------

SETTING = dict(temperature=0.8, top_k=0, top_p=1.0)
N_BATCHED = 2000  # rows of one speculative_generate call
N_ASSISTED = 150  # generate() calls (batch size 1 on that path): fewer, the slow part of this file


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def sampling(request, tmp_path_factory):
    """(quantized peaked target over V tokens, random drafter attached, exact distribution of its first T tokens)."""
    folder = tmp_path_factory.mktemp("peaked") / request.param
    peaked_target(vocab=V, seed=1).save_pretrained(folder)
    target = load_quantized(folder, request.param)
    # Seed 12: the first cycle's draft is accepted whole or cut after one token, often (asserted below).
    drafter = attached(random_drafter(target, seed=12), target)
    probs = exact_distribution(target, SETTING)
    assert probs.max() < 0.6 and (probs > 1e-3).sum() >= 6, "degenerate target distribution: the test proves little"
    return target, drafter, probs


def test_batched_sampling_matches_exact_distribution(sampling):
    target, drafter, probs = sampling
    torch.manual_seed(1234)
    out = speculative_generate(target, PROMPT.expand(N_BATCHED, -1), drafter=drafter, do_sample=True,
                               max_new_tokens=T, **SETTING)
    tv = total_variation(histogram(out.sequences), probs)
    first = np.bincount([min(s.accepted[0], 2) for s in out.stats], minlength=3)
    q99 = iid_tv_quantiles(probs, N_BATCHED)[1]
    print(f"batched: TV {tv:.4f} (iid 99% {q99:.4f}); first cycle accepted 0/1/2+: {first.tolist()}")
    assert tv < q99, (tv, q99)
    # Not vacuous: drafts were accepted and cut (a rejection resamples from the residual distribution).
    assert (first >= 0.02 * N_BATCHED).sum() >= 2 and first[1] >= 0.02 * N_BATCHED, first


def test_assisted_sampling_matches_exact_distribution(sampling):
    target, drafter, probs = sampling
    torch.manual_seed(4321)
    rows = [
        target.generate(PROMPT, do_sample=True, max_new_tokens=T, assistant_model=drafter, **SETTING)
        for _ in range(N_ASSISTED)
    ]
    tv = total_variation(histogram(torch.cat(rows)), probs)
    q99 = iid_tv_quantiles(probs, N_ASSISTED)[1]
    print(f"assisted: TV {tv:.4f} (iid 99% {q99:.4f})")
    assert tv < q99, (tv, q99)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def test_quantization_configs():
    assert quantization_config("none", torch.float32) is None
    eight = quantization_config("8bit", torch.float32)
    assert eight.load_in_8bit and eight.llm_int8_threshold == 0.0  # each row quantized on its own
    four = quantization_config("4bit", torch.bfloat16)
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4" and four.bnb_4bit_compute_dtype == torch.bfloat16


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_cli_generate_quantized(tmp_path_factory, quantization):
    """End to end with bitsandbytes' own kernels (a 64-wide target, which their AVX512-BF16 4-bit layout needs)."""
    from test_cli import run_cli, tiny_tokenizer

    root = tmp_path_factory.mktemp(f"cli-{quantization}")
    target = peaked_target(vocab=VOCAB, seed=0)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4).save_pretrained(root / "drafter")
    result = run_cli("generate", "w1 w2 w3 w4", "--target", root / "target", "--drafter", root / "drafter",
                     "--quantize", quantization, "--max-new-tokens", 12, "--warmup", 0, "--block-size", 4)
    assert result.code == 0, result.err
    assert "bitsandbytes" in result.err
    assert "outputs identical: yes" in result.out


def test_cli_quantize_without_bitsandbytes_fails_before_loading(saved, monkeypatch):
    from test_cli import run_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    result = run_cli("generate", "hi", "--quantize", "4bit", "--target", saved[0])
    assert result.code == 1
    assert "needs the bitsandbytes package" in result.err and "pip install 'dcoco-hf[bnb]'" in result.err
    assert "loading target" not in result.err


def test_a_quantized_mismatch_is_explained_not_reported_as_a_bug():
    from dcoco_hf.cli.bench import greedy_mismatch_reason

    reason = greedy_mismatch_reason("float32", "4-bit nf4 bitsandbytes, compute float32")
    assert "near-tie" in reason and "drop --quantize" in reason and "report" not in reason
    assert "please report this" in greedy_mismatch_reason("float32")
