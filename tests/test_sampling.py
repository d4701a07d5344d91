"""Speculative sampling through `target.generate(do_sample=True, assistant_model=drafter)` is lossless.

The exact distribution of the first T new tokens is computed by enumerating all V**T continuations through the target
with the logits warpers `generate()` applies (same classes, same order). Samples from speculative generate must then be
as close to it as iid samples are: their total variation (TV) must stay under the 99th percentile of the TV of N iid
multinomial draws from the exact distribution. The same test runs a deliberately wrong engine (the classic bug: the
drafter's soft distribution as draft logits for an argmax draft, so transformers applies min(1, p/q) with the wrong q)
and requires its TV to be far above that floor, so the check has the power to see a biased sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_reference import (
    PROMPT,
    T,
    V,
    exact_distribution,
    histogram,
    iid_tv_quantiles,
    peaked_target,
    random_drafter,
    total_variation,
)

import dcoco_hf.runtime.candidate_generator as candidate_generator
from dcoco_hf import DCOCOCandidateGenerator, DCOCODrafter

N_SPEC = 600  # speculative samples per setting (each is one generate() call: batch size 1 is required)
N_WRONG = 150  # the wrong variant is so biased that fewer samples suffice
SETTINGS = {
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "t07-k4-p09": dict(temperature=0.7, top_k=4, top_p=0.9),
}


@pytest.fixture(scope="module")
def models():
    """Tiny target and a random drafter whose (fixed) first draft gets rejected, half and fully accepted often."""
    target = peaked_target()
    joints = [exact_distribution(target, setting).reshape((V,) * T).sum(axis=2) for setting in SETTINGS.values()]
    for seed in range(200):  # the first seed that qualifies (24 with torch 2.13 on CPU)
        # A soft drafter distribution: the wrong variant's q is then far from one-hot.
        drafter = random_drafter(target, seed, soft=True)
        y1, y2 = first_draft(drafter)
        if min(min(outcome_probabilities(joint, y1, y2)) for joint in joints) > 0.05:
            return target, drafter
    raise AssertionError("no drafter seed gives a first draft with all three acceptance outcomes")


def first_draft(drafter) -> tuple[int, int]:
    """The first draft of every sampling call: same prompt, no target context yet, deterministic proposal."""
    candidates, _ = DCOCOCandidateGenerator(drafter).get_candidates(PROMPT, max_new_tokens=2)
    return tuple(candidates[0, -2:].tolist())


def outcome_probabilities(joint: np.ndarray, y1: int, y2: int) -> np.ndarray:
    """P(first cycle accepts 0, 1, 2 of the draft (y1, y2)) from the exact joint of the first two tokens."""
    return np.array([1 - joint[y1].sum(), joint[y1].sum() - joint[y1, y2], joint[y1, y2]])


def speculative_samples(target, drafter, setting: dict, n: int, accepted: list[int] | None = None) -> torch.LongTensor:
    rows = []
    for _ in range(n):
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=T, assistant_model=drafter, **setting)
        rows.append(out)
        if accepted is not None:
            accepted.append(drafter.generation_stats(out).accepted[0])  # drafted tokens accepted in the first cycle
    return torch.cat(rows)


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_speculative_sampling_matches_exact_distribution(models, setting):
    target, drafter = models
    kwargs = SETTINGS[setting]
    probs = exact_distribution(target, kwargs)
    assert probs.max() < 0.5 and (probs > 1e-3).sum() >= 6, "degenerate target distribution: the test proves little"
    q01, q99 = iid_tv_quantiles(probs, N_SPEC)

    torch.manual_seed(1234)
    plain = target.generate(PROMPT.expand(N_SPEC, -1), do_sample=True, max_new_tokens=T, **kwargs)
    plain_tv = total_variation(histogram(plain), probs)
    accepted: list[int] = []
    spec_tv = total_variation(histogram(speculative_samples(target, drafter, kwargs, N_SPEC, accepted)), probs)
    counts = np.bincount(accepted, minlength=3)
    print(f"{setting}: TV speculative {spec_tv:.4f}, plain {plain_tv:.4f}, iid 1%-99% [{q01:.4f}, {q99:.4f}]; "
          f"first-cycle drafts accepted 0/1/2: {counts.tolist()}")
    # The exact distribution is right (plain sampling agrees with it) and speculation is indistinguishable from it.
    assert plain_tv < q99, (plain_tv, q99)
    assert spec_tv < q99, (spec_tv, q99, plain_tv)
    assert abs(spec_tv - plain_tv) < q99 - q01, (spec_tv, plain_tv, q01, q99)
    # Non-vacuous: the first cycle's 2 drafted tokens were rejected, half accepted and fully accepted, often enough.
    assert counts.min() >= 0.02 * N_SPEC, counts
    # And as often as they should: the first draft (y1, y2) is fixed (same prompt, no context yet), so the first
    # cycle accepts nothing with probability 1 - P(y1), exactly y1 with P(y1) - P(y1 y2), both with P(y1 y2).
    expected = outcome_probabilities(probs.reshape((V,) * T).sum(axis=2), *first_draft(drafter))
    tolerance = 4 * np.sqrt(expected * (1 - expected) / N_SPEC) + 1e-3
    assert np.all(np.abs(counts / N_SPEC - expected) < tolerance), (counts / N_SPEC, expected)


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_soft_draft_logits_are_caught(models, setting, monkeypatch):
    """The classic bug, the drafter's soft distribution as draft logits of an argmax (or corrected) draft, so that
    transformers' min(1, p/q) uses a q the draft was never sampled from: the same TV check must flag it."""
    target, drafter = models
    kwargs = SETTINGS[setting]
    probs = exact_distribution(target, kwargs)
    last: dict[str, object] = {}
    propose = DCOCODrafter.propose

    def recording_propose(self, *args, **kw):
        last["proposal"] = propose(self, *args, **kw)
        return last["proposal"]

    def soft_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
        proposal = last["proposal"]  # top_k == V: candidate_logits hold the drafter's whole distribution
        n = tokens.shape[1]
        logits = torch.full((*tokens.shape, vocab_size), float("-inf"))
        return logits.scatter(-1, proposal.candidates[:, :n], proposal.candidate_logits[:, :n])

    monkeypatch.setattr(DCOCODrafter, "propose", recording_propose)
    monkeypatch.setattr(candidate_generator, "one_hot_logits", soft_logits)
    torch.manual_seed(4321)
    wrong_tv = total_variation(histogram(speculative_samples(target, drafter, kwargs, N_WRONG)), probs)
    _, q99 = iid_tv_quantiles(probs, N_WRONG)
    print(f"{setting}: TV with soft draft logits {wrong_tv:.4f}, iid 99% {q99:.4f}")
    assert wrong_tv > 2 * q99, (wrong_tv, q99)
