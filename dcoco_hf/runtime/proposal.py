"""What each speculation cycle verifies: the schedule, one small policy object per generate() call.

The engine asks its schedule once per cycle, and reports each verification to it:

    block(rows, may_skip)   before the cycle: the block to draft (anchor + slots), or None: a plain step
    propose(draft)          after the draft: verify the chain's first k slots, or the first N nodes of a draft tree
    verified(outcome)       what the target committed: the schedule learns from it (or not)

Three schedules implement it (`num_assistant_tokens_schedule` in the drafter's generation config):

* "constant" (`ConstantSchedule`, the no-op): the configured block every cycle, every slot proposed (with a tree
  budget, the whole tree); it learns nothing.
* "heuristic" (`HeuristicSchedule`): transformers' rule: two more tokens after a block accepted in full, one fewer
  otherwise.
* "cost" (`CostSchedule`, the default): the block and the proposal of most expected committed tokens per second.

The cost-aware schedule starts a call with DScout's block for the machine and batch size, the B of most tokens per
second

    tau(B) / (draft(B) + verify(B columns) + loop)        (DScout: tau from the drafter's `block_tau`, costs timed)

and, once the call has drafted `RECENT_DRAFTS` times, drafts the block its own recent drafts forecast fastest,
chosen again every `RECENT_DRAFTS` drafts (on a CPU where 2 verify columns cost much less than 4, chat is drafted in
shorter blocks than code). After a draft it proposes the first k of its slots, the k of most expected tokens per
second for this draft's slot confidences:

    E[committed | k] = 1 + sum_{i <= k} prod_{j <= i} p_j     (prefix-first: verification stops at the first error)
    T(k)             = draft(B) + verify(k + 1 columns) + loop

(p_j from `acceptance.AcceptanceModel`; a CPU whose verify columns cost proposes fewer where slots are unsure). And
before a draft, when the last drafts, proposed at their best k and re-predicted at the call's acceptance now, are not
expected to beat plain steps, the cycles are plain steps: 1, 2, 4, ... up to `MAX_PLAIN_RUN` in a row while that
holds, so a drafter that cannot guess the text costs a draft now and then instead of every cycle.

Trees meet the chain in one place, `fastest`: with a tree budget, every tree size N competes with every chain length
k in expected tokens per second, a tree's forecast discounted by what tree cycles committed of theirs
(`CostModel.tree_yield`).

Lossless whatever the schedule says: the target verifies every proposed token, and the schedule reads only the
drafter's side and what was committed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from .acceptance import (
    AcceptanceModel,
    NodeFeatures,
    chain_labels,
    draftable_share,
    expected_tokens,
    fade_recent,
    slot_confidence,
    tree_expected,
    update_recent,
)
from .costs import CycleCosts, best_block

if TYPE_CHECKING:
    from .drafting import DraftProposal
    from .stats import DCOCOStats
    from .trees import TreeDraft

# The schedules `num_assistant_tokens_schedule` may name (the drafter's generation config).
COST_SCHEDULE = "cost"
SCHEDULES = (COST_SCHEDULE, "constant", "heuristic", "heuristic_transient")
# Longest run of plain steps the schedule plans at once, before it asks again whether drafting pays.
MAX_PLAIN_RUN = 16
# The most plain steps in a row while drafting is not expected to pay: then a draft checks anyway, since the text may
# have changed in ways the forecast, which reads only past drafts, cannot see. The target tap keeps the states of
# that many forwards for the next draft's context (`TargetTap.max_pending`).
PROBE_EVERY = 64
# The drafts whose slot confidences forecast the next one's (`CostSchedule.block`); the call's block is chosen again
# every this many drafts, as often as that evidence turns over (`CostSchedule._call_block`).
RECENT_DRAFTS = 8
# The committed tokens whose share inside the draft vocabulary predicts the next ones' (`acceptance.draftable_share`).
DRAFTABLE_WINDOW = 8
# A loop time learned per kind of cycle starts as the plain steps', worth this many cycles: one cycle slowed by a
# hiccup (a page fault, the first forward of a new width) would otherwise price drafting out for the call.
_LOOP_PRIOR_CYCLES = 4
# The tree yield starts at 1, worth this many predicted drafted tokens.
_YIELD_PRIOR_TOKENS = 8.0


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


# ------------------------------------------------------------------------------------------------ the interface


class Proposal(NamedTuple):
    """What the target verifies after each row's anchor: the chain's first k drafted slots or, with `tree` > 0, the
    first `tree` nodes of each row's draft tree (k = 0 then)."""

    k: int
    tree: int = 0


