"""`SpeculationEngine`: one generate() call's speculation, whichever loop verifies it.

Two loops drive the same engine: transformers' assisted loop (`target.generate(..., assistant_model=drafter)`, one
row, through the `DCOCOCandidateGenerator` adapter) and the batched loop (`speculative_generate`, B rows). Each cycle
the loop asks the engine what comes next (`next_cycle`: the call's schedule decides, `proposal.py`): a plain step, or
a draft of a block, of which the schedule picks what the target verifies (`draft`); the target verifies, and the
loop reports what each row accepted and committed (`verified`), which the engine books and passes to the schedule.
On the assisted path that is transformers' own count of matches (`update_candidate_strategy`), never inferred from
forwards.

The engine owns what lives exactly one call besides the schedule: the drafter's context cache, the committed answers
and every row's statistics. The call's lifetime is here too: one call at a time per drafter (`claim`, `one_call`),
and the last call's statistics (`keep_call_statistics`, `call_statistics`), kept beside the drafter rather than in it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from ..network.corrector import walk_name
from .proposal import COST_SCHEDULE, Draft, Schedule, Verified, make_schedule
from .stats import DCOCOStats
from .trees import DraftTrees, TreeDraft, node_labels

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from .drafting import AttachedDrafter, DraftProposal


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


class SpeculationEngine:
    """Drafts and statistics of one generate() call over `rows` sequences; what each cycle drafts and verifies is
    its schedule's (`proposal.py`), asked once per cycle.

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
    """

    def __init__(
        self, drafter: AttachedDrafter, rows: int, correct: bool = True, selection: str | None = None,
        context_length: int = 256, tree_budget: int = 0,
    ) -> None:
        self.drafter, self.correct, self.selection = drafter, correct, selection
        config, generation = drafter.config, drafter.generation_config
        self.cache = drafter.draft_cache(context_length)
        # The drafter's settings, read once: a cycle enters the drafter only to `propose`.
        self.timed = drafter.time_phases
        self.stats = [DCOCOStats(drafter.draft_block_size, config.top_k) for _ in range(rows)]  # grow as drafted
        self.cap, floor = proposal_limits(generation, config.block_size - 1)
        self.answers: list[list[int]] = [[] for _ in range(rows)]  # each row's committed answer tokens
        name = drafter.proposal_schedule_name
        ids = drafter.draft_token_ids
        self.schedule: Schedule = make_schedule(
            name, drafter.cost_model, rows=rows, block_size=drafter.draft_block_size, largest=config.block_size,
            cap=self.cap, floor=floor, answers=self.answers, stats=self.stats,
            draft_vocabulary=frozenset(ids.tolist()) if ids is not None and name == COST_SCHEDULE else None,
        )
        walk = walk_name(selection or drafter.decoding.selection)
        trees_apply = walk == "prefix_first" and name in (COST_SCHEDULE, "constant")
        self.tree_budget = tree_budget if trees_apply else 0
        self.block: int | None = None  # the cycle's block, as the schedule decided it (None: a plain step)
        self._decided = False  # whether the schedule was asked about this cycle
        self._drafted: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(rows)]  # (start, candidates [S, K])
        self._proposal: DraftProposal | None = None  # the cycle's draft, until verified
        self._trees: DraftTrees | None = None  # the cycle's draft trees, until verified

    # ------------------------------------------------------------------------------------------------ a cycle

    def next_cycle(self, row_ids: Sequence[int], may_skip: bool = True) -> int | None:
        """Ask the schedule about the next cycle of the active rows: the block to draft, or None for a plain step
        (only with `may_skip`: a loop that must draft now, like the assisted loop's first cycle, passes False)."""
        self.block, self._decided = self.schedule.block(row_ids, may_skip), True
        return self.block

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
        """Draft the cycle's block (`next_cycle`; asked now if it was not) for the active rows `row_ids`, and what
        the target verifies of it: (proposal, k, trees), the chain's first k slots (at most `cap`) or the rows' draft
        trees (k = 0). anchor, anchor_positions [b]; context [b, N, n_layers * H] the target states not yet in the
        drafter cache at context_positions [b, N]; masks and context ids as in `DCOCODrafter.propose` (the mask
        sized for the cycle's block)."""
        block = self.block if self._decided and self.block is not None else self.next_cycle(row_ids, may_skip=False)
        offsets = torch.arange(block, device=anchor.device)
        position_ids = torch.cat([context_positions, anchor_positions[:, None] + offsets], dim=1)  # [b, N + block]
        blind = self.cache.get_seq_length() == context.shape[1] == 0  # no target state read: nothing to learn from
        proposal = self.drafter.propose(
            anchor, context, position_ids, self.cache, attention_mask, selection=self.selection,
            correct=self.correct, context_ids=context_ids, context_valid=context_valid,
            timed=self.timed, block_size=block,
        )
        for row, candidates in zip(row_ids, proposal.candidates):
            self.stats[row].observe_drafted_block(block)
            self._drafted[row].append((len(self.answers[row]), candidates))
        offered = TreeDraft.of(proposal, self.tree_budget) if self.tree_budget else None
        choice = self.schedule.propose(Draft(proposal, row_ids, min(cap, block - 1), offered, blind))
        trees = offered.take(choice.tree, proposal.tokens.device) if choice.tree else None
        self._proposal, self._trees, self._decided = proposal, trees, False
        return proposal, choice.k, trees

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
        seconds: float | None = None,
    ) -> None:
        """After the target verified the cycle: `proposed` drafts were offered to every active row (0: a plain step;
        a tree's nodes), row i accepted `accepted[i]` of them and committed the tokens `committed[i]` (accepted drafts
        and the target's own token, cut at the budget or an EOS). With trees: `path` [b][depth + 1] the accepted
        path's block columns (`verification.follow_path`) and `path_tokens` the target's token at each of them, both
        on the host. `seconds`: the cycle's wall time (None: untimed)."""
        proposal, self._proposal = self._proposal, None
        trees, self._trees = self._trees, None
        plain = proposal is None and self._decided_plain()
        for row, count, tokens in zip(row_ids, accepted, committed):
            stats = self.stats[row]
            if trees is not None:
                stats.observe_tree(proposed, count, len(tokens))
            elif proposal is not None:
                stats.observe_draft(proposed, count, len(tokens))
            elif plain:
                stats.observe_plain_steps(committed=len(tokens))
            else:  # transformers' own step where no draft fits (the last token of a call)
                stats.committed_tokens += len(tokens)
            self.answers[row].extend(tokens)
        labels = None
        if trees is not None:
            labels = node_labels(trees, list(path), list(accepted), list(path_tokens))
            self._book_tree_successors(trees, labels, row_ids, path, accepted, path_tokens)
        if proposal is not None:
            for row in row_ids:
                self.stats[row].drafter_seconds += proposal.backbone_seconds
                self.stats[row].corrector_seconds += proposal.corrector_seconds
        node_outcomes = [[(node.features(on_chain), label) for node, label, on_chain in row] for row in labels] \
            if labels is not None else None
        self.schedule.verified(Verified(row_ids, proposed, accepted, committed, node_outcomes, seconds))
        self._book_cycle_time(row_ids, seconds, committed)
        self._decided = False

    def finish(self) -> None:
        """The call ended: book each drafted block's candidate coverage (the candidates cross to the host in one
        copy)."""
        blocks = [candidates for row_blocks in self._drafted for _, candidates in row_blocks]
        if not blocks:
            return
        on_host = torch.cat([candidates.flatten() for candidates in blocks]).cpu().split([c.numel() for c in blocks])
        on_host = iter(on_host)
        for row, row_blocks in enumerate(self._drafted):
            answer = self.answers[row]
            for start, candidates in row_blocks:
                candidates = next(on_host).view(candidates.shape)
                truth = torch.tensor(answer[start : start + candidates.shape[0]], dtype=torch.long)
                self.stats[row].observe_candidates(candidates[: truth.shape[0]] == truth[:, None])  # [s, K]
            row_blocks.clear()

    # ------------------------------------------------------------------------------------------------ internals

    def _decided_plain(self) -> bool:
        """Whether the cycle just verified was a plain step the schedule decided (not transformers' own last step)."""
        return self._decided and self.block is None

    def _book_cycle_time(self, row_ids: Sequence[int], seconds: float | None, committed: Sequence[Sequence[int]]
                         ) -> None:
        """Each row's statistics compare the timed cycle with plain steps for its tokens."""
        costs = self.drafter.cost_model.costs_at(len(row_ids))
        if seconds is None or costs is None:
            return
        for row, tokens in zip(row_ids, committed):
            self.stats[row].plain_estimate_seconds += costs.plain * len(tokens)
            self.stats[row].cycle_wall_seconds += seconds

    def _book_tree_successors(self, trees, labels, row_ids, path, accepted, path_tokens) -> None:
        """After each accepted node with a next slot: whether the target's next token was its best child as the
        walk ranks that node's children and as the slot's marginals rank them (`DCOCOStats.next_after_accepted`)."""
        scores = trees.scores
        for i, row in enumerate(row_ids):
            candidates, nodes = scores.candidates[i], trees.nodes[i]
            for depth in range(1, accepted[i] + 1):
                node = nodes[path[i][depth] - 1]
                if node.slot + 1 >= len(candidates):
                    continue
                following = candidates[node.slot + 1]
                walk_best = following[scores.best_successor[i][node.slot][node.candidate]]
                target = path_tokens[i][depth]
                self.stats[row].observe_next_after_accepted(node.on_chain, walk_best == target, following[0] == target)


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
