"""`DCOCOStats`: the one record of what speculative decoding did in one or more generate() calls.

Every counter is filled through an `observe_*` method by whoever sees the event: the `SpeculationEngine` of a call
(transformers' assisted loop or the batched `speculative_generate`) observes its drafts, what the target accepted
and, at the end of the call, which committed tokens were in each slot's candidates; the benchmark observes the drafts of
every method, DCOCO's or not, from its trace of target forwards. Rates (tau, per-slot and chain acceptance, the ceilings
of tau) are read from the counters on demand, so merging runs is a sum and nothing is counted twice.

The tau ceilings follow the DCOCO paper's analysis of the prefix-first walk: committing stops at the first wrong slot,
so a slot counts only while every slot before it was right.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

# Counters kept per drafted slot (index 0 = slot 1); they grow to the longest block observed.
_SLOT_COUNTERS = (
    "slot_proposed", "slot_reached", "slot_accepted", "slot_seen", "slot_top1", "slot_topk", "prefix_top1",
    "prefix_topk", "prefix_walk", "slot_predicted", "slot_labelled", "slot_label_accepted",
)
_SCALAR_COUNTERS = (
    "cycles", "committed_tokens", "target_forwards", "drafter_seconds", "corrector_seconds", "target_seconds",
    "prefill_seconds", "plain_estimate_seconds", "cycle_wall_seconds", "tree_cycles", "tree_nodes", "after_sibling",
    "after_sibling_walk", "after_sibling_marginal", "after_chain", "after_chain_walk", "after_chain_marginal",
)


@dataclass
class DCOCOStats:
    """Counters of drafting and verification. tau = committed tokens per target forward.

    Args:
        block_size: the drafted block (anchor + slots) the counters are first sized for; 0 for "grow as observed".
        top_k: candidates per slot (reported only).
    """

    block_size: int = 0
    top_k: int = 0
    cycles: int = 0
    committed_tokens: int = 0
    target_forwards: int = 0
    accepted: list[int] = field(default_factory=list)  # drafted tokens committed, per cycle
    drafter_seconds: float = 0.0
    corrector_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0  # the prompt's target forward, part of target_seconds; the rest is the cycles'
    # per drafted slot: cycles that proposed it / reached it (every slot before it accepted) / accepted it
    slot_proposed: list[int] = field(default_factory=list)
    slot_reached: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    # per drafted slot: cycles whose committed token there is known / was the drafter's top-1 / inside its top-K
    slot_seen: list[int] = field(default_factory=list)
    slot_top1: list[int] = field(default_factory=list)
    slot_topk: list[int] = field(default_factory=list)
    # per drafted slot s: cycles whose committed tokens at slots 1..s were all top-1 / all inside the top-K / top-1
    # at slot 1 and inside the top-K after it (the most the paper's prefix-first walk can reach)
    prefix_top1: list[int] = field(default_factory=list)
    prefix_topk: list[int] = field(default_factory=list)
    prefix_walk: list[int] = field(default_factory=list)
    # the proposal length: cycles per tokens proposed (index 0: plain steps the schedule took instead of a draft)
    proposal_lengths: list[int] = field(default_factory=list)
    # the drafted block (anchor + slots): cycles per block size drafted (the cost-aware schedule picks one per cycle)
    drafted_blocks: list[int] = field(default_factory=list)
    # per drafted slot, over the blocks the cost-aware schedule labelled (the slot reached: every slot before it
    # right): the acceptance it predicted (summed), how many were labelled, how many were right
    slot_predicted: list[float] = field(default_factory=list)
    slot_labelled: list[int] = field(default_factory=list)
    slot_label_accepted: list[int] = field(default_factory=list)
    # over the cycles the engine timed: what plain steps would have taken for their tokens (the cost model's plain
    # step), and their wall time
    plain_estimate_seconds: float = 0.0
    cycle_wall_seconds: float = 0.0
    # draft trees (`trees.py`): cycles that verified a tree instead of a chain, and their nodes
    tree_cycles: int = 0
    tree_nodes: int = 0
    # after the target accepted a tree node off the chain (a sibling), or on it, with a next slot drafted: how often
    # the next token was the best child as the walk's scores rank that node's children (the corrector re-ranks them
    # for it) and as the slot's marginals rank them (whatever the parent: a drafter without a corrector)
    after_sibling: int = 0
    after_sibling_walk: int = 0
    after_sibling_marginal: int = 0
    after_chain: int = 0
    after_chain_walk: int = 0
    after_chain_marginal: int = 0

    def __post_init__(self) -> None:
        self._grow(self.block_size - 1)

    def _grow(self, slots: int) -> None:
        for name in _SLOT_COUNTERS:
            counts = getattr(self, name)
            counts += [0] * (slots - len(counts))

    # ------------------------------------------------------------------------------------------------ observing

    def observe_draft(self, drafted: int, accepted: int, committed: int | None = None) -> None:
        """One verification: `drafted` tokens proposed, the first `accepted` of them taken and `committed` tokens
        written in all (default accepted + 1: the target's own token after the accepted drafts)."""
        self._grow(drafted)
        self._count_length(drafted)
        self.cycles += 1
        self.committed_tokens += accepted + 1 if committed is None else committed
        self.accepted.append(accepted)
        for slot in range(drafted):
            self.slot_proposed[slot] += 1
            self.slot_reached[slot] += slot <= accepted
            self.slot_accepted[slot] += slot < accepted

    def observe_tree(self, nodes: int, accepted: int, committed: int) -> None:
        """One verified draft tree of `nodes` nodes: `accepted` of them on the target's path, `committed` tokens
        written (accepted + the target's own, cut at the budget or an EOS)."""
        self.cycles += 1
        self.tree_cycles += 1
        self.tree_nodes += nodes
        self.committed_tokens += committed
        self.accepted.append(accepted)

    def observe_next_after_accepted(self, on_chain: bool, walk_hit: bool, marginal_hit: bool) -> None:
        """An accepted tree node with a next slot drafted: whether the target's next token was its best child under
        the walk's scores (`walk_hit`) and under the next slot's marginals (`marginal_hit`)."""
        prefix = "after_chain" if on_chain else "after_sibling"
        setattr(self, prefix, getattr(self, prefix) + 1)
        setattr(self, f"{prefix}_walk", getattr(self, f"{prefix}_walk") + walk_hit)
        setattr(self, f"{prefix}_marginal", getattr(self, f"{prefix}_marginal") + marginal_hit)

    def observe_plain_steps(self, count: int = 1, committed: int = 0) -> None:
        """`count` plain 1-token steps taken instead of a draft (proposal length 0), committing `committed` tokens."""
        self._count_length(0, count)
        self.committed_tokens += committed

    def observe_prediction(self, predicted: list[float], labels: list[bool]) -> None:
        """One drafted block's predicted chain acceptance per slot against what happened (`chain_labels`)."""
        self._grow(len(labels))
        for slot, (p, label) in enumerate(zip(predicted, labels)):
            self.slot_predicted[slot] += p
            self.slot_labelled[slot] += 1
            self.slot_label_accepted[slot] += label

    def observe_drafted_block(self, block: int) -> None:
        """One draft of a block of `block` (anchor + slots)."""
        _count(self.drafted_blocks, block)

    def _count_length(self, k: int, count: int = 1) -> None:
        _count(self.proposal_lengths, k, count)

    def observe_candidates(self, hits: torch.Tensor) -> None:
        """One drafted block's candidates against the tokens finally committed there: hits [s, K] is True where
        candidate k of slot j is the committed token (s <= slots: the sequence may end inside the block)."""
        self._grow(hits.shape[0])
        top1 = hits[:, 0].long()  # [s]
        topk = hits.any(-1).long()  # [s]
        runs = {  # [s] 1 while every slot so far was right in that sense
            "prefix_top1": top1.cumprod(0), "prefix_topk": topk.cumprod(0),
            "prefix_walk": topk.cumprod(0) * top1[:1],
        }
        rows = {"slot_top1": top1, "slot_topk": topk, **runs}
        for name, values in rows.items():
            counts = getattr(self, name)
            for slot, value in enumerate(values.tolist()):
                counts[slot] += value
        for slot in range(hits.shape[0]):
            self.slot_seen[slot] += 1

    def merge(self, other: DCOCOStats) -> DCOCOStats:
        """The sum of two runs' counters (benchmark totals)."""
        merged = DCOCOStats(max(self.block_size, other.block_size), max(self.top_k, other.top_k))
        for name in _SCALAR_COUNTERS:
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.accepted = self.accepted + other.accepted
        for name in ("proposal_lengths", "drafted_blocks"):
            mine, theirs = getattr(self, name), getattr(other, name)
            width = max(len(mine), len(theirs))
            setattr(merged, name, [a + b for a, b in zip(_padded(mine, width), _padded(theirs, width))])
        width = max(len(getattr(stats, name)) for stats in (self, other) for name in _SLOT_COUNTERS)
        for name in _SLOT_COUNTERS:
            mine, theirs = _padded(getattr(self, name), width), _padded(getattr(other, name), width)
            setattr(merged, name, [a + b for a, b in zip(mine, theirs)])
        return merged

    __add__ = merge  # sum(stats_list, DCOCOStats())

    # ---------------------------------------------------------------------------------------------------- rates

    @property
    def tau(self) -> float:
        return self.committed_tokens / max(self.target_forwards, 1)

    @property
    def mean_accepted(self) -> float | None:
        return sum(self.accepted) / len(self.accepted) if self.accepted else None

    def accept_hist(self) -> dict[str, int]:
        """Cycles per accepted length (string keys, as JSON writes them)."""
        return {str(length): count for length, count in sorted(Counter(self.accepted).items())}

    def per_slot_accept(self) -> list[float | None]:
        return _ratios(self.slot_accepted, self.slot_proposed)

    def chain_accept(self) -> list[float | None]:
        """Per slot, the share accepted of the cycles that reached it (every slot before it accepted).

        tau is about 1 + the sum over j of the products of the first j of these, so they show where a corrector can
        earn: under the prefix-first walk it changes slots 2 and later, and only in cycles that reach them.
        """
        return _ratios(self.slot_accepted, self.slot_reached)

    def prefix_tau(self, runs: str) -> float | None:
        """Tokens per verify these cycles would commit if each kept its longest run of right slots, counting a slot
        right when the committed token was
        - "top1": the drafter's top-1 (what argmax drafting of the same blocks earns);
        - "topk": anywhere in its top-K (the ceiling of every walk over these candidates, a perfect corrector's);
        - "walk": the top-1 at slot 1 and anywhere in the top-K after it (the ceiling of the paper's prefix-first
          walk, which only re-selects successors).
        """
        prefixes = {"top1": self.prefix_top1, "topk": self.prefix_topk, "walk": self.prefix_walk}
        if runs not in prefixes:
            raise ValueError(f"runs={runs!r} is unknown; choose one of {sorted(prefixes)}.")
        if not self.slot_seen or not self.slot_seen[0]:
            return None
        return 1 + sum(n / d for n, d in zip(prefixes[runs], self.slot_seen) if d)

    @property
    def seconds_saved(self) -> float | None:
        """Plain steps' estimated time for the timed cycles' tokens less their wall time (negative: time lost)."""
        return self.plain_estimate_seconds - self.cycle_wall_seconds if self.cycle_wall_seconds else None

    def next_after_accepted(self) -> dict[str, float | int | None]:
        """After an accepted tree node off the chain (a sibling) and on it: how often the next token was the node's
        best child under the walk's scores and under the slot's marginals, and how many such nodes there were."""
        rates: dict[str, float | int | None] = {}
        for prefix in ("after_sibling", "after_chain"):
            seen = getattr(self, prefix)
            rates[f"{prefix}_nodes"] = seen
            for ranking in ("walk", "marginal"):
                rates[f"{prefix}_{ranking}"] = getattr(self, f"{prefix}_{ranking}") / seen if seen else None
        return rates

    def predicted_accept(self) -> list[float | None]:
        """Per slot, the mean acceptance the schedule predicted over the blocks that reached the slot."""
        return [p / n if n else None for p, n in zip(self.slot_predicted, self.slot_labelled)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "committed_tokens": self.committed_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "mean_accepted": self.mean_accepted,
            "accept_hist": self.accept_hist(),
            "per_slot_accept": self.per_slot_accept(),
            "chain_accept": self.chain_accept(),
            "coverage_top1": _ratios(self.slot_top1, self.slot_seen),
            "coverage_topk": _ratios(self.slot_topk, self.slot_seen),
            "argmax_prefix_tau": self.prefix_tau("top1"),
            "topk_ceiling_tau": self.prefix_tau("topk"),
            "walk_ceiling_tau": self.prefix_tau("walk"),
            "proposal_lengths": {str(k): n for k, n in enumerate(self.proposal_lengths) if n},
            "drafted_blocks": {str(b): n for b, n in enumerate(self.drafted_blocks) if n},
            "predicted_accept": self.predicted_accept(),
            "observed_accept": _ratios(self.slot_label_accepted, self.slot_labelled),
            "seconds_saved": self.seconds_saved,
            "tree_cycles": self.tree_cycles,
            "mean_tree_nodes": self.tree_nodes / self.tree_cycles if self.tree_cycles else None,
            **self.next_after_accepted(),
            "drafter_seconds": self.drafter_seconds,
            "corrector_seconds": self.corrector_seconds,
            "target_seconds": self.target_seconds,
            "prefill_seconds": self.prefill_seconds,
        }


def _ratios(numerators: list[int], denominators: list[int]) -> list[float | None]:
    return [n / d if d else None for n, d in zip(numerators, denominators)]


def _count(counts: list[int], index: int, count: int = 1) -> None:
    counts += [0] * (index + 1 - len(counts))
    counts[index] += count


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))


__all__ = ["DCOCOStats"]