@dataclass
class Draft:
    """A drafted block as a schedule reads it: the drafter's proposal for the active `rows`, the most chain slots this
    cycle may propose (`cap`), the rows' draft trees when the call builds them, and whether the draft read no target
    state yet (`blind`: the assisted loop's first draft, which precedes the prompt's forward)."""

    proposal: DraftProposal
    rows: Sequence[int]
    cap: int
    trees: TreeDraft | None = None
    blind: bool = False

    @property
    def block(self) -> int:
        return self.proposal.tokens.shape[1] + 1


class Verified(NamedTuple):
    """One verified cycle of the active `rows`: `proposed` chain slots or tree nodes offered to each (0: a plain step),
    row i accepted `accepted[i]` and committed `committed[i]`; with a tree, each row's labelled nodes (`trees
    .node_labels`: the nodes whose parent was accepted, and whether the target's token was theirs); `seconds` the
    cycle's wall time (None: untimed, like the prompt's cycle)."""

    rows: Sequence[int]
    proposed: int
    accepted: Sequence[int]
    committed: Sequence[Sequence[int]]
    node_labels: list[list[tuple[NodeFeatures, bool]]] | None = None
    seconds: float | None = None


class Schedule(Protocol):
    """Asked once per cycle what to draft and what to verify, and told what was committed."""

    def block(self, rows: Sequence[int], may_skip: bool = True) -> int | None:
        """The block (anchor + slots) to draft this cycle, or None for a plain step (only with `may_skip`)."""
        ...

    def propose(self, draft: Draft) -> Proposal: ...

    def verified(self, outcome: Verified) -> None: ...


# ------------------------------------------------------------------------------------------- the simple schedules


@dataclass
class ConstantSchedule:
    """The configured block every cycle, every slot of it proposed (with draft trees, the whole tree): transformers'
    "constant" schedule. It learns nothing."""

    block_size: int

    def block(self, rows: Sequence[int], may_skip: bool = True) -> int:
        return self.block_size

    def propose(self, draft: Draft) -> Proposal:
        if draft.trees is not None:
            return Proposal(0, tree=draft.trees.size)
        return Proposal(min(draft.cap, draft.block - 1))

    def verified(self, outcome: Verified) -> None:
        pass


@dataclass
class HeuristicSchedule:
    """transformers' "heuristic" rule: after a cycle in which every row accepted every proposed token, two more
    tokens; otherwise one fewer (at least one). It drafts only the slots it proposes; on the assisted path
    transformers moves its own count by the same rule and caps each cycle's proposal with it."""

    tokens: int
    largest: int  # the largest block the drafter drafts

    def block(self, rows: Sequence[int], may_skip: bool = True) -> int:
        return min(self.tokens, self.largest - 1) + 1

    def propose(self, draft: Draft) -> Proposal:
        return Proposal(min(self.tokens, draft.cap, draft.block - 1))

    def verified(self, outcome: Verified) -> None:
        if outcome.proposed:
            full = all(accepted == outcome.proposed for accepted in outcome.accepted)
            self.tokens = self.tokens + 2 if full else max(1, self.tokens - 1)


# ------------------------------------------------------------------------------------- what the costs know


