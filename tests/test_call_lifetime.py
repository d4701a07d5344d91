"""One target generate() call with an attached drafter: identical stopping to plain generate(), a target tap that
stops listening when the call ends (returned or raised), clear refusals (inputs_embeds, a second thread)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import PROMPT_LEN
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from dcoco_hf import speculative_generate
from dcoco_hf.runtime.candidate_generator import check_stopping_criteria, cut_at_stop, tokens_before_stop


class StopAfterToken(StoppingCriteria):
    """Fires once the last token is one of `tokens`: a pure function of the ids, like transformers' own criteria."""

    def __init__(self, tokens: set[int]) -> None:
        self.tokens = torch.tensor(sorted(tokens))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


def _prompt(target, seed: int) -> torch.Tensor:
    return torch.randint(1, target.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _stop_tokens(target, drafter, seeds) -> set[int]:
    """Tokens that greedy decoding writes a few tokens in, inside accepted drafted blocks (so the bug would show)."""
    seen: dict[int, int] = {}
    for seed in seeds:
        out = target.generate(_prompt(target, seed), max_new_tokens=30, do_sample=False)[0, PROMPT_LEN:]
        for token in out[4:].tolist():
            seen[token] = seen.get(token, 0) + 1
    return {max(seen, key=seen.get)}


def test_custom_stopping_criteria_stop_exactly_where_plain_generate_does(fitted):
    target, drafter = fitted
    stops = _stop_tokens(target, drafter, range(8))
    cut_inside_a_block = 0
    for seed in range(8):
        ids = _prompt(target, seed)
        kwargs = dict(max_new_tokens=40, do_sample=False,
                      stopping_criteria=StoppingCriteriaList([StopAfterToken(stops)]))
        plain = target.generate(ids, **kwargs)
        fast = target.generate(ids, assistant_model=drafter, **kwargs)
        assert fast.tolist() == plain.tolist()
        stats = drafter.generation_stats(fast)
        cut_inside_a_block += plain.shape[1] < PROMPT_LEN + 40 and stats.cycles > 0
    assert cut_inside_a_block > 0  # the criterion did stop some runs early, with drafting under way



class StopWhenUnsure(StoppingCriteria):
    """Fires once the newest token's top probability under the target falls below `threshold`: it reads the
    target's processed `scores`, which no drafter has for tokens the target has not verified yet."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, input_ids, scores, **kwargs):
        unsure = scores[-1].softmax(-1).max(-1).values < self.threshold
        return unsure.to(input_ids.device)


def test_custom_stopping_criteria_with_output_scores_are_refused_naming_scores(fitted):
    target, drafter = fitted
    ids = _prompt(target, 0)
    scored = dict(max_new_tokens=40, do_sample=False, output_scores=True, return_dict_in_generate=True)
    for criterion in (StopWhenUnsure(0.5), StopAfterToken({7})):  # whether it reads them cannot be known
        criteria = StoppingCriteriaList([criterion])
        plain = target.generate(ids, stopping_criteria=criteria, **scored)
        assert plain.sequences.shape[1] > PROMPT_LEN
        with pytest.raises(ValueError, match=r"scores.*plain generate\(\)"):
            target.generate(ids, assistant_model=drafter, stopping_criteria=criteria, **scored)
    assert not drafter.tap.listening  # the refused call left the tap as it was
    # transformers' own criteria read token ids only: accepted with output_scores, and exact
    kwargs = dict(scored, max_time=600.0)
    plain = target.generate(ids, **kwargs)
    fast = target.generate(ids, assistant_model=drafter, **kwargs)
    assert fast.sequences.tolist() == plain.sequences.tolist() and len(fast.scores) == len(plain.scores)


def test_check_stopping_criteria_admits_token_id_criteria_and_criteria_without_scores():
    custom = StoppingCriteriaList([MaxLengthCriteria(20), MaxTimeCriteria(60.0), StopAfterToken({7})])
    check_stopping_criteria(custom, scores_requested=False)  # criteria then get None, as in plain generate()
    check_stopping_criteria(StoppingCriteriaList([MaxLengthCriteria(20), EosTokenCriteria(2)]), True)
    check_stopping_criteria(None, True)
    with pytest.raises(ValueError, match="StopAfterToken.*scores"):
        check_stopping_criteria(custom, scores_requested=True)


def test_sampling_never_runs_past_a_stop(fitted):
    """Under sampling the cut depends only on the committed text and the proposal, so the distribution is plain
    sampling's; here: no sampled run continues after a token at which the criterion fired."""
    target, drafter = fitted
    stops = _stop_tokens(target, drafter, range(4))
    criteria = StoppingCriteriaList([StopAfterToken(stops)])
    for seed in range(12):
        torch.manual_seed(seed)
        out = target.generate(_prompt(target, seed), assistant_model=drafter, do_sample=True, temperature=0.8,
                              max_new_tokens=30, stopping_criteria=criteria)[0, PROMPT_LEN:].tolist()
        fired = [i for i, token in enumerate(out) if token in stops]
        assert not fired or fired[0] == len(out) - 1, (out, stops)


def test_tokens_before_stop_cuts_before_the_first_firing_position():
    criteria = StoppingCriteriaList([StopAfterToken({7})])
    committed = torch.tensor([[1, 2, 3]])
    assert tokens_before_stop(criteria, committed, torch.tensor([[4, 5, 7, 7, 8]])) == 2
    assert tokens_before_stop(criteria, committed, torch.tensor([[7, 5]])) == 0
    assert tokens_before_stop(criteria, committed, torch.tensor([[4, 5]])) == 2
    assert tokens_before_stop(StoppingCriteriaList(), committed, torch.tensor([[7]])) == 1
    # a first token that fires gives way to slot 1's best candidate that does not (transformers takes no empty draft)
    assert cut_at_stop(criteria, committed, torch.tensor([[7, 5]]), torch.tensor([7, 7, 9, 4])).tolist() == [[9]]
    assert cut_at_stop(criteria, committed, torch.tensor([[4, 7]]), torch.tensor([4, 7])).tolist() == [[4]]


def test_the_tap_stops_listening_when_generate_returns(fitted):
    target, drafter = fitted
    ids = _prompt(target, 0)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    assert not drafter.tap.listening
    with torch.no_grad():
        target(input_ids=out)  # a later plain forward: recorded nowhere
    assert drafter.tap.pending == []
    stats = drafter.generation_stats(out)  # and the call's statistics are still its own
    assert stats.committed_tokens == out.shape[1] - PROMPT_LEN and stats.target_forwards >= 1


class _Explode(LogitsProcessor):
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt("stopped by the user")
        return scores


def test_the_tap_stops_listening_when_generate_raises(fitted):
    target, drafter = fitted
    with pytest.raises(KeyboardInterrupt):
        target.generate(_prompt(target, 1), assistant_model=drafter, max_new_tokens=20, do_sample=False,
                        logits_processor=LogitsProcessorList([_Explode(after=3)]))
    assert not drafter.tap.listening and drafter.tap.pending == []


def test_inputs_embeds_is_refused_clearly(fitted):
    target, drafter = fitted
    embeds = target.get_input_embeddings()(_prompt(target, 2))
    with pytest.raises(ValueError, match="inputs_embeds=.*Pass input_ids"):
        target.generate(inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=10, do_sample=False)


class _Gate:
    """A target forward pre-hook that holds the first thread's call inside its loop until the second thread has
    tried its own call."""

    def __init__(self, thread: int) -> None:
        self.thread, self.inside, self.release = thread, threading.Event(), threading.Event()

    def __call__(self, module, args, kwargs) -> None:
        if threading.get_ident() == self.thread:
            self.inside.set()
            self.release.wait(timeout=300)


def _call(path: str, target, drafter, ids):
    if path == "assisted":
        return target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    return speculative_generate(target, ids, drafter=drafter, max_new_tokens=16, do_sample=False).sequences


@pytest.mark.parametrize("path", ["assisted", "batched"])
def test_a_second_thread_is_refused_while_a_call_runs(fitted, path):
    target, drafter = fitted
    ids = _prompt(target, 3)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    results = {}

    def first() -> None:
        try:
            results["first"] = _call(path, target, drafter, ids)
        except Exception as error:  # noqa: BLE001 -- reported by the main thread below
            results["first"] = error

    thread = threading.Thread(target=first)
    gate = None
    try:
        thread.start()
        gate = _Gate(thread.ident)
        hook = target.register_forward_pre_hook(gate, with_kwargs=True)
        assert gate.inside.wait(timeout=60)
        with pytest.raises(RuntimeError, match="already generating in another thread"):
            _call(path, target, drafter, ids)
    finally:
        if gate is not None:
            gate.release.set()
        thread.join(timeout=600)
        hook.remove()
    assert not thread.is_alive()
    assert not isinstance(results["first"], Exception), results["first"]
    assert results["first"].tolist() == expected.tolist()  # the running call was not disturbed
    assert _call(path, target, drafter, ids).tolist() == expected.tolist()  # free again once it ended


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["\n", "return", ":"])
def test_stop_strings_on_the_default_target_stop_where_plain_generate_does(stop):
    from dcoco_hf import DCOCODrafter
    from dcoco_hf.assets import load_default_target
    from dcoco_hf.cli.common import default_drafter_path

    target, tokenizer = load_default_target()
    drafter = DCOCODrafter.from_pretrained(default_drafter_path()).attach(target)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    kwargs = dict(max_new_tokens=48, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    with torch.no_grad():
        plain = target.generate(ids, **kwargs)
        fast = target.generate(ids, assistant_model=drafter, **kwargs)
    assert fast.tolist() == plain.tolist()
    assert tokenizer.decode(plain[0, ids.shape[1]:]).endswith(stop)  # the stop string did cut the answer short


@pytest.mark.parametrize("path", ["assisted", "batched"])
def test_no_device_sync_in_the_hot_path_unless_timing_was_asked(fitted, path, monkeypatch):
    """On a GPU each sync stalls the pipeline: drafting and the tap wait for the device only with time_phases."""
    import dcoco_hf.runtime.drafting as drafting
    import dcoco_hf.runtime.tap as tap

    target, drafter = fitted
    waits = []
    # as if on a GPU: every sync asked for with timing on is counted
    fake = lambda device, timed=True: (lambda: waits.append(1)) if timed else (lambda: None)  # noqa: E731
    monkeypatch.setattr(drafting, "device_sync", fake)
    monkeypatch.setattr(tap, "device_sync", fake)
    ids = _prompt(target, 4)
    _call(path, target, drafter, ids)
    assert waits == []
    drafter.generation_config.time_phases = True
    try:
        _call(path, target, drafter, ids)
    finally:
        del drafter.generation_config.time_phases
    assert len(waits) > 0
