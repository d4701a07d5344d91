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
k, or, in a call that builds draft trees, verified as its tree (`recent_trees`) where that is expected faster. Chat,
whose drafts rarely survive past the second slot, drafts short blocks; code drafts long ones.

The costs come from `CycleCosts`, timed when the drafter is attached (`block_choice.measure_cycle_costs`): robust to a
noisy machine (interleaved sizes, repeats, medians, a monotone fit), cached per machine; what they miss is learned
from the cycles' own wall times (`loop`, and `loop(B)` from the cycles that drafted B). When even the best block is
not expected to beat a plain step, the cycles after this one are plain steps (k = 0: no draft, a 1-row forward), for 1,
2, 4, ... up to `MAX_PLAIN_RUN` cycles while drafts keep failing, so a drafter that cannot guess the text costs a draft
now and then instead of every cycle.

Lossless whatever k is: the target verifies every proposed token, and k depends only on the drafter's side.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# The schedules `num_assistant_tokens_schedule` may name (the drafter's generation config).
COST_SCHEDULE = "cost"
SCHEDULES = (COST_SCHEDULE, "constant", "heuristic", "heuristic_transient")
# Longest run of plain steps the schedule plans at once, before it asks again whether drafting pays.
MAX_PLAIN_RUN = 16
# The most plain steps in a row while the plan says drafting would not pay (`SpeculationEngine.draft_block`): then a
# draft checks anyway, since the text may have changed in ways the plan, which reads only past drafts, cannot see.
# The target tap keeps the states of that many forwards for the next draft's context (`TargetTap.max_pending`).
PROBE_EVERY = 64
# The longest block whose cycle costs are timed and cached (`CycleCosts`), and the most verify columns they hold:
# `tune` refuses larger blocks rather than timing them for minutes.
MAX_TIMED_BLOCK = 64
MAX_TIMED_ROWS = 2 * MAX_TIMED_BLOCK
_RECENT_DECAY = 0.25  # weight of the newest slot-1 outcome in a call's running acceptance
_RECENT_FADE = 0.05  # per plain step, the share of the way the running acceptance drifts back to the prior
_LEARNING_RATE = 0.05
_TYPICAL_DECAY = 0.2  # weight of the newest draft in a slot's typical confidence
_PLANNED_DRAFTS = 8  # the recent drafts whose confidences forecast the next draft's
_EPS = 1e-3
_LOOP_PRIOR_CYCLES = 4  # a block's loop time starts as its fallback's, worth this many cycles
_YIELD_PRIOR_TOKENS = 8.0  # the tree yield starts at 1, worth this many predicted drafted tokens
# A tree that costs more than the chain replaces it only when expected this much faster. The plan compares the best
# of up to `tree_budget` tree sizes, each forecast with error, against one chain forecast: the maximum of many noisy
# forecasts runs high (the winner's curse), so a dearer tree that merely ties the chain on forecast runs slower than
# it. A tree no dearer than the chain (where verify columns are nearly free, as on a GPU, or one as wide as the
# chain) needs only to be expected to commit more; on a CPU whose wide forwards cost more, cycles stay on the chain
# unless a wider tree is clearly ahead.
TREE_MARGIN = 1.1


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


def cheapest_cover(seconds: Sequence[float]) -> list[float]:
    """Verify seconds per width (`seconds[n - 1]`: n columns) as the plan should price them: n columns cost the
    cheapest forward of at least n, never less than a plain step (`seconds[0]`).

    A wider forward can cost less than a narrower one: CPU GEMM kernels work in SIMD-wide tiles, and on an AVX-512
    machine 16 columns of SmolLM2-135M took 1.46x a plain step where 12 took 1.65x and 17 1.9x
    (`scripts/verify_cost.py`). Pricing 12 columns at 16's cost is then right for the plan: at that price it
    proposes the wider option (more tokens for the same forward), which does cost that. Pooling the dip into its
    neighbours instead (a least-squares monotone fit) priced every width from 10 to 16 at about 12's cost, and
    the 16-column tree out."""
    plain, covers, cheapest = seconds[0], [], math.inf
    for wider in reversed(seconds[1:]):
        cheapest = min(cheapest, wider)
        covers.append(max(plain, cheapest))
    return [plain, *reversed(covers)]