@dataclass
class CostModel:
    """What the cost-aware schedule keeps across the calls of one attached drafter: the costs of this device (one
    row: `costs`; other batch sizes: `batch_costs`, timed when a batched call first needs them), the acceptance fit,
    and what the timed costs miss, learned from the cycles' own wall times per batch size and kind of cycle (plain,
    chain, tree: transformers' loop and the engine around the forwards, a tree's mask and reordering).
    `costs` None (an untuned drafter) drafts the largest block and proposes every slot."""

    costs: CycleCosts | None
    acceptance: AcceptanceModel
    block_tau: dict[int, float] = field(default_factory=dict)  # the drafter's tau per block size
    batch_costs: dict[int, CycleCosts] = field(default_factory=dict)
    # False: `costs` stand for every batch size (costs a caller set by hand: nothing is timed per batch then)
    per_batch: bool = True
    _loops: dict[tuple[int, str], tuple[float, int]] = field(default_factory=dict, repr=False)
    # Per kind (tree: True, chain: False): drafted tokens committed and predicted over the cycles of that kind.
    _yields: dict[bool, tuple[float, float]] = field(default_factory=dict, repr=False)

    def costs_at(self, batch: int) -> CycleCosts | None:
        """The costs at `batch` rows: timed, or interpolated between the nearest timed batch sizes; None when none
        is timed at or above it (the caller times it: `tuning.time_batch`)."""
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

    def loop(self, batch: int, kind: str) -> float:
        """Seconds per cycle outside the modelled forwards, for cycles of `kind` ("plain", "chain", "tree") at
        `batch` rows: learned, else the plain steps' at that batch size, else one row's."""
        for key in ((batch, kind), (batch, "plain"), (1, "plain")):
            if key in self._loops:
                return self._loops[key][0]
        return 0.0

    def observe_loop(self, seconds: float, batch: int, kind: str) -> None:
        """A cycle's wall time less its modelled forwards: one more sample of its kind's running mean (never below 0;
        one cycle counts for at most a plain step more than modelled). A drafted kind starts from the plain steps'
        mean, worth `_LOOP_PRIOR_CYCLES` cycles."""
        costs = self.costs_at(batch)
        if costs is not None:
            seconds = min(seconds, costs.plain)
        mean, samples = self._loops.get(
            (batch, kind), (self.loop(batch, kind), 0 if kind == "plain" else _LOOP_PRIOR_CYCLES)
        )
        self._loops[(batch, kind)] = (_running_mean(mean, seconds, samples + 1), samples + 1)

    def observe_yield(self, predicted: float, committed: float, tree: bool) -> None:
        """A drafted cycle's expected and committed tokens per row, its certain token included."""
        done, expected = self._yields.get(tree, (0.0, 0.0))
        self._yields[tree] = (done + committed - 1.0, expected + predicted - 1.0)

    def tree_yield(self) -> float:
        """What tree cycles committed of their forecast drafted tokens, over what chain cycles did of theirs: the
        factor on a tree's forecast gain (at most 1). A tree's nodes are predicted by the chain's fit plus two node
        terms learned from fewer labels, and the largest of many forecasts wins the comparison, so trees chosen on
        forecast alone err high; measured against the chain's own yield, only the trees' extra optimism counts.
        Each ratio starts at 1, worth `_YIELD_PRIOR_TOKENS` predicted tokens."""

        def ratio(tree: bool) -> float:
            done, expected = self._yields.get(tree, (0.0, 0.0))
            return (done + _YIELD_PRIOR_TOKENS) / (expected + _YIELD_PRIOR_TOKENS)

        return min(ratio(True) / ratio(False), 1.0)

    def blocks(self, batch: int, cap: int) -> list[int]:
        """The blocks a call at `batch` rows may draft: timed, of at most cap + 1, with a recorded tau (without tau
        for any, the largest timed; untuned, cap + 1)."""
        costs = self.costs_at(batch)
        sizes = [b for b in sorted(costs.draft) if b - 1 <= cap] if costs is not None else []
        if not sizes:
            return [cap + 1]
        return [b for b in sizes if b in self.block_tau] or sizes[-1:]

    def machine_block(self, batch: int, cap: int) -> int:
        """DScout's block at `batch` rows: of `blocks`, the one of most tau(B) per second of a cycle proposing all of
        it (`best_block`)."""
        sizes = self.blocks(batch, cap)
        if len(sizes) == 1:
            return sizes[0]
        costs, loop = self.costs_at(batch), self.loop(batch, "chain")
        return best_block({b: self.block_tau[b] for b in sizes}, {b: costs.cycle(b - 1, b) + loop for b in sizes})

    def prior_gain(self, block: int, batch: int) -> float | None:
        """Expected tokens per second of drafting `block` at `batch` rows, over a plain step's, at the drafter's
        recorded tau (None without one)."""
        tau = self.block_tau.get(block)
        if tau is None or self.costs_at(batch) is None:
            return None
        seconds = self.cycle_seconds(block, batch)
        return tau / seconds[block - 1] * seconds[0]

    def cycle_seconds(self, block: int, batch: int) -> list[float]:
        """Modelled seconds of a cycle drafting `block` and proposing k of its slots, k = 0 .. block - 1, at `batch`
        rows (k = 0: a plain step, no draft)."""
        costs = self.costs_at(batch)
        return [costs.plain + self.loop(batch, "plain")] + [
            costs.cycle(k, block) + self.loop(batch, "chain") for k in range(1, block)
        ]

    def tree_seconds(self, block: int, nodes: int, batch: int) -> list[float]:
        """Modelled seconds of a cycle drafting `block` and verifying a tree of N nodes, N = 1 .. `nodes` (index
        N - 1), at `batch` rows."""
        costs = self.costs_at(batch)
        fixed = costs.draft_seconds(block) + self.loop(batch, "tree")
        return [fixed + costs.verify_seconds(n + 1) for n in range(1, nodes + 1)]


