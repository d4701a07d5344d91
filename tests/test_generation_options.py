"""Which `generate()` options are exact with a drafter and which are refused (transformers 5.24, tiny fitted target).

Every case runs plain `target.generate()` and the same call with the drafter, on both ways in: transformers' assisted
path (`assistant_model=drafter`, one prompt) and `speculative_generate` (a ragged left-padded batch of 3). Each
asserts token-for-token equality with plain generate() ("exact") or the documented error. Sampling settings are
made deterministic (top_k=1, a tiny top_p, min_p=1) so that equality shows the processors are applied at every
verified position; that sampling is distributed exactly like plain generate() is tested in test_sampling.py and
test_batched.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import _FITTED, VOCAB, fit_drafter, make_target
from transformers import LogitsProcessor, LogitsProcessorList

from dcoco_hf import speculative_generate
from dcoco_hf.runtime.hf_compat import assisted_static_cache

PAD = 0
NEW = 24
EXACT = "exact"


def _eos(free: torch.Tensor) -> dict[str, Any]:
    return {"eos_token_id": int(free[0, -NEW + 9]), "pad_token_id": PAD}  # a token plain greedy writes 10 tokens in


def _banned(free: torch.Tensor) -> int:
    return int(free[0, -NEW + 2])


# name: (generate() keywords, given plain greedy output of the single prompt; assisted path; speculative_generate)
CASES: dict[str, tuple[Callable[[torch.Tensor], dict[str, Any]], Any, Any]] = {
    "greedy": (lambda free: {}, EXACT, EXACT),
    "sampling-top_k": (lambda free: {"do_sample": True, "temperature": 0.7, "top_k": 1}, EXACT, EXACT),
    "sampling-top_p": (lambda free: {"do_sample": True, "top_p": 1e-6, "top_k": 0}, EXACT, EXACT),
    "sampling-min_p": (lambda free: {"do_sample": True, "min_p": 1.0, "top_k": 0}, EXACT, EXACT),
    "repetition_penalty": (lambda free: {"repetition_penalty": 1.5}, EXACT, EXACT),
    "sampling-repetition_penalty": (
        lambda free: {"do_sample": True, "top_k": 1, "repetition_penalty": 1.5}, EXACT, EXACT,
    ),
    "no_repeat_ngram_size": (lambda free: {"no_repeat_ngram_size": 2}, EXACT, EXACT),
    "bad_words_ids": (lambda free: {"bad_words_ids": [[_banned(free)], free[0, -NEW + 4 : -NEW + 6].tolist()]},
                      EXACT, EXACT),
    "sequence_bias": (lambda free: {"sequence_bias": {tuple(free[0, -NEW + 4 : -NEW + 6].tolist()): -9.0}},
                      EXACT, EXACT),
    "min_new_tokens": (lambda free: {"min_new_tokens": 16, **_eos(free)}, EXACT, EXACT),
    "min_length": (lambda free: {"min_length": 24, **_eos(free)}, EXACT, EXACT),
    "forced_eos_token_id": (lambda free: {"forced_eos_token_id": _banned(free)}, EXACT, EXACT),
    "exponential_decay_length_penalty": (
        lambda free: {"exponential_decay_length_penalty": (4, 1.5), **_eos(free)}, EXACT, EXACT,
    ),
    "begin_suppress_tokens": (lambda free: {"begin_suppress_tokens": [_banned(free)]}, EXACT, EXACT),
    "prefix_allowed_tokens_fn": (  # reads the row index and the row's prefix
        lambda free: {"prefix_allowed_tokens_fn": lambda row, ids: range(1 + (row + int(ids[-1])) % 2, VOCAB, 2)},
        EXACT, EXACT,
    ),
    "custom_logits_processor": (  # a processor of the user's: speculative_generate cannot know how it reads rows
        lambda free: {"logits_processor": LogitsProcessorList([_HalveLast()])},
        EXACT, "['_HalveLast'] are not supported by speculative_generate",
    ),
    "suppress_tokens": (lambda free: {"suppress_tokens": [_banned(free)]}, EXACT, EXACT),
    "renormalize_logits": (lambda free: {"renormalize_logits": True, "remove_invalid_values": True}, EXACT, EXACT),
    "eos_and_pad": (_eos, EXACT, EXACT),
    # transformers before 5.24 refuses assisted generation on a static cache (hf_compat)
    "static_cache": (
        lambda free: {"cache_implementation": "static"},
        EXACT if assisted_static_cache() else "not supported with Static cache", EXACT,
    ),
    "return_dict_in_generate": (lambda free: {"return_dict_in_generate": True}, EXACT, EXACT),
    # transformers keeps beam search and drops the assistant with a warning: plain beam search, the drafter unused
    "num_beams": (lambda free: {"num_beams": 2}, EXACT, "num_beams=2: speculative_generate does greedy decoding"),
    "num_return_sequences": (
        lambda free: {"do_sample": True, "top_k": 1, "num_return_sequences": 2},
        "num_return_sequences has to be 1 when doing assisted generate", EXACT,
    ),
    "output_scores": (
        lambda free: {"return_dict_in_generate": True, "output_scores": True, "output_logits": True},
        EXACT, "output_scores=True is not supported by speculative_generate",
    ),
}


class _HalveLast(LogitsProcessor):
    """Halves the logit of each row's last token."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.scatter(1, input_ids[:, -1:], scores.gather(1, input_ids[:, -1:]) / 2)


