"""A corrector that any serving engine can run over its drafted blocks, with the drafter network's own code.

An engine that drafts DFlash blocks itself (vLLM: `dcoco_hf/serving/vllm_model.py`) has each block's drafter hidden
states, its anchor token and its slots' logits, but no `DCOCODrafter`. `DCOCOBlockCorrector` holds what the corrector
reads besides those (its weights, the corpus pair counts, the draft vocabulary) and binds the network's methods
(`modeling_dcoco.DCOCODraftModel`) that take a block's candidates, score them and walk them, so the engine's pick is the
one `DCOCODrafter.propose` would make from the same block, not a re-implementation of it. It serves every corrector that
reads nothing else, whichever the drafter's `corrector_type` names (`correctors.corrector_class`): DCOCO and the DFlash2
candidate selector (which reads its codebooks by draft-vocabulary column: `draft_columns` is bound too). LiLiCorr also
reads the anchor's fused context row (`Corrector.reads_anchor_state`), which an engine's draft forward keeps in its KV
cache only, so it is refused. The name keeps the package's prefix, as `DCOCODrafter` does for every corrector it
carries. No engine is imported here, so the equivalence is tested without one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..network.configuration_dcoco import DCOCOConfig
from ..network.corrector import CorpusBigrams
from ..network.correctors import corrector_class
from ..network.modeling_dcoco import DCOCODraftModel, SlotCandidates


class DCOCOBlockCorrector(nn.Module):
    """The corrector half of a `DCOCODrafter` (its corrector, pair counts and draft vocabulary), with the drafter's
    own methods that read a block's candidates and score them; `embed` is the target's token embedding."""

    # The same functions `DCOCODrafter.propose` calls: one implementation of the corrector for every engine.
    slot_candidates = DCOCODraftModel.slot_candidates
    score_candidates = DCOCODraftModel.score_candidates
    candidate_bigrams = DCOCODraftModel.candidate_bigrams
    candidate_corpus_inputs = DCOCODraftModel.candidate_corpus_inputs
    scores_first_slot = DCOCODraftModel.scores_first_slot
    draft_columns = DCOCODraftModel.draft_columns  # the selector's codebooks are indexed by draft-vocabulary column
    correct_candidates = DCOCODraftModel.correct_candidates  # the scores, then the walk

    def __init__(self, config: DCOCOConfig, embed: Callable[[torch.Tensor], torch.Tensor],
                 selection: str = "prefix_first", geometric_lambda: float = 0.75) -> None:
        super().__init__()
        check_servable(config)
        self.config = config
        self.selection, self.geometric_lambda = selection, geometric_lambda
        self.__dict__["_embed"] = embed  # the target's, borrowed: not a submodule, so never in this state dict
        self.corrector = corrector_class(config.corrector_type).from_config(config)
        self.corpus_bigrams = CorpusBigrams(config.vocab_size, config.corpus_bigrams) if config.corpus_bigrams else None
        size = config.draft_vocab_size
        self.register_buffer("draft_token_ids", torch.zeros(size, dtype=torch.long) if size else None)

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """Target embeddings of token ids of any shape -> [..., H] (an engine's embedding may take 1-D ids only)."""
        return self._embed(token_ids.reshape(-1)).view(*token_ids.shape, -1)

    def input_embedding(self) -> nn.Module:
        """What `score_candidates` embeds candidates with (`DCOCODrafter.input_embedding`): `embed`, as a module."""
        return _Embedding(self.embed)

    @torch.no_grad()
    def walk(self, block_hidden: torch.Tensor, anchor_ids: torch.LongTensor, logits: torch.Tensor,
             context_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """The corrected block: block_hidden [B, 1 + S, H] (anchor row, then slots), anchor_ids [B], the slots'
        full-vocabulary logits [B, S, V] -> token ids [B, S], as `DCOCODrafter.propose` picks them. context_ids
        [B, L] the committed tokens up to the anchor, read by a corrector with `context_bigrams`; None: only the
        anchor is known (no pair of the text is, so m(a, b) = 0)."""
        column_tokens = self.draft_token_ids
        if column_tokens is not None:  # propose among the draft vocabulary only, as the drafter does
            logits = logits[..., column_tokens]
        candidates, candidate_logits, log_probs = self.slot_candidates(logits.float(), column_tokens)  # [B, S, K]
        if candidates.shape[1] < 2 and not self.scores_first_slot:
            return candidates[..., 0]
        context_ids = anchor_ids[:, None] if context_ids is None else context_ids  # one token: no pair
        # No context states or positions: they only locate LiLiCorr's anchor row, which check_servable refuses.
        drafted = SlotCandidates(block_hidden, None, candidates, candidate_logits, log_probs)
        correction = self.correct_candidates(
            drafted, anchor_ids, context_ids=context_ids, selection=self.selection,
            geometric_lambda=self.geometric_lambda,
        )
        return candidates.gather(-1, correction.chosen[..., None]).squeeze(-1)


def check_servable(config: DCOCOConfig) -> None:
    """Refuse a corrector that reads more than a drafted block (LiLiCorr's anchor state), naming the way out."""
    if corrector_class(config.corrector_type).reads_anchor_state:
        raise ValueError(
            f"The {config.corrector_type!r} corrector reads the anchor's fused context row, which a serving engine's "
            "draft forward does not hand its draft model, so the vllm format cannot carry it. Export the backbone "
            "with `dcoco-hf export --format dflash` (plain DFlash), or serve a DCOCO or DFlash2-selector drafter."
        )


class _Embedding(nn.Module):
    """A token-embedding function as a module, held outside the state dict (the embedding is the engine's)."""

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.__dict__["embed"] = embed

    def forward(self, token_ids: torch.LongTensor) -> torch.Tensor:
        return self.embed(token_ids)


__all__ = ["DCOCOBlockCorrector", "check_servable"]
