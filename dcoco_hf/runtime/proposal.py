"""Per-cycle proposal length: how many drafted tokens each cycle hands the target to verify (a leaf module).

A block drafter drafts every slot of its block in one forward, so a draft costs about the same whatever share of it
is proposed; what the proposal length k changes is the verify forward (k + 1 rows, dearer per row on a CPU) and how
many tokens that forward may commit. Each cycle the cost-aware schedule proposes the k of most expected committed
tokens per second:

    E[committed | k] = 1 + sum_{i <= k} prod_{j <= i} p_j     (prefix-first: verification stops at the first error)
    T(k, B)          = draft(B) + verify(k + 1) + loop(B)     T(0) = verify(1) + loop: a plain step

p_j is the chance that slot j is accepted given that every slot before it was (the chain acceptance of DScout and of
the DCOCO paper's prefix-first analysis). It is predicted per slot from the slot's confidence, the probability the
walk's own scores give the chosen candidate (the corrector's transition scores when it ran, else the drafter's
logits), and from how well drafts fared in the call so far; an online logistic fit calibrates it from what the
target committed, every drafted slot counted (a slot that was not proposed is labelled by whether the committed token
there equals it), starting from the drafter's `block_tau` (tau per block size implies the chain acceptance).

Whether to draft at all, and which block B, is decided before each draft, from what is known then: a draft of
fewer slots is cheaper (on a CPU a block of 8 costs about twice a block of 2), and the next draft will look like the
recent ones. So each cycle drafts the B of most expected tokens per second when each of the last drafts' slot
confidences (`AcceptanceModel.recent_drafts`, re-predicted with the call's acceptance now) is proposed at its own best
k. Chat, whose drafts rarely survive past the second slot, drafts short blocks; code drafts long ones.

The costs come from `CycleCosts`, timed when the drafter is attached (`block_choice.measure_cycle_costs`): robust to a
noisy machine (interleaved sizes, repeats, medians, a monotone fit), cached per machine; what they miss is learned
from the cycles' own wall times (`loop`, and `loop(B)` from the cycles that drafted B). When even the best block is
not expected to beat a plain step, the cycles after this one are plain steps (k = 0: no draft, a 1-row forward), for 1, 2,
4, ... up to `MAX_PLAIN_RUN` cycles while drafts keep failing, so a drafter that cannot guess the text costs a draft
now and then instead of every cycle.

Lossless whatever k is: the target verifies every proposed token, and k depends only on the drafter's side.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# The schedules `num_assistant_tokens_schedule` may name (the drafter's generation config).
COST_SCHEDULE = "cost"
SCHEDULES = (COST_SCHEDULE, "constant", "heuristic", "heuristic_transient")
# Longest run of plain steps between two drafts that probe whether drafting pays again (the target tap keeps the
# states of that many forwards for the next draft's context: tap.TargetTap's max_pending).
MAX_PLAIN_RUN = 16
# The longest block whose cycle costs are timed and cached (`CycleCosts`), and the most verify rows they hold: `tune`
# refuses larger blocks rather than timing them for minutes.
MAX_TIMED_BLOCK = 64
MAX_TIMED_ROWS = 2 * MAX_TIMED_BLOCK
_RECENT_DECAY = 0.25  # weight of the newest slot-1 outcome in a call's running acceptance
_RECENT_FADE = 0.05  # per plain step, the share of the way the running acceptance drifts back to the prior
_LEARNING_RATE = 0.05
_TYPICAL_DECAY = 0.2  # weight of the newest draft in a slot's typical confidence
_PLANNED_DRAFTS = 8  # the recent drafts whose confidences forecast the next draft's
_EPS = 1e-3


def check_schedule(name: str) -> str:
    """The schedule `name`, or a ValueError naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(
            f"num_assistant_tokens_schedule={name!r} (the drafter's generation config): choose one of {SCHEDULES}: "
            f"'{COST_SCHEDULE}' picks each cycle's proposal length from predicted acceptance and measured costs, "
            "'constant' proposes num_assistant_tokens every cycle, 'heuristic' is transformers' rule (+2 after a "
            "fully accepted block, -1 otherwise)."
        )
    return name


# ------------------------------------------------------------------------------------------------- the costs


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [mean for mean, weight in blocks for _ in range(int(weight))]


