"""`DCOCOCandidateGenerator`: the adapter between transformers' assisted loop and the `SpeculationEngine`.

`target.generate(..., assistant_model=drafter)` calls the drafter's `generate()` once per cycle, a delegate to
`assisted_cycle` here: transformers hands back whatever the drafter returns as its `cache` on the next cycle of the
same call, so a handle returned there (`EngineHandle`) keeps one adapter and its engine alive exactly as long as one
target `generate()` call, and neither transformers nor the target's class is patched. After each verification
transformers reports its count of matches to its candidate generator (`update_candidate_strategy`), which the
adapter forwards to the engine (`hf_compat.report_verifications`): acceptance is what transformers accepted.

Target hidden states come from forward hooks on the target's decoder layers (`TargetTap`): they are exactly the
states of the target's own verification forwards. A forward's rows become drafter context only where its token ids
agree with the committed sequence and lie strictly before the anchor, so rejected drafts, new prompts and multi-turn
continuations take care of themselves.

Lossless by construction: the target verifies every proposal. The proposal is deterministic, so its "draft
distribution" is a point mass, and we hand transformers ONE-HOT logits; its speculative sampling then accepts with
probability q_target(y) and resamples from q_target restricted to v != y, which is exact (DCOCO appendix G).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import AssistedCandidateGenerator, CandidateGenerator
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .engine import Call, SpeculationEngine, claim, keep_call_statistics, require_prompt_tokens
from .hf_compat import (
    TRANSFORMERS_VERSION,
    assisted_driver,
    assisted_loop_cuts_at_eos,
    assisted_loop_scores,
    assisted_stopping_criteria,
    cache_kwargs,
    output_cache,
    proposal_length,
    report_verifications,
    set_proposal_length,
)
from .stats import DCOCOStats

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter


def assisted_cycle(
    drafter: DCOCODrafter, input_ids: torch.LongTensor | None, generation_config: GenerationConfig | None,
    keywords: dict[str, Any],
) -> GenerateDecoderOnlyOutput:
    """One cycle of `target.generate(..., assistant_model=drafter)`: what `DCOCODrafter.generate` returns to
    transformers' `AssistedCandidateGenerator` (the proposal as sequences, its one-hot scores, and our handle of the
    call as the assistant's cache, which transformers hands back on the next cycle)."""
    if generation_config is None or not getattr(generation_config, "is_assistant", False):
        raise TypeError(
            "DCOCODrafter does not generate text by itself. Use "
            "`target.generate(**inputs, assistant_model=drafter)` (after `drafter.attach(target)`), or "
            "`dcoco_hf.speculative_generate(target, input_ids, drafter=drafter)` for batches."
        )
    handle = output_cache(keywords)
    if not isinstance(handle, EngineHandle):
        handle = start_assisted_call(drafter, generation_config)
    max_new_tokens = keywords.get("max_new_tokens") or drafter.config.block_size - 1
    candidate_ids, candidate_logits = handle.engine.get_candidates(
        input_ids, max_new_tokens=max_new_tokens, scores=assisted_loop_scores()
    )
    return GenerateDecoderOnlyOutput(
        sequences=candidate_ids, scores=tuple(candidate_logits.unbind(1)), **cache_kwargs(handle)
    )


class EngineHandle(Call):
    """What transformers' AssistedCandidateGenerator stores as our `cache` between cycles: it lives exactly as long
    as one target `generate()` call.

    It only asks a cache for its length and to crop it; the engine re-synchronises from token ids itself, so both
    are no-ops here.
    """

    engine: DCOCOCandidateGenerator

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, max_length: int) -> None:
        return None