def fastest(tokens: Sequence[float], seconds: Sequence[float]) -> int:
    """The option of most expected `tokens` per `seconds`, the first on a tie. The one rule that prices every choice
    of a cycle: chain lengths and tree sizes alike, in expected committed tokens per second."""
    return max(range(len(tokens)), key=lambda i: tokens[i] / seconds[i])


def _running_mean(mean: float, sample: float, samples: int) -> float:
    """The mean of the samples so far, turning into a moving average (5% per sample) after 20; never below 0."""
    return max(0.0, mean + max(1.0 / samples, 0.05) * (sample - mean))


def next_plain_run(gain: float, previous_run: int) -> int:
    """Plain steps to take before the next draft when drafting is expected to pay `gain` times a plain step: none
    while it pays, else twice the previous run (1, 2, 4, ...) up to `MAX_PLAIN_RUN`."""
    if gain >= 1.0:
        return 0
    return min(max(1, 2 * previous_run), MAX_PLAIN_RUN)


# ------------------------------------------------------------------------------------------ the cost-aware schedule


@dataclass
class _Pending:
    """One row's drafted chain, kept until the committed text settles its slots."""

    start: int  # index in the row's committed answer of the block's slot 1
    tokens: list[int]  # every drafted slot, proposed or not
    confidence: list[float]
    predicted: list[float]
    recent: float
    draftable: float


