"""One draft: the backbone forward over a block, each slot's top-K candidates and the corrector's walk through them
(`draft`), and what the engines need from a drafter (`DraftProposal`, `AttachedDrafter`).

`DCOCODrafter.propose` builds the inputs and calls `draft`; the network does the work (`draft_candidates`, then
`correct_candidates`). With captured drafting (`DCOCODrafter.compile_drafting`) the whole draft is one compiled
graph per block shape over a static context cache (`whole_draft`, `static_layout`). The engines
(`candidate_generator.py`, `generation.py`) and the tuning (`tuning.py`, `block_choice.py`) are typed against
`AttachedDrafter` rather than `DCOCODrafter`, which sits above them, so the package's import graph stays a tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from ..network.configuration_dcoco import DCOCOConfig, DecodingChoices
from ..network.modeling_dcoco import Correction, DCOCODraftModel
from .context_cache import DraftContextCache, StaticDraftContextCache
from .device import device_sync
from .tap import TargetTap


@dataclass
class DraftProposal:
    """One drafted block, after correction.

    tokens: [B, S] proposed tokens for slots 1..S (S = block_size - 1).
    candidates: [B, S, K] top-K candidate ids per slot, best first.
    candidate_logits: [B, S, K] their drafter logits.
    chosen: [B, S] index of the proposed token inside each slot's candidates.
    transition_scores: [B, S - 1, K, K] or None when the corrector was skipped.
    first_slot_scores: [B, K] anchor -> slot 1 scores (`correct_first_slot`), else None.
    backbone_seconds / corrector_seconds: wall time of the backbone (+ lm_head, top-K) and of scoring + walk; a
        captured draft (`compile_drafting`) is one graph, timed whole as backbone_seconds (corrector_seconds 0).
    """

    tokens: torch.Tensor
    candidates: torch.Tensor
    candidate_logits: torch.Tensor
    chosen: torch.Tensor
    transition_scores: torch.Tensor | None
    first_slot_scores: torch.Tensor | None
    backbone_seconds: float
    corrector_seconds: float


@dataclass
class DraftInputs:
    """What one draft reads (`DCOCODrafter.propose` documents each)."""

    block_ids: torch.LongTensor  # [B, block] the anchor, then mask slots
    context_hidden_states: torch.Tensor  # [B, N, n_layers * H] target states not yet in the cache
    position_ids: torch.LongTensor  # [B or 1, N + block]
    attention_mask: torch.Tensor | None  # key mask [B, keys], full mask [B, 1, block, keys], or None
    cache: DraftContextCache | StaticDraftContextCache
    context_ids: torch.LongTensor | None  # [B, L] committed tokens, with `context_bigrams`
    context_valid: torch.BoolTensor | None  # [B, L] False at padding of context_ids

    def keywords(self) -> dict[str, Any]:
        """The fields by name, not copied (a compiled draft's arguments)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True)
class Walk:
    """How the corrector reads a block off its transition scores (the generation config's `selection` and
    `geometric_lambda`)."""

    selection: str
    geometric_lambda: float


def block_of(anchor_ids: torch.LongTensor, block_size: int, mask_token_id: int) -> torch.LongTensor:
    """anchor_ids [B] -> the blocks [B, block_size]: each anchor, then mask slots."""
    masks = anchor_ids.new_full((anchor_ids.shape[0], block_size - 1), mask_token_id)
    return torch.cat([anchor_ids[:, None], masks], dim=1)


def draft(
    network: DCOCODraftModel,
    inputs: DraftInputs,
    walk: Walk | None,
    timed: bool = False,
    compiled: Callable[..., tuple] | None = None,
) -> DraftProposal:
    """Draft one block per row and, with a `walk`, correct it; the cache keeps the new context rows only.

    A static cache with `compiled` (`compile_drafting`'s graph) drafts through the graph when the inputs have its
    one shape (`static_layout`); the rest run eagerly. `timed`: wait for the device before reading the clock."""
    sync = device_sync(inputs.block_ids.device, timed)
    start = time.perf_counter()
    kept = inputs.cache.get_seq_length() + inputs.context_hidden_states.shape[1]
    captured = False
    if isinstance(inputs.cache, StaticDraftContextCache):
        inputs, captured = static_layout(network, inputs)
        captured = captured and compiled is not None
    if captured:  # one graph: backbone, candidates and correction, timed whole (as the backbone's time)
        candidates, candidate_logits, chosen, first_scores, scores = compiled(**inputs.keywords(), walk=walk)
        sync()
        backbone_seconds, corrector_seconds = time.perf_counter() - start, 0.0
    else:
        drafted = network.draft_candidates(
            inputs.block_ids, inputs.context_hidden_states, inputs.position_ids, inputs.attention_mask, inputs.cache
        )
        candidates, candidate_logits = drafted.candidates, drafted.logits
        sync()
        backbone_seconds = time.perf_counter() - start
        start = time.perf_counter()
        chosen = first_scores = scores = None
        if walk is not None:
            correction = correct(network, drafted, inputs, walk)
            chosen, first_scores, scores = correction.chosen, correction.first_slot_scores, correction.transition_scores
        sync()
        corrector_seconds = time.perf_counter() - start if walk is not None else 0.0
    inputs.cache.truncate(kept)
    if chosen is None:
        chosen = torch.zeros(candidates.shape[:2], dtype=torch.long, device=candidates.device)
    tokens = candidates.gather(-1, chosen[..., None]).squeeze(-1)  # [B, S]
    return DraftProposal(
        tokens, candidates, candidate_logits, chosen, scores, first_scores, backbone_seconds, corrector_seconds
    )


def correct(network: DCOCODraftModel, drafted: Any, inputs: DraftInputs, walk: Walk) -> Correction:
    """The corrector phase of a draft (`DCOCODraftModel.correct_candidates`) for these inputs."""
    return network.correct_candidates(
        drafted, inputs.block_ids[:, 0], position_ids=inputs.position_ids, context_ids=inputs.context_ids,
        context_valid=inputs.context_valid, selection=walk.selection, geometric_lambda=walk.geometric_lambda,
    )


def whole_draft(network: DCOCODraftModel, walk: Walk | None, **fields: Any) -> tuple:
    """A whole draft, what `compile_drafting` captures: (candidates, candidate logits, chosen, first-slot scores,
    transition scores), the last three None without a walk. `fields`: a `DraftInputs`' fields by name."""
    inputs = DraftInputs(**fields)
    drafted = network.draft_candidates(
        inputs.block_ids, inputs.context_hidden_states, inputs.position_ids, inputs.attention_mask, inputs.cache
    )
    if walk is None:
        return drafted.candidates, drafted.logits, None, None, None
    correction = correct(network, drafted, inputs, walk)
    return (drafted.candidates, drafted.logits, correction.chosen, correction.first_slot_scores,
            correction.transition_scores)


def static_layout(network: DCOCODraftModel, inputs: DraftInputs) -> tuple[DraftInputs, bool]:
    """A draft's inputs laid out for a static cache: (inputs, whether they have the block's one captured shape).

    A captured draft reads a fixed number of new context rows, `config.block_size` (the most one verify commits),
    so fewer are padded (zero states at position -2, masked; the next draft overwrites them) and the context ids
    span the whole buffer; more (a prompt, a run of plain steps) run eagerly on the same buffers.
    """
    cache, largest = inputs.cache, network.config.block_size
    (batch, block), new_rows = inputs.block_ids.shape, inputs.context_hidden_states.shape[1]
    padded_rows = max(new_rows, largest)
    pad = padded_rows - new_rows
    device = inputs.block_ids.device
    visible = visible_keys(inputs.attention_mask, batch, block, cache.length + new_rows + block, device)
    mask = cache.place(batch, new_rows, padded_rows, block, visible, device)  # [B, 1, block, capacity]
    positions = inputs.position_ids.expand(batch, -1)
    positions = torch.cat([positions[:, :new_rows], positions.new_full((batch, pad), -2), positions[:, new_rows:]], 1)
    context = nn.functional.pad(inputs.context_hidden_states, (0, 0, 0, pad))  # [B, padded rows, n_layers * H]
    context_ids, context_valid = inputs.context_ids, inputs.context_valid
    if context_ids is not None:
        width = max(cache.capacity, context_ids.shape[1])
        valid = context_valid if context_valid is not None else torch.ones_like(context_ids, dtype=torch.bool)
        context_ids = nn.functional.pad(context_ids, (0, width - context_ids.shape[1]))
        context_valid = nn.functional.pad(valid, (0, width - valid.shape[1]))  # padding: no pair
    laid_out = DraftInputs(inputs.block_ids, context, positions, mask, cache, context_ids, context_valid)
    return laid_out, padded_rows == largest


def visible_keys(
    mask: torch.Tensor | None, batch: int, block: int, keys: int, device: torch.device
) -> torch.BoolTensor:
    """A draft's attention mask (None, a key mask [B, keys], or a full mask [B, 1, block, keys]: 1 / True or an
    additive 0 where visible) -> which keys each block row sees, [B, block, keys]."""
    if mask is None:
        return torch.ones(batch, block, keys, dtype=torch.bool, device=device)
    if mask.is_floating_point():
        mask = mask > torch.finfo(mask.dtype).min / 2  # additive: 0 visible, a large negative (or -inf) masked
    mask = mask.bool()
    return mask[:, None, :].expand(-1, block, -1) if mask.dim() == 2 else mask[:, 0]


class AttachedDrafter(Protocol):
    """A drafter bound to its target, as the engines and the tuning use it (`DCOCODrafter` is the one
    implementation)."""

    config: DCOCOConfig
    generation_config: GenerationConfig
    draft_token_ids: torch.LongTensor | None
    dtype: torch.dtype
    last_call: Any  # the statistics of its last generate() call (`engine.keep_call_statistics`), or None

    @property
    def target(self) -> PreTrainedModel: ...

    @property
    def tap(self) -> TargetTap: ...

    @property
    def decoding(self) -> DecodingChoices: ...

    @property
    def time_phases(self) -> bool: ...

    @property
    def draft_block_size(self) -> int: ...

    @property
    def proposal_schedule_name(self) -> str: ...

    @property
    def cost_model(self) -> Any: ...  # proposal.CostModel (the schedules read drafts: drafting stays below them)

    def propose(
        self, anchor_ids: torch.LongTensor, context_hidden_states: torch.Tensor, position_ids: torch.LongTensor,
        cache: DraftContextCache | StaticDraftContextCache, attention_mask: torch.Tensor | None = None, **options: Any,
    ) -> DraftProposal: ...

    def draft_cache(self, capacity: int) -> DraftContextCache | StaticDraftContextCache: ...

    def attach(self, target: PreTrainedModel, tune: bool = True, **tune_options: Any) -> AttachedDrafter: ...

    def detach(self) -> AttachedDrafter: ...

    def generation_stats(self, sequences: torch.LongTensor | None = None) -> Any: ...


__all__ = ["AttachedDrafter", "DraftInputs", "DraftProposal", "Walk", "block_of", "draft", "static_layout",
           "visible_keys", "whole_draft"]
