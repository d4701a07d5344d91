"""The DFlash2 candidate selector: a low-rank bilinear transition score over each slot's top-K candidates.

DFlash2, the DFlash successor served by vLLM and SGLang, re-selects among a slot's top-K candidates as DCOCO and
LiLiCorr do, with the cheapest transition score of the three. Each token t has a predecessor code P[t] and a
successor code S[t] (two [V, r] codebooks), each slot l a context code W h_l (a [r, H] projection of the slot's
drafter hidden), and the transition score of candidate c at slot l after predecessor p is

    score_l(p, c) = unary_l(c) + sum_r P[p, r] * (W h_l)[r] * S[c, r]

where unary_l(c) is the drafter's logit of c at slot l. Slot 1's predecessor is the anchor (the last committed
token), every later slot's is a candidate of the slot before, so the start scores [R, K] and the transition scores
[R, S - 1, K, K] are one product over the pair lattice (`Corrector.pair_lattice`, the anchor as a slot 0 of K equal
candidates). The walk is our prefix-first walk with the first slot corrected: slot 1 takes the best start, every
next slot the best successor of the one chosen (`corrector.prefix_first_walk`).

Token ids index the codebooks through the drafter's draft vocabulary (`reads_draft_columns`): with one (FR-Spec
style, `draft_vocab_size`), the codebooks hold one row per draft-vocabulary token, so a SmolLM2 selector of rank 16
keeps 2 x 8192 x 16 numbers instead of 2 x 49152 x 16; a token outside it (an anchor the drafter could never have
proposed) has a zero code, so its transitions add nothing to the unary logits. The public format indexes the codebooks
by token id over the whole vocabulary; `to_public_format` expands ours with zero rows elsewhere
(`dcoco_hf/serving/export.py`).

A fresh selector has a zero successor codebook and small random predecessor codes and projection: every bilinear
term is 0, so each score is the drafter's logit and the walk returns the drafter's argmax (the first of equal maxima
is candidate 0, the drafter's top-1), as an untrained DCOCO or LiLiCorr head does. Only one factor starts at zero,
because a product of factors gets no gradient while two of them are zero. The predecessor codes start small (std
`initializer_range`, as token embeddings do) because a token that is never a predecessor in training keeps its
starting code, which then adds its noise to every score after it. Stage 2 trains it with the chain loss
(`losses.lilicorr_loss`), the cross-entropy of the true token among the K successors of the true predecessor, slot by
slot along the oracle prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .corrector import BlockLattice, Corrector

PUBLIC_ARCHITECTURE = "DFlash2DraftModel"
PUBLIC_PREFIX = "candidate_selector."


class SelectorCorrector(Corrector):
    """Start and transition scores of a block's candidates from two token codebooks and a slot projection.

    Args:
        hidden_size: width H of the drafter's slot hiddens.
        codebook_size: rows of each codebook: the draft vocabulary's size, else the target's vocabulary.
        rank: width r of the codes (public `selector_rank`).
        initializer_range: std of the fresh predecessor codes.
    """

    reads_draft_columns = True
    chain_loss = True

    def __init__(self, hidden_size: int, codebook_size: int, rank: int = 16, initializer_range: float = 0.02) -> None:
        super().__init__()
        self.initializer_range = initializer_range
        self.predecessor_codebook = nn.Parameter(torch.empty(codebook_size, rank))  # P [V', r]
        self.successor_codebook = nn.Parameter(torch.zeros(codebook_size, rank))  # S [V', r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # W [r, H]
        self.init_weights()

    @classmethod
    def from_config(cls, config: Any) -> SelectorCorrector:
        return cls(config.hidden_size, config.draft_vocab_size or config.vocab_size, config.selector_rank,
                   config.initializer_range)

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.selector_rank < 1:
            raise ValueError(f"selector_rank={config.selector_rank} must be >= 1 (the width of the token codes).")

    @classmethod
    def scores_first_slot(cls, config: Any) -> bool:
        return True  # the anchor is slot 1's predecessor

    def init_weights(self) -> None:
        """A fresh selector scores every candidate by its drafter logit (module docstring): S = 0, P small and random
        so the successor codes get a gradient from the first step (transformers' `init` leaves loaded tensors
        alone)."""
        init.normal_(self.predecessor_codebook, std=self.initializer_range)
        init.zeros_(self.successor_codebook)

    def score(
        self,
        config: Any,
        lattice: BlockLattice,
        embedding: nn.Module | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """anchor_ids [R] and candidates [R, S, K] arrive as codebook rows (`reads_draft_columns`; -1: none)."""
        tokens = self.pair_lattice(config, lattice.anchor_ids, lattice.candidates)  # [R, S + 1, K], anchor as slot 0
        scores = self(lattice.block_hidden[..., 1:, :], tokens[:, :-1], lattice.candidates, lattice.logits)
        return scores[:, 0, 0], scores[:, 1:]  # [R, K], [R, S - 1, K, K]

    def forward(
        self,
        slot_hidden: torch.Tensor,
        predecessors: torch.LongTensor,
        successors: torch.LongTensor,
        unary_logits: torch.Tensor,
    ) -> torch.Tensor:
        """score_l(p, c) for every predecessor p and candidate c of every slot.

        Args:
            slot_hidden: [R, S, H] drafter hidden of each drafted slot.
            predecessors: [R, S, K] codebook rows of the slot's possible predecessors (slot 1: K copies of the anchor).
            successors: [R, S, K] codebook rows of the slot's candidates.
            unary_logits: [R, S, K] the candidates' drafter logits.
        Returns:
            [R, S, K, K]; entry [r, l, a, c] scores candidate c at slot l + 1 after predecessor a.
        """
        context = self.hidden_projection(slot_hidden.to(self.hidden_projection.weight.dtype))  # [R, S, r]
        before = (
            self.codes(self.predecessor_codebook, predecessors).to(context.dtype) * context[:, :, None]
        )  # [R, S, K, r]
        after = self.codes(self.successor_codebook, successors).to(context.dtype)  # [R, S, K, r]
        transition = torch.matmul(before, after.transpose(-1, -2)).float()  # [R, S, K, K]
        return unary_logits.float()[:, :, None, :] + transition

    @staticmethod
    def codes(codebook: torch.Tensor, rows: torch.LongTensor) -> torch.Tensor:
        """codebook [V', r] rows [...] (-1: outside the codebook, a zero code) -> [..., r]."""
        inside = rows >= 0
        return F.embedding(rows.clamp(min=0), codebook) * inside[..., None].to(codebook.dtype)


def public_tensors(
    state: dict[str, torch.Tensor], token_ids: torch.Tensor | None, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The selector's tensors of a drafter state dict in the public layout: `candidate_selector.*`, codebooks over the
    whole vocabulary (row t is the code of token t; zero for tokens outside our draft vocabulary `token_ids`)."""
    tensors = {}
    for name, tensor in state.items():
        if not name.startswith("corrector."):
            continue
        name = name[len("corrector."):]
        if name.endswith("_codebook") and token_ids is not None:
            full = tensor.new_zeros(vocab_size, tensor.shape[1])  # [V, r]
            full[token_ids.to(tensor.device)] = tensor
            tensor = full
        tensors[PUBLIC_PREFIX + name] = tensor.detach().contiguous()
    if not tensors:
        raise ValueError("This drafter has no candidate selector (config.corrector_type must be 'dflash2') to export.")
    return tensors


__all__ = ["PUBLIC_ARCHITECTURE", "SelectorCorrector", "public_tensors"]