class CostSchedule:
    """The default schedule (module docstring), over the rows of one call.

    Args:
        model: the drafter's `CostModel` (costs and acceptance fit, kept across calls).
        rows: sequences in the call.
        cap / floor: the most slots a cycle proposes and the floor on a slot's predicted acceptance
            (`engine.proposal_limits`).
        answers: each row's committed answer tokens, as the engine extends them (labels and draftable shares).
        stats: each row's statistics, which book how well acceptance was predicted.
        draft_vocabulary: the drafter's draft vocabulary (None: the whole vocabulary).
    """

    def __init__(
        self, model: CostModel, rows: int, cap: int, floor: float, answers: list[list[int]],
        stats: list[DCOCOStats], draft_vocabulary: frozenset[int] | None = None,
    ) -> None:
        self.model, self.cap, self.floor = model, cap, floor
        self.answers, self.stats, self.draft_vocabulary = answers, stats, draft_vocabulary
        self.recent = [model.acceptance.prior[0]] * rows  # per row: its running slot-1 acceptance
        self.recent_drafts: deque[list[float]] = deque(maxlen=RECENT_DRAFTS)  # their slot confidences
        self.drafts = 0  # drafts so far in the call (one per row and drafted cycle)
        self.chosen: tuple[int, int] | None = None  # (the call's block, `drafts` when it was chosen)
        self.plain_run = 0  # the last run of plain steps planned
        self.plain_left = 0  # plain steps still to take after this one
        self.plain_since_draft = 0
        self._pending: list[list[_Pending]] = [[] for _ in range(rows)]
        self._cycle: tuple[int, float, str] | None = None  # the cycle's block, expected tokens per row and kind

    # ----------------------------------------------------------------------------------------- before the draft

    def block(self, rows: Sequence[int], may_skip: bool = True) -> int | None:
        """The call's block (`_call_block`), or None for a plain step: within a planned run of plain steps, or when
        the recent drafts say drafting is not expected to beat one (then a run of 1, 2, 4, ... starts); a draft probes
        after `PROBE_EVERY` plain steps in a row whatever the forecast."""
        self._cycle = None  # a cycle that drafts nothing (the assisted loop's last token) teaches nothing
        block = self._call_block(rows)
        if not may_skip:
            return block
        if self.plain_left:
            self.plain_left -= 1
            return self._plain_step(rows)
        if self.model.costs_at(len(rows)) is None or self.plain_since_draft >= PROBE_EVERY:
            return block
        self.plain_run = next_plain_run(self._gain(block, rows), self.plain_run)
        if self.plain_run:
            self.plain_left = self.plain_run - 1
            return self._plain_step(rows)
        return block

    def _call_block(self, rows: Sequence[int]) -> int:
        """DScout's machine block until the call has drafted `RECENT_DRAFTS` times; from then on, chosen again every
        `RECENT_DRAFTS` drafts (as often as the forecast's evidence turns over), the block its recent drafts forecast
        fastest (`_gain`): slots a block of 2 did not draft are predicted from the call's running acceptance, so text
        whose first slot is mostly right (code) is drafted in longer blocks than text whose first slot mostly fails
        (chat), where a longer block's cycle costs more than its extra slots bring."""
        batch = len(rows)
        if self.chosen is not None and self.drafts - self.chosen[1] < RECENT_DRAFTS:
            return self.chosen[0]
        if self.drafts < RECENT_DRAFTS or self.model.costs_at(batch) is None:
            return self.model.machine_block(batch, self.cap)
        sizes = self.model.blocks(batch, self.cap)
        block = max(sizes, key=lambda size: self._gain(size, rows)) if len(sizes) > 1 else sizes[0]
        self.chosen = (block, self.drafts)
        return block

    def _plain_step(self, rows: Sequence[int]) -> None:
        """A plain step: what failed drafts taught fades as the text moves on, so a call that left a passage the
        drafter could not guess drafts again."""
        self.plain_since_draft += 1
        for row in rows:
            self.recent[row] = fade_recent(self.recent[row], self.model.acceptance.prior[0])
        self._cycle = (0, 1.0, "plain")
        return None

    def _gain(self, block: int, rows: Sequence[int]) -> float:
        """Expected tokens per second of drafting `block`, over a plain step's: the recent drafts (their slot
        confidences, re-predicted at the rows' acceptance now; a slot a draft did not hold, as a smaller batch's block
        may not, at confidence 0.5: the fit's prior), each proposed at its best k; before any draft, the drafter's
        recorded tau for it."""
        seconds = self.model.cycle_seconds(block, len(rows))  # [k]
        recent = sum(self.recent[row] for row in rows) / len(rows)
        draftable = sum(self._draftable(row) for row in rows) / len(rows)
        tokens = spent = 0.0
        for confidence in self.recent_drafts:
            held = confidence[: block - 1] + [0.5] * (block - 1 - len(confidence))
            predicted = self.model.acceptance.predict(held, recent, draftable)
            expected = expected_tokens(predicted, self.cap, self.floor)  # [k + 1]
            k = 1 + fastest(expected[1:], seconds[1 : len(expected)])
            tokens, spent = tokens + expected[k], spent + seconds[k]
        if not self.recent_drafts:
            prior = self.model.prior_gain(block, len(rows))
            return 1.0 if prior is None else prior
        return tokens / spent * seconds[0]

    def _draftable(self, row: int) -> float:
        return draftable_share(self.answers[row][-DRAFTABLE_WINDOW:], self.draft_vocabulary)

    # ------------------------------------------------------------------------------------------ after the draft

    def propose(self, draft: Draft) -> Proposal:
        """The chain's k, or a tree's size, of most expected tokens per second summed over the rows, which share one
        verify forward; without costs, every slot (or the whole tree)."""
        rows, batch = draft.rows, len(draft.rows)
        confidence, tokens = _chain(draft)  # [b][S] each
        shares = [self._draftable(row) for row in rows]
        acceptance = self.model.acceptance
        predicted = [acceptance.predict(c, self.recent[row], d) for c, row, d in zip(confidence, rows, shares)]
        chain = [expected_tokens(p, draft.cap, self.floor) for p in predicted]  # [b][k + 1], cut by cap and floor
        width = max(len(expected) for expected in chain)
        options = [sum(expected[min(k, len(expected) - 1)] for expected in chain) for k in range(1, width)]
        trees = self._tree_expected(draft.trees, rows, shares) if draft.trees is not None else []  # [N - 1]
        costs = self.model.costs_at(batch)
        if costs is None:
            choice = Proposal(0, tree=len(trees)) if trees else Proposal(width - 1)
        else:
            seconds = self.model.cycle_seconds(draft.block, batch)[1:width]
            trust = self.model.tree_yield()
            options += [batch + trust * (total - batch) for total in trees]
            seconds += self.model.tree_seconds(draft.block, len(trees), batch)
            best = fastest(options, seconds)
            choice = Proposal(best + 1) if best < width - 1 else Proposal(0, tree=best - width + 2)
        expected = (trees[choice.tree - 1] if choice.tree else options[choice.k - 1]) / batch
        self._cycle = (draft.block, expected, "tree" if choice.tree else "chain")
        if not draft.blind:
            self.drafts += len(rows)
            for i, row in enumerate(rows):
                self.recent_drafts.append(confidence[i])
                if not choice.tree:  # a tree cycle learns from its nodes' labels instead
                    block = _Pending(len(self.answers[row]), tokens[i], confidence[i], predicted[i], self.recent[row],
                                     shares[i])
                    self._pending[row].append(block)
        self.plain_since_draft = 0
        return choice

    def _tree_expected(self, trees: TreeDraft, rows: Sequence[int], shares: Sequence[float]) -> list[float]:
        """E[committed] summed over the rows of the trees of N nodes, N = 1 .. the budget."""
        per_row = [
            tree_expected(self.model.acceptance.predict_tree(tree, self.recent[row], share), tree.parents)
            for tree, row, share in zip(trees.planned, rows, shares)
        ]  # [b][N + 1]
        return [sum(row[n] for row in per_row) for n in range(1, min(map(len, per_row)))]

    # --------------------------------------------------------------------------------------------- learning

    def verified(self, outcome: Verified) -> None:
        """Learn from a verified cycle: its wall time (what the timed costs missed), the drafted tokens it committed
        against the forecast, the tree's node labels, and each row's drafted slots the committed text settles."""
        cycle, self._cycle = self._cycle, None
        batch = len(outcome.rows)
        costs = self.model.costs_at(batch)
        if cycle is not None and costs is not None:
            block, expected, kind = cycle
            committed = sum(map(len, outcome.committed)) / batch
            if kind != "plain" and outcome.seconds is not None:
                self.model.observe_yield(expected, committed, kind == "tree")
            if outcome.seconds is not None:
                modelled = costs.plain if kind == "plain" else (
                    costs.draft_seconds(block) + costs.verify_seconds(outcome.proposed + 1))
                self.model.observe_loop(outcome.seconds - modelled, batch, kind)
        acceptance = self.model.acceptance
        for i, row in enumerate(outcome.rows):
            if outcome.node_labels is not None and outcome.node_labels[i]:
                features, labels = zip(*outcome.node_labels[i])
                acceptance.observe_nodes(features, labels, self.recent[row], self._draftable(row))
                first = [label for node, label in outcome.node_labels[i]
                         if node.slot == 0 and node.sibling_share >= 1.0]
                if first:
                    self.recent[row] = update_recent(self.recent[row], first[0])
            self._settle(row)

    def _settle(self, row: int) -> None:
        """Teach the acceptance fit from the row's drafted chains whose fate the committed text now settles: every
        slot up to the first wrong one, proposed or not (`chain_labels`)."""
        answer, waiting = self.answers[row], []
        for block in self._pending[row]:
            labels = chain_labels(block.tokens, answer[block.start : block.start + len(block.tokens)])
            if len(labels) < len(block.tokens) and all(labels):
                waiting.append(block)  # every slot so far right: the next ones are not committed yet
                continue
            if labels:
                self.model.acceptance.observe(block.confidence, block.recent, labels, block.draftable)
                self.stats[row].observe_prediction(block.predicted, labels)
                self.recent[row] = update_recent(self.recent[row], labels[0])
        self._pending[row] = waiting