@dataclass
class CycleCosts:
    """Seconds of the parts of one speculation cycle on one device, for one target and drafter.

    verify[n - 1]: a target forward of n rows on a cached context (n = 1 is a plain decoding step);
    draft[B]: drafting and correcting a block of B; both non-decreasing (a monotone fit of medians).
    spread: the timings' median relative interquartile range (how noisy the machine was while timing).
    """

    verify: list[float]
    draft: dict[int, float]
    spread: float = 0.0

    @classmethod
    def fit(cls, verify: Mapping[int, Sequence[float]], draft: Mapping[int, Sequence[float]]) -> CycleCosts:
        """From repeated timings per size ({rows: [seconds]}, {block: [seconds]}): medians, made monotone."""
        rows = sorted(verify)
        if rows != list(range(1, len(rows) + 1)):
            raise ValueError(f"verify timings must cover 1..n rows, got {rows}")
        blocks = sorted(draft)
        spreads = [_relative_iqr(samples) for samples in [*verify.values(), *draft.values()]]
        return cls(
            verify=isotonic([statistics.median(verify[n]) for n in rows]),
            draft=dict(zip(blocks, isotonic([statistics.median(draft[b]) for b in blocks]))),
            spread=statistics.median(spreads) if spreads else 0.0,
        )

    @property
    def plain(self) -> float:
        return self.verify[0]

    @property
    def max_rows(self) -> int:
        return len(self.verify)

    def cycle(self, k: int, block: int) -> float:
        """Seconds of a cycle proposing k tokens of a drafted block of `block` (k = 0: a plain step, no draft)."""
        if k == 0:
            return self.plain
        return self.draft_seconds(block) + self.verify[min(k, self.max_rows - 1)]

    def draft_seconds(self, block: int) -> float:
        timed = [b for b in self.draft if b >= block] or [max(self.draft)]
        return self.draft[min(timed)]

    def to_dict(self) -> dict[str, Any]:
        return {"verify": self.verify, "draft": {str(b): s for b, s in self.draft.items()}, "spread": self.spread}

    @classmethod
    def from_dict(cls, data: Any) -> CycleCosts:
        """Read what `to_dict` wrote; a ValueError for anything else (a cache file of another shape)."""
        if not isinstance(data, Mapping):
            raise ValueError("cycle costs must be a mapping")
        verify, draft, spread = data.get("verify"), data.get("draft"), data.get("spread", 0.0)
        if not isinstance(verify, list) or not verify or not isinstance(draft, Mapping) or not draft:
            raise ValueError("cycle costs need a non-empty 'verify' list and 'draft' mapping")
        if not all(str(b).isdigit() for b in draft) or not _is_number(spread) or not 0.0 <= spread < math.inf:
            raise ValueError("cycle costs need block sizes as 'draft' keys and a finite 'spread' >= 0")
        verify = [_positive_seconds(v) for v in verify]
        draft = {int(b): _positive_seconds(s) for b, s in draft.items()}
        if verify != isotonic(verify) or not all(2 <= b <= MAX_TIMED_BLOCK for b in draft) or len(verify) > MAX_TIMED_ROWS:
            raise ValueError(
                f"cycle costs out of range (verify must be non-decreasing, blocks in [2, {MAX_TIMED_BLOCK}])"
            )
        return cls(verify, draft, float(spread))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_seconds(value: Any) -> float:
    # A number as JSON writes one: a string ("0.01") is what a hand-edited or foreign file holds, not a timing.
    if not _is_number(value) or not (math.isfinite(value) and 0.0 < value < 3600.0):
        raise ValueError(f"a cost of {value!r} seconds")
    return float(value)


def _relative_iqr(samples: Sequence[float]) -> float:
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / max(statistics.median(samples), 1e-12)


# ------------------------------------------------------------------------------------------- the acceptance


