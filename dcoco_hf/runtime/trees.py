"""Draft trees scored by the corrector: more tokens per target forward from the candidates a draft already holds.

A block drafter keeps each slot's top-K candidates, but a chain verifies one per slot. A tree verifies several in
the same target forward (DDTree, arXiv 2604.12989: best-first over the drafter's per-slot top-k by summed log-prob,
up to a node budget, one forward with an ancestor mask at positions start + depth). What limits such trees is that a
block drafter's guess for slot p + 1 is conditioned on its own slot-p guess: after the target accepts a sibling, the
marginal's best next token is right far less often than on the argmax chain. DCOCO's transition scores S_p(a, b) rank
slot p + 1's candidates given the candidate a chosen at slot p, so here every node's children are ranked for that
node: a node's score is its path's log-probability under the corrector's chain (log-softmax of the anchor -> slot 1
scores, then of S_p(a, .) along the path); a drafter without a corrector falls back to the product of each slot's
marginals, as DDTree.

`best_first` builds the N most likely nodes with every node's ancestors kept (a node's path probability is at most
its parent's, so the N best form a tree); children are expanded lazily (a node's best child and its next sibling),
so a tree of N nodes costs O(N log N) on the host. The chain of the prefix-first walk is the tree's all-rank-0 path
(the "chain"): a tree whose N nodes are a single path is exactly the walk's block. The target's own tokens take one
path through a verified tree (`verification.follow_path`, the same walk as for a chain); `path_order` puts that
path's columns first, after which a verified tree looks exactly like a verified chain whose accepted prefix is that
path (the batched loop then crops, masks and compacts as for chains).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from .drafting import DraftProposal
from .acceptance import NodeFeatures, PlannedTree


@dataclass(frozen=True)
class TreeNode:
    """One node of a draft tree: candidate `candidate` of slot `slot` (0-based: slot 0 follows the anchor) under the
    node `parent` (its index in the tree, -1: the anchor)."""

    slot: int
    candidate: int
    parent: int
    log_prob: float  # of its path under the walk's scores
    confidence: float  # its probability under its parent's successor scores
    sibling_share: float  # its probability over its best sibling's (1 for the best child)
    on_chain: bool  # every node of its path is its parent's best child: the prefix-first walk's block

    def features(self, parent_on_chain: bool) -> NodeFeatures:
        return NodeFeatures(self.slot, self.confidence, self.sibling_share, not parent_on_chain)


@dataclass
class DraftTrees:
    """One draft tree per row, N nodes each, in best-first order (a parent before its children), as the verify
    forward lays them out: block column 0 is the anchor, node i is column i + 1.

    tokens / parents / depths: [b, N] on the device (a node's parent as a block column; depth 1 under the anchor);
    nodes, node_tokens: the same trees on the host."""

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    nodes: list[list[TreeNode]]
    node_tokens: list[list[int]]
    scores: TreeScores  # what they were built from

    @property
    def depth(self) -> int:
        """The deepest node's depth (the anchor's children: 1)."""
        return max((node.slot + 1 for row in self.nodes for node in row), default=0)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        """Whether every row's tree is a single path (node i's parent is column i): a plain causal block."""
        return all(node.parent == i - 1 for row in self.nodes for i, node in enumerate(row))

    def visible(self) -> torch.BoolTensor:
        """[b, N + 1, N + 1]: which block columns each block column attends to (its ancestors and itself)."""
        batch, n = self.parents.shape
        seen = torch.eye(n + 1, dtype=torch.bool, device=self.parents.device).repeat(batch, 1, 1)
        seen[:, :, 0] = True  # the anchor is every node's ancestor
        for column in range(1, n + 1):  # parents come first: copy the parent's row, then add the node itself
            parent = self.parents[:, column - 1]  # [b]
            seen[:, column] |= seen[torch.arange(batch, device=parent.device), parent]
        return seen


@dataclass
class TreeScores:
    """One draft's scores on the host, what trees are built from (`tree_scores`), per row: slot 1's conditional
    log-probabilities given the anchor [K] (the anchor -> slot 1 scores, else the drafter's slot-1 logits); slot p +
    1's given each candidate of slot p [S - 1][K][K] (the corrector's transition scores; None without a corrector);
    each slot's marginals [S][K] (the drafter's logits over its top-K); the candidates' token ids [S][K]; and each
    candidate's best successor as the walk ranks them [S - 1][K] (the marginals' best without a corrector)."""

    first: list[list[float]]
    transitions: list[list[list[list[float]]]] | None
    marginals: list[list[list[float]]]
    candidates: list[list[list[int]]]
    best_successor: list[list[list[int]]]


def tree_scores(proposal: DraftProposal) -> TreeScores:
    """The draft's `TreeScores`, read to the host at once (one copy: float64 holds every token id exactly)."""
    batch, slots, k = proposal.candidates.shape
    first = proposal.first_slot_scores if proposal.first_slot_scores is not None else proposal.candidate_logits[:, 0]
    marginals = torch.log_softmax(proposal.candidate_logits.double(), -1)  # [b, S, K]
    scores = proposal.transition_scores
    transitions = torch.log_softmax(scores.double(), -1) if scores is not None else None  # [b, S - 1, K, K]
    best = scores.argmax(-1) if scores is not None else torch.zeros(batch, slots - 1, k, dtype=torch.long,
                                                                     device=proposal.candidates.device)
    parts = [torch.log_softmax(first.double(), -1), marginals, proposal.candidates.double(), best.double()]
    parts += [transitions] if transitions is not None else []
    host = torch.cat([part.reshape(batch, -1) for part in parts], dim=1).tolist()  # [b][...]
    sizes = [k, slots * k, slots * k, (slots - 1) * k, (slots - 1) * k * k]
    rows = []
    for row in host:
        pieces, at = [], 0
        for size in sizes[: len(parts)]:
            pieces.append(row[at : at + size])
            at += size
        rows.append(pieces)

    def shaped(values: list[float], *shape: int, cast=float) -> list:
        if shape[0] == 0:
            return []
        if len(shape) == 1:
            return [cast(v) for v in values]
        step = len(values) // shape[0]
        return [shaped(values[i * step : (i + 1) * step], *shape[1:], cast=cast) for i in range(shape[0])]

    return TreeScores(
        first=[row[0] for row in rows],
        transitions=[shaped(row[4], slots - 1, k, k) for row in rows] if transitions is not None else None,
        marginals=[shaped(row[1], slots, k) for row in rows],
        candidates=[shaped(row[2], slots, k, cast=int) for row in rows],
        best_successor=[shaped(row[3], slots - 1, k, cast=int) for row in rows],
    )


