"""`DCOCOCandidateGenerator`: the speculation engine behind `target.generate(..., assistant_model=drafter)`.

One engine lives exactly as long as one target `generate()` call and holds all its state: the target hidden-state
capture, the drafter's context cache and the statistics. It reaches `generate()` through transformers' public
assisted-generation path (the drafter's `generate()` is called once per cycle, see `DCOCODrafter.generate`), so
neither transformers nor the target's class is patched.

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
from transformers.generation.candidate_generator import AssistedCandidateGenerator, CandidateGenerator
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from .context_cache import DraftContextCache
from .hf_compat import assisted_loop_cuts_at_eos
from .proposal import (
    COST_SCHEDULE,
    DraftPlan,
    chain_labels,
    draftable_share,
    fade_recent,
    next_plain_run,
    slot_confidence,
    update_recent,
)
from .stats import DCOCOStats

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter
    from .drafting import DraftProposal


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
        driver: transformers' `AssistedCandidateGenerator` of the call (`assisted_driver`), through which the
            cost-aware schedule takes plain steps (k = 0); None proposes at least one token every cycle.

    Each cycle proposes k tokens of the drafted block: under the cost-aware schedule (the default) it drafts the
    block and proposes the k of most expected tokens per second (`proposal.py`), else it drafts the configured block
    and proposes as many as transformers asks for (`num_assistant_tokens`, which the "heuristic" schedule moves).
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
        self.selection = selection
        self.correct = correct
        # transformers cuts accepted blocks at max_length (and, from 5.18, at EOS) itself; the others it checks only
        # per cycle.
        handled = (EosTokenCriteria, MaxLengthCriteria) if assisted_loop_cuts_at_eos() else (MaxLengthCriteria,)
        self.stopping_criteria = StoppingCriteriaList(c for c in stopping_criteria or () if not isinstance(c, handled))
        self.cache = DraftContextCache()
        self.context_end = 0  # every committed position below this is in the drafter cache (or was never seen)
        self.stats = DCOCOStats(drafter.config.block_size, drafter.config.top_k)
        self._pending_cycle: tuple[int, int, int, DraftProposal] | None = None  # (len, drafted, forwards, proposal)
        self._closed_sequence: torch.LongTensor | None = None
        self._last_committed: torch.LongTensor | None = None
        self._slot_candidates: list[tuple[int, torch.Tensor]] = []  # (committed length, [S, K]) per cycle
        self._ended: TapCounters | None = None  # the tap's counters when the call ended
        # Phase times on a GPU need a device sync per phase, which stalls it: only when asked (the bench asks).
        self.timed = drafter.time_phases
        generation = drafter.generation_config
        self.floor = float(getattr(generation, "assistant_confidence_threshold", 0.0) or 0.0)
        self.schedule = drafter.proposal_schedule if drafter.proposal_schedule_name == COST_SCHEDULE else None
        # Weak: transformers' generator holds our handle (as its assistant's cache), whose finaliser holds this engine.
        self._driver = weakref.ref(driver) if driver is not None and self.schedule is not None else None
        self._driver_tokens = driver.num_assistant_tokens if self._driver is not None else 0
        self.recent = self.schedule.acceptance.prior[0] if self.schedule is not None else 0.0  # running slot-1 rate
        self.plain_run = 0  # the last run of plain steps the schedule planned
        self.plain_left = 0  # plain steps still to take before the next draft
        self._unlabelled: list[tuple[int, list[int], list[float], list[float], float, float]] = []
        ids = drafter.draft_token_ids
        self.draft_vocabulary = frozenset(ids.tolist()) if ids is not None and self.schedule is not None else None
        self._cycle_start: float | None = None  # when the previous get_candidates started
        self._drafted = 0  # cycles drafted in this call
        self._last_committed_tail: list[int] = []  # the newest committed tokens, read with a draft vocabulary
        self._prompt_length: int | None = None  # of the call's prompt: its first draft's committed length
        self._plain_since_draft = 0  # plain steps the schedule took since the last draft
        self._plan: DraftPlan | None = None  # this cycle's block, and whether drafting is expected to pay
        on_forward = self._on_target_forward if self._driver is not None else None
        self.tap.listen(self, timed=self.timed, on_forward=on_forward)

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
        if input_ids.shape[1] == 0:
            raise ValueError(
                "generate(inputs_embeds=...) with a DCOCO drafter is not supported: the drafter reads the target's "
                "states of known tokens and needs their ids. Pass input_ids (the prompt's token ids) instead."
            )
        committed = input_ids[0]
        self._finish_cycle(committed)
        self._label_drafts(committed)
        if self._prompt_length is None:
            self._prompt_length = committed.shape[0]
        if self.draft_vocabulary is not None:  # the answer's tokens only: a chat template's are never drafted
            answer = committed[self._prompt_length :]
            self._last_committed_tail = answer[-_DRAFTABLE_WINDOW:].tolist()
        draftable = draftable_share(self._last_committed_tail, self.draft_vocabulary)
        context, positions = self._new_context(committed)
        length = committed.shape[0]
        largest = self.drafter.config.block_size
        cap = largest - 1 if max_new_tokens is None else min(max_new_tokens, largest - 1)
        self._plan = self.schedule.plan_draft(self.recent, draftable, cap, self.floor) if self.schedule else None
        block = self._plan.block if self._plan is not None else largest
        block_positions = torch.arange(length - 1, length - 1 + block, device=input_ids.device)
        position_ids = torch.cat([positions, block_positions])[None]
        proposal = self.drafter.propose(
            committed[-1:], context[None], position_ids, self.cache, selection=self.selection, correct=self.correct,
            context_ids=committed[None], timed=self.timed, block_size=block,
        )
        self.stats.observe_drafted_block(block)
        k = self._proposal_length(proposal, length, min(cap, block - 1), draftable)
        tokens = cut_at_stop(
            self.stopping_criteria, input_ids, proposal.tokens[:, :k], proposal.candidates[0, 0], scores,
            self.vocab_size,
        )
        self.stats.drafter_seconds += proposal.backbone_seconds
        self.stats.corrector_seconds += proposal.corrector_seconds
        self._pending_cycle = (length, tokens.shape[1], self.tap.forward_count, proposal)
        self._last_committed = committed
        self._drafted += 1
        self._plain_since_draft = 0
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=1), one_hot_logits(tokens, self.vocab_size)

    def _proposal_length(self, proposal: DraftProposal, length: int, cap: int, draftable: float) -> int:
        """How many of the drafted tokens to propose (see the class docstring), and, under the cost-aware schedule,
        how many plain steps to take before the next draft."""
        if self.schedule is None:
            return cap
        confidence = slot_confidence(
            proposal.candidate_logits, proposal.chosen, proposal.transition_scores, proposal.first_slot_scores
        )[0].tolist()  # [S]
        acceptance = self.schedule.acceptance
        predicted = acceptance.predict(confidence, self.recent, draftable)
        choice = self.schedule.choose(predicted, cap, self.floor, proposal.tokens.shape[1] + 1)
        acceptance.note_drafted(confidence)
        if self._drafted:  # the call's first draft precedes the prompt's forward: it has no context to go by
            entry = (length, proposal.tokens[0].tolist(), confidence, predicted, self.recent, draftable)
            self._unlabelled.append(entry)
            self.plain_run = next_plain_run(self._plan.gain, self.plain_run)
            driver = self.driver
            if self.plain_run and driver is not None:
                self.plain_left, driver.num_assistant_tokens = self.plain_run, 0
        return choice.k

    @property
    def driver(self) -> AssistedCandidateGenerator | None:
        """transformers' generator of this call, while the call runs (see `assisted_driver`)."""
        return self._driver() if self._driver is not None else None

    def _on_target_forward(self, width: int) -> None:
        """After each target forward (the tap): count the plain steps taken instead of drafts, and draft again
        after the planned run."""
        if self.plain_left and width == 1:
            self.plain_left -= 1
            self._plain_since_draft += 1
            self.stats.observe_plain_steps()
            self.recent = fade_recent(self.recent, self.schedule.acceptance.prior[0])
            driver = self.driver
            if not self.plain_left and driver is not None:
                driver.num_assistant_tokens = self._driver_tokens

    def _label_drafts(self, committed: torch.LongTensor, final: bool = False) -> None:
        """Teach the acceptance fit from the drafted blocks whose fate the committed text now settles: every slot
        up to the first wrong one, proposed or not (`chain_labels`)."""
        if not self._unlabelled:
            return
        # Only the positions the waiting blocks cover cross to the host, not the whole sequence every cycle.
        start = min(entry[0] for entry in self._unlabelled)
        end = max(entry[0] + len(entry[1]) for entry in self._unlabelled)
        known = committed[start:end].tolist()
        waiting = []
        for entry in self._unlabelled:
            length, proposed, confidence, predicted, recent, draftable = entry
            labels = chain_labels(proposed, known[length - start : length - start + len(proposed)])
            if not final and len(labels) < len(proposed) and all(labels):
                waiting.append(entry)  # every slot so far right: the next ones are not committed yet
                continue
            if labels:
                self.schedule.acceptance.observe(confidence, recent, labels, draftable)
                self.stats.observe_prediction(predicted, labels)
                self.recent = update_recent(self.recent, labels[0])
        self._unlabelled = waiting

    def end_call(self) -> None:
        """The generate() call is over (returned or raised): stop recording the target, keep the statistics."""
        if self._ended is None and self.tap.owner is self:
            counters = self._tap_counters()
            self._ended = counters._replace(starts=list(counters.starts))  # frozen: a copy, not the tap's live list
        self.tap.stop(self)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Unused: the engine learns from the committed text itself (`_label_drafts`), which also settles the slots
        it drafted but did not propose; transformers calls the assisted generator's method, not this one."""

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().weight.shape[0]

    def close(self, sequences: torch.LongTensor) -> None:
        """Account for the last cycle, which transformers ends without calling the drafter again.

        Raises if `sequences` did not come from this engine's generate() call (for instance a later call with too
        few new tokens to draft never consulted the drafter): statistics are never silently attributed to it.
        """
        if self._closed_sequence is not None:  # closed already: only the very same sequences may ask again
            if not torch.equal(sequences[0].to(self._closed_sequence.device), self._closed_sequence):
                raise RuntimeError(_OTHER_CALL)
            return
        self._check_same_call(sequences[0])
        self._finish_cycle(sequences[0], timed=False)  # transformers returned long after this cycle ended
        self._label_drafts(sequences[0], final=True)
        self._book_coverage(sequences[0])
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

    def _finish_cycle(self, committed: torch.LongTensor, timed: bool = True) -> None:
        """Book the previous cycle now that its committed tokens are known: acceptance, and with `timed` its wall
        time (since the previous draft; plain steps taken in between included)."""
        now = time.perf_counter()
        started, self._cycle_start = self._cycle_start, now
        if self._pending_cycle is None:
            return
        length, drafted, forwards_before, proposal = self._pending_cycle
        self._pending_cycle = None
        forward_count = self._tap_counters().forwards
        forwards = forward_count - forwards_before
        if forwards == 0:
            raise RuntimeError(
                "The drafter's target ran no forward since the last draft: generate() was called on a different "
                "model than the one this drafter is attached to. Call `drafter.attach(model)` for the model you "
                "generate with."
            )
        new = committed.shape[0] - length
        # Every target forward commits one token of its own: the first one after the draft verified it; the others
        # were plain steps (the schedule's, or at the end of a call, when no room is left for a draft).
        accepted = max(0, min(new - forwards, drafted))
        self.stats.observe_draft(drafted, accepted, new)
        self._slot_candidates.append((length, proposal.candidates[0]))
        costs = self.schedule.costs if self.schedule is not None else None
        if timed and costs is not None and started is not None and self._drafted > 1:
            wall = now - started
            block = proposal.tokens.shape[1] + 1
            modelled = costs.cycle(drafted, block) + (forwards - 1) * costs.plain
            self.schedule.observe_loop((wall - modelled) / forwards, block if forwards == 1 else None)
            self.stats.plain_estimate_seconds += new * costs.plain
            self.stats.cycle_wall_seconds += wall

    def _check_same_call(self, sequence: torch.LongTensor) -> None:
        forward_count, _, forward_starts, _ = self._tap_counters()
        length, _, forwards_before, _ = self._pending_cycle or (0, 0, forward_count, None)
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

    def _book_coverage(self, sequence: torch.LongTensor) -> None:
        """Per drafted block: which of its candidates were the tokens finally committed there."""
        for length, candidates in self._slot_candidates:  # candidates [S, K]
            truth = sequence[length : length + candidates.shape[0]].to(candidates.device)
            self.stats.observe_candidates(candidates[: truth.shape[0]] == truth[:, None])  # [s, K]
        self._slot_candidates = []