def start_assisted_call(drafter: DCOCODrafter, generation_config: GenerationConfig) -> EngineHandle:
    """The first cycle of a target `generate()` call: a new adapter and engine, living as long as the call does.

    transformers drops our handle when the call returns or raises; the handle's finaliser then ends the engine,
    so the tap stops recording the target right there. The drafter is claimed before the engine exists: a refused
    call (another thread's, `claim`) must not touch the running call's tap.
    """
    criteria = assisted_stopping_criteria()
    check_stopping_criteria(criteria, scores_requested=assisted_loop_scores() is not None)
    if criteria is None and getattr(generation_config, "stop_strings", None):
        raise ValueError(
            "stop_strings with a DCOCO drafter need transformers' assisted loop as of 5.17-5.25 (its stopping "
            "criteria could not be found); drop stop_strings or cut the text after generate()."
        )
    driver = assisted_driver()
    if driver is None:
        raise RuntimeError(
            f"transformers {TRANSFORMERS_VERSION}'s assisted loop could not be found calling the drafter, so its "
            "verifications cannot reach it. dcoco-hf supports the transformers releases in its pyproject.toml; "
            "install one of those, or use dcoco_hf.speculative_generate(target, input_ids, drafter=drafter)."
        )
    handle = EngineHandle()
    claim(drafter, handle)
    engine = handle.engine = DCOCOCandidateGenerator(
        drafter, generation_config, correct=drafter.decoding.use_corrector, stopping_criteria=criteria, driver=driver
    )
    weakref.finalize(handle, engine.end_call)
    keep_call_statistics(drafter, engine)
    return handle


class TapCounters(NamedTuple):
    """What the tap counted of one call's target forwards."""

    forwards: int
    seconds: float
    starts: list[int]  # first position of each forward
    prefill_seconds: float  # of the prompt's forward