@dataclass
class CycleCosts:
    """Seconds of the parts of one speculation cycle on one device, for one target and drafter, at one batch size.

    verify[n - 1]: a target forward of n columns for each of `batch` rows on a cached context (n = 1 is a plain
    decoding step of the batch); draft[B]: drafting and correcting a block of B for each row; both non-decreasing
    (`cheapest_cover` of the verify medians, a monotone fit of the draft medians; widths timed sparsely are
    interpolated). spread: the timings' median relative interquartile range (how noisy the machine was while
    timing).
    """

    verify: list[float]
    draft: dict[int, float]
    spread: float = 0.0
    batch: int = 1

    @classmethod
    def fit(
        cls, verify: Mapping[int, Sequence[float]], draft: Mapping[int, Sequence[float]], batch: int = 1
    ) -> CycleCosts:
        """From repeated timings per size ({columns: [seconds]}, {block: [seconds]}): medians; verify widths between
        two timed ones are interpolated linearly (1 and the widest must be timed), then each priced as the cheapest
        forward covering it (`cheapest_cover`); draft medians made monotone."""
        widths = sorted(verify)
        if not widths or widths[0] != 1:
            raise ValueError(f"verify timings must start at 1 column (a plain step), got {widths}")
        blocks = sorted(draft)
        spreads = [_relative_iqr(samples) for samples in [*verify.values(), *draft.values()]]
        medians = [statistics.median(verify[n]) for n in widths]
        return cls(
            verify=cheapest_cover([_interpolate(widths, medians, n) for n in range(1, widths[-1] + 1)]),
            draft=dict(zip(blocks, isotonic([statistics.median(draft[b]) for b in blocks]))),
            spread=statistics.median(spreads) if spreads else 0.0,
            batch=batch,
        )

    @property
    def plain(self) -> float:
        return self.verify[0]

    @property
    def max_rows(self) -> int:
        """The widest verify forward timed (columns per row)."""
        return len(self.verify)

    def verify_seconds(self, columns: int) -> float:
        """A verify forward of `columns` per row: timed, or beyond the widest timed the last step's slope
        continued (a tree wider than any block)."""
        if columns <= self.max_rows:
            return self.verify[columns - 1]
        slope = self.verify[-1] - self.verify[-2] if self.max_rows > 1 else self.verify[-1]
        return self.verify[-1] + slope * (columns - self.max_rows)

    def cycle(self, k: int, block: int) -> float:
        """Seconds of a cycle proposing k tokens of a drafted block of `block` (k = 0: a plain step, no draft)."""
        if k == 0:
            return self.plain
        return self.draft_seconds(block) + self.verify_seconds(k + 1)

    def draft_seconds(self, block: int) -> float:
        timed = [b for b in self.draft if b >= block] or [max(self.draft)]
        return self.draft[min(timed)]

    def between(self, other: CycleCosts, batch: int) -> CycleCosts:
        """The costs at a batch size between this one's and `other`'s, each part interpolated linearly in the
        batch size (a forward's work grows with its rows; rows finishing shrink a call's batch)."""
        low, high = (self, other) if self.batch <= other.batch else (other, self)
        share = 0.0 if high.batch == low.batch else (batch - low.batch) / (high.batch - low.batch)
        width = min(low.max_rows, high.max_rows)
        blocks = sorted(set(low.draft) & set(high.draft))
        return CycleCosts(
            verify=[a + share * (b - a) for a, b in zip(low.verify[:width], high.verify[:width])],
            draft={block: low.draft[block] + share * (high.draft[block] - low.draft[block]) for block in blocks},
            spread=max(low.spread, high.spread),
            batch=batch,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"verify": self.verify, "draft": {str(b): s for b, s in self.draft.items()}, "spread": self.spread,
                "batch": self.batch}

    @classmethod
    def from_dict(cls, data: Any) -> CycleCosts:
        """Read what `to_dict` wrote; a ValueError for anything else (a cache file of another shape)."""
        if not isinstance(data, Mapping):
            raise ValueError("cycle costs must be a mapping")
        verify, draft, spread = data.get("verify"), data.get("draft"), data.get("spread", 0.0)
        batch = data.get("batch", 1)
        if not isinstance(verify, list) or not verify or not isinstance(draft, Mapping) or not draft:
            raise ValueError("cycle costs need a non-empty 'verify' list and 'draft' mapping")
        if not all(str(b).isdigit() for b in draft):
            raise ValueError("cycle costs need block sizes as 'draft' keys")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 4096:
            raise ValueError(f"a batch size of {batch!r}")
        verify = [_positive_seconds(v) for v in verify]
        draft = {int(b): _positive_seconds(s) for b, s in draft.items()}
        spread = _spread(spread)
        if (verify != isotonic(verify) or not all(2 <= b <= MAX_TIMED_BLOCK for b in draft)
                or len(verify) > MAX_TIMED_ROWS):
            raise ValueError(
                f"cycle costs out of range (verify must be non-decreasing, blocks in [2, {MAX_TIMED_BLOCK}])"
            )
        return cls(verify, draft, spread, batch)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """ys at x, linear between the neighbouring xs (ascending, x within their range)."""
    right = next(i for i, known in enumerate(xs) if known >= x)
    if xs[right] == x or right == 0:
        return ys[right]
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _spread(value: Any) -> float:
    spread = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(spread) and spread >= 0.0):
        raise ValueError(f"a spread of {value!r}")
    return spread


