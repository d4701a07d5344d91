"""Greedy speculation through `target.generate(assistant_model=drafter)` equals plain `generate()` token for token."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import PROMPT_LEN, scrambled

from dcoco_hf import DCOCOStats
from dcoco_hf.runtime.hf_compat import assisted_static_cache

# (prompt seed, prompt length, max_new_tokens): lengths at, around and far from the block boundary (block 8 = 7 slots)
CASES = [
    (0, 6, 1), (1, 6, 6), (2, 6, 7), (3, 6, 8), (4, 6, 9), (5, 3, 13), (6, 9, 14), (7, 6, 15),
    (8, 1, 16), (9, 12, 21), (10, 6, 22), (11, 20, 40), (12, 6, 48), (13, 2, 33), (14, 6, 60), (15, 30, 25),
]
_TOTALS: dict[str, DCOCOStats] = {}


def _prompt(seed: int, length: int, vocab: int) -> torch.LongTensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed,prompt_len,max_new_tokens", CASES)
@pytest.mark.parametrize("variant", ["fitted", "scrambled"])
def test_greedy_equals_plain_generate(fitted, arch, variant, seed, prompt_len, max_new_tokens):
    target, drafter = fitted
    if variant == "scrambled":
        drafter = scrambled(drafter, seed=seed)
    ids = _prompt(seed, prompt_len, target.config.vocab_size)
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    got = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    if max_new_tokens < 2:  # transformers never consults the drafter for a single new token
        with pytest.raises(RuntimeError, match="never drafts"):
            drafter.generation_stats(got)
        return
    stats = drafter.generation_stats(got)
    assert stats.committed_tokens == got.shape[1] - prompt_len
    key = f"{arch}-{variant}"
    _TOTALS[key] = stats if key not in _TOTALS else _TOTALS[key].merge(stats)


def test_exactness_cases_exercised_acceptance(fitted, arch):
    """Guard against a vacuous pass: the cases above must have accepted long drafts, full blocks included."""
    totals = _TOTALS.get(f"{arch}-fitted")
    if totals is None:
        pytest.skip("run together with test_greedy_equals_plain_generate")
    assert totals.tau > 1.25, totals.as_dict()
    assert max(totals.accepted) == 7  # a full block was accepted at least once
    assert sum(0 < a < 7 for a in totals.accepted) >= 3  # and blocks were cut mid-way
    assert sum(a > 0 for a in _TOTALS[f"{arch}-scrambled"].accepted) > 5


def test_corrections_change_proposals(fitted):
    """The scrambled corrector really overrules the drafter's argmax on many slots (else the tests prove nothing)."""
    target, drafter = fitted
    noisy = scrambled(drafter, seed=3)
    ids = _prompt(99, 24, target.config.vocab_size)
    sequence = target.generate(ids, max_new_tokens=40, do_sample=False)
    changed = total = 0
    for cut in range(PROMPT_LEN, sequence.shape[1] - 1, 3):
        proposals = [
            _draft(model, target, sequence[:, :cut], correct) for model, correct in ((noisy, True), (noisy, False))
        ]
        changed += int((proposals[0] != proposals[1]).sum())
        total += proposals[0].numel()
    assert changed / total > 0.2, (changed, total)


def _draft(drafter, target, ids, correct: bool) -> torch.LongTensor:
    from dcoco_hf.runtime.candidate_generator import DCOCOCandidateGenerator

    engine = DCOCOCandidateGenerator(drafter, correct=correct)
    target(input_ids=ids[:, :-1])  # the verify forward that would have preceded this draft
    candidates, _ = engine.get_candidates(ids)
    return candidates[:, ids.shape[1] :]


def test_eos_inside_block(fitted):
    """An EOS accepted in the middle of a block ends generation exactly where plain generate() stops."""
    target, drafter = fitted
    for seed in range(6):
        ids = _prompt(200 + seed, 6, target.config.vocab_size)
        free = target.generate(ids, max_new_tokens=30, do_sample=False)
        eos = int(free[0, ids.shape[1] + 10])  # a token that will appear mid-generation
        expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
        got = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        assert got.shape[1] < free.shape[1] or int(got[0, -1]) == eos


def test_second_call_multi_turn_and_reuse(fitted):
    """A second, longer generate() continuing the first conversation stays exact; state does not leak."""
    target, drafter = fitted
    ids = _prompt(300, 8, target.config.vocab_size)
    first = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert first.tolist() == target.generate(ids, max_new_tokens=20, do_sample=False).tolist()
    follow_up = torch.cat([first, _prompt(301, 7, target.config.vocab_size)], dim=1)
    expected = target.generate(follow_up, max_new_tokens=30, do_sample=False)
    got = target.generate(follow_up, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    stats = drafter.generation_stats(got)
    assert stats.committed_tokens == 30 and stats.target_forwards <= 30
    # and an unrelated prompt afterwards
    other = _prompt(302, 5, target.config.vocab_size)
    assert (
        target.generate(other, max_new_tokens=12, do_sample=False, assistant_model=drafter).tolist()
        == target.generate(other, max_new_tokens=12, do_sample=False).tolist()
    )


def test_selection_walks_are_lossless(fitted):
    target, drafter = fitted
    noisy = scrambled(drafter, seed=5)
    ids = _prompt(400, 6, target.config.vocab_size)
    expected = target.generate(ids, max_new_tokens=25, do_sample=False).tolist()
    for selection, first_slot in itertools.product(("greedy", "viterbi", "geometric"), (False, True)):
        noisy.generation_config.selection, noisy.config.correct_first_slot = selection, first_slot
        got = target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=noisy)
        assert got.tolist() == expected, (selection, first_slot)


def test_transformers_dflash_path_same_weights(fitted):
    """The same drafter runs under transformers' own `speculation_type="dflash"` (plain DFlash) and stays exact."""
    target, drafter = fitted
    for seed in range(3):
        ids = _prompt(500 + seed, 6, target.config.vocab_size)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        got = target.generate(
            ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, speculation_type="dflash"
        )
        assert got.tolist() == expected.tolist()


@pytest.mark.skipif(
    not assisted_static_cache(), reason="transformers < 5.24 refuses a static cache in assisted generation"
)
def test_static_cache_same_output_and_same_drafts(fitted):
    """With transformers' static cache (the GPU path) output stays exact and the drafter sees the same context."""
    target, drafter = fitted
    for seed in range(3):
        ids = _prompt(600 + seed, 6, target.config.vocab_size)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        dynamic = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        accepted_dynamic = drafter.generation_stats(dynamic).accepted
        static = target.generate(
            ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, cache_implementation="static"
        )
        assert static.tolist() == expected.tolist() == dynamic.tolist()
        assert drafter.generation_stats(static).accepted == accepted_dynamic