class DCOCOCandidateGenerator(CandidateGenerator):
    """Drafts corrected DFlash blocks for one `generate()` call of the drafter's attached target.

    Args:
        drafter: an attached `DCOCODrafter`.
        generation_config: the target's generation config (unused beyond validation; kept for the transformers API).
        selection: walk override ("prefix_first" | "viterbi" | "geometric"); default the drafter's (`decoding`).
        correct: False proposes plain DFlash argmax blocks (same weights, corrector off).
        stopping_criteria: the call's criteria; proposals stop before the first token at which one fires.
        driver: transformers' `AssistedCandidateGenerator` of the call (`assisted_driver`): its verifications reach
            `update_candidate_strategy` here, and through it the cost-aware schedule takes plain steps (k = 0).
            None: whoever calls `get_candidates` reports each verification to `update_candidate_strategy`.

    Each cycle proposes k tokens of the drafted block (`SpeculationEngine.draft`), at most as many as transformers
    asks for (`num_assistant_tokens`, which the "heuristic" schedule moves).
    """

    def __init__(
        self,
        drafter: "DCOCODrafter",
        generation_config: Any | None = None,
        selection: str | None = None,
        correct: bool = True,
        stopping_criteria: StoppingCriteriaList | None = None,
        driver: AssistedCandidateGenerator | None = None,
    ) -> None:
        self.drafter = drafter
        self.target = drafter.target  # raises the clear "not attached" error
        self.tap = drafter.tap
        self.engine = SpeculationEngine(drafter, rows=1, correct=correct, selection=selection)
        # transformers cuts accepted blocks at max_length (and, from 5.18, at EOS) itself; the others it checks only
        # per cycle.
        handled = (EosTokenCriteria, MaxLengthCriteria) if assisted_loop_cuts_at_eos() else (MaxLengthCriteria,)
        self.stopping_criteria = StoppingCriteriaList(c for c in stopping_criteria or () if not isinstance(c, handled))
        self.context_end = 0  # every committed position below this is in the drafter cache (or was never seen)
        self._length: int | None = None  # committed tokens when transformers last reported
        self._pending: int | None = None  # the cycle's proposed tokens, until verified
        self._cycle_start: float | None = None  # when the previous verification was reported
        self._closed_sequence: torch.LongTensor | None = None
        self._last_committed: torch.LongTensor | None = None
        self._ended: TapCounters | None = None  # the tap's counters when the call ended
        self._plain_since_draft = 0  # plain steps taken since the last draft
        self._draft_forwards = 0  # the tap's forward count at the last draft
        # Weak: transformers' generator holds our handle (as its assistant's cache), whose finaliser holds this engine.
        self._driver = weakref.ref(driver) if driver is not None else None
        self._driver_tokens = proposal_length(driver) if driver is not None else 0
        if driver is not None:
            report_verifications(driver, self.update_candidate_strategy)
        self.tap.listen(self, timed=drafter.time_phases)  # exact GPU phase times cost a sync per phase

    @property
    def stats(self) -> DCOCOStats:
        return self.engine.stats[0]

    @property
    def cache(self):
        return self.engine.cache

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        max_new_tokens: int | None = None,
        scores: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """input_ids [1, L] (committed) -> (candidate ids [1, L + k], one-hot candidate logits [1, k, V]).
        `scores`: what the assisted loop passes its stopping criteria (`assisted_loop_scores`)."""
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"transformers' assisted generation runs one sequence at a time (got batch {input_ids.shape[0]}); "
                "use dcoco_hf.speculative_generate(target, drafter, input_ids, attention_mask=...) for batches."
            )
        require_prompt_tokens(input_ids)
        committed = input_ids[0]
        length = committed.shape[0]
        if self._length is None:
            self._length = length  # the prompt: the engine counts answer tokens only
        context, positions = self._new_context(committed)
        largest = self.drafter.config.block_size
        cap = largest - 1 if max_new_tokens is None else min(max_new_tokens, largest - 1)
        anchor_position = torch.tensor([length - 1], device=input_ids.device)
        proposal, k, _ = self.engine.draft(  # the assisted loop verifies chains (no tree budget)
            committed[-1:], anchor_position, context[None], positions[None], [0], cap, context_ids=committed[None]
        )
        tokens = cut_at_stop(
            self.stopping_criteria, input_ids, proposal.tokens[:, :k], proposal.candidates[0, 0], scores
        )
        self._draft_forwards = self.tap.forward_count
        self._pending = tokens.shape[1]
        self._last_committed = committed
        self._plain_since_draft = 0
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=1), one_hot_logits(tokens, self.vocab_size)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """transformers verified the cycle: `num_matches` proposed tokens were accepted and `input_ids` [1, L'] is the
        committed sequence now. Books the cycle, times it, and after a planned run of plain steps drafts again."""
        now = time.perf_counter()
        started, self._cycle_start = self._cycle_start, now
        length = self._length if self._length is not None else input_ids.shape[1]
        new = input_ids[0, length:].tolist()
        self._length = input_ids.shape[1]
        pending, self._pending = self._pending, None
        if pending is not None and self._tap_counters().forwards == self._draft_forwards:
            raise RuntimeError(
                "The drafter's target ran no forward since the last draft: generate() was called on a different "
                "model than the one this drafter is attached to. Call `drafter.attach(model)` for the model you "
                "generate with."
            )
        if pending is None:
            self._plain_since_draft += 1
        seconds = now - started if started is not None else None  # the prompt's prefill is no cycle cost
        self.engine.verified([0], pending or 0, [int(num_matches)], [new], seconds=seconds)
        driver = self.driver
        if driver is None:  # transformers' loop cannot take a plain step for us: every cycle drafts
            return
        # The next cycle: for a plain step transformers verifies no draft (`assisted_driver`); its own count
        # (which its "heuristic" schedule moves) is put back for the next draft.
        if self.engine.next_cycle([0]) is None:
            set_proposal_length(driver, 0)
        elif proposal_length(driver) == 0:
            set_proposal_length(driver, self._driver_tokens)

    @property
    def driver(self) -> AssistedCandidateGenerator | None:
        """transformers' generator of this call, while the call runs (see `assisted_driver`)."""
        return self._driver() if self._driver is not None else None

    def end_call(self) -> None:
        """The generate() call is over (returned or raised): stop recording the target, keep the statistics."""
        if self._ended is None and self.tap.owner is self:
            counters = self._tap_counters()
            self._ended = counters._replace(starts=list(counters.starts))  # frozen: a copy, not the tap's live list
        self.tap.stop(self)

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().weight.shape[0]

    def close(self, sequences: torch.LongTensor) -> None:
        """Settle the call's statistics: the drafted slots the committed text decides, candidate coverage and the
        tap's forward counts.

        Raises if `sequences` did not come from this engine's generate() call (for instance a later call with too
        few new tokens to draft never consulted the drafter): statistics are never silently attributed to it.
        """
        if self._closed_sequence is not None:  # closed already: only the very same sequences may ask again
            if not torch.equal(sequences[0].to(self._closed_sequence.device), self._closed_sequence):
                raise RuntimeError(_OTHER_CALL)
            return
        self._check_same_call(sequences[0])
        self.engine.finish()
        self._closed_sequence = sequences[0].clone()
        counters = self._tap_counters()
        self.stats.target_forwards, self.stats.target_seconds = counters.forwards, counters.seconds
        self.stats.prefill_seconds = counters.prefill_seconds
        self.end_call()

    def _tap_counters(self) -> TapCounters:
        """The tap's counters of this call's target forwards so far (frozen when the call ended)."""
        if self._ended is not None:
            return self._ended
        tap = self.tap
        return TapCounters(tap.forward_count, tap.seconds, tap.forward_starts, tap.prefill_seconds)

    # ------------------------------------------------------------------ internals

    def _new_context(self, committed: torch.LongTensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """Rows of the target forwards since the last draft that are committed, before the anchor and not yet in
        the drafter cache: ([n, n_layers * H], [n])."""
        anchor_position = committed.shape[0] - 1
        rows, positions = [], []
        for forward in self.tap.drain():
            ids, pos = forward.ids[0].to(committed.device), forward.positions[0].to(committed.device)
            inside = pos < anchor_position
            agrees = inside & (committed[pos.clamp(max=anchor_position)] == ids)
            agreeing = int(agrees.long().cumprod(0).sum())  # a state is valid only if every earlier token agrees
            fresh = (pos[:agreeing] >= self.context_end).nonzero()
            if agreeing == 0 or fresh.numel() == 0:
                continue
            first = int(fresh[0])
            rows.append(forward.states[0, first:agreeing])
            positions.append(pos[first:agreeing])
            self.context_end = int(pos[agreeing - 1]) + 1
        width = len(self.drafter.config.target_layer_ids) * self.drafter.config.hidden_size
        if not rows:
            device = committed.device
            return torch.zeros(0, width, device=device, dtype=self.drafter.dtype), committed.new_zeros(0)
        return torch.cat(rows), torch.cat(positions)

    def _check_same_call(self, sequence: torch.LongTensor) -> None:
        forward_count, _, forward_starts, _ = self._tap_counters()
        forwards_before = self._draft_forwards
        last = self._last_committed
        later_starts = forward_starts[forwards_before:]
        if forwards_before == 0:
            # The call's first draft precedes its prefill, which verifies it and starts where the prompt cache ends.
            later_starts = later_starts[1:]
        same = (
            last is not None
            and sequence.shape[0] >= last.shape[0]
            and torch.equal(sequence[: last.shape[0]].to(last.device), last)
            and len(later_starts) <= 2 + self._plain_since_draft
            and all(start >= last.shape[0] - 1 for start in later_starts)
        )
        if not same:
            raise RuntimeError(_OTHER_CALL)


_OTHER_CALL = (
    "These sequences did not come from the last generate() call that consulted this drafter (a call with fewer than 2 "
    "new tokens never drafts). Statistics exist only for calls that used the drafter."
)


# transformers' own criteria: each reads the token ids (or the clock), never `scores`.
TOKEN_ID_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)


