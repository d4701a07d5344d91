"""The adapter to transformers (dcoco_hf/runtime/hf_compat.py) against the installed release: each reader of the assisted
loop's internals finds what it reads inside a real `generate(assistant_model=drafter)` call, and nothing outside
one. CI runs this file on the oldest and the newest supported transformers, so a release that moves these internals
fails here, by name, before any output could change."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT_LEN, VOCAB
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

import dcoco_hf.runtime.candidate_generator as runtime
from dcoco_hf.runtime import hf_compat
class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _spy(monkeypatch, name: str) -> list:
    """Record what the drafter's call of `hf_compat.<name>` returned."""
    seen, read = [], getattr(hf_compat, name)

    def recording(*args, **kwargs):
        seen.append(read(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(runtime, name, recording)
    return seen


def _generate(target, drafter, **kwargs):
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               assistant_model=drafter, **kwargs)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_loops_stopping_criteria_are_found(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_stopping_criteria")
    _generate(target, drafter, stopping_criteria=StoppingCriteriaList([_Never()]))
    assert len(seen) == 1 and isinstance(seen[0], StoppingCriteriaList)  # read once per call, at its first cycle
    kinds = {type(criterion) for criterion in seen[0]}
    assert _Never in kinds and MaxLengthCriteria in kinds  # the caller's criteria and generate()'s own


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_loops_scores_are_found_when_asked_for(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_loop_scores")
    _generate(target, drafter)
    assert seen and all(scores is None for scores in seen)  # not asked for: the loop keeps none
    seen.clear()
    _generate(target, drafter, output_scores=True, return_dict_in_generate=True)
    assert seen and all(isinstance(scores, tuple) for scores in seen)
    assert all(score.shape[-1] == VOCAB for scores in seen for score in scores)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_driving_assisted_candidate_generator_is_found(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_driver")
    _generate(target, drafter)
    assert len(seen) == 1 and isinstance(seen[0], AssistedCandidateGenerator)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_every_verification_reaches_the_engine_with_transformers_matches(fitted, monkeypatch):
    """The engine's acceptance is transformers' own count (`update_candidate_strategy`'s num_matches), cycle by
    cycle, and the committed tokens it books are the sequence transformers returns."""
    target, drafter = fitted  # the constant schedule: a draft every cycle but where none fits before max_length
    reported, update = [], AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        reported.append(int(num_matches))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", recording)
    accepted = []
    for seed in range(4):
        reported.clear()
        ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        stats = drafter.generation_stats(out)
        assert len(reported) - 1 <= len(stats.accepted) <= len(reported)
        assert stats.accepted == reported[: len(stats.accepted)]
        assert stats.committed_tokens == out.shape[1] - PROMPT_LEN
        accepted += stats.accepted
    assert any(accepted)


def test_nothing_is_found_outside_a_generate_call():
    assert hf_compat.assisted_stopping_criteria() is None
    assert hf_compat.assisted_loop_scores() is None
    assert hf_compat.assisted_driver() is None
