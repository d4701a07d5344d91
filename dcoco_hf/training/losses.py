"""Training objectives of the drafter, on top of the drafter's own forward (no second drafting code path).

Stage 1, DFlash (public reference recipe): per sequence, sample anchors among response tokens; each block
[anchor, MASK x (B-1)] sees the target context strictly before its anchor, itself bidirectionally, and no other block,
all in one packed forward. Slot k predicts the token at anchor + k with weight exp(-(k-1)/gamma).

Slot labels are the target's greedy tokens under teacher forcing: slot k's label is the target's argmax at position
anchor + k - 1, kept while the text from the anchor up to that slot is itself the target's greedy path. On the target's
own regenerated responses this is the response token (the reference recipe); on any other text it still labels
exactly what the target would accept, so plain text (source code, documentation) becomes valid training data with one
target forward per sequence instead of a slow generation.

Stage 2, DCOCO (arXiv:2610.12570, section 3.4): the label of an adjacent slot pair (p, p+1) is the target's argmax
token pair at those positions under teacher forcing, kept only when both tokens are inside their slots' top-K; the loss
is the cross-entropy over the joint softmax of the pair's K^2 transition scores, weighted exp(-(p-1)/rho), rho = 4.

That joint cross-entropy is the sum of two terms, -log p(a*) - log p(b* | a*): finding the predecessor's row, and the
successor given it. The prefix-first walk only ever makes the second decision (its predecessor is already chosen), so
`successor_loss` keeps that term alone (`pair_loss="successor"` in training; the paper's joint loss is the default).

LiLiCorr (arXiv:2608.20530, `dcoco_hf/network/lilicorr.py`): `lilicorr_loss` is the public training objective's
cross-entropy term: per slot, a softmax over its K candidates given the true predecessor (the anchor's start scores for
slot 1), on the slots whose true token, and every earlier slot's, is inside the top-K (past the first miss nothing can
be accepted, so nothing is taught there).

DScout's acceptance-weighted loss (AWL) replaces the fixed decay of the DFlash slot loss: slot k is weighted by the
probability, detached, that every earlier slot is accepted (`awl_slot_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class PackedBlocks:
    """A batch of sequences with `m` anchored blocks each, ready for one drafter forward.

    block_ids [N, m*B], position_ids [N, T + m*B], attention_mask [N, 1, m*B, T + m*B] (True = visible),
    labels [N, m, B-1] (the target's greedy token at anchor + k), label_mask [N, m, B-1] (slot inside the sequence
    and the response, and the text between anchor and slot on the target's greedy path).
    """

    block_ids: torch.LongTensor
    position_ids: torch.LongTensor
    attention_mask: torch.BoolTensor
    labels: torch.LongTensor
    label_mask: torch.BoolTensor
    anchors: torch.LongTensor  # [N, m]


def sample_anchors(
    loss_mask: torch.BoolTensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Up to `num_anchors` distinct anchor positions per row, among positions p whose next token p + 1 is a response
    token. Returns anchors [N, m] (sorted) and a validity mask [N, m] (rows with fewer candidates are padded)."""
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, 1:]
    noise = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
    noise = noise.masked_fill(~candidates, 2.0)  # non-candidates sort last
    m = min(num_anchors, loss_mask.shape[1])
    picked = noise.topk(m, dim=1, largest=False)
    anchors, order = picked.indices.sort(dim=1)
    valid = picked.values.gather(1, order) < 2.0
    return anchors, valid


