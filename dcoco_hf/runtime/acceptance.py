"""How likely each drafted slot is to be accepted: the acceptance fit the cost-aware schedule plans with (a leaf
module).

p_j is the chance that slot j is accepted given that every slot before it was (the chain acceptance of DScout and of
the DCOCO paper's prefix-first analysis: verification stops at the first error), so a proposal of k slots commits

    E[committed | k] = 1 + sum_{i <= k} prod_{j <= i} p_j

tokens per verify. p_j is predicted per slot from the slot's confidence (the probability the walk's own scores give
the chosen candidate: the corrector's transition scores when it ran, else the drafter's logits) and from how well
drafts fared in the call so far; an online logistic fit calibrates it from what the target committed, every drafted
slot counted (a slot that was not proposed is labelled by whether the committed token there equals it), starting
from the drafter's `block_tau` (tau per block size implies the chain acceptance). A draft tree's nodes add two terms
(`NodeFeatures`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

_RECENT_DECAY = 0.25  # weight of the newest slot-1 outcome in a call's running acceptance
_RECENT_FADE = 0.05  # per plain step, the share of the way the running acceptance drifts back to the prior
_LEARNING_RATE = 0.05
_EPS = 1e-3


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
    "AcceptanceModel", "NodeFeatures", "PlannedTree", "chain_labels", "chain_prior", "draftable_share",
    "expected_tokens", "fade_recent", "node_terms", "slot_confidence", "tree_expected", "tree_reach", "update_recent",
]
