"""The drafter's training step: one packed drafter forward, then the DFlash and (stage 2) DCOCO losses.

Shared by the `transformers.Trainer` wrapper and by anything else that trains a drafter, so there is one objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..candidate_generator import TargetTap
from .losses import dcoco_loss, default_gamma, dflash_loss, pack_blocks, sample_anchors, transition_labels


@dataclass
class DrafterLoss:
    loss: torch.Tensor
    dflash: torch.Tensor
    dcoco: torch.Tensor | None
    slot_accuracy: torch.Tensor  # [B-1] top-1 accuracy per slot on labelled slots


@torch.no_grad()
def target_context(
    target: torch.nn.Module,
    layer_ids: list[int],
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """Target hidden states at `layer_ids` (the very hooks used at inference) and the target's argmax tokens.

    Returns states [N, T, n_layers * H] and argmax [N, T] (the target's greedy next token after each position).
    """
    tap = TargetTap(target, layer_ids)
    try:
        tap.listen()
        logits = target(input_ids=input_ids, attention_mask=attention_mask).logits
        (forward,) = tap.drain()
    finally:
        tap.remove()
    return forward.states, logits.argmax(-1)


def drafter_loss(
    drafter: torch.nn.Module,
    input_ids: torch.LongTensor,
    loss_mask: torch.BoolTensor,
    context_states: torch.Tensor,
    target_argmax: torch.LongTensor | None = None,
    num_anchors: int = 32,
    gamma: float | None = None,
    rho: float = 4.0,
    generator: torch.Generator | None = None,
) -> DrafterLoss:
    """Stage-1 loss, plus the stage-2 DCOCO loss when `target_argmax` is given (labels under teacher forcing).

    input_ids / loss_mask [N, T] (loss_mask marks response tokens), context_states [N, T, n_layers * H].
    """
    cfg = drafter.config
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    blocks = pack_blocks(input_ids, loss_mask, anchors, valid, cfg.block_size, cfg.mask_token_id)
    n, m = anchors.shape
    hidden = drafter(
        drafter.embed(blocks.block_ids), context_states, blocks.position_ids, blocks.attention_mask
    ).last_hidden_state
    slot_hidden = hidden.view(n, m, cfg.block_size, -1)[:, :, 1:]  # [N, m, S, H]
    logits = drafter.slot_logits(slot_hidden)  # [N, m, S, V]
    stage1 = dflash_loss(logits, blocks, gamma if gamma is not None else default_gamma(cfg.block_size))
    with torch.no_grad():
        correct = (logits.argmax(-1) == blocks.labels) & blocks.label_mask
        accuracy = correct.sum((0, 1)) / blocks.label_mask.sum((0, 1)).clamp(min=1)
    if target_argmax is None:
        return DrafterLoss(stage1, stage1.detach(), None, accuracy)

    # Stage 2: labels are the target's argmax at each slot's position (the prediction made one step before it).
    slot_pos = (anchors[:, :, None] + torch.arange(cfg.block_size - 1, device=anchors.device)).clamp(
        max=input_ids.shape[1] - 1
    )
    argmax_tokens = target_argmax.gather(1, slot_pos.flatten(1)).view_as(blocks.labels)
    candidate_logits, candidates = logits.float().topk(cfg.top_k, dim=-1)  # [N, m, S, K]
    scores = drafter.corrector(
        slot_hidden.flatten(0, 1),
        drafter.embed(candidates.flatten(0, 1)).to(slot_hidden.dtype),
        candidate_logits.flatten(0, 1),
    )  # [N*m, S-1, K, K]
    pair_index, usable = transition_labels(candidates, argmax_tokens, blocks.label_mask)
    stage2 = dcoco_loss(scores, pair_index.flatten(0, 1), usable.flatten(0, 1), rho)
    return DrafterLoss(stage1 + stage2, stage1.detach(), stage2.detach(), accuracy)