def chain_prior(block_tau: Mapping[str, float] | None, slots: int) -> list[float]:
    """Per slot, the chance it is accepted given every slot before it was, implied by tau per block size: a block
    of B commits tau(B) = 1 + sum_{i < B} prod_{j <= i} p_j tokens per verify, so prod_{j <= i} p_j = tau(i + 1) -
    tau(i). Unmeasured slots repeat the last measured rate; 0.5 everywhere without `block_tau`."""
    if not block_tau:
        return [0.5] * slots
    tau = {1: 1.0, **{int(b): float(t) for b, t in block_tau.items()}}
    survival, prior = 1.0, []
    for slot in range(1, slots + 1):
        if slot + 1 in tau and slot in tau:
            reach = min(max(tau[slot + 1] - tau[slot], _EPS * survival), survival)
            prior.append(reach / survival)
            survival = reach
        else:
            prior.append(prior[-1] if prior else 0.5)
    return [min(max(p, 0.02), 0.98) for p in prior]


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class AcceptanceModel:
    """p_j = sigmoid(bias_j + w_conf * logit(confidence_j) + w_recent * (logit(recent) - logit(prior_1)) + w_vocab *
    (draftable - 1)), fitted online by logistic SGD on every labelled slot.

    recent: the call's running slot-1 acceptance; draftable: the share of the last committed tokens inside the
    drafter's draft vocabulary (1 without one), a signal read before anything is spent: text in a script the draft
    vocabulary lacks cannot be drafted. It starts at the prior (w_conf = 0), with both call-level features shifting
    every slot alike until the fit says otherwise."""

    def __init__(self, prior: Sequence[float], learning_rate: float = _LEARNING_RATE) -> None:
        self.prior = list(prior)
        self.bias = [_logit(p) for p in prior]
        self.weights = [0.0, 1.0, 2.0]  # confidence, recent, draftable
        self.learning_rate = learning_rate
        self.observed = 0
        self._typical_logit: list[float | None] = [None] * len(prior)  # per slot, recent drafts' mean confidence
        self.recent_drafts: deque[list[float]] = deque(maxlen=_PLANNED_DRAFTS)  # their slot confidences

    @property
    def slots(self) -> int:
        return len(self.bias)

    def _features(self, confidence: float, recent: float, draftable: float) -> tuple[float, float, float]:
        return _logit(confidence), _logit(recent) - _logit(self.prior[0]), draftable - 1.0

    def _p(self, slot: int, features: tuple[float, float, float]) -> float:
        return _sigmoid(self.bias[slot] + sum(w * x for w, x in zip(self.weights, features)))

    def predict(self, confidence: Sequence[float], recent: float, draftable: float = 1.0) -> list[float]:
        """Chain acceptance per slot for a block whose slots have these confidences."""
        return [self._p(slot, self._features(c, recent, draftable)) for slot, c in enumerate(confidence[: self.slots])]

    def note_drafted(self, confidence: Sequence[float]) -> None:
        """One drafted block's slot confidences, for `typical` (a running mean of their logits per slot) and
        `recent_drafts`."""
        self.recent_drafts.append(list(confidence[: self.slots]))
        for slot, c in enumerate(confidence[: self.slots]):
            known = self._typical_logit[slot]
            x = _logit(c)
            self._typical_logit[slot] = x if known is None else (1 - _TYPICAL_DECAY) * known + _TYPICAL_DECAY * x

    def typical(self) -> list[float]:
        """Per slot, the confidence of a typical recent draft: a slot never drafted takes the nearest shallower
        slot's (0.5 before any draft)."""
        typical, last = [], 0.0
        for known in self._typical_logit:
            last = known if known is not None else last
            typical.append(_sigmoid(last))
        return typical

    def observe(self, confidence: Sequence[float], recent: float, labels: Sequence[bool], draftable: float = 1.0) -> None:
        """One block's labelled slots: labels[j] whether slot j was right, for the slots every earlier one of which
        was right (the chain's condition), in order."""
        for slot, (c, label) in enumerate(zip(confidence[: self.slots], labels)):
            features = self._features(c, recent, draftable)
            gradient = self._p(slot, features) - float(label)
            self.bias[slot] -= self.learning_rate * gradient
            self.weights = [w - self.learning_rate * gradient * x for w, x in zip(self.weights, features)]
            self.observed += 1


def chain_labels(proposed: Sequence[int], committed: Sequence[int]) -> list[bool]:
    """Whether each drafted slot held the token finally committed at its position, up to and including the first
    that did not (the slots after it were never reached); `committed` may be shorter than the block."""
    labels = []
    for draft, token in zip(proposed, committed):
        labels.append(draft == token)
        if draft != token:
            break
    return labels