def check_stopping_criteria(criteria: StoppingCriteriaList | None, scores_requested: bool) -> None:
    """Refuse a call that hands its stopping criteria `scores` (`output_scores` with `return_dict_in_generate`)
    when one of them is not transformers' own.

    A custom criterion may read the target's processed scores of the newest token (a confidence test), which exist
    for a drafted token only once the target has verified its block. transformers' loop checks the criteria after
    each block, so such a criterion could fire only at a block's last token and would stop later than plain
    `generate()`. Without `output_scores` every criterion gets `scores=None`, as in plain `generate()`, and reads
    token ids only: those stop exactly where plain `generate()` stops (`tokens_before_stop`).
    """
    if not scores_requested:
        return
    custom = sorted({type(c).__name__ for c in criteria or () if type(c) not in TOKEN_ID_CRITERIA})
    if custom:
        raise ValueError(
            f"stopping criteria {custom} with output_scores=True and a DCOCO drafter: a custom criterion may read "
            "`scores`, the target's processed scores of each new token, which a drafted token has only after the "
            "target verified its block, so a criterion testing them would stop later than plain generate(). Use "
            "plain generate() (without assistant_model) for criteria that read scores, or criteria that read token "
            "ids only, without output_scores (they then get scores=None and stop exactly where plain generate() does)."
        )


