"""`SpeculationEngine`: one generate() call's speculation, whichever loop verifies it.

Two loops drive the same engine: transformers' assisted loop (`target.generate(..., assistant_model=drafter)`, one
row, through the `DCOCOCandidateGenerator` adapter) and the batched loop (`speculative_generate`, B rows). Each cycle
the loop takes a plain step while the engine has some planned (`plain_left`), else has it draft a block and choose
how many of its slots to propose (`draft`); the target verifies, and the loop reports what each row accepted and
committed (`verified`): on the assisted path that is transformers' own count of matches
(`update_candidate_strategy`), never inferred from forwards.

The engine owns what lives exactly one call: the drafter's context cache, the cost-aware schedule's running state
(each row's recent acceptance, the planned plain run, the drafted blocks whose slots the committed text has not
settled yet) and every row's statistics. How a cycle's block and proposal length are chosen is `proposal.py`'s
(DScout's per-machine block, planned per cycle). The call's lifetime is here too: one call at a time per drafter
(`claim`, `one_call`), and the last call's statistics (`keep_call_statistics`, `call_statistics`), kept beside the
drafter rather than in it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from ..network.corrector import walk_name
from .proposal import (
    COST_SCHEDULE,
    DraftPlan,
    chain_labels,
    draftable_share,
    PROBE_EVERY,
    fade_recent,
    next_plain_run,
    slot_confidence,
    tree_expected,
    update_recent,
)
from .stats import DCOCOStats
from .trees import (
    DraftTrees,
    TreeNode,
    TreeScores,
    best_first,
    chain_of,
    draft_trees,
    node_labels,
    planned_tree,
    tree_scores,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from .drafting import AttachedDrafter, DraftProposal

# Committed tokens whose share inside the draft vocabulary predicts the next ones.
DRAFTABLE_WINDOW = 8



def require_prompt_tokens(input_ids: torch.LongTensor) -> None:
    """Refuse a prompt without token ids (an empty input_ids, or generate(inputs_embeds=...)): the drafter reads
    the target's states of known tokens."""
    if input_ids.shape[-1] == 0:
        raise ValueError(
            "input_ids holds no tokens (an empty prompt, or generate(inputs_embeds=...)): a DCOCO drafter reads the "
            "target's states of known tokens and needs their ids. Pass input_ids with at least one token (for an "
            "unconditional start, the tokenizer's BOS token)."
        )

def proposal_limits(generation: GenerationConfig, slots: int) -> tuple[int, float]:
    """(cap, floor) of a call, from the drafter's generation config: the most drafted tokens a cycle proposes
    (`num_assistant_tokens`, at most the block's `slots`; None: all of them) and the floor on a slot's predicted
    acceptance (`assistant_confidence_threshold`; None: 0, no floor). Raises a ValueError naming a bad field.

    0 tokens is refused: transformers' assisted loop reads it as "never ask the drafter" (it decodes plainly without
    calling it, so nothing here sees it), while None here is the whole block."""
    tokens = getattr(generation, "num_assistant_tokens", None)
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, Integral) or tokens < 1):
        raise ValueError(
            f"num_assistant_tokens={tokens!r} (the drafter's generation config) must be a positive integer, the most "
            f"drafted tokens a cycle proposes (at most {slots} here; None: all of them). Set "
            "drafter.generation_config.num_assistant_tokens; to decode without drafting, generate without the drafter."
        )
    threshold = getattr(generation, "assistant_confidence_threshold", None)
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, Real)
                                  or not 0.0 <= threshold <= 1.0):  # NaN fails the comparison too
        raise ValueError(
            f"assistant_confidence_threshold={threshold!r} (the drafter's generation config) must be a number in "
            "[0, 1], the floor on a slot's predicted acceptance below which it is not proposed (0: no floor). Set "
            "drafter.generation_config.assistant_confidence_threshold."
        )
    return min(int(tokens or slots), slots), float(threshold or 0.0)