def pack_blocks(
    input_ids: torch.LongTensor,
    greedy_next: torch.LongTensor,
    loss_mask: torch.BoolTensor,
    anchors: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    block_size: int,
    mask_token_id: int,
) -> PackedBlocks:
    """Build the packed block inputs, labels and block attention mask for anchors [N, m] in sequences [N, T].

    greedy_next [N, T]: the target's argmax at each position under teacher forcing (its greedy next token).
    """
    n, t = input_ids.shape
    m = anchors.shape[1]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    slot_pos = anchors[:, :, None] + offsets  # [N, m, B] absolute positions of block tokens
    block_ids = torch.full((n, m, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)  # slot 0 embeds the anchor itself, never MASK
    inside = slot_pos[:, :, 1:] < t
    label_pos = slot_pos[:, :, 1:].clamp(max=t - 1)  # [N, m, B-1]
    labels = greedy_next.gather(1, (label_pos - 1).reshape(n, -1)).view(n, m, block_size - 1)
    # A slot's label is what the target would accept only while the text before it follows the greedy path.
    follows = torch.ones_like(input_ids, dtype=torch.bool)
    follows[:, 1:] = input_ids[:, 1:] == greedy_next[:, :-1]
    on_path = follows.gather(1, label_pos.reshape(n, -1)).view(n, m, block_size - 1)
    prefix_on_path = torch.ones_like(on_path)
    prefix_on_path[:, :, 1:] = on_path[:, :, :-1].cumprod(dim=-1).bool()
    label_mask = inside & prefix_on_path & loss_mask.gather(1, label_pos.reshape(n, -1)).view(n, m, block_size - 1)
    label_mask &= anchor_valid[:, :, None]

    # Context: block i sees target positions strictly before its anchor. Blocks: only themselves, bidirectionally.
    context_visible = torch.arange(t, device=device)[None, None, :] < anchors[:, :, None]  # [N, m, T]
    context_visible = context_visible[:, :, None, :].expand(n, m, block_size, t).reshape(n, m * block_size, t)
    block_of = torch.arange(m, device=device).repeat_interleave(block_size)
    same_block = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)
    attention_mask = torch.cat([context_visible, same_block], dim=-1)[:, None]  # [N, 1, mB, T + mB]
    position_ids = torch.cat([torch.arange(t, device=device).expand(n, t), slot_pos.reshape(n, -1)], dim=1)
    return PackedBlocks(block_ids.view(n, -1), position_ids, attention_mask, labels, label_mask, anchors)