def tokens_before_stop(
    criteria: StoppingCriteriaList,
    input_ids: torch.LongTensor,
    tokens: torch.LongTensor,
    scores: tuple[torch.Tensor, ...] | None = None,
) -> int:
    """How many of the proposed `tokens` [1, k] to keep after `input_ids` [1, L]: those before the first one at
    which a stopping criterion fires.

    transformers' assisted loop checks the criteria once per cycle, after the accepted block, where plain
    `generate()` checks after every token. Proposing nothing past the first firing position restores plain
    `generate()`'s behaviour exactly: accepted tokens are a prefix of the proposal, so a criterion can only fire at
    the block's last token (the target's own), where the loop's check sees it. The cut depends only on the
    committed text and the proposal, so sampling stays exact too.

    Criteria get the `scores` the assisted loop passes them (`assisted_loop_scores`): None unless generate() was
    asked for `output_scores`, and then only transformers' own criteria are here (`check_stopping_criteria`),
    which read token ids only.
    """
    if not criteria:
        return tokens.shape[1]
    sequence = torch.cat([input_ids, tokens.to(input_ids.device)], dim=1)
    length = input_ids.shape[1]
    for kept in range(tokens.shape[1]):
        if bool(criteria(sequence[:, : length + kept + 1], scores).any()):
            return kept
    return tokens.shape[1]


def cut_at_stop(
    criteria: StoppingCriteriaList,
    input_ids: torch.LongTensor,
    tokens: torch.LongTensor,
    first_slot_candidates: torch.LongTensor,
    scores: tuple[torch.Tensor, ...] | None = None,
) -> torch.LongTensor:
    """The proposal `tokens` [1, k] cut before the first position where a stopping criterion fires (see
    `tokens_before_stop`); [1, >= 1] since transformers' loop takes no empty proposal.

    When the first token already fires, the proposal becomes slot 1's best candidate (`first_slot_candidates` [K])
    that does not: if the target accepts it, no stop was skipped; if it rejects it, the target's own token ends the
    block, where the loop's check sees it. Only criteria that fire whatever the token (`max_time`) keep slot 1.
    """
    kept = tokens_before_stop(criteria, input_ids, tokens, scores)
    if kept > 0:
        return tokens[:, :kept]
    for candidate in first_slot_candidates.view(-1, 1, 1).to(tokens.device):  # [K, 1, 1]
        if tokens_before_stop(criteria, input_ids, candidate, scores) == 1:
            return candidate
    return tokens[:, :1]


def one_hot_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
    """Logits of a point-mass proposal: 0 at the proposed token, -inf elsewhere. [B, k] -> [B, k, V]."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)


__all__ = ["DCOCOCandidateGenerator", "EngineHandle", "assisted_cycle", "cut_at_stop", "one_hot_logits",
           "start_assisted_call", "tokens_before_stop"]