def chain_of(scores: TreeScores, row: int) -> tuple[list[float], list[int]]:
    """The prefix-first walk's block of one row, read off its `TreeScores` (the tree's all-rank-0 path): each slot's
    confidence (its probability under its parent's successor scores, as `proposal.slot_confidence` reads it on the
    device) and token."""
    first, marginals, candidates = scores.first[row], scores.marginals[row], scores.candidates[row]
    previous = max(range(len(first)), key=first.__getitem__)  # the first of equal maxima, as argmax
    confidence, tokens = [math.exp(first[previous])], [candidates[0][previous]]
    for slot in range(1, len(marginals)):
        if scores.transitions is None:  # without a corrector the chain is each slot's argmax: candidate 0
            chosen, log_p = 0, marginals[slot][0]
        else:
            chosen = scores.best_successor[row][slot - 1][previous]
            log_p = scores.transitions[row][slot - 1][previous][chosen]
        confidence.append(math.exp(log_p))
        tokens.append(candidates[slot][chosen])
        previous = chosen
    return confidence, tokens


def best_first(
    first: list[float],
    transitions: list[list[list[float]]] | None,
    marginals: list[list[float]],
    budget: int,
) -> list[TreeNode]:
    """The `budget` most likely nodes of one row's draft, best first, every node's ancestors included.

    first [K]: slot 1's log-probabilities given the anchor; transitions [S - 1][K][K]: slot p + 1's given each
    candidate of slot p (None: `marginals` [S][K], each slot's own log-probabilities whatever its parent)."""
    slots = len(marginals)

    def children(slot: int, parent_candidate: int) -> list[float]:
        if slot == 0:
            return first
        return transitions[slot - 1][parent_candidate] if transitions is not None else marginals[slot]

    def ranked(scores: list[float]) -> list[int]:
        return sorted(range(len(scores)), key=lambda c: -scores[c])

    # Heap entries: (-path log-prob, tie-break, slot, rank, parent index, parent's path log-prob, the ranking).
    root_order = ranked(first)
    heap = [(-first[root_order[0]], 0, 0, 0, -1, 0.0, root_order)]
    nodes: list[TreeNode] = []
    pushed = 1
    while heap and len(nodes) < budget:
        neg, _, slot, rank, parent, parent_lp, order = heapq.heappop(heap)
        scores = children(slot, nodes[parent].candidate if parent >= 0 else -1)
        candidate = order[rank]
        on_chain = rank == 0 and (parent < 0 or nodes[parent].on_chain)
        share = math.exp(scores[candidate] - scores[order[0]])
        confidence = math.exp(scores[candidate])
        nodes.append(TreeNode(slot, candidate, parent, -neg, confidence, share, on_chain))
        index = len(nodes) - 1
        if rank + 1 < len(order):  # the next sibling
            heapq.heappush(heap, (-(parent_lp + scores[order[rank + 1]]), pushed, slot, rank + 1, parent, parent_lp,
                                  order))
            pushed += 1
        if slot + 1 < slots:  # this node's best child
            child_scores = children(slot + 1, candidate)
            child_order = ranked(child_scores)
            heapq.heappush(heap, (neg - child_scores[child_order[0]], pushed, slot + 1, 0, index, -neg, child_order))
            pushed += 1
    return nodes


