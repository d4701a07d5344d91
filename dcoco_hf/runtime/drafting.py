"""What the engines need from a drafter: one drafted block (`DraftProposal`) and the attached drafter's interface
(`AttachedDrafter`).

The engines (`candidate_generator.py`, `generation.py`) and the tuning (`tuning.py`, `block_choice.py`) are typed
against this protocol rather than against `DCOCODrafter`, which sits above them (`drafter.py` builds on all of them),
so the package's import graph stays a tree.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..network.configuration_dcoco import DCOCOConfig, DecodingChoices
from .context_cache import DraftContextCache, StaticDraftContextCache
from .proposal import ProposalSchedule
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


class AttachedDrafter(Protocol):
    """A drafter bound to its target, as the engines and the tuning use it (`DCOCODrafter` is the one
    implementation)."""

    config: DCOCOConfig
    generation_config: GenerationConfig
    draft_token_ids: torch.LongTensor | None
    dtype: torch.dtype

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
    def proposal_schedule(self) -> ProposalSchedule: ...

    def propose(
        self, anchor_ids: torch.LongTensor, context_hidden_states: torch.Tensor, position_ids: torch.LongTensor,
        cache: DraftContextCache | StaticDraftContextCache, attention_mask: torch.Tensor | None = None, **options: Any,
    ) -> DraftProposal: ...

    def draft_cache(self, capacity: int) -> DraftContextCache | StaticDraftContextCache: ...

    def attach(self, target: PreTrainedModel, tune: bool = True, **tune_options: Any) -> AttachedDrafter: ...

    def detach(self) -> AttachedDrafter: ...

    def one_call(self) -> AbstractContextManager[None]: ...

    def keep_call_statistics(self, call: Any) -> None: ...

    def generation_stats(self, sequences: torch.LongTensor | None = None) -> Any: ...


__all__ = ["AttachedDrafter", "DraftProposal"]
