"""A bfloat16 drafter beside a float32 target, and the reverse, on every path.

`attach` casts (`align_drafter_dtype`, logged) the drafter to the dtype of the target's hidden states: transformers'
own `speculation_type="dflash"` path applies the target's lm_head to the drafter's output as it is and fails on a
mix. After the cast every path runs: assisted (`target.generate(assistant_model=drafter)`), batched
(`speculative_generate`) and transformers' DFlash path, greedy and sampling. Our own two paths also run on an
uncast mix (a drafter cast by hand after attach). Greedy output equals plain `generate()` token for token with a
float32 target; with a bfloat16 one it may part only at a near-tie of plain decoding's logits (see README).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import _FITTED, VOCAB, fit_drafter, make_target

from dcoco_hf import speculative_generate
from dcoco_hf.runtime.precision import align_drafter_dtype, target_compute_dtype

MIXES = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]  # (target, drafter)
# A bfloat16 logit of these tiny targets (|logit| < 4) is rounded to 1/64 at worst; a verify forward and a 1-token
# step may each round differently, a few steps deep. Plain decoding's top-2 gap where paths part must be below this.
NEAR_TIE = 0.25


def _fitted():
    if "llama" not in _FITTED:
        target = make_target("llama")
        _FITTED["llama"] = (target, fit_drafter(target))
    return _FITTED["llama"]


def mixed(target_dtype: torch.dtype, drafter_dtype: torch.dtype, align: bool):
    """(target in target_dtype, fitted drafter made in drafter_dtype and attached to it, the log text of the cast).
    Without `align`, the drafter is cast back to drafter_dtype by hand after attach (which aligned it)."""
    target, drafter = _fitted()
    target = copy.deepcopy(target).to(target_dtype)
    drafter = copy.deepcopy(drafter).to(drafter_dtype)
    note = align_drafter_dtype(drafter, target) if align else None
    drafter.attach(target, tune=False)
    if not align:
        drafter.to(drafter_dtype)
    return target, drafter, note


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def attach_log(drafter, target) -> list[str]:
    """What `drafter.attach(target, tune=False)` logs (the "dcoco_hf" logger does not propagate to caplog)."""
    handler, logger = _Lines(), logging.getLogger("dcoco_hf")
    logger.addHandler(handler)
    try:
        drafter.attach(target, tune=False)
    finally:
        logger.removeHandler(handler)
    return handler.lines


def _prompt(seed: int, length: int, rows: int = 1) -> torch.LongTensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_same_or_near_tie(target, ids, got: torch.LongTensor, max_new_tokens: int) -> None:
    """Greedy `got` equals plain greedy, or (half precision) first parts from it where plain's top-2 logits tie."""
    plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                            return_dict_in_generate=True)
    if got.tolist() == plain.sequences.tolist():
        return
    assert target.dtype != torch.float32, "float32 greedy speculation must be token-exact"
    row, column = next((r, c) for r in range(got.shape[0]) for c in range(got.shape[1])
                       if got[r, c] != plain.sequences[r, c])
    top2 = plain.scores[column - ids.shape[1]][row].float().topk(2).values
    assert top2[0] - top2[1] < NEAR_TIE, (row, column, top2.tolist())


@pytest.mark.parametrize("target_dtype,drafter_dtype", MIXES)
def test_attach_cast_says_what_it_did(target_dtype, drafter_dtype):
    target, drafter, note = mixed(target_dtype, drafter_dtype, align=True)
    name = str(target_dtype).removeprefix("torch.")
    assert note == f"drafter cast from {str(drafter_dtype).removeprefix('torch.')} to {name}, the dtype of the " \
                   "target's hidden states"
    assert target_compute_dtype(target) == target_dtype
    assert all(p.dtype == target_dtype for p in drafter.parameters())
    assert align_drafter_dtype(drafter, target) is None  # nothing left to cast


@pytest.mark.parametrize("target_dtype,drafter_dtype", MIXES)
def test_attach_casts_the_drafter_and_logs_it(target_dtype, drafter_dtype):
    target, drafter = _fitted()
    target = copy.deepcopy(target).to(target_dtype)
    drafter = copy.deepcopy(drafter).to(drafter_dtype)
    expected = (f"drafter cast from {str(drafter_dtype).removeprefix('torch.')} to "
                f"{str(target_dtype).removeprefix('torch.')}, the dtype of the target's hidden states")
    assert attach_log(drafter, target) == [expected]
    assert all(p.dtype == target_dtype for p in drafter.parameters())
    assert attach_log(drafter, target) == []  # attached again: nothing to cast, nothing said


@pytest.mark.parametrize("target_dtype,drafter_dtype", MIXES)
def test_every_path_runs_after_the_cast(target_dtype, drafter_dtype):
    target, drafter, _ = mixed(target_dtype, drafter_dtype, align=True)
    ids = _prompt(0, 6)
    assisted = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert_same_or_near_tie(target, ids, assisted, 24)
    batch = _prompt(1, 5, rows=3)
    batched = speculative_generate(target, batch, drafter=drafter, max_new_tokens=24, do_sample=False)
    assert_same_or_near_tie(target, batch, batched.sequences, 24)
    dflash = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                             speculation_type="dflash")
    assert_same_or_near_tie(target, ids, dflash, 24)
    torch.manual_seed(0)
    sampled = target.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, assistant_model=drafter)
    assert sampled.shape == (1, 18)
    sampled = speculative_generate(target, batch, drafter=drafter, max_new_tokens=12, do_sample=True)
    assert sampled.sequences.shape == (3, 17)


@pytest.mark.parametrize("target_dtype,drafter_dtype", MIXES)
def test_our_paths_run_on_an_uncast_mix(target_dtype, drafter_dtype):
    """A drafter cast by hand after attach: ours cast at the two seams (target states in, lm_head out)."""
    target, drafter, _ = mixed(target_dtype, drafter_dtype, align=False)
    ids = _prompt(2, 7)
    got = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert_same_or_near_tie(target, ids, got, 24)
    batch = _prompt(3, 4, rows=2)
    got = speculative_generate(target, batch, drafter=drafter, max_new_tokens=24, do_sample=False)
    assert_same_or_near_tie(target, batch, got.sequences, 24)


def test_float32_target_greedy_is_token_exact_with_a_bfloat16_drafter():
    """The target verifies every token, so the drafter's precision changes speed, never a float32 output."""
    target, drafter, _ = mixed(torch.float32, torch.bfloat16, align=False)
    accepted = []
    for seed, length, new in [(4, 6, 30), (5, 12, 40), (6, 3, 25)]:
        ids = _prompt(seed, length)
        expected = target.generate(ids, max_new_tokens=new, do_sample=False)
        got = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        accepted += drafter.generation_stats(got).accepted
    assert sum(accepted) > len(accepted) / 4, accepted  # the bfloat16 drafter's drafts were accepted