_DRAFTABLE_WINDOW = 8  # committed tokens whose share inside the draft vocabulary predicts the next ones

_OTHER_CALL = (
    "These sequences did not come from the last generate() call that consulted this drafter (a call with fewer than 2 "
    "new tokens never drafts). Statistics exist only for calls that used the drafter."
)


def tokens_before_stop(
    criteria: StoppingCriteriaList,
    input_ids: torch.LongTensor,
    tokens: torch.LongTensor,
    scores: tuple[torch.Tensor, ...] | None = None,
    vocab_size: int | None = None,
) -> int:
    """How many of the proposed `tokens` [1, k] to keep after `input_ids` [1, L]: those before the first one at
    which a stopping criterion fires.

    transformers' assisted loop checks the criteria once per cycle, after the accepted block, where plain
    `generate()` checks after every token. Proposing nothing past the first firing position restores plain
    `generate()`'s behaviour exactly: accepted tokens are a prefix of the proposal, so a criterion can only fire at
    the block's last token (the target's own), where the loop's check sees it. The cut depends only on the
    committed text and the proposal, so sampling stays exact too.

    Criteria get the `scores` the assisted loop passes them (`assisted_loop_scores`): None unless generate() was
    asked for `output_scores` (as in plain generate()), else the loop's tuple of processed target scores of the
    committed tokens, extended here by the proposal's own point-mass logits (the candidate logits the loop gets;
    `vocab_size` wide) for the proposed tokens, whose target scores do not exist yet. A criterion that reads scores
    is then checked again on the target's scores by the loop after every block, as in transformers' assisted loop.
    """
    if not criteria:
        return tokens.shape[1]
    sequence = torch.cat([input_ids, tokens.to(input_ids.device)], dim=1)
    proposed = None if scores is None else one_hot_logits(tokens, vocab_size).unbind(1)  # k x [1, V]
    length = input_ids.shape[1]
    for kept in range(tokens.shape[1]):
        seen = None if scores is None else (*scores, *proposed[: kept + 1])
        if bool(criteria(sequence[:, : length + kept + 1], seen).any()):
            return kept
    return tokens.shape[1]