def planned_tree(nodes: list[TreeNode]) -> PlannedTree:
    """One row's nodes (best first) as the cost-aware schedule predicts them."""
    features = [node.features(node.parent < 0 or nodes[node.parent].on_chain) for node in nodes]
    return PlannedTree.of(features, [node.parent for node in nodes])


@dataclass
class TreeDraft:
    """The tree proposer's offer for one draft: each row's `budget` most likely nodes, best first (`best_first`),
    from which a schedule takes the first N (`Proposal.tree`)."""

    scores: TreeScores
    nodes: list[list[TreeNode]]

    @classmethod
    def of(cls, proposal: DraftProposal, budget: int) -> TreeDraft:
        scores = tree_scores(proposal)
        transitions = scores.transitions
        nodes = [best_first(scores.first[i], transitions[i] if transitions is not None else None, scores.marginals[i],
                            budget) for i in range(len(scores.first))]
        return cls(scores, nodes)

    @property
    def size(self) -> int:
        """The most nodes every row's tree holds."""
        return min(map(len, self.nodes))

    @property
    def planned(self) -> list[PlannedTree]:
        return [planned_tree(row) for row in self.nodes]

    def chain(self) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's chain (the all-rank-0 path): its slots' confidences and tokens (`chain_of`)."""
        confidence, tokens = zip(*(chain_of(self.scores, row) for row in range(len(self.nodes))))
        return list(confidence), list(tokens)

    def take(self, size: int, device: torch.device) -> DraftTrees:
        """The rows' trees of their first `size` nodes, as the verify forward's block."""
        return draft_trees(self.scores, [row[:size] for row in self.nodes], device)


def draft_trees(scores: TreeScores, nodes: list[list[TreeNode]], device: torch.device) -> DraftTrees:
    """The rows' trees (`best_first`, N nodes each) as the verify forward's block."""
    tokens = [[scores.candidates[i][n.slot][n.candidate] for n in row] for i, row in enumerate(nodes)]
    depths = [[n.slot + 1 for n in row] for row in nodes]
    parents = [[n.parent + 1 for n in row] for row in nodes]  # as block columns
    block = torch.tensor([tokens, parents, depths], dtype=torch.long, device=device)  # one copy to the device
    return DraftTrees(block[0], block[1], block[2], nodes, tokens, scores)


def path_order(path: torch.LongTensor, columns: int) -> torch.LongTensor:
    """The block's columns reordered with the accepted path first ([b, depth + 1] from `follow_path`; its padding
    repeats the last accepted column), then every other column in order -> [b, columns], a permutation per row."""
    batch, steps = path.shape
    keys = steps + torch.arange(columns, device=path.device).expand(batch, -1).clone()  # off the path: after it
    # A path column's key is its depth (a repeated last column takes one of its later depths: still after the rest
    # of the path and before every column off it), so the keys are distinct.
    keys.scatter_(1, path, torch.arange(steps, device=path.device).expand(batch, -1))
    return keys.argsort(1)


def node_labels(
    trees: DraftTrees, path: list[list[int]], accepted: list[int], target_tokens: list[list[int]]
) -> list[list[tuple[TreeNode, bool, bool]]]:
    """Per row, every node whose parent was accepted (the anchor's children included), with whether the target's
    token at its parent was its own (its label) and whether its parent is on the chain. path, accepted: from
    `follow_path`; target_tokens: the target's token at each path column; all on the host."""
    labelled = []
    for row, nodes in enumerate(trees.nodes):
        on_path = {path[row][d]: d for d in range(accepted[row] + 1)}  # accepted column -> its depth on the path
        parent_chain = {0: True, **{i + 1: node.on_chain for i, node in enumerate(nodes)}}
        found = []
        for i, node in enumerate(nodes):
            depth = on_path.get(node.parent + 1)
            if depth is not None:
                label = trees.node_tokens[row][i] == target_tokens[row][depth]
                found.append((node, label, parent_chain[node.parent + 1]))
        labelled.append(found)
    return labelled



__all__ = ["DraftTrees", "TreeDraft", "TreeNode", "TreeScores", "best_first", "chain_of", "draft_trees", "node_labels",
           "path_order", "planned_tree", "tree_scores"]