def _chain(draft: Draft) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's drafted chain as the host reads it: its slots' confidences and tokens. With trees, the chain is the
    trees' all-rank-0 path, read with the trees' own scores."""
    if draft.trees is not None:
        return draft.trees.chain()
    proposal = draft.proposal
    confidence = slot_confidence(
        proposal.candidate_logits, proposal.chosen, proposal.transition_scores, proposal.first_slot_scores
    )  # [b, S]
    # One read for both: float64 holds every token id exactly.
    confidence, tokens = torch.stack([confidence.double(), proposal.tokens.double()]).tolist()
    return confidence, [[int(t) for t in row] for row in tokens]


def drafts_at(model: CostModel, batch: int, cap: int) -> bool:
    """Whether a cost-aware call of `batch` rows drafts at all: its block is expected to beat plain steps at the
    drafter's recorded tau (without costs or tau: yes, the evidence comes from the call's own drafts)."""
    gain = model.prior_gain(model.machine_block(batch, cap), batch)
    return gain is None or gain >= 1.0


def make_schedule(
    name: str, model: CostModel, *, rows: int, block_size: int, largest: int, cap: int, floor: float,
    answers: list[list[int]], stats: list[DCOCOStats], draft_vocabulary: frozenset[int] | None = None,
) -> Schedule:
    """The schedule `name` (`SCHEDULES`) for one call: `block_size` is the configured block (constant), `largest`
    the largest the drafter drafts."""
    if name == COST_SCHEDULE:
        return CostSchedule(model, rows, cap, floor, answers, stats, draft_vocabulary)
    if name == "constant":
        return ConstantSchedule(block_size)
    return HeuristicSchedule(block_size - 1, largest)


__all__ = [
    "COST_SCHEDULE", "ConstantSchedule", "CostModel", "CostSchedule", "Draft", "HeuristicSchedule", "MAX_PLAIN_RUN",
    "PROBE_EVERY", "Proposal", "SCHEDULES", "Schedule", "Verified", "check_schedule", "drafts_at",
    "fastest", "make_schedule", "next_plain_run",
]
