"""The W @ x^T layout for few-row CPU forwards (dcoco_hf/cpu_linear.py): same numbers, same model, still lossless."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target
from peft import LoraConfig, get_peft_model
from torch import nn

from dcoco_hf import FewRowsLinear, cpu_linear, restore_linear, use_few_rows_linear
from dcoco_hf.cpu_linear import few_rows_max


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 9])
def test_matches_f_linear(bias, rows):
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)  # [B, T, in] as a decoder feeds it
    expected = layer(x)
    use_few_rows_linear(layer)
    got = layer(x)
    assert got.shape == expected.shape == (1, rows, 40)
    if 1 < rows <= 6:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # one row (plain decoding) and long inputs keep F.linear: bit-identical
        assert torch.equal(got, expected)


def test_dispatch_takes_the_transposed_path_only_for_few_rows(monkeypatch):
    """Guards the speed claim: 2..max_rows rows must not reach F.linear, other shapes must."""
    layer = nn.Linear(8, 8)
    use_few_rows_linear(layer, max_rows=4)
    calls = []
    real = cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (1, 2, 4, 5):
        layer(torch.randn(rows, 8))
    assert calls == [torch.Size([1, 8]), torch.Size([5, 8])]


def test_swap_keeps_weights_and_restores():
    target = make_target("llama")
    state = {k: v.clone() for k, v in target.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in target.modules())
    assert use_few_rows_linear(target, max_rows=5) == linears > 0
    assert few_rows_max(target) == 5
    assert all(type(m) is not nn.Linear for m in target.modules())
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())
    assert restore_linear(target) == linears
    assert few_rows_max(target) is None and not any(isinstance(m, FewRowsLinear) for m in target.modules())
    with pytest.raises(ValueError, match="restore_linear"):
        use_few_rows_linear(target, max_rows=1)


def test_subclasses_are_left_alone():
    class Quantised(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Quantised(4, 4))
    assert use_few_rows_linear(model) == 1
    assert type(model[1]) is Quantised


def test_plain_generate_is_bit_identical_and_speculation_stays_exact(fitted):
    """Plain decoding never takes the new path; greedy speculation (4-row verifies) still equals it."""
    target, drafter = fitted
    ids = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs)
    block = drafter.config.block_size
    try:
        drafter.config.block_size = 4  # verify forwards of 4 rows: inside the transposed path
        use_few_rows_linear(target)
        swapped = target.generate(ids, **kwargs)
        assert swapped.sequences.tolist() == plain.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(swapped.logits, plain.logits))
        speculative = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert speculative.tolist() == plain.sequences.tolist()
        assert sum(drafter.generation_stats(speculative).accepted) > 0  # verify forwards really had several rows
    finally:
        restore_linear(target)
        drafter.config.block_size = block


def test_lora_wrapped_target():
    """LoRA layers keep their own forward; the plain layers inside take the new layout with unchanged results."""
    target = make_target("qwen3")
    lora = get_peft_model(target, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, target.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    expected = lora(ids).logits
    use_few_rows_linear(lora)
    wrappers = [m for m in lora.modules() if type(m).__name__ == "Linear" and hasattr(m, "base_layer")]
    assert wrappers and all(type(m.base_layer) is FewRowsLinear for m in wrappers)
    torch.testing.assert_close(lora(ids).logits, expected, rtol=1e-5, atol=1e-5)
