"""The drafter's training step: one packed drafter forward, then the DFlash and (stage 2) DCOCO losses.

Shared by the `transformers.Trainer` wrapper and by anything else that trains a drafter, so there is one objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..runtime.tap import TargetTap, decoder_layers
from .losses import (
    awl_slot_weights,
    candidate_index,
    default_gamma,
    dflash_loss,
    first_slot_loss,
    lilicorr_loss,
    pack_blocks,
    pair_loss_fn,
    predecessor_rows,
    sample_anchors,
    transition_labels,
)
from .phases import SLOT_WEIGHTINGS


@dataclass
class DrafterLoss:
    loss: torch.Tensor
    dflash: torch.Tensor
    dcoco: torch.Tensor | None
    slot_accuracy: torch.Tensor  # [B-1] top-1 accuracy per slot on labelled slots (0 where none is labelled)
    # Stage 2, over usable pairs (both true tokens in the top-K), given the true predecessor: how often the true
    # successor is the drafter's top-1, and how often it is the corrector's best successor (what the walk picks).
    successor_accuracy: tuple[torch.Tensor, torch.Tensor] | None = None
    # With `correct_first_slot`, over blocks whose slot-1 token is in the top-K: how often it is the drafter's
    # top-1, and how often it is the corrector's best successor of the anchor.
    first_slot_accuracy: tuple[torch.Tensor, torch.Tensor] | None = None


class _LayersRead(Exception):
    """Raised by the deepest layer a greedy-text forward reads: the rest of the forward is not needed."""


@torch.no_grad()
def target_context(
    target: torch.nn.Module,
    layer_ids: list[int],
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    greedy_text: bool = False,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """Target hidden states at `layer_ids` (the very hooks used at inference) and the target's argmax tokens.

    Returns states [N, T, n_layers * H] and argmax [N, T] (the target's greedy next token after each position).
    `greedy_text`: the rows' answers are the target's own greedy text (right-padded), so its argmax at every position
    training reads (from the one before an answer's first token) is the next token; the forward then stops after
    the deepest layer read, skipping the layers above it and the LM head (a quarter of a SmolLM2-135M forward, most
    of a Gemma 3 270M one with its 262,144-token head).
    """
    if greedy_text:
        return _states_below(target, layer_ids, input_ids, attention_mask), _next_tokens(input_ids)
    tap = TargetTap(target, layer_ids)
    try:
        tap.listen()
        logits = target(input_ids=input_ids, attention_mask=attention_mask).logits
        (forward,) = tap.drain()
    finally:
        tap.remove()
    return forward.states, logits.argmax(-1)


def _states_below(
    target: torch.nn.Module, layer_ids: list[int], input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """[N, T, n_layers * H]: the outputs of the decoder layers `layer_ids`, as the tap records them, from a forward
    cut short once the deepest of them has run."""
    layers, wanted, states = decoder_layers(target), set(layer_ids), {}

    def record(layer_id: int, module, args, output) -> None:
        states[layer_id] = output[0] if isinstance(output, tuple) else output
        if len(states) == len(wanted):
            raise _LayersRead

    handles = [layers[i].register_forward_hook(partial(record, i)) for i in wanted]
    try:
        target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _LayersRead:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([states[i] for i in layer_ids], dim=-1)


def _next_tokens(input_ids: torch.LongTensor) -> torch.LongTensor:
    """[N, T]: each position's next token (the last position repeats its own: no label is read there)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)


def drafter_loss(
    drafter: torch.nn.Module,
    input_ids: torch.LongTensor,
    loss_mask: torch.BoolTensor,
    context_states: torch.Tensor,
    target_argmax: torch.LongTensor,
    num_anchors: int = 32,
    gamma: float | None = None,
    rho: float = 4.0,
    dcoco: bool = True,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    pair_loss: str = "joint",
    slot_weighting: str = "decay",
) -> DrafterLoss:
    """The stage-1 DFlash loss, plus the stage-2 DCOCO loss when `dcoco` (both labelled by the target's argmax).

    input_ids / loss_mask / target_argmax [N, T] (loss_mask marks the tokens to learn), context_states
    [N, T, n_layers * H]; both come from `target_context` or a feature cache. `block_size` (default: the drafter's
    drafting block, `config.block_size`) sets the training blocks; nothing in the weights depends on it, so one
    checkpoint can be trained on several sizes (DScout's mixed horizons, see `DrafterTrainingModel`).
    `pair_loss`: "joint" (the paper's K^2 softmax) or "successor" (the true predecessor's row only, see losses).
    `slot_weighting`: the DFlash slot loss's weights, "decay" (exp(-(k-1)/gamma)) or "awl" (DScout's acceptance
    weights, `awl_slot_weights`). With a corrector trained by its chain loss (LiLiCorr's, the DFlash2 selector's)
    stage 2 is that loss.
    """
    pair_loss_of = pair_loss_fn(pair_loss)
    if slot_weighting not in SLOT_WEIGHTINGS:
        raise ValueError(f"slot_weighting={slot_weighting!r} is unknown; choose one of {SLOT_WEIGHTINGS}.")
    cfg = drafter.config
    block_size = block_size or cfg.block_size
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    blocks = pack_blocks(input_ids, target_argmax, loss_mask, anchors, valid, block_size, cfg.mask_token_id)
    n, m = anchors.shape
    hidden = drafter(
        drafter.embed(blocks.block_ids), context_states, blocks.position_ids, blocks.attention_mask
    ).last_hidden_state
    block_hidden = hidden.view(n, m, block_size, -1)  # [N, m, B, H]
    slot_hidden = block_hidden[:, :, 1:]  # [N, m, S, H]
    # The softmax runs over exactly the tokens the drafter may propose (its draft vocabulary, if it has one), as
    # `propose` ranks them; a label outside it can never be proposed, so it teaches nothing and is dropped.
    columns = drafter.draft_columns(blocks.labels)  # [N, m, S] label -> logit column (-1: not proposable)
    # The lm_head dominates a step's cost, so only labelled slots go through it: on teacher-forced text many slots
    # lie past the point where the text leaves the target's greedy path.
    labelled = blocks.label_mask & (columns >= 0)  # [N, m, S]
    slot, labels = labelled.nonzero()[:, -1], columns[labelled]  # [L], [L] (columns of the labels)
    logits, column_tokens = drafter.proposal_logits(slot_hidden[labelled])  # [L, V'], token id of each column
    gamma = gamma if gamma is not None else default_gamma(block_size)
    weights = None
    if slot_weighting == "awl":
        label_probs = logits.float().softmax(-1).gather(1, labels[:, None]).squeeze(1)  # [L] Q_k(y*_k)
        grid = torch.zeros(labelled.shape, device=logits.device).index_put((labelled,), label_probs)  # [N, m, S]
        weights = awl_slot_weights(grid, labelled)[labelled]  # [L]
    stage1 = dflash_loss(logits, labels, slot, block_size, gamma, weights)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels).float()
        counts = torch.zeros(labelled.shape[-1], device=logits.device).index_add_(0, slot, torch.ones_like(correct))
        accuracy = torch.zeros_like(counts).index_add_(0, slot, correct) / counts.clamp(min=1)
    if not dcoco:
        return DrafterLoss(stage1, stage1.detach(), None, accuracy)
    anchor_ids = blocks.block_ids.view(n, m, block_size)[:, :, 0]  # [N, m]
    if drafter.corrector.chain_loss:
        return _lilicorr_stage(
            drafter, stage1, accuracy, blocks, labelled, block_hidden, anchor_ids, context_states, input_ids, loss_mask
        )

    top_ids, top_logits, _ = drafter.slot_candidates(logits, column_tokens)  # [L, K], as `propose` takes them
    # Unlabelled slots get placeholder candidates: every pair touching them is unusable, and a pair's score reads
    # only its own two slots, so they never reach the loss.
    k = top_ids.shape[-1]
    candidates = top_ids.new_zeros(*labelled.shape, k).index_put((labelled,), top_ids)  # [N, m, S, K]
    candidate_logits = top_logits.new_zeros(*labelled.shape, k).index_put((labelled,), top_logits)
    pair_index, usable = transition_labels(candidates, blocks.labels, labelled)  # [N, m, S-1]
    rows = usable.any(-1)  # [N, m] blocks with a usable pair (or, below, a slot-1 label among its candidates)
    if cfg.correct_first_slot:
        index, found = candidate_index(candidates[:, :, 0], blocks.labels[:, :, 0], labelled[:, :, 0])  # [N, m]
        rows = rows | found
    # m(a, b) over the text up to each block's anchor, as drafting sees it; corpus counts without each record's own
    # pairs (leave-one-out), as for a prompt the corpus never saw.
    first_scores, scores = drafter.score_candidates(
        block_hidden, anchor_ids, candidates, candidate_logits, context_ids=input_ids,
        anchor_positions=blocks.anchors, exclude=(input_ids, loss_mask), rows=rows,
    )  # [R, K] or None, [R, S-1, K, K]
    pair_index, usable = pair_index[rows], usable[rows]  # [R, S-1]
    stage2 = pair_loss_of(scores, pair_index, usable, rho)
    first_accuracy = None
    if cfg.correct_first_slot and found.any():
        first_scores, index = first_scores[found[rows]], index[found]  # [F, K], [F]
        stage2 = stage2 + first_slot_loss(first_scores, index)
        with torch.no_grad():
            first_accuracy = ((index == 0).float().mean(), (first_scores.argmax(-1) == index).float().mean())
    return DrafterLoss(
        stage1 + stage2, stage1.detach(), stage2.detach(), accuracy, successor_accuracy(scores, pair_index, usable),
        first_accuracy,
    )


def _lilicorr_stage(
    drafter: torch.nn.Module,
    stage1: torch.Tensor,
    accuracy: torch.Tensor,
    blocks,
    labelled: torch.BoolTensor,
    block_hidden: torch.Tensor,
    anchor_ids: torch.LongTensor,
    context_states: torch.Tensor,
    input_ids: torch.LongTensor,
    loss_mask: torch.BoolTensor,
) -> DrafterLoss:
    """Stage 2 with a corrector trained by the chain loss (LiLiCorr's head, the DFlash2 selector): score each
    block's whole lattice as `propose` does, then the chain loss.

    Every slot of a scored block needs its candidates (the lattice attention reads them all), so the lm_head runs over
    all slots of the blocks whose slot 1 is labelled; blocks without a labelled slot 1 teach the chain nothing.
    """
    cfg = drafter.config
    rows = labelled[..., 0]  # [N, m]
    logits, column_tokens = drafter.proposal_logits(block_hidden[rows][:, 1:])  # [R, S, V']
    top = drafter.slot_candidates(logits, column_tokens)  # [R, S, K] ids, logits, log-probs (or None)
    scored = [*top, None, None]
    if drafter.corrector.reads_anchor_state:
        # The anchor row is the fused target context just before each block, as drafting reads it (`anchor_rows`).
        sequence, before = rows.nonzero()[:, 0], blocks.anchors[rows] - 1  # [R], [R]
        scored[3:] = drafter.fuse_target_states(context_states[sequence, before.clamp(min=0)]), before >= 0  # [R, H]
    # Back to one entry per block [N, m, ...] (zeros where unscored): the pair evidence reads each block's sequence.
    candidates, candidate_logits, log_probs, anchor, anchor_valid = (
        None if x is None else x.new_zeros(*rows.shape, *x.shape[1:]).index_put((rows,), x) for x in scored
    )
    start, pairs = drafter.score_candidates(
        block_hidden, anchor_ids, candidates, candidate_logits, log_probs,
        anchor=None if anchor is None else (anchor, anchor_valid),
        context_ids=input_ids, anchor_positions=blocks.anchors, exclude=(input_ids, loss_mask), rows=rows,
    )  # [R, K], [R, S - 1, K, K]
    index, found = candidate_index(top[0], blocks.labels[rows], labelled[rows])  # [R, S]
    stage2 = lilicorr_loss(start, pairs, index, found)
    k = cfg.top_k
    pair_index, usable = index[:, :-1] * k + index[:, 1:], found[:, :-1] & found[:, 1:]  # [R, S - 1]
    first = found[:, 0]
    with torch.no_grad():
        first_accuracy = (
            (index[first, 0] == 0).float().mean(), (start.argmax(-1) == index[:, 0])[first].float().mean()
        )
    return DrafterLoss(
        stage1 + stage2, stage1.detach(), stage2.detach(), accuracy, successor_accuracy(pairs, pair_index, usable),
        first_accuracy,
    )


@torch.no_grad()
def successor_accuracy(
    transition_scores: torch.Tensor, pair_index: torch.LongTensor, usable: torch.BoolTensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafter, corrector) top-1 accuracy of the successor given the true predecessor, over usable pairs.

    transition_scores [R, P, K, K]; pair_index / usable [R, P] from `transition_labels`. Candidates are sorted by
    drafter logit, so the drafter's pick is candidate 0; the corrector's is the best entry of the predecessor's row.
    """
    row, after = predecessor_rows(transition_scores, pair_index)  # [R, P, K], [R, P]
    drafter = (after == 0)[usable].float().mean()
    corrector = (row.argmax(-1) == after)[usable].float().mean()
    return drafter, corrector


def fit_on_own_answers(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    steps: int = 120,
    prompts: int = 48,
    prompt_len: int = 6,
    new_tokens: int = 40,
    seed: int = 0,
) -> torch.nn.Module:
    """A few seconds of `drafter_loss` on the target's own greedy answers to random prompts (AdamW, lr 3e-3):
    enough for a tiny random-weight target's drafts to be accepted often, so checks of the acceptance path have
    accepted drafts to check. Not a training recipe (that is `scripts/train_drafter.py`). Prompts come from torch's
    global generator; returns the drafter in eval mode."""
    ids = torch.randint(0, target.config.vocab_size, (prompts, prompt_len)).to(target.device)
    sequences = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    loss_mask = torch.zeros_like(sequences, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    states, argmax = target_context(target, drafter.config.target_layer_ids, sequences)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    drafter.train()
    for _ in range(steps):
        rows = torch.randint(0, sequences.shape[0], (16,), generator=generator)
        loss = drafter_loss(
            drafter, sequences[rows], loss_mask[rows], states[rows], argmax[rows], num_anchors=8, generator=generator
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()