def cut_at_stop(
    criteria: StoppingCriteriaList,
    input_ids: torch.LongTensor,
    tokens: torch.LongTensor,
    first_slot_candidates: torch.LongTensor,
    scores: tuple[torch.Tensor, ...] | None = None,
    vocab_size: int | None = None,
) -> torch.LongTensor:
    """The proposal `tokens` [1, k] cut before the first position where a stopping criterion fires (see
    `tokens_before_stop`); [1, >= 1] since transformers' loop takes no empty proposal.

    When the first token already fires, the proposal becomes slot 1's best candidate (`first_slot_candidates` [K])
    that does not: if the target accepts it, no stop was skipped; if it rejects it, the target's own token ends the
    block, where the loop's check sees it. Only criteria that fire whatever the token (`max_time`) keep slot 1.
    """
    kept = tokens_before_stop(criteria, input_ids, tokens, scores, vocab_size)
    if kept > 0:
        return tokens[:, :kept]
    for candidate in first_slot_candidates.view(-1, 1, 1).to(tokens.device):  # [K, 1, 1]
        if tokens_before_stop(criteria, input_ids, candidate, scores, vocab_size) == 1:
            return candidate
    return tokens[:, :1]


def one_hot_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
    """Logits of a point-mass proposal: 0 at the proposed token, -inf elsewhere. [B, k] -> [B, k, V]."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)
