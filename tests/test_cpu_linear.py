"""Few-row CPU linear layouts (dcoco_hf/runtime/cpu_linear.py): same numbers, same model, still lossless, chosen by
timing."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import make_target
from peft import LoraConfig, get_peft_model
from torch import nn

from dcoco_hf import FewRowsLinear, restore_linear, use_few_rows_linear
from dcoco_hf.runtime import cpu_linear
from dcoco_hf.runtime.cpu_linear import (
    LAYOUTS,
    available_layouts,
    few_rows_plan,
    tune_few_rows_layout,
)

FAST_LAYOUTS = [name for name in available_layouts() if name != "gemm"]


@pytest.mark.parametrize("layout", FAST_LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 9])
def test_matches_f_linear(layout, bias, rows):
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)  # [B, T, in] as a decoder feeds it
    expected = layer(x)
    use_few_rows_linear(layer, layout=layout)
    got = layer(x)
    assert got.shape == expected.shape == (1, rows, 40)
    if 1 < rows <= 6:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # one row (plain decoding) and long inputs keep F.linear: bit-identical
        assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", FAST_LAYOUTS)
def test_dispatch_takes_the_layout_only_for_its_rows(monkeypatch, layout):
    """Guards the speed claim: 2..max_rows rows must not reach F.linear, other shapes must."""
    layer = nn.Linear(8, 8)
    use_few_rows_linear(layer, max_rows=4, layout=layout)
    calls = []
    real = cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        for rows in (1, 2, 4, 5):
            layer(torch.randn(rows, 8))
    assert calls == [torch.Size([1, 8]), torch.Size([5, 8])]


def test_a_plan_can_mix_layouts_per_row_count(monkeypatch):
    layer = nn.Linear(8, 8)
    plan = {2: "gemm", 3: "transposed"}
    assert use_few_rows_linear(layer, layout=plan) == plan == few_rows_plan(layer)
    calls = []
    real = cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (2, 3, 4):
        layer(torch.randn(rows, 8))
    assert calls == [torch.Size([2, 8]), torch.Size([4, 8])]


@pytest.mark.skipif("packed" not in available_layouts(), reason="this torch build has no MKL packed GEMM")
def test_packed_weight_follows_weight_updates_and_gradients():
    layer = nn.Linear(16, 12)
    use_few_rows_linear(layer, layout="packed")
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = layer(x)
        layer.load_state_dict({"weight": torch.randn(12, 16), "bias": torch.randn(12)})  # in place: same storage
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, layer(x))
    # The packed op has no backward: a training forward still gets gradients, through the transposed product.
    layer(x.requires_grad_()).sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 12).T @ x.detach())


@pytest.mark.skipif("packed" not in available_layouts(), reason="this torch build has no MKL packed GEMM")
def test_packed_copies_are_made_and_checked_when_the_plan_is_set(monkeypatch):
    """A forward must not pay for packing: the first verify of a generation and every timing would include it."""
    layer = nn.Linear(16, 12)
    use_few_rows_linear(layer, layout={2: "gemm", 3: "packed", 4: "packed"})
    packed, checked = layer.__dict__["_packed"][1:]
    assert checked == {3, 4}
    monkeypatch.setattr(cpu_linear.torch.ops.mkl, "_mkl_reorder_linear_weight", None)  # packing again would fail
    with torch.no_grad():
        assert layer(torch.randn(4, 16)).shape == (4, 12)
    assert layer.__dict__["_packed"][1] is packed


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layouts must be among"):
        use_few_rows_linear(nn.Linear(4, 4), layout="blocked")
    with pytest.raises(ValueError, match="row counts of 2 or more"):
        use_few_rows_linear(nn.Linear(4, 4), layout={1: "transposed"})


def test_tuning_picks_a_layout_per_row_count_and_leaves_the_model_alone():
    target = make_target("llama")
    plan = tune_few_rows_layout(target, range(2, 5), repeats=1)
    assert set(plan) == {2, 3, 4} and set(plan.values()) <= set(LAYOUTS)
    assert not any(isinstance(m, FewRowsLinear) for m in target.modules())
    assert set(use_few_rows_linear(target, max_rows=4)) == {2, 3, 4}  # the default, "auto", tunes the same way


def test_swap_keeps_weights_and_restores():
    target = make_target("llama")
    state = {k: v.clone() for k, v in target.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in target.modules())
    assert use_few_rows_linear(target, max_rows=5, layout="transposed") == {r: "transposed" for r in range(2, 6)}
    assert sum(type(m) is FewRowsLinear for m in target.modules()) == linears > 0
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())
    assert restore_linear(target) == linears
    assert few_rows_plan(target) is None and not any(isinstance(m, FewRowsLinear) for m in target.modules())
    with pytest.raises(ValueError, match="restore_linear"):
        use_few_rows_linear(target, max_rows=1)


def test_subclasses_are_left_alone():
    class Quantised(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Quantised(4, 4))
    use_few_rows_linear(model, layout="transposed")
    assert type(model[0]) is FewRowsLinear and type(model[1]) is Quantised


@pytest.mark.parametrize("layout", FAST_LAYOUTS)
def test_plain_generate_is_bit_identical_and_speculation_stays_exact(fitted, layout):
    """Plain decoding never takes the new path; greedy speculation (4-row verifies) still equals it."""
    target, drafter = fitted
    kwargs = dict(max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)
    # Tiny random targets fall into loops the drafter never learned on some prompts: several prompts make sure
    # drafts really get accepted (several-row verifies), whatever the processor's rounding did to the fit.
    prompts = [torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(seed))
               for seed in (0, 1, 5)]
    plain = [target.generate(ids, **kwargs) for ids in prompts]
    block = drafter.config.block_size
    accepted = 0
    try:
        drafter.config.block_size = 4  # verify forwards of 4 rows: inside the few-rows path
        use_few_rows_linear(target, layout=layout)
        use_few_rows_linear(drafter, max_rows=8, layout=layout)
        for ids, expected in zip(prompts, plain):
            swapped = target.generate(ids, **kwargs)
            assert swapped.sequences.tolist() == expected.sequences.tolist()
            assert all(torch.equal(a, b) for a, b in zip(swapped.logits, expected.logits))
            speculative = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter)
            assert speculative.tolist() == expected.sequences.tolist()
            accepted += sum(drafter.generation_stats(speculative).accepted)
    finally:
        restore_linear(target)
        restore_linear(drafter)
        drafter.config.block_size = block
    assert accepted > 0  # verify forwards really had several rows


@pytest.mark.parametrize("layout", FAST_LAYOUTS)
def test_lora_wrapped_target(layout):
    """LoRA layers keep their own forward; the plain layers inside take the new layout with unchanged results."""
    target = make_target("qwen3")
    lora = get_peft_model(target, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, target.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    expected = lora(ids).logits
    use_few_rows_linear(lora, layout=layout)
    wrappers = [m for m in lora.modules() if type(m).__name__ == "Linear" and hasattr(m, "base_layer")]
    assert wrappers and all(type(m.base_layer) is FewRowsLinear for m in wrappers)
    torch.testing.assert_close(lora(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_packed_copies_that_do_not_fit_in_memory_are_never_made(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_packed_fits", lambda layers: False)
    target = make_target("llama")
    assert "packed" not in tune_few_rows_layout(target, range(2, 4), repeats=1).values()
    if "packed" in available_layouts():
        with pytest.raises(ValueError, match="layout='transposed'"):
            use_few_rows_linear(target, layout="packed")


def test_bf16_weights_never_take_the_packed_gemm():
    """MKL's packed GEMM is sgemm: half-precision models are timed and served with the other layouts only."""
    target = make_target("llama").to(torch.bfloat16)
    assert "packed" not in tune_few_rows_layout(target, range(2, 4), repeats=1).values()
    if "packed" in available_layouts():
        with pytest.raises(ValueError, match="fp32"):
            use_few_rows_linear(target, layout="packed")