def _positive_seconds(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"a cost of {value!r} seconds")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0.0 < seconds < 3600.0):
        raise ValueError(f"a cost of {value!r} seconds")
    return seconds


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


class NodeFeatures(NamedTuple):
    """What predicts a draft-tree node's acceptance given its parent's (`trees.py`): the slot it fills, its
    confidence (the probability its parent's successor scores give it), its share of its best sibling's (1 on the
    chain), and whether its parent is off the chain (a block drafter's guesses after an accepted sibling are worse:
    its marginals are conditioned on the chain)."""

    slot: int
    confidence: float
    sibling_share: float
    parent_off_chain: bool


def node_terms(node: NodeFeatures) -> tuple[int, float, float, float]:
    """A node's features as the acceptance fit's terms: (slot, logit(confidence), log(sibling share), parent off the
    chain). They are fixed when the tree is drafted, so a tree computes them once (`PlannedTree.of`) however often
    the plan re-predicts it."""
    return node.slot, _logit(node.confidence), math.log(max(node.sibling_share, _EPS)), float(node.parent_off_chain)


class PlannedTree(NamedTuple):
    """A draft tree as the plan reads it: its nodes' features, best first, each node's parent (an index into
    `nodes`, -1: the anchor; a parent comes before its children), and the nodes' `node_terms`."""

    nodes: list[NodeFeatures]
    parents: list[int]
    terms: list[tuple[int, float, float, float]]

    @classmethod
    def of(cls, nodes: list[NodeFeatures], parents: list[int]) -> PlannedTree:
        return cls(nodes, parents, [node_terms(node) for node in nodes])