@dataclass
class _DraftedBlock:
    """One row's drafted block, kept until the committed text settles its slots."""

    start: int  # index in the row's committed answer tokens of the block's slot 1
    candidates: torch.Tensor  # [S, K]
    tokens: list[int] | None  # every drafted slot, proposed or not; None: the schedule learns nothing from it
    confidence: list[float] | None  # per slot
    predicted: list[float] | None
    recent: float
    draftable: float


class SpeculationEngine:
    """Drafts, proposal lengths and statistics of one generate() call over `rows` sequences.

    Args:
        drafter: an attached drafter.
        rows: sequences in the call (1 on transformers' assisted path).
        correct: False proposes plain DFlash argmax blocks (same weights, corrector off).
        selection: walk override ("prefix_first" | "viterbi" | "geometric"); default the drafter's (`decoding`).
        context_length: the longest context the call is expected to reach, which a static context cache (captured
            drafting) allocates for at once; it grows beyond it when needed.

        tree_budget: the most nodes a cycle's draft tree may have (`trees.py`; the batched loop verifies trees, the
            assisted loop one chain); 0: chains only. Trees follow the prefix-first walk's scores: with another walk
            the cycles verify chains.

    Under the cost-aware schedule (the default) each cycle drafts the block of most expected tokens per second and
    verifies what is expected to commit the most tokens per second summed over the rows, at the batch's shape: the
    chain's first k slots (one verify forward of k + 1 columns) or, with a tree budget, a tree of N nodes (N + 1
    columns); a draft not expected to beat a plain step makes the next cycles plain steps. Other schedules draft the
    configured block and propose up to the loop's cap ("constant" with a budget: the budget's tree, every cycle).
    """

    def __init__(
        self, drafter: AttachedDrafter, rows: int, correct: bool = True, selection: str | None = None,
        context_length: int = 256, tree_budget: int = 0,
    ) -> None:
        self.drafter, self.correct, self.selection = drafter, correct, selection
        config, generation = drafter.config, drafter.generation_config
        self.cache = drafter.draft_cache(context_length)
        # The drafter's settings, read once: a cycle enters the drafter only to `propose`.
        self.block_size, self.timed = drafter.draft_block_size, drafter.time_phases
        self.stats = [DCOCOStats(self.block_size, config.top_k) for _ in range(rows)]  # grow as drafted
        self.cap, self.floor = proposal_limits(generation, config.block_size - 1)
        self.schedule = drafter.proposal_schedule if drafter.proposal_schedule_name == COST_SCHEDULE else None
        prior = self.schedule.acceptance.prior[0] if self.schedule is not None else 0.0
        self.recent = [prior] * rows  # per row: its running slot-1 acceptance
        self.plain_run = 0  # the last run of plain steps the schedule planned
        self.plain_left = 0  # plain steps still to take before the next draft
        self._plain_since_draft = 0  # plain steps taken since the last draft
        ids = drafter.draft_token_ids
        self.draft_vocabulary = frozenset(ids.tolist()) if ids is not None and self.schedule is not None else None
        self.answers: list[list[int]] = [[] for _ in range(rows)]  # each row's committed answer tokens
        self._waiting: list[list[_DraftedBlock]] = [[] for _ in range(rows)]  # slots not all settled yet
        self._drafted: list[list[_DraftedBlock]] = [[] for _ in range(rows)]  # every block, for candidate coverage
        self._proposal: DraftProposal | None = None  # the cycle's draft, until verified
        self._trees: tuple[DraftTrees, TreeScores] | None = None  # the cycle's draft trees and scores, until verified
        self._forecast: tuple[float, bool] | None = None  # the cycle's expected tokens per row, and whether a tree
        self._plan: DraftPlan | None = None  # the cycle's block, and whether drafting is expected to pay
        self._draftable: list[float] = []  # the active rows' draftable shares when the block was planned
        walk = walk_name(selection or drafter.decoding.selection)
        schedule_name = drafter.proposal_schedule_name
        trees_apply = walk == "prefix_first" and schedule_name in (COST_SCHEDULE, "constant")
        self.tree_budget = tree_budget if trees_apply else 0

    # ------------------------------------------------------------------------------------------------ a cycle

    def draft(
        self,
        anchor: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        context: torch.Tensor,
        context_positions: torch.LongTensor,
        row_ids: Sequence[int],
        cap: int,
        attention_mask: torch.Tensor | None = None,
        context_ids: torch.LongTensor | None = None,
        context_valid: torch.Tensor | None = None,
    ) -> tuple[DraftProposal, int, DraftTrees | None]:
        """Draft one block for the active rows `row_ids` and choose what the target verifies: (proposal, k, trees),
        the chain's first k slots (at most `cap`), or with `tree_budget` the rows' draft trees (k = 0). anchor,
        anchor_positions [b]; context [b, N, n_layers * H] the target states not yet in the drafter cache at
        context_positions [b, N]; masks and context ids as in `DCOCODrafter.propose` (the mask sized for
        `draft_block(row_ids, cap)`'s block)."""
        block = self._plan.block if self._plan is not None else self.draft_block(row_ids, cap, may_skip=False)
        offsets = torch.arange(block, device=anchor.device)
        position_ids = torch.cat([context_positions, anchor_positions[:, None] + offsets], dim=1)  # [b, N + block]
        blind = self.cache.get_seq_length() == context.shape[1] == 0  # no target state read: nothing to learn from
        proposal = self.drafter.propose(
            anchor, context, position_ids, self.cache, attention_mask, selection=self.selection,
            correct=self.correct, context_ids=context_ids, context_valid=context_valid,
            timed=self.timed, block_size=block,
        )
        k, trees = self._proposal_length(proposal, row_ids, min(cap, block - 1), blind)
        self._proposal, self._plan, self._plain_since_draft = proposal, None, 0
        return proposal, k, trees

    def draft_block(self, row_ids: Sequence[int], cap: int, may_skip: bool = True) -> int | None:
        """The block (anchor + slots) the next `draft` drafts: the configured one, or the cost-aware schedule's for
        the rows' mean running acceptance and draftable share (`plan_draft`). None (with `may_skip`): no draft this
        cycle but a run of plain steps (`plain_left`), because the plan says drafting would not pay (it reads the
        drafts of earlier cycles and calls); a draft probes again at the latest after `PROBE_EVERY` plain steps in a
        row, as the text may change in ways the plan cannot see."""
        self._draftable = [self._draftable_share(row) for row in row_ids]
        if self.schedule is None:
            self._plan = DraftPlan(self.block_size, 1.0)
            return self._plan.block
        recent = sum(self.recent[row] for row in row_ids) / len(row_ids)
        draftable = sum(self._draftable) / len(self._draftable)
        self._plan = self.schedule.plan_draft(recent, draftable, cap, self.floor, batch=len(row_ids),
                                              tree_budget=self.tree_budget)
        if may_skip and self._plan.gain < 1.0 and self._plain_since_draft < PROBE_EVERY:
            self.plain_run = self.plain_left = next_plain_run(self._plan.gain, self.plain_run)
            self._plan = None
            return None
        return self._plan.block

    def prefilled(self, row_ids: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """The prompts' forward committed `committed[i]` (the target's first token) for row i, without a draft."""
        for row, tokens in zip(row_ids, committed):
            self.stats[row].committed_tokens += len(tokens)
            self.answers[row].extend(tokens)

    def verified(
        self,
        row_ids: Sequence[int],
        proposed: int,
        accepted: Sequence[int],
        committed: Sequence[Sequence[int]],
        path: Sequence[Sequence[int]] | None = None,
        path_tokens: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """After the target verified the cycle: `proposed` drafts were offered to every active row (0: a plain step;
        a tree's nodes), row i accepted `accepted[i]` of them and committed the tokens `committed[i]` (accepted drafts
        and the target's own token, cut at the budget or an EOS). With trees: `path` [b][depth + 1] the accepted
        path's block columns (`verification.follow_path`) and `path_tokens` the target's token at each of them, both
        on the host."""
        proposal, self._proposal = self._proposal, None
        trees, self._trees = self._trees, None
        forecast, self._forecast = self._forecast, None
        if forecast is not None and self.schedule is not None:
            self.schedule.observe_yield(forecast[0], sum(map(len, committed)) / len(committed), forecast[1])
        if trees is not None:
            self._learn_from_trees(*trees, row_ids, path, accepted, path_tokens)
            trees = trees[0]
        for row, count, tokens in zip(row_ids, accepted, committed):
            stats = self.stats[row]
            if trees is not None:
                stats.observe_tree(proposed, count, len(tokens))
            elif proposal is not None:
                stats.observe_draft(proposed, count, len(tokens))
            elif self.plain_left:
                stats.observe_plain_steps(committed=len(tokens))
            else:  # transformers' own step where no draft fits (the last token of a call)
                stats.committed_tokens += len(tokens)
            self.answers[row].extend(tokens)
            self._settle(row)
        if proposal is None and self.plain_left:
            self.plain_left -= 1
            self._plain_since_draft += 1
            prior = self.schedule.acceptance.prior[0]
            for row in row_ids:
                self.recent[row] = fade_recent(self.recent[row], prior)
        elif proposal is not None:
            for row in row_ids:
                self.stats[row].drafter_seconds += proposal.backbone_seconds
                self.stats[row].corrector_seconds += proposal.corrector_seconds

    def observe_cycle_time(
        self, row_ids: Sequence[int], seconds: float, proposed: int, block: int | None, committed: Sequence[int],
        tree: bool = False,
    ) -> None:
        """A timed cycle of the active rows that committed `committed[i]` tokens for row i (a draft of `block` and
        its verify of `proposed` chain slots or tree nodes, or a plain step with block None): what the costs timed at
        this batch size missed teaches the schedule (`loop`, and `loop(B)` for chains or trees), and each row's
        statistics compare the cycle with plain steps for its tokens."""
        batch = len(row_ids)
        costs = self.schedule.costs_at(batch) if self.schedule is not None else None
        if costs is None:
            return
        if block is None:
            modelled = costs.plain
        else:
            modelled = costs.draft_seconds(block) + costs.verify_seconds(proposed + 1)
        self.schedule.observe_loop(seconds - modelled, block, batch, tree)
        for row, tokens in zip(row_ids, committed):
            stats = self.stats[row]
            stats.plain_estimate_seconds += costs.plain * tokens
            stats.cycle_wall_seconds += seconds

    def finish(self) -> None:
        """The call ended: label what the committed text settles and book each block's candidate coverage (the
        candidates cross to the host in one copy)."""
        blocks = [block for row_blocks in self._drafted for block in row_blocks]
        if blocks:
            on_host = torch.cat([block.candidates.flatten() for block in blocks]).cpu()
            for block, candidates in zip(blocks, on_host.split([b.candidates.numel() for b in blocks])):
                block.candidates = candidates.view(block.candidates.shape)
        for row, row_blocks in enumerate(self._drafted):
            self._settle(row, final=True)
            answer = self.answers[row]
            for block in row_blocks:
                truth = torch.tensor(answer[block.start : block.start + block.candidates.shape[0]], dtype=torch.long)
                self.stats[row].observe_candidates(block.candidates[: truth.shape[0]] == truth[:, None])  # [s, K]
            row_blocks.clear()

    # ------------------------------------------------------------------------------------------------ internals

    def _draftable_share(self, row: int) -> float:
        return draftable_share(self.answers[row][-DRAFTABLE_WINDOW:], self.draft_vocabulary)

    def _proposal_length(
        self, proposal: DraftProposal, row_ids: Sequence[int], cap: int, blind: bool
    ) -> tuple[int, DraftTrees | None]:
        """What to verify: the chain's first k slots, or the rows' draft trees (k = 0); and under the cost-aware
        schedule how many plain steps to take next."""
        drafted, draftable, gain = proposal.tokens.shape[1], self._draftable, self._plan.gain
        for row in row_ids:
            self.stats[row].observe_drafted_block(drafted + 1)
        scores = tree_scores(proposal) if self.tree_budget else None
        nodes = self._tree_nodes(scores) if scores is not None else None
        device = proposal.tokens.device
        if self.schedule is None:
            self._keep(proposal, row_ids, None, None, None, draftable)
            if nodes is None:
                return cap, None
            trees = draft_trees(scores, nodes, device)
            self._trees = (trees, scores)
            return 0, trees
        if scores is not None:  # the chain is the trees' all-rank-0 path: read with the trees' scores
            confidence, tokens = map(list, zip(*(chain_of(scores, i) for i in range(len(row_ids)))))
        else:
            confidence = slot_confidence(
                proposal.candidate_logits, proposal.chosen, proposal.transition_scores, proposal.first_slot_scores
            )  # [b, S]
            # One read for both: float64 holds every token id exactly.
            confidence, tokens = torch.stack([confidence.double(), proposal.tokens.double()]).tolist()  # [b][S] each
        acceptance = self.schedule.acceptance
        predicted = [acceptance.predict(c, self.recent[row], d) for c, row, d in zip(confidence, row_ids, draftable)]
        planned = [planned_tree(row_nodes) for row_nodes in nodes] if nodes is not None else None
        expected_trees = None
        if planned is not None:
            expected_trees = [tree_expected(acceptance.predict_tree(tree, self.recent[row], share), tree.parents)
                              for tree, row, share in zip(planned, row_ids, draftable)]
        choice = self.schedule.choose_batch(predicted, cap, self.floor, drafted + 1, trees=expected_trees)
        for i, row_confidence in enumerate(confidence):
            acceptance.note_drafted(row_confidence, planned[i] if planned is not None else None)
        trees = draft_trees(scores, [row[: choice.tree] for row in nodes], device) if choice.tree else None
        if blind:  # the call's first assisted draft precedes the prompt's forward: it has no context to go by
            self._keep(proposal, row_ids, None, None, None, draftable)
        else:  # a tree cycle learns from its nodes' labels instead (`_learn_from_trees`)
            learned = trees is None
            self._keep(proposal, row_ids, [[int(t) for t in row] for row in tokens] if learned else None, confidence,
                       predicted, draftable)
            self.plain_run = self.plain_left = next_plain_run(gain, self.plain_run)
        if trees is not None:
            self._trees = (trees, scores)
        if not blind:
            self._forecast = (choice.expected, trees is not None)
        return choice.k, trees

    def _tree_nodes(self, scores: TreeScores) -> list[list[TreeNode]]:
        """Each row's `tree_budget` most likely draft-tree nodes, best first (`trees.best_first`)."""
        transitions = scores.transitions
        return [best_first(scores.first[i], transitions[i] if transitions is not None else None, scores.marginals[i],
                           self.tree_budget) for i in range(len(scores.first))]

    def _learn_from_trees(
        self,
        trees: DraftTrees,
        scores: TreeScores,
        row_ids: Sequence[int],
        path: Sequence[Sequence[int]],
        accepted: Sequence[int],
        path_tokens: Sequence[Sequence[int]],
    ) -> None:
        """What a verified tree teaches: every node whose parent was accepted is labelled (the acceptance fit learns
        from them, and the running acceptance from the chain's slot-1 node); after each accepted node with a next
        slot, whether the target's next token was its best child as the walk ranks that node's children and as
        the slot's marginals rank them (`DCOCOStats.next_after_accepted`)."""
        labels = node_labels(trees, list(path), list(accepted), list(path_tokens))
        for i, row in enumerate(row_ids):
            if self.schedule is not None and labels[i]:
                features = [node.features(parent_on_chain) for node, _, parent_on_chain in labels[i]]
                outcomes = [label for _, label, _ in labels[i]]
                self.schedule.acceptance.observe_nodes(features, outcomes, self.recent[row], self._draftable[i])
                first = [label for node, label, _ in labels[i] if node.parent < 0 and node.on_chain]
                if first:
                    self.recent[row] = update_recent(self.recent[row], first[0])
            candidates, nodes = scores.candidates[i], trees.nodes[i]
            for depth in range(1, accepted[i] + 1):
                node = nodes[path[i][depth] - 1]
                if node.slot + 1 >= len(candidates):
                    continue
                following = candidates[node.slot + 1]
                walk_best = following[scores.best_successor[i][node.slot][node.candidate]]
                target = path_tokens[i][depth]
                self.stats[row].observe_next_after_accepted(node.on_chain, walk_best == target, following[0] == target)

    def _keep(self, proposal: DraftProposal, row_ids, tokens, confidence, predicted, draftable) -> None:
        """Keep each row's block for its candidate coverage and, with `tokens` (host lists), for the fit."""
        for i, row in enumerate(row_ids):
            learn = tokens is not None
            block = _DraftedBlock(
                len(self.answers[row]), proposal.candidates[i], tokens[i] if learn else None,
                confidence[i] if learn else None, predicted[i] if learn else None, self.recent[row], draftable[i],
            )
            self._drafted[row].append(block)
            if learn:
                self._waiting[row].append(block)

    def _settle(self, row: int, final: bool = False) -> None:
        """Teach the acceptance fit from the row's drafted blocks whose fate the committed text now settles: every
        slot up to the first wrong one, proposed or not (`chain_labels`)."""
        answer, waiting = self.answers[row], []
        for block in self._waiting[row]:
            drafted = block.tokens
            labels = chain_labels(drafted, answer[block.start : block.start + len(drafted)])
            if not final and len(labels) < len(drafted) and all(labels):
                waiting.append(block)  # every slot so far right: the next ones are not committed yet
                continue
            if labels:
                self.schedule.acceptance.observe(block.confidence, block.recent, labels, block.draftable)
                self.stats[row].observe_prediction(block.predicted, labels)
                self.recent[row] = update_recent(self.recent[row], labels[0])
        self._waiting[row] = waiting


# ------------------------------------------------------------------------------------------------ the call's lifetime


class Call:
    """Alive exactly as long as one generate() call, in the thread that runs it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()


class CallStatistics(Protocol):
    """What `call_statistics` reads of a finished call: the assisted loop's adapter, or the batched loop's run."""

    stats: Any

    def close(self, sequences: torch.LongTensor) -> None: ...


_CLAIM_LOCK = threading.Lock()
# Beside each drafter, held weakly both ways: its call in progress (a weak reference to the call's `Call`). A drafter
# copy starts with none.
_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def claim(drafter: object, call: Call) -> None:
    """Make `call` (alive exactly as long as one generate() call) the drafter's call in progress. One drafter serves
    one call at a time: a call from a second thread while one runs would mix their target states, so it is
    refused."""
    with _CLAIM_LOCK:
        running = _RUNNING.get(drafter)
        running = running() if running is not None else None
        if running is not None and running.thread != call.thread:
            raise RuntimeError(
                "this drafter is already generating in another thread: one drafter serves one generate() call at "
                "a time. Give each thread its own drafter (copy.deepcopy(drafter).attach(target, tune=False)) "
                "and target, or serialise the calls."
            )
        _RUNNING[drafter] = weakref.ref(call)


@contextmanager
def one_call(drafter: object) -> Iterator[None]:
    """The duration of one generate() call of our own loop (`speculative_generate`); see `claim`."""
    call = Call()
    claim(drafter, call)
    try:
        yield
    finally:
        with _CLAIM_LOCK:
            running = _RUNNING.get(drafter)
            if running is not None and running() is call:
                del _RUNNING[drafter]


def keep_call_statistics(drafter: AttachedDrafter, call: CallStatistics) -> None:
    """Make `call` what `call_statistics(drafter)` reads: the drafter's last generate() call. The drafter holds it
    (`last_call`), as a result rather than state: the call itself is over, and the statistics go with the drafter."""
    drafter.last_call = call


def call_statistics(drafter: AttachedDrafter, sequences: torch.LongTensor | None = None) -> Any:
    """The statistics of the drafter's last generate() call (`DCOCODrafter.generation_stats`); `sequences`, what the
    call returned, also counts its final cycle (transformers stops without telling the drafter)."""
    call = drafter.last_call
    if call is None:
        raise RuntimeError(
            "No generate() call has consulted this drafter yet (a call with fewer than 2 new tokens never drafts)."
        )
    if sequences is not None:
        call.close(sequences)
    return call.stats


__all__ = ["Call", "SpeculationEngine", "call_statistics", "claim", "keep_call_statistics", "one_call",
           "proposal_limits", "require_prompt_tokens"]