def _sequences(out: Any) -> list[list[int]]:
    return (out if isinstance(out, torch.Tensor) else out.sequences).tolist()


def _check(expected: Any, run: Callable[[], Any], plain: Any) -> None:
    if expected != EXACT:
        with pytest.raises(ValueError, match=re.escape(expected)):
            run()
        return
    torch.manual_seed(0)
    got = run()
    assert _sequences(got) == _sequences(plain)
    for name in ("scores", "logits"):  # per-token scores and logits as plain generate() returns them
        if getattr(plain, name, None) is not None:
            assert len(getattr(got, name)) == len(getattr(plain, name))
            for mine, theirs in zip(getattr(got, name), getattr(plain, name)):
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llama():
    """The tiny llama target and its fitted drafter (shared with the other test modules), prompts, plain output."""
    if "llama" not in _FITTED:
        target = make_target("llama")
        _FITTED["llama"] = (target, fit_drafter(target))
    target, drafter = _FITTED["llama"]
    drafter.attach(target)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    lengths, batch = [5, 9, 2], torch.full((3, 9), PAD)
    generator = torch.Generator().manual_seed(4)
    for row, length in enumerate(lengths):
        batch[row, 9 - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
    mask = (torch.arange(9) >= 9 - torch.tensor(lengths)[:, None]).long()
    free = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    return target, drafter, prompt, batch, mask, free


@pytest.mark.parametrize("case", list(CASES))
def test_assisted_path(llama, case):
    target, drafter, prompt, _, _, free = llama
    kwargs = {"max_new_tokens": NEW, "do_sample": False, **CASES[case][0](free)}
    torch.manual_seed(0)
    plain = target.generate(prompt, **kwargs)
    _check(CASES[case][1], lambda: target.generate(prompt, assistant_model=drafter, **kwargs), plain)


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_generate(llama, case):
    target, drafter, _, batch, mask, free = llama
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "attention_mask": mask, "pad_token_id": PAD,
              **CASES[case][0](free)}
    torch.manual_seed(0)
    plain = target.generate(batch, **kwargs)
    _check(CASES[case][2], lambda: speculative_generate(target, batch, drafter=drafter, **kwargs), plain)


def test_assisted_path_refuses_batches(llama):
    """transformers' assisted generation serves one sequence; batches go through speculative_generate."""
    target, drafter, _, batch, mask, _ = llama
    with pytest.raises(ValueError, match="assisted generate is only supported for batch_size = 1"):
        target.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=drafter,
                        pad_token_id=PAD)


class _Trie:
    """A strict `prefix_allowed_tokens_fn`: it knows the (batch id, prefix) pairs it was built from and returns []
    for any other prefix, as a trie of allowed continuations does; it records every call."""

    def __init__(self, known: set[tuple[int, tuple[int, ...]]] | None = None) -> None:
        self.known, self.seen = known, set()

    def __call__(self, batch_id: int, ids: torch.Tensor) -> list[int]:
        key = (batch_id, tuple(ids.tolist()))
        self.seen.add(key)
        if self.known is not None and key not in self.known:
            return []
        return list(range(1 + (batch_id + int(ids[-1])) % 2, VOCAB, 2))


@pytest.mark.parametrize("do_sample", [False, True])
def test_prefix_allowed_tokens_fn_sees_only_what_plain_generate_shows_it(llama, do_sample):
    """In a ragged batch every prefix (and batch id) the user's function is called with is one plain generate()
    calls it with, so a strict function works and its side effects match; the output is plain generate()'s."""
    target, drafter, _, batch, mask, _ = llama
    kwargs = {"max_new_tokens": NEW, "do_sample": do_sample, "attention_mask": mask, "pad_token_id": PAD}
    if do_sample:
        kwargs["top_k"] = 1
    recorder = _Trie()
    plain = target.generate(batch, prefix_allowed_tokens_fn=recorder, **kwargs)
    strict = _Trie(known=set(recorder.seen))
    schedule = drafter.generation_config.num_assistant_tokens_schedule
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # draft every cycle: whole blocks verified
    try:
        got = speculative_generate(target, batch, drafter=drafter, prefix_allowed_tokens_fn=strict, **kwargs)
    finally:
        drafter.generation_config.num_assistant_tokens_schedule = schedule
    assert got.sequences.tolist() == plain.tolist()
    assert strict.seen <= recorder.seen
    assert sum(sum(stats.accepted) for stats in got.stats) > 0  # drafts were accepted: multi-position verifies ran