def slot_confidence(
    candidate_logits: torch.Tensor,
    chosen: torch.LongTensor,
    transition_scores: torch.Tensor | None,
    first_slot_scores: torch.Tensor | None,
) -> torch.Tensor:
    """The probability the walk's scores give each chosen candidate: [B, S] in (0, 1].

    candidate_logits [B, S, K] and chosen [B, S] as in `DraftProposal`; transition_scores [B, S - 1, K, K] (None when
    the corrector did not run): slot j > 1 is scored by the row of its chosen predecessor; first_slot_scores [B, K]
    score slot 1 when the corrector scores the anchor's transitions, else the drafter's slot-1 logits do."""
    first = first_slot_scores if first_slot_scores is not None else candidate_logits[:, 0]  # [B, K]
    if transition_scores is None:
        rows = candidate_logits  # [B, S, K]
    else:
        previous = chosen[:, :-1, None, None].expand(-1, -1, 1, transition_scores.shape[-1])  # [B, S - 1, 1, K]
        successors = transition_scores.gather(2, previous).squeeze(2)  # [B, S - 1, K]
        rows = torch.cat([first[:, None], successors], dim=1)  # [B, S, K]
    return rows.float().softmax(-1).gather(-1, chosen[..., None]).squeeze(-1)  # [B, S]


# ------------------------------------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class ProposalChoice:
    """k: tokens to propose; expected: expected tokens committed by that cycle; gain: its expected tokens per second
    over a plain step's (below 1: drafting did not pay this cycle)."""

    k: int
    expected: float
    gain: float


@dataclass(frozen=True)
class DraftPlan:
    """block: the block to draft next (anchor + slots); gain: the expected tokens per second of drafting it, each
    draft proposed at its best length, over a plain step's (below 1: plain steps are expected to pay more)."""

    block: int
    gain: float


def expected_tokens(predicted: Sequence[float], cap: int, floor: float) -> list[float]:
    """E[committed | k] for k = 0, 1, ...: 1 + sum_{i <= k} prod_{j <= i} p_j, up to `cap` slots and cut before the
    first slot after slot 1 predicted below `floor`."""
    expected, survival = [1.0], 1.0
    for k, p in enumerate(predicted[:cap], start=1):
        if p < floor and k > 1:
            break
        survival *= p
        expected.append(expected[-1] + survival)
    return expected


@dataclass
class ProposalSchedule:
    """What the cost-aware schedule keeps across the calls of one attached drafter: the costs of this device and
    the acceptance fit. `costs` None (an untuned drafter) proposes every slot, like the constant schedule."""

    costs: CycleCosts | None
    acceptance: AcceptanceModel
    loop_seconds: float = 0.0  # per-cycle time outside the timed forwards, refined from the cycles themselves
    # The same, per drafted block, from the cycles that drafted it: what the timed costs miss for that block (a
    # draft or a verify width that runs slower in the loop than when timed alone) moves the next choices.
    block_loop: dict[int, float] = field(default_factory=dict)
    _loop_samples: int = field(default=0, repr=False)
    _block_samples: dict[int, int] = field(default_factory=dict, repr=False)

    def cycle_seconds(self, block: int) -> list[float]:
        """The modelled wall time of a cycle drafting `block` and proposing k of it, for k = 0 .. block - 1."""
        return [self.costs.cycle(k, block) + self.loop_for(block) for k in range(block)]

    def loop_for(self, block: int) -> float:
        """The time outside the modelled forwards of a cycle drafting `block`: its own cycles', else every cycle's."""
        return self.block_loop.get(block, self.loop_seconds)

    def choose(self, predicted: Sequence[float], cap: int, floor: float, block: int) -> ProposalChoice:
        """The k in [1, cap] of most expected tokens per second, cut before the first slot predicted below `floor`
        (transformers' `assistant_confidence_threshold`); a cycle that drafted proposes at least one token."""
        return self.choose_batch([predicted], cap, floor, block)

    def choose_batch(self, predicted: Sequence[Sequence[float]], cap: int, floor: float, block: int) -> ProposalChoice:
        """`choose` for one k shared by the rows of a batch (one verify forward of k + 1 columns): the k of most
        expected tokens, summed over the rows, per second; `expected` and `gain` are per row."""
        per_row = [expected_tokens(row, cap, floor) for row in predicted]
        width = max((len(expected) for expected in per_row), default=1)  # a row's proposals end where it is cut
        totals = [sum(expected[min(k, len(expected) - 1)] for expected in per_row) for k in range(width)]
        rows = max(len(predicted), 1)
        if self.costs is None:
            k = len(totals) - 1
            return ProposalChoice(k, totals[k] / rows, 1.0)
        seconds = self.cycle_seconds(block)
        k = fastest_length(totals, seconds)
        return ProposalChoice(k, totals[k] / rows, totals[k] / seconds[k] * (self.costs.plain + self.loop_seconds) / rows)

    def plan_draft(self, recent: float, draftable: float, cap: int, floor: float) -> DraftPlan:
        """Before a draft: the timed block (at most cap + 1: the anchor and `cap` slots) of most expected tokens per
        second when each recent draft (`AcceptanceModel.recent_drafts`, slots it did not draft at their typical
        confidence) is predicted with the call's running acceptance `recent` and `draftable` share now and proposed
        at its own best k; the smaller block on a tie. Without costs: the largest block, gain 1."""
        acceptance = self.acceptance
        if self.costs is None:
            return DraftPlan(max(2, min(cap + 1, acceptance.slots + 1)), 1.0)
        typical = acceptance.typical()
        drafts = acceptance.recent_drafts or [typical]
        forecasts = [
            expected_tokens(acceptance.predict([*c, *typical[len(c) :]], recent, draftable), cap, floor)
            for c in drafts
        ]  # [drafts][k + 1]
        reach = min(cap, acceptance.slots)
        sizes = [b for b in sorted(self.costs.draft) if b - 1 <= reach] or [min(self.costs.draft)]
        plain = self.costs.plain + self.loop_seconds
        best = DraftPlan(sizes[0], -1.0)
        for block in sizes:
            costs = self.cycle_seconds(block)  # [k]
            tokens = seconds = 0.0
            for expected in forecasts:
                k = fastest_length(expected, costs)
                tokens, seconds = tokens + expected[k], seconds + costs[k]
            if tokens / seconds * plain > best.gain:
                best = DraftPlan(block, tokens / seconds * plain)
        return best

    def observe_loop(self, seconds: float, block: int | None = None) -> None:
        """A cycle's wall time less its modelled forwards, per forward: the running mean of the rest (never below 0),
        and that of the drafted `block`'s when the cycle was one draft and its verify (no plain steps in it)."""
        self._loop_samples += 1
        self.loop_seconds = _running_mean(self.loop_seconds, seconds, self._loop_samples)
        if block is not None:
            samples = self._block_samples[block] = self._block_samples.get(block, 0) + 1
            self.block_loop[block] = _running_mean(self.loop_for(block), seconds, samples)