def test_auto_times_a_few_row_counts_and_fills_the_gaps_from_below(monkeypatch):
    timed = []

    def fake_tune(model, rows, repeats=4):
        timed.extend(rows)
        return {r: ("transposed" if r >= 12 else "gemm") for r in rows}

    monkeypatch.setattr(cpu_linear, "tune_few_rows_layout", fake_tune)
    plan = use_few_rows_linear(nn.Linear(4, 4), max_rows=20)
    assert timed == [2, 3, 4, 5, 6, 7, 8, 12, 16, 20]  # every count up to 8, then about two per octave
    assert set(plan) == set(range(2, 21))
    assert [r for r, name in plan.items() if name == "transposed"] == list(range(12, 21))


def test_verify_cost_rounding_compares_the_same_positions():
    """scripts/verify_cost.py's last line: an n-token forward against n 1-token steps. Misaligned positions would
    differ by whole logits, not by float32 rounding."""
    spec = importlib.util.spec_from_file_location("verify_cost", Path(__file__).parents[1] / "scripts/verify_cost.py")
    verify_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verify_cost)
    target = make_target("llama")
    context = torch.randint(0, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert verify_cost.verify_rounding(target, context, 4) < 1e-4


@pytest.mark.parametrize("layout", available_layouts())
def test_a_deep_copy_of_a_laid_out_drafter_drafts_like_the_original(layout):
    """The thread-refusal error's recipe, copy.deepcopy(drafter).attach(target, tune=False), after any layout: MKL's
    packed weight (an opaque tensor) is rebuilt from the plain weight by the copy, which drafts exactly the same."""
    from dcoco_hf import DCOCODrafter
    from dcoco_hf.runtime.context_cache import DraftContextCache

    target = make_target("llama")
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    use_few_rows_linear(drafter, layout=layout)
    copied = copy.deepcopy(drafter).attach(target, tune=False)
    assert few_rows_plan(copied) == few_rows_plan(drafter)
    generator = torch.Generator().manual_seed(1)
    states = torch.randn(1, 3, len(drafter.config.target_layer_ids) * drafter.config.hidden_size, generator=generator)
    ids = torch.randint(0, target.config.vocab_size, (1, 3), generator=generator)
    positions = torch.arange(3 + 4)[None]  # 3 context rows and a block of 4: forwards of 2..6 rows
    mine, theirs = (model.propose(ids[:, -1], states, positions, DraftContextCache(), context_ids=ids)
                    for model in (drafter, copied))
    assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.candidate_logits, theirs.candidate_logits)
    prompt = torch.randint(0, target.config.vocab_size, (1, 6), generator=generator)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=copied).tolist() == \
        expected.tolist()


@pytest.mark.parametrize("layout", FAST_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_cast_after_its_plan_computes_with_f_linear(layout, dtype):
    """`target.to(dtype)` after the layouts were set (as a default attach does) keeps every forward working and
    bit-identical to the same model never laid out: prefills of 2..17 rows included (MKL's packed GEMM is fp32 only)."""
    model = make_target("llama")
    reference = copy.deepcopy(model).to(dtype)
    use_few_rows_linear(model, max_rows=17, layout=layout)
    model.to(dtype)
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    for rows in (2, 6, 17):
        ids = torch.randint(0, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
        got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        assert got.sequences.tolist() == expected.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits))
    model.to(torch.float32)  # and back: the plan applies again, packed copies re-made for the new weight
    ids = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)