def slot_weights(block_size: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """exp(-(k-1)/decay) for slots k = 1..B-1: early slots matter most, since verification stops at the first error."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / decay)


def default_gamma(block_size: int) -> float:
    """DFlash's slot-loss decay: 7 for B = 16, 5 for B = 10, 4 for B = 8 (interpolated elsewhere)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 7.0 * math.log(block_size) / math.log(16))


def dflash_loss(
    labelled_logits: torch.Tensor,
    labels: torch.LongTensor,
    slot: torch.LongTensor,
    block_size: int,
    gamma: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted slot cross-entropy over the labelled slots: logits [L, V], labels [L], slot index [L] (0 = slot 1).

    weights [L], when given, replace the decay exp(-(k-1)/gamma) (e.g. `awl_slot_weights`)."""
    ce = F.cross_entropy(labelled_logits.float(), labels, reduction="none")
    if weights is None:
        weights = slot_weights(block_size, gamma, labelled_logits.device)[slot]
    return (ce * weights).sum() / weights.sum().clamp(min=1e-6)


def awl_slot_weights(label_probs: torch.Tensor, labelled: torch.BoolTensor) -> torch.Tensor:
    """DScout's acceptance weights: w_k = stop-grad(prod_{j<k} alpha_j), alpha_j the probability that slot j is
    accepted, for label_probs / labelled [..., S] (slot axis last) -> [..., S].

    Our labels are the target's greedy tokens y*, so the target distribution P_j is the one-hot of y*_j, and for a
    draft token sampled from the drafter's Q_j, E[min(1, P_j(y) / Q_j(y))] = sum_y min(Q_j(y), P_j(y)) = Q_j(y*_j):
    alpha_j is the drafter's probability of the label (label_probs). An unlabelled slot is never accepted (alpha 0).
    Slot 1 always weighs 1.
    """
    alpha = torch.where(labelled, label_probs.detach().float(), 0.0)
    ones = torch.ones_like(alpha[..., :1])
    return torch.cat([ones, alpha[..., :-1]], dim=-1).cumprod(dim=-1)


def lilicorr_loss(
    start_scores: torch.Tensor, pair_scores: torch.Tensor, index: torch.LongTensor, found: torch.BoolTensor
) -> torch.Tensor:
    """LiLiCorr's chain cross-entropy: slot 1 over the start scores, slot p + 1 over the K successors of the true
    slot-p candidate, averaged over the slots whose true token is in the top-K at that slot and at every earlier one.

    start_scores [R, K], pair_scores [R, S - 1, K, K]; index [R, S] the true token's position in each slot's top-K,
    found [R, S] whether it is there (and labelled), from `candidate_index`.
    """
    k = start_scores.shape[-1]
    before = index[:, :-1, None, None].expand(-1, -1, 1, k)  # [R, S - 1, 1, K]
    successors = pair_scores.gather(2, before).squeeze(2)  # [R, S - 1, K] the true predecessor's rows
    nodes = torch.cat([start_scores[:, None], successors], dim=1).float()  # [R, S, K]
    ce = F.cross_entropy(nodes.flatten(0, 1), index.flatten(), reduction="none").view(index.shape)  # [R, S]
    supervised = found.long().cumprod(dim=-1).float()  # the oracle prefix
    return (ce * supervised).sum() / supervised.sum().clamp(min=1.0)


def candidate_index(
    candidates: torch.LongTensor, tokens: torch.LongTensor, label_mask: torch.BoolTensor
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Position of each label token inside its slot's top-K, and whether it is there (and labelled).

    candidates [..., K]; tokens / label_mask [...].
    """
    hits = candidates == tokens[..., None]  # [..., K]
    return hits.float().argmax(-1), hits.any(-1) & label_mask


def transition_labels(
    candidates: torch.LongTensor, argmax_tokens: torch.LongTensor, label_mask: torch.BoolTensor
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Joint label index a*K + b of each adjacent slot pair, and whether it is usable.

    candidates [..., S, K]; argmax_tokens [..., S] the target's argmax at each slot under teacher forcing.
    A pair is usable only if both tokens are inside their slots' top-K (the walk cannot choose anything else).
    """
    index, found = candidate_index(candidates, argmax_tokens, label_mask)  # [..., S]
    pair_index = index[..., :-1] * candidates.shape[-1] + index[..., 1:]
    return pair_index, found[..., :-1] & found[..., 1:]


def dcoco_loss(
    transition_scores: torch.Tensor, pair_index: torch.LongTensor, usable: torch.BoolTensor, rho: float = 4.0
) -> torch.Tensor:
    """Cross-entropy over the joint softmax of each pair's K^2 transitions, weighted exp(-(p-1)/rho).

    transition_scores [..., P, K, K]; pair_index / usable [..., P].
    """
    flat = transition_scores.flatten(-2).float()  # [..., P, K^2]
    ce = F.cross_entropy(flat.flatten(0, -2), pair_index.flatten(), reduction="none").view_as(pair_index.float())
    return _pair_weighted_mean(ce, usable, rho)


def predecessor_rows(
    transition_scores: torch.Tensor, pair_index: torch.LongTensor
) -> tuple[torch.Tensor, torch.LongTensor]:
    """The true predecessor's row of scores [..., P, K] and the true successor's index [..., P], from scores
    [..., P, K, K] and joint labels a*K + b [..., P]: what the walk sees once it stands on the right predecessor."""
    k = transition_scores.shape[-1]
    before, after = pair_index // k, pair_index % k
    return transition_scores.gather(-2, before[..., None, None].expand(*before.shape, 1, k)).squeeze(-2), after


def successor_loss(
    transition_scores: torch.Tensor, pair_index: torch.LongTensor, usable: torch.BoolTensor, rho: float = 4.0
) -> torch.Tensor:
    """Cross-entropy over the K successors of the true predecessor (the walk's decision), weighted as `dcoco_loss`.

    transition_scores [..., P, K, K]; pair_index / usable [..., P].
    """
    rows, after = predecessor_rows(transition_scores, pair_index)  # [..., P, K], [..., P]
    ce = F.cross_entropy(rows.float().flatten(0, -2), after.flatten(), reduction="none").view_as(after.float())
    return _pair_weighted_mean(ce, usable, rho)


def _pair_weighted_mean(ce: torch.Tensor, usable: torch.BoolTensor, rho: float) -> torch.Tensor:
    """Mean of per-pair losses [..., P] over usable pairs, pair p weighted exp(-(p-1)/rho)."""
    weights = slot_weights(ce.shape[-1] + 1, rho, ce.device) * usable
    return (ce * weights).sum() / weights.sum().clamp(min=1e-6)


PAIR_LOSSES = {"joint": dcoco_loss, "successor": successor_loss}


def pair_loss_fn(name: str) -> Callable[..., torch.Tensor]:
    """The stage-2 pair loss called `name` ("joint" or "successor"); an unknown name is refused."""
    if name not in PAIR_LOSSES:
        raise ValueError(f"pair_loss={name!r} is unknown; choose one of {sorted(PAIR_LOSSES)}.")
    return PAIR_LOSSES[name]


def first_slot_loss(first_slot_scores: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """Cross-entropy over the K anchor -> slot 1 transitions (`correct_first_slot`): the anchor is certain, so the
    joint softmax of its pair has one row. first_slot_scores [R, K], index [R] of the target's token in the top-K."""
    return F.cross_entropy(first_slot_scores.float(), index)