def fastest_length(expected: Sequence[float], seconds: Sequence[float]) -> int:
    """The proposal length k >= 1 of most expected tokens (`expected[k]`) per second (`seconds[k]`), the shorter on
    a tie; k stops where either list does."""
    return max(range(1, min(len(expected), len(seconds))), key=lambda k: expected[k] / seconds[k])


def _running_mean(mean: float, sample: float, samples: int) -> float:
    """The mean of the samples so far, turning into a moving average (5% per sample) after 20; never below 0."""
    return max(0.0, mean + max(1.0 / samples, 0.05) * (sample - mean))


def next_plain_run(gain: float, previous_run: int) -> int:
    """Plain steps to take before the next draft, when drafting is expected to pay `gain` times a plain step
    (`DraftPlan.gain`): none while it pays, else twice the previous run (1, 2, 4, ...) up to `MAX_PLAIN_RUN`."""
    if gain >= 1.0:
        return 0
    return min(max(1, 2 * previous_run), MAX_PLAIN_RUN)


def draftable_share(tokens: Sequence[int], draft_vocabulary: frozenset[int] | None) -> float:
    """The share of `tokens` a drafter with this draft vocabulary could propose (1.0 without one)."""
    if draft_vocabulary is None or not tokens:
        return 1.0
    return sum(token in draft_vocabulary for token in tokens) / len(tokens)


def update_recent(recent: float, accepted_first_slot: bool) -> float:
    """A call's running slot-1 acceptance, after one more drafted block."""
    return (1 - _RECENT_DECAY) * recent + _RECENT_DECAY * float(accepted_first_slot)


def fade_recent(recent: float, prior: float, steps: int = 1) -> float:
    """The running acceptance after `steps` plain steps: what failed drafts taught fades as the text moves on, so a
    call that left a passage the drafter could not guess drafts again (no plain run is taught by a draft)."""
    keep = (1 - _RECENT_FADE) ** steps
    return keep * recent + (1 - keep) * prior


__all__ = [
    "COST_SCHEDULE", "MAX_TIMED_BLOCK", "MAX_TIMED_ROWS", "SCHEDULES", "AcceptanceModel", "CycleCosts", "DraftPlan",
    "ProposalChoice", "ProposalSchedule",
    "chain_labels", "chain_prior", "check_schedule", "draftable_share", "expected_tokens", "fade_recent", "isotonic",
    "next_plain_run", "slot_confidence", "update_recent",
]