def tree_reach(predicted: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each node's chance of being reached and accepted: its path's predicted acceptances multiplied (`predicted[i]`
    is node i's given its parent's)."""
    reach: list[float] = []
    for p, parent in zip(predicted, parents):
        reach.append(p * (reach[parent] if parent >= 0 else 1.0))
    return reach


def tree_expected(predicted: Sequence[float], parents: Sequence[int]) -> list[float]:
    """E[committed] of the tree of the first N nodes for N = 0, 1, ...: 1 + the sum of its nodes' `tree_reach`.
    Every prefix of a best-first order is a tree: it holds each of its nodes' parents."""
    return list(itertools.accumulate(tree_reach(predicted, parents), initial=1.0))


class AcceptanceModel:
    """p_j = sigmoid(bias_j + w_conf * logit(confidence_j) + w_recent * (logit(recent) - logit(prior_1)) + w_vocab *
    (draftable - 1)), fitted online by logistic SGD on every labelled slot.

    recent: the call's running slot-1 acceptance; draftable: the share of the last committed tokens inside the
    drafter's draft vocabulary (1 without one), a signal read before anything is spent: text in a script the draft
    vocabulary lacks cannot be drafted. It starts at the prior (w_conf = 0), with both call-level features shifting
    every slot alike until the fit says otherwise.

    A draft tree's nodes (`NodeFeatures`) add two terms, both zero on the chain: w_share * log(sibling_share), which
    starts at 1 (a sibling is accepted about as often as its share of the best sibling's probability says), and
    w_off * parent_off_chain, which starts at 0 and learns what a parent off the chain costs."""

    def __init__(self, prior: Sequence[float], learning_rate: float = _LEARNING_RATE) -> None:
        self.prior = list(prior)
        self.bias = [_logit(p) for p in prior]
        self.weights = [0.0, 1.0, 2.0]  # confidence, recent, draftable
        self.node_weights = [1.0, 0.0]  # log(sibling share), parent off the chain: zero features on the chain
        self.learning_rate = learning_rate
        self.observed = 0
        self._typical_logit: list[float | None] = [None] * len(prior)  # per slot, recent drafts' mean confidence
        self.recent_drafts: deque[list[float]] = deque(maxlen=_PLANNED_DRAFTS)  # their slot confidences
        # their draft trees' nodes and parents (None: a draft without trees), aligned with `recent_drafts`
        self.recent_trees: deque[PlannedTree | None] = deque(maxlen=_PLANNED_DRAFTS)

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

    def predict_tree(self, tree: PlannedTree, recent: float, draftable: float = 1.0, nodes: int | None = None
                     ) -> list[float]:
        """Each of the tree's first `nodes` nodes' chance of acceptance given its parent's (all: None). Runs for every
        recent tree before every draft, so it reads the nodes' precomputed terms."""
        call = self._call_term(recent, draftable)
        return [self._p_terms(terms, call) for terms in (tree.terms if nodes is None else tree.terms[:nodes])]

    def observe_nodes(
        self, nodes: Sequence[NodeFeatures], labels: Sequence[bool], recent: float, draftable: float = 1.0
    ) -> None:
        """Tree nodes whose parent was accepted, labelled by whether the target's token there was theirs.

        A node on the chain (its parent's best child, its parent on the chain: both node terms zero) teaches the
        chain's fit as a chain slot would; a node off it teaches only the node terms, so however many siblings a
        call verifies, the chain's own forecast (and with it the choice between drafting and plain steps) stays what
        chain cycles taught."""
        call = self._call_term(recent, draftable)
        for node, label in zip(nodes, labels):
            terms = node_terms(node)
            gradient = self._p_terms(terms, call) - float(label)
            if node.sibling_share >= 1.0 and not node.parent_off_chain:
                features = self._features(node.confidence, recent, draftable)
                self.bias[min(node.slot, self.slots - 1)] -= self.learning_rate * gradient
                self.weights = [w - self.learning_rate * gradient * x for w, x in zip(self.weights, features)]
            else:
                self.node_weights = [w - self.learning_rate * gradient * x
                                     for w, x in zip(self.node_weights, terms[2:])]
            self.observed += 1

    def _call_term(self, recent: float, draftable: float) -> float:
        """The call-level features' share of every node's logit."""
        _, w_recent, w_draftable = self.weights
        return w_recent * (_logit(recent) - _logit(self.prior[0])) + w_draftable * (draftable - 1.0)

    def _p_terms(self, terms: tuple[int, float, float, float], call: float) -> float:
        slot, confidence, share, off = terms
        (w_share, w_off), w_confidence = self.node_weights, self.weights[0]
        return _sigmoid(self.bias[min(slot, self.slots - 1)] + w_confidence * confidence + call + w_share * share
                        + w_off * off)

    def note_drafted(self, confidence: Sequence[float], tree: PlannedTree | None = None) -> None:
        """One drafted block's slot confidences, for `typical` (a running mean of their logits per slot) and
        `recent_drafts`; with its draft tree (`recent_trees`) when the call builds trees."""
        self.recent_drafts.append(list(confidence[: self.slots]))
        self.recent_trees.append(tree)
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

    def observe(
        self, confidence: Sequence[float], recent: float, labels: Sequence[bool], draftable: float = 1.0
    ) -> None:
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
    """k: tokens to propose on the chain; tree: the nodes of the draft tree to verify instead (0: the chain);
    expected: expected tokens committed by that cycle, per row; gain: its expected tokens per second over a plain
    step's (below 1: drafting did not pay this cycle)."""

    k: int
    expected: float
    gain: float
    tree: int = 0


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
    """What the cost-aware schedule keeps across the calls of one attached drafter: the costs of this device (one
    row: `costs`; other batch sizes: `batch_costs`, timed when a batched call first needs them) and the acceptance fit.
    `costs` None (an untuned drafter) proposes every slot, like the constant schedule.

    What the timed costs miss is learned from the cycles' own wall times, per batch size: every cycle's (`loop`),
    and each drafted block's, chain or tree, from the cycles that drafted it (a draft or a verify width that runs
    slower in the loop than when timed alone moves the next choices; a tree's mask and reordering are paid there).
    """

    costs: CycleCosts | None
    acceptance: AcceptanceModel
    batch_costs: dict[int, CycleCosts] = field(default_factory=dict)
    # False: `costs` stand for every batch size (costs a caller set by hand: nothing is timed per batch then)
    per_batch: bool = True
    _loops: dict[tuple[int, int | None, bool], tuple[float, int]] = field(default_factory=dict, repr=False)
    # Per kind (tree: True, chain: False): drafted tokens committed and predicted over the cycles of that kind.
    _yields: dict[bool, tuple[float, float]] = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------------------------------- costs per batch

    def costs_at(self, batch: int) -> CycleCosts | None:
        """The costs at `batch` rows: timed, or interpolated between the nearest timed batch sizes; None when none
        is timed at or above it (the caller times it: `DCOCODrafter.time_batch`)."""
        if not self.per_batch:
            return self.costs
        timed = {1: self.costs, **self.batch_costs} if self.costs is not None else dict(self.batch_costs)
        if batch in timed:
            return timed[batch]
        below = [size for size in timed if size < batch]
        above = [size for size in timed if size > batch]
        if not below or not above:
            return None
        return timed[max(below)].between(timed[min(above)], batch)

    def needs_timing(self, batch: int) -> bool:
        """Whether a call of `batch` rows needs its costs timed first (tuned, and no timed size at or above it)."""
        return self.costs is not None and self.costs_at(batch) is None

    # ---------------------------------------------------------------------------------------- the loop's share

    @property
    def loop_seconds(self) -> float:
        """Per cycle of one row, the time outside the modelled forwards (every cycle's)."""
        return self.loop_for(None)

    def loop_for(self, block: int | None, batch: int = 1, tree: bool = False) -> float:
        """The time outside the modelled forwards of a cycle drafting `block` (None: any cycle) at `batch` rows,
        verifying a tree or a chain: its own cycles', else every cycle's at that batch size, else one row's."""
        for key in ((batch, block, tree), (batch, block, False), (batch, None, False), (1, None, False)):
            if key in self._loops:
                return self._loops[key][0]
        return 0.0

    def observe_loop(self, seconds: float, block: int | None = None, batch: int = 1, tree: bool = False) -> None:
        """A cycle's wall time less its modelled forwards: the running mean of the rest (never below 0) at this
        batch size, and that of the drafted `block`'s (chain or tree) when the cycle was one draft and its verify
        (no plain steps in it).

        A block's own mean starts from the one it falls back to, worth `_LOOP_PRIOR_CYCLES` cycles, and one cycle
        counts for at most a plain step more than modelled: a single hiccup (a page fault, the first forward of a
        new width) would otherwise price an option out, and an option the plan stops choosing is never timed
        again."""
        costs = self.costs_at(batch)
        if costs is not None:
            seconds = min(seconds, costs.plain)
        keys = [(batch, None, False)] + ([(batch, block, tree)] if block is not None else [])
        known = [  # read before either mean moves: a new block's prior is the loop as it was before this cycle
            self._loops.get(key, (self.loop_for(key[1], batch, tree), _LOOP_PRIOR_CYCLES if key[1] is not None else 0))
            for key in keys
        ]
        for key, (mean, samples) in zip(keys, known):
            self._loops[key] = (_running_mean(mean, seconds, samples + 1), samples + 1)

    def observe_yield(self, predicted: float, committed: float, tree: bool) -> None:
        """A drafted cycle's expected and committed tokens per row, its certain token included (`ProposalChoice`)."""
        done, expected = self._yields.get(tree, (0.0, 0.0))
        self._yields[tree] = (done + committed - 1.0, expected + predicted - 1.0)

    def tree_yield(self) -> float:
        """What tree cycles committed of their forecast drafted tokens, over what chain cycles did of theirs: the
        factor on a tree's forecast gain.

        A tree's nodes are predicted by the chain's fit plus two node features learned from fewer labels, and the
        plan takes a tree when the best of its sizes beats the chain: the larger forecast error wins the comparison
        more often (on a 2-core CPU, trees chosen on forecast alone ran slower than the chain). Measured
        against the chain's own yield, so only the trees' extra optimism counts; each starts at 1, worth
        `_YIELD_PRIOR_TOKENS` predicted tokens."""
        def ratio(tree: bool) -> float:
            done, expected = self._yields.get(tree, (0.0, 0.0))
            return (done + _YIELD_PRIOR_TOKENS) / (expected + _YIELD_PRIOR_TOKENS)

        return min(ratio(True) / ratio(False), 1.0)

    def cycle_seconds(self, block: int, batch: int = 1) -> list[float]:
        """The modelled wall time of a cycle drafting `block` and proposing k of its chain, for k = 0 .. block - 1,
        at `batch` rows (k = 0: a plain step)."""
        costs = self.costs_at(batch)
        return [costs.plain + self.loop_for(None, batch)] + [
            costs.cycle(k, block) + self.loop_for(block, batch) for k in range(1, block)
        ]

    def tree_seconds(self, block: int, budget: int, batch: int = 1) -> list[float]:
        """The modelled wall time of a cycle drafting `block` and verifying a tree of N nodes per row, for N = 1 ..
        `budget` (index N - 1), at `batch` rows."""
        costs = self.costs_at(batch)
        fixed = costs.draft_seconds(block) + self.loop_for(block, batch, tree=True)
        return [fixed + costs.verify_seconds(nodes + 1) for nodes in range(1, budget + 1)]

    # ---------------------------------------------------------------------------------------- the choices

    def choose(self, predicted: Sequence[float], cap: int, floor: float, block: int) -> ProposalChoice:
        """The k in [1, cap] of most expected tokens per second, cut before the first slot predicted below `floor`
        (transformers' `assistant_confidence_threshold`); a cycle that drafted proposes at least one token."""
        return self.choose_batch([predicted], cap, floor, block)

    def choose_batch(
        self,
        predicted: Sequence[Sequence[float]],
        cap: int,
        floor: float,
        block: int,
        trees: Sequence[Sequence[float]] | None = None,
    ) -> ProposalChoice:
        """`choose` for the rows of a batch, which share one verify forward: the chain's k (k + 1 columns) or, with
        `trees` (per row, the expected tokens of its draft tree of N nodes for N = 0, 1, ...), the tree size N (N + 1
        columns) of most expected tokens, summed over the rows, per second at this batch size (a tree dearer than the
        chain only when clearly ahead: `takes_tree`); `expected` and `gain` are per row. Without costs: every slot (or
        the whole tree)."""
        per_row = [expected_tokens(row, cap, floor) for row in predicted]
        width = max((len(expected) for expected in per_row), default=1)  # a row's proposals end where it is cut
        totals = [sum(expected[min(k, len(expected) - 1)] for expected in per_row) for k in range(width)]
        rows = max(len(predicted), 1)
        tree_totals = [sum(row[n] for row in trees) for n in range(min(map(len, trees)))] if trees else []
        costs = self.costs_at(rows)
        if costs is None:
            if len(tree_totals) > 1:
                n = len(tree_totals) - 1
                return ProposalChoice(0, tree_totals[n] / rows, 1.0, tree=n)
            k = len(totals) - 1
            return ProposalChoice(k, totals[k] / rows, 1.0)
        seconds = self.cycle_seconds(block, rows)
        plain_rate = rows / seconds[0]
        k = fastest_length(totals, seconds)
        best = ProposalChoice(k, totals[k] / rows, totals[k] / seconds[k] / plain_rate)
        tree_seconds = self.tree_seconds(block, len(tree_totals) - 1, rows)  # [N - 1]
        trust, chain_gain, chain_seconds = self.tree_yield(), best.gain, seconds[k]
        for n in range(1, len(tree_totals)):
            expected = rows + trust * (tree_totals[n] - rows)  # each row's certain token, and its drafted ones
            gain = expected / tree_seconds[n - 1] / plain_rate
            if takes_tree(gain, tree_seconds[n - 1], best.gain, chain_gain, chain_seconds):
                best = ProposalChoice(0, tree_totals[n] / rows, gain, tree=n)
        return best

    def plan_draft(
        self, recent: float, draftable: float, cap: int, floor: float, batch: int = 1, tree_budget: int = 0
    ) -> DraftPlan:
        """Before a draft: the timed block (at most cap + 1: the anchor and `cap` slots) of most expected tokens per
        second at `batch` rows when each recent draft (`AcceptanceModel.recent_drafts`, slots it did not draft at
        their typical confidence) is predicted with the call's running acceptance `recent` and `draftable` share now
        and verified the fastest way: its chain at its own best k or, with `tree_budget`, its draft tree
        (`recent_trees`, the nodes the block holds) at its best size, whichever is expected faster; the smaller
        block on a tie. Without costs: the largest block, gain 1."""
        acceptance = self.acceptance
        costs = self.costs_at(batch)
        if costs is None:
            return DraftPlan(max(2, min(cap + 1, acceptance.slots + 1)), 1.0)
        typical = acceptance.typical()
        drafts = list(acceptance.recent_drafts) or [typical]
        trees = list(acceptance.recent_trees) if tree_budget and acceptance.recent_drafts else [None] * len(drafts)
        forecasts = [
            expected_tokens(acceptance.predict([*c, *typical[len(c) :]], recent, draftable), cap, floor)
            for c in drafts
        ]  # [drafts][k + 1]
        # Per recent tree: each node's slot and its chance of being reached and accepted, re-predicted now.
        reached = [self._reached(tree, recent, draftable, tree_budget) if tree else [] for tree in trees]
        reach = min(cap, acceptance.slots)
        trust = self.tree_yield()
        sizes = [b for b in sorted(costs.draft) if b - 1 <= reach] or [min(costs.draft)]
        best = DraftPlan(sizes[0], -1.0)
        for block in sizes:
            seconds = self.cycle_seconds(block, batch)  # [k]
            tree_seconds = self.tree_seconds(block, tree_budget, batch)  # [N - 1]
            tokens = spent = 0.0
            for expected, nodes in zip(forecasts, reached):
                k = fastest_length(expected, seconds)
                draft_tokens, draft_seconds = expected[k], seconds[k]
                chain_rate, chain_seconds = draft_tokens / draft_seconds, draft_seconds
                in_block = [p for slot, p in nodes if slot < block - 1]  # the nodes a draft of this block holds
                held = 1.0
                for n, p in enumerate(in_block[: len(tree_seconds)], start=1):
                    held += trust * p
                    rate = held / tree_seconds[n - 1]
                    if takes_tree(rate, tree_seconds[n - 1], draft_tokens / draft_seconds, chain_rate, chain_seconds):
                        draft_tokens, draft_seconds = held, tree_seconds[n - 1]
                tokens, spent = tokens + draft_tokens, spent + draft_seconds
            if tokens / spent * seconds[0] > best.gain:
                best = DraftPlan(block, tokens / spent * seconds[0])
        return best

    def _reached(self, tree: PlannedTree, recent: float, draftable: float, budget: int) -> list[tuple[int, float]]:
        """Per node of a recent draft tree (its first `budget`), its slot and its predicted chance of being reached
        and accepted (`tree_reach`)."""
        predicted = self.acceptance.predict_tree(tree, recent, draftable, nodes=budget)
        return [(node.slot, p) for node, p in zip(tree.nodes, tree_reach(predicted, tree.parents[:budget]))]


def takes_tree(rate: float, seconds: float, best_rate: float, chain_rate: float, chain_seconds: float) -> bool:
    """Whether a tree expected to commit `rate` tokens per second in a cycle of `seconds` replaces the best option so
    far (`best_rate`), given the chain's best (`chain_rate`, in cycles of `chain_seconds`): a tree dearer than the
    chain must also be expected `TREE_MARGIN` times as fast as it (rates may be gains over a plain step's)."""
    return rate > best_rate and (seconds <= chain_seconds or rate > TREE_MARGIN * chain_rate)


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
    "AcceptanceModel", "COST_SCHEDULE", "CycleCosts", "DraftPlan", "MAX_TIMED_BLOCK", "MAX_TIMED_ROWS",
    "NodeFeatures", "PROBE_EVERY", "PlannedTree", "ProposalChoice", "ProposalSchedule", "SCHEDULES", "TREE_MARGIN",
    "chain_labels", "chain_prior", "cheapest_cover", "check_schedule", "draftable_share", "expected_tokens",
    "fade_recent", "isotonic", "next_plain_run", "node_terms", "slot_confidence", "takes_tree", "tree_expected",
    "tree_reach", "update_recent",
]
