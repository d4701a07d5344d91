"""The DCOCO contextual corrector and the walks that read a block off its transition scores.

Paper: "Contextual Correction of Parallel Drafts for Speculative Decoding" (DCOCO, arXiv:2610.12570), section 3.
A parallel drafter predicts every slot without seeing its neighbours' choices, so a block can be incoherent
("New Diego"). The right token is often inside the slot's top-K though (on Qwen3-8B top-1 covers 0.400 of slots and
top-16 covers 0.755), so DCOCO re-selects instead of re-generating:

1. candidates: per drafted slot the top-K token ids c_i^k with their drafter logits l_i(k) and the slot hidden h_i;
2. candidate representation z_i^k = LN_affine(W_fuse [LN(W_cand E[c_i^k]); LN(W_ctx h_i)]), width r;
3. slot-pair state s_p = W_pair [h_p; h_{p+1}], shared by the K^2 transitions of the pair;
4. transition score S_p(a, b) = l_{p+1}(b) + Delta([s_p; z_p^a; z_{p+1}^b; l_p(a); l_{p+1}(b)]), Delta a GELU MLP
   3r+2 -> hidden -> 1 whose output layer starts at zero (an untrained corrector reproduces the drafter's argmax);
   every transition of the block is scored in one batched op;
5. prefix-first walk: slot 1 keeps the drafter argmax, then k_{p+1} = argmax_b S_p(k_p, b), because verification
   stops at the first error and a good late slot cannot pay for a bad early one.

Our first extension (`DCOCOConfig.correct_first_slot`, off by default): the anchor is the block's position 0 and its
token is known, so it is a predecessor with a single candidate, and the same Delta scores the anchor -> slot 1
transitions S_0(anchor, b) = l_1(b) + Delta([s_0; z_0; z_1^b; 0; l_1(b)]) (s_0 pairs the anchor's drafter hidden
with slot 1's, z_0 is the anchor token's representation, and the anchor has no drafter logit). The walk then starts
from argmax_b S_0 instead of the drafter argmax. With short blocks most of the top-K headroom sits at slot 1, which
the paper's walk cannot touch; a zero Delta still returns the drafter's argmax.

Our second extension (`DCOCOConfig.context_bigrams`, off by default): Delta also reads m(a, b), 1 when the token
pair (a, b) already occurs in the committed text (prompt and output so far), else 0. The slot hiddens are computed
without the neighbours' choices, which is why blocks go incoherent; whether the committed text ever wrote b right
after a is the cheapest evidence about that pair (code repeats its identifiers, prose its phrases), read from the
token ids with one sort, no forward. Its Delta weights start at zero, so adding it to a trained corrector changes
nothing until trained.

Our third extension (`DCOCOConfig.corpus_bigrams`, off by default): Delta also reads how often b directly followed a
in the target's own answers to the training prompts, c(a, b), and how often a was followed by anything, n(a), as
log(1 + c) and log(1 + c) - log(1 + n) (a smoothed log P(b | a)). `CorpusBigrams` stores the counts with the weights
(a few hundred KB), so drafting reads them with one sorted lookup. Where m(a, b) knows the prompt at hand, c(a, b)
knows the target's habits ("Here are some", "**Step 1:**"), which is what chat blocks lack most. In training each
record's own pairs are taken out of the counts (leave-one-out), so the corrector learns how far counts from other
texts can be trusted, as on a new prompt. Its Delta weights start at zero too.

The first layer of Delta is stored as four linear maps, one per input group ([s_p], [z_p^a], [z_{p+1}^b],
[l_p(a), l_{p+1}(b)]). That is the same 3r+2 -> hidden affine map with the same parameter count, but the batched op
then costs O(P K hidden) for the projections plus one broadcast add, instead of a matmul over P K^2 concatenated rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class BlockLattice:
    """What a corrector scores (`Corrector.score`): R blocks' drafter output and each slot's top-K candidates, with
    the pair inputs over their lattice (`Corrector.pair_lattice`), as `DCOCODraftModel.score_candidates` gathers
    them for drafting and training alike."""

    block_hidden: torch.Tensor  # [R, block, H] the drafter output: anchor row, then the slots
    anchor_ids: torch.LongTensor  # [R] (draft-vocabulary rows with `reads_draft_columns`)
    candidates: torch.LongTensor  # [R, S, K] (likewise)
    logits: torch.Tensor  # [R, S, K] the candidates' drafter logits
    log_probs: torch.Tensor | None = None  # [R, S, K] under each slot's softmax, with `reads_log_probs`
    anchor: tuple[torch.Tensor, torch.BoolTensor] | None = None  # LiLiCorr's anchor rows [R, H], valid [R]
    seen: torch.Tensor | None = None  # [R, P, K, K] m(a, b), with `context_bigrams`
    corpus: torch.Tensor | None = None  # [R, P, K, K, 2] the corpus inputs, with `corpus_bigrams`


def zero_linear(inputs: int, outputs: int, bias: bool) -> nn.Linear:
    """A linear map that starts at zero and stays zero through `DCOCOPreTrainedModel._init_weights` (`zero_init`):
    an input or output added this way changes no score until trained."""
    layer = nn.Linear(inputs, outputs, bias=bias)
    layer.zero_init = True
    nn.init.zeros_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


class Corrector(nn.Module):
    """What the drafter asks of a corrector: build from the config, lay out its pair inputs, score a block's
    candidates. Subclasses register under a `corrector_type` name in `correctors.CORRECTORS`.

    The pair lattice (`pair_lattice`) is the candidates [..., S, K], with the anchor as a slot 0 of K equal
    candidates in front when the first slot is scored, so one lookup of the pair inputs (`ContextBigrams`,
    `CorpusBigrams`) serves the anchor -> slot 1 pairs and the slot pairs (half the small ops per draft).
    """

    # The candidates' log-probabilities under each slot's softmax (`DCOCODraftModel.slot_candidates`).
    reads_log_probs: ClassVar[bool] = False
    # The fused target context of the position before the block (`DCOCODrafter.anchor_rows`).
    reads_anchor_state: ClassVar[bool] = False
    # Its weights are sized for the drafter's `block_size`: a longer block needs a new head.
    sized_by_block: ClassVar[bool] = False
    # Stage 2 trains it with the chain loss over the whole lattice instead of per-transition cross-entropy.
    chain_loss: ClassVar[bool] = False
    # Token ids reach `score` as rows of the drafter's draft vocabulary (`DCOCODraftModel.draft_columns`; -1 outside
    # it): a corrector with per-token tables keeps them draft-vocabulary sized (the DFlash2 selector's codebooks).
    reads_draft_columns: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: Any) -> Corrector:
        """The corrector a `DCOCOConfig` describes."""
        raise NotImplementedError

    def init_weights(self) -> None:
        """Start the parameters transformers' default init does not cover (none by default)."""

    def prepare_capture(self, embedding: nn.Module) -> None:
        """Build, eagerly, what drafting caches from the weights and a compiled graph cannot rebuild itself (nothing
        by default); `embedding` is the target's input embedding. Called when drafting is compiled."""

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise a ValueError naming a bad field of this corrector and the fix (nothing to check by default)."""

    @classmethod
    def scores_first_slot(cls, config: Any) -> bool:
        """Whether the anchor -> slot 1 transitions are scored (read per call: `correct_first_slot` may change)."""
        return bool(config.correct_first_slot)

    @classmethod
    def pair_lattice(cls, config: Any, anchor_ids: torch.LongTensor, candidates: torch.LongTensor) -> torch.LongTensor:
        """anchor_ids [...], candidates [..., S, K] -> the pair lattice [..., P + 1, K] (class docstring)."""
        if not cls.scores_first_slot(config):
            return candidates
        anchor = anchor_ids[..., None, None].expand(*candidates.shape[:-2], 1, candidates.shape[-1])  # [..., 1, K]
        return torch.cat([anchor, candidates], dim=-2)  # [..., S + 1, K]

    @classmethod
    def split_anchor_pairs(
        cls, config: Any, pairs: torch.Tensor | None, features: int = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pair inputs over `pair_lattice` [..., P, K, K] (+ `features` trailing dims) -> (the slot pairs
        [..., S - 1, K, K], the anchor -> slot 1 pairs [..., K] or None), each with those trailing dims."""
        if pairs is None or not cls.scores_first_slot(config):
            return pairs, None
        tail = (slice(None),) * features
        every = slice(None)
        return pairs[(..., slice(1, None), every, every, *tail)], pairs[(..., 0, 0, every, *tail)]

    def score(
        self,
        config: Any,
        lattice: BlockLattice,
        embedding: nn.Module | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Score R blocks' candidates (`lattice`; embedding: the target's input embedding) -> (anchor -> slot 1 scores
        [R, K] or None, pair scores [R, S - 1, K, K])."""
        raise NotImplementedError


class DCOCOCorrector(Corrector):
    """Scores every adjacent-slot candidate transition of a draft block.

    Args:
        hidden_size: width H of the drafter hidden states and of the target embedding.
        rank: width r of candidate representations and slot-pair states (paper: 128).
        mlp_hidden: hidden width of the transition MLP Delta (paper: 256).
        context_bigrams: Delta also reads m(a, b), whether the pair occurs in the committed text (module docstring).
        corpus_bigrams: Delta also reads the pair's counts in the training answers (`CorpusBigrams.inputs`).
    """

    def __init__(
        self,
        hidden_size: int,
        rank: int = 128,
        mlp_hidden: int = 256,
        context_bigrams: bool = False,
        corpus_bigrams: bool = False,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.cand_proj = nn.Linear(hidden_size, rank, bias=False)  # W_cand
        self.ctx_proj = nn.Linear(hidden_size, rank, bias=False)  # W_ctx
        self.fuse_proj = nn.Linear(2 * rank, rank, bias=False)  # W_fuse
        self.fuse_norm = nn.LayerNorm(rank)  # the affine LN of z
        self.pair_proj = nn.Linear(2 * hidden_size, rank, bias=False)  # W_pair
        # Delta, first layer (3r + 2 -> mlp_hidden, one bias), split by input group.
        self.delta_pair = nn.Linear(rank, mlp_hidden, bias=True)
        self.delta_prev = nn.Linear(rank, mlp_hidden, bias=False)
        self.delta_next = nn.Linear(rank, mlp_hidden, bias=False)
        self.delta_logits = nn.Linear(2, mlp_hidden, bias=False)
        # m(a, b) -> Delta, zero at start: a trained corrector gains the input without changing its scores.
        self.delta_seen = zero_linear(1, mlp_hidden, bias=False) if context_bigrams else None
        # Delta, output layer: zero at start so S_p(a, b) = l_{p+1}(b) and the walk returns the drafter argmax.
        self.delta_out = zero_linear(mlp_hidden, 1, bias=True)
        self.delta_corpus = None
        if corpus_bigrams:
            self.add_corpus_input()

    @classmethod
    def from_config(cls, config: Any) -> DCOCOCorrector:
        return cls(config.hidden_size, config.corrector_rank, config.corrector_hidden, config.context_bigrams,
                   bool(config.corpus_bigrams))

    def score(
        self,
        config: Any,
        lattice: BlockLattice,
        embedding: nn.Module | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        seen, first_seen = self.split_anchor_pairs(config, lattice.seen)
        corpus, first_corpus = self.split_anchor_pairs(config, lattice.corpus, features=1)
        block_hidden = lattice.block_hidden
        slot_hidden = block_hidden[..., 1:, :]  # [R, S, H]
        candidate_embeds = embedding(lattice.candidates).to(slot_hidden.dtype)  # [R, S, K, H]
        scores = self(slot_hidden, candidate_embeds, lattice.logits, seen, corpus)  # [R, S - 1, K, K]
        if not self.scores_first_slot(config):
            return None, scores
        dtype = block_hidden.dtype
        first = self.first_slot_scores(
            block_hidden[:, 0], embedding(lattice.anchor_ids).to(dtype), block_hidden[:, 1],
            candidate_embeds[..., 0, :, :].to(dtype), lattice.logits[:, 0], first_seen, first_corpus,
        )
        return first, scores

    def add_corpus_input(self) -> None:
        """Give Delta the two corpus inputs of `CorpusBigrams.inputs`, with zero weights: a trained corrector scores
        exactly as before until trained."""
        if self.delta_corpus is None:
            ref = self.delta_out.weight
            self.delta_corpus = zero_linear(CorpusBigrams.NUM_INPUTS, self.delta_out.in_features, bias=False).to(ref)

    def widened(self, mlp_hidden: int) -> "DCOCOCorrector":
        """A copy whose Delta has `mlp_hidden` hidden units and scores every transition exactly as this one does.

        The old units are copied; the new ones get fresh input weights and a zero output weight, the same start as
        the zero-initialised output layer, so they change nothing until trained. Used to give a trained corrector
        more capacity without losing what it learned.
        """
        old_hidden = self.delta_out.in_features
        if mlp_hidden < old_hidden:
            raise ValueError(f"mlp_hidden={mlp_hidden} is below the current {old_hidden}: widening only adds units.")
        wide = DCOCOCorrector(
            self.pair_proj.in_features // 2, self.rank, mlp_hidden, self.delta_seen is not None,
            self.delta_corpus is not None,
        ).to(self.delta_out.weight)
        state = wide.state_dict()
        for name, tensor in self.state_dict().items():
            if name.startswith(("delta_pair", "delta_prev", "delta_next", "delta_logits", "delta_seen",
                                "delta_corpus")):
                state[name][:old_hidden] = tensor
            elif name == "delta_out.weight":  # [1, hidden]
                state[name].zero_()[:, :old_hidden] = tensor
            else:
                state[name].copy_(tensor)
        wide.load_state_dict(state)
        return wide

    def candidate_representations(self, candidate_embeds: torch.Tensor, slot_hidden: torch.Tensor) -> torch.Tensor:
        """z_i^k from candidate embeddings [B, S, K, H] and slot hiddens [B, S, H] -> [B, S, K, r]."""
        # Non-affine LN first: token embeddings and drafter hiddens differ in scale by orders of magnitude.
        cand = F.layer_norm(self.cand_proj(candidate_embeds), (self.rank,))  # [B, S, K, r]
        ctx = F.layer_norm(self.ctx_proj(slot_hidden), (self.rank,))  # [B, S, r]
        ctx = ctx.unsqueeze(2).expand_as(cand)  # [B, S, K, r]
        return self.fuse_norm(self.fuse_proj(torch.cat([cand, ctx], dim=-1)))

    def forward(
        self,
        slot_hidden: torch.Tensor,
        candidate_embeds: torch.Tensor,
        candidate_logits: torch.Tensor,
        seen: torch.Tensor | None = None,
        corpus: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Transition scores S_p(a, b) for every adjacent pair of drafted slots.

        Args:
            slot_hidden: [B, S, H] drafter hidden of each drafted slot (the input of the lm_head).
            candidate_embeds: [B, S, K, H] target embeddings of each slot's top-K candidates.
            candidate_logits: [B, S, K] drafter logits of those candidates.
            seen: [B, S - 1, K, K] m(a, b) of each transition (`ContextBigrams.seen`), with `context_bigrams` only.
            corpus: [B, S - 1, K, K, 2] corpus inputs of each transition (`CorpusBigrams.inputs`), with
                `corpus_bigrams` only.
        Returns:
            [B, S - 1, K, K] scores; entry [b, p, a, c] scores candidate c at slot p + 1 after candidate a at slot p.
        """
        logits = candidate_logits.to(slot_hidden.dtype)
        z = self.candidate_representations(candidate_embeds, slot_hidden)  # [B, S, K, r]
        pair = self.pair_proj(torch.cat([slot_hidden[:, :-1], slot_hidden[:, 1:]], dim=-1))  # [B, P, r]
        return self._transition_scores(pair, z[:, :-1], z[:, 1:], logits[:, :-1], logits[:, 1:], seen, corpus)

    def first_slot_scores(
        self,
        anchor_hidden: torch.Tensor,
        anchor_embeds: torch.Tensor,
        slot_hidden: torch.Tensor,
        candidate_embeds: torch.Tensor,
        candidate_logits: torch.Tensor,
        seen: torch.Tensor | None = None,
        corpus: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Anchor -> slot 1 transition scores S_0(anchor, b) (`correct_first_slot`), by the same Delta.

        Args:
            anchor_hidden: [B, H] drafter hidden at the anchor position (block position 0).
            anchor_embeds: [B, H] target embedding of the anchor token.
            slot_hidden: [B, H] drafter hidden of slot 1.
            candidate_embeds: [B, K, H] target embeddings of slot 1's candidates.
            candidate_logits: [B, K] their drafter logits.
            seen: [B, K] m(anchor, b) of each candidate, with `context_bigrams` only.
            corpus: [B, K, 2] corpus inputs of (anchor, b), with `corpus_bigrams` only.
        Returns:
            [B, K] scores of slot 1's candidates after the anchor.
        """
        logits = candidate_logits.to(slot_hidden.dtype)[:, None]  # [B, 1, K]
        z_anchor = self.candidate_representations(anchor_embeds[:, None, None], anchor_hidden[:, None])  # [B,1,1,r]
        z_first = self.candidate_representations(candidate_embeds[:, None], slot_hidden[:, None])  # [B, 1, K, r]
        pair = self.pair_proj(torch.cat([anchor_hidden, slot_hidden], dim=-1))[:, None]  # [B, 1, r]
        # The anchor is certain and has no drafter logit: its logit input is 0.
        seen = None if seen is None else seen[:, None, None]  # [B, 1, 1, K]
        corpus = None if corpus is None else corpus[:, None, None]  # [B, 1, 1, K, 2]
        scores = self._transition_scores(
            pair, z_anchor, z_first, torch.zeros_like(logits[..., :1]), logits, seen, corpus
        )
        return scores[:, 0, 0]  # [B, K]

    def _transition_scores(
        self,
        pair: torch.Tensor,
        z_prev: torch.Tensor,
        z_next: torch.Tensor,
        prev_logits: torch.Tensor,
        next_logits: torch.Tensor,
        seen: torch.Tensor | None,
        corpus: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """l_{p+1}(b) + Delta for pair states [B, P, r], predecessors [B, P, Ka, r] / [B, P, Ka], successors
        [B, P, Kb, r] / [B, P, Kb], m(a, b) [B, P, Ka, Kb] and corpus inputs [B, P, Ka, Kb, 2] (each or None)
        -> [B, P, Ka, Kb]."""
        if (seen is None) != (self.delta_seen is None):
            raise ValueError(
                "m(a, b) goes with the corrector's context_bigrams setting: pass seen=ContextBigrams(...).seen(...) "
                f"exactly when the config has context_bigrams=True (this corrector: {self.delta_seen is not None})."
            )
        if (corpus is None) != (self.delta_corpus is None):
            raise ValueError(
                "The corpus inputs go with the corrector's corpus_bigrams setting: "
                "pass corpus=CorpusBigrams.inputs(...) exactly when the config has corpus_bigrams set "
                f"(this corrector: {self.delta_corpus is not None})."
            )
        w = self.delta_logits.weight  # [hidden, 2]
        hidden = (
            self.delta_pair(pair)[:, :, None, None, :]  # [B, P, 1, 1, hidden]
            + (self.delta_prev(z_prev) + prev_logits[..., None] * w[:, 0])[:, :, :, None, :]  # [B, P, Ka, 1, hidden]
            + (self.delta_next(z_next) + next_logits[..., None] * w[:, 1])[:, :, None, :, :]  # [B, P, 1, Kb, hidden]
        )
        if seen is not None:
            hidden = hidden + seen.to(hidden.dtype)[..., None] * self.delta_seen.weight[:, 0]  # [B, P, Ka, Kb, hidden]
        if corpus is not None:
            hidden = hidden + self.delta_corpus(corpus.to(hidden.dtype))  # [B, P, Ka, Kb, hidden]
        delta = self.delta_out(F.gelu(hidden)).squeeze(-1)  # [B, P, Ka, Kb]
        return next_logits[:, :, None, :] + delta


class ContextBigrams:
    """The token pairs of each row's committed text, sorted once, to look up m(a, b) for any number of candidates.

    context_ids [B, L]; context_valid [B, L] marks the real tokens (False: padding, which forms no pair). Pairs are
    hashed to (row, a, b) and kept as sorted hashes, each with the position of its second token.
    """

    def __init__(
        self, context_ids: torch.LongTensor, vocab_size: int, context_valid: torch.BoolTensor | None = None
    ) -> None:
        # int64 throughout: (row, a, b) hashes pass 2^31 at vocabularies of 46K tokens (stored records are int32).
        context_ids = context_ids.long()
        batch, length = context_ids.shape
        self.vocab_size = vocab_size
        self.rows = torch.arange(batch, device=context_ids.device)  # [B]
        pair = self._hash(self.rows[:, None], context_ids[:, :-1], context_ids[:, 1:])  # [B, L - 1]
        if context_valid is not None:
            pair = pair.masked_fill(~(context_valid[:, :-1] & context_valid[:, 1:]), -1)  # no query hashes to -1
        end = torch.arange(1, length, device=context_ids.device).expand_as(pair)  # [B, L - 1] position of the second
        # Sorted with repeats rather than made unique: `torch.unique` learns its size on the host, a sync per draft on
        # a GPU. The stable sort keeps a repeated pair's positions ascending, so the first of its run, the one a
        # lookup finds, holds the earliest.
        self.keys, order = pair.flatten().sort(stable=True)  # [B * (L - 1)]
        self.ends = end.flatten()[order]  # [B * (L - 1)]

    def _hash(self, row: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return (row * self.vocab_size + first.long()) * self.vocab_size + second.long()

    def seen(
        self, first: torch.LongTensor, second: torch.LongTensor, ends: torch.LongTensor | None = None
    ) -> torch.BoolTensor:
        """m(a, b) for token ids first / second [B, ...] (broadcast together): whether `first` is directly followed by
        `second` in the row's context. ends [B, ...] (broadcast with first), when given, counts only pairs whose
        second token sits at a position <= end (training: the text up to each block's anchor). -> [B, ...]."""
        query = self._hash(self.rows.view(-1, *([1] * (first.dim() - 1))), first, second)  # [B, ...]
        index, found = _find_sorted(self.keys, query)
        return found if ends is None else found & (self.ends[index] <= ends)


def _find_sorted(keys: torch.Tensor, query: torch.Tensor) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Where each query would sit in ascending keys [N] (clamped to a valid index; the first of repeated keys) and
    whether it is there, both [query's shape]; with no keys at all (e.g. a context of one token), nothing is found."""
    if keys.numel() == 0:
        return torch.zeros_like(query), torch.zeros(query.shape, dtype=torch.bool, device=query.device)
    index = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)
    return index, keys[index] == query


class CorpusBigrams(nn.Module):
    """How often each token pair (a, b) was written in the target's own training answers, stored with the weights.

    Buffers (saved in model.safetensors): `pair_keys` [N] the pairs' hashes a * V + b, ascending; `pair_counts` [N]
    c(a, b); `first_counts` [V] n(a), the pairs starting with a. Count them with `CorpusBigrams.count`.
    """

    NUM_INPUTS = 2  # log(1 + c) and log(1 + c) - log(1 + n)

    def __init__(self, vocab_size: int, num_pairs: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("pair_keys", torch.zeros(num_pairs, dtype=torch.long))
        self.register_buffer("pair_counts", torch.zeros(num_pairs, dtype=torch.int32))
        self.register_buffer("first_counts", torch.zeros(vocab_size, dtype=torch.int32))

    @property
    def num_pairs(self) -> int:
        return self.pair_keys.numel()

    @classmethod
    def count(
        cls, texts: Iterable[tuple[torch.LongTensor, torch.BoolTensor]], vocab_size: int
    ) -> "CorpusBigrams":
        """Count the pairs (t - 1, t) over the learned tokens t of each text: (input_ids [T], learned [T]) pairs, as
        in training records (`loss_mask`); texts of one token, or with no learned token, add nothing."""
        keys = [cls._keys(ids[None].long(), learned[None].bool(), vocab_size)[1] for ids, learned in texts]
        if not keys or sum(k.numel() for k in keys) == 0:
            raise ValueError("No token pair to count: pass texts with learned tokens after their first position.")
        unique, counts = torch.unique(torch.cat(keys), return_counts=True)
        table = cls(vocab_size, unique.numel())
        table.pair_keys.copy_(unique)
        table.pair_counts.copy_(counts)
        table.first_counts.copy_(torch.bincount(unique // vocab_size, weights=counts.double(), minlength=vocab_size))
        return table

    @staticmethod
    def _keys(ids: torch.LongTensor, learned: torch.BoolTensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, a * V + b) of every pair of ids [B, T] whose second token is learned [B, T] -> ([n], [n])."""
        row, end = learned[:, 1:].nonzero(as_tuple=True)
        return row, ids[row, end] * vocab_size + ids[row, end + 1]

    def own_counts(self, input_ids: torch.LongTensor, learned: torch.BoolTensor) -> tuple[torch.Tensor, ...]:
        """Each row's own pair and predecessor counts, counted as `count` does, for `inputs(..., exclude=)`: rows of
        input_ids / learned [B, T] are training records the table counted (leave-one-out)."""
        row, key = self._keys(input_ids.long(), learned.bool(), self.vocab_size)
        own_pairs = torch.unique(row * self.vocab_size**2 + key, return_counts=True)  # (row, a, b) hashes, counts
        own_first = torch.unique(row * self.vocab_size + key // self.vocab_size, return_counts=True)  # (row, a)
        return (*own_pairs, *own_first)

    def inputs(
        self, first: torch.LongTensor, second: torch.LongTensor, exclude: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        """Delta's corpus inputs for token ids first / second [B, ...] (broadcast together) -> [B, ..., 2] float.

        exclude (`own_counts` of the rows' records), in training: take each row's own pairs out of the counts (the
        row's record was counted), so that seen pairs are as rare as in a new prompt's answer.
        """
        first, second = torch.broadcast_tensors(first.long(), second.long())
        pair = first * self.vocab_size + second
        if exclude is None and self.num_pairs:  # drafting: the counts' logs, taken once per table (half the ops)
            log_pairs, log_first = self._log_counts()  # [N], [V]
            index, found = _find_sorted(self.pair_keys, pair)
            log_after = torch.where(found, log_pairs[index], 0.0)
            return torch.stack([log_after, log_after - log_first[first]], dim=-1)
        after = self._lookup(self.pair_keys, self.pair_counts, pair)  # c(a, b)
        following = self.first_counts[first].double()  # n(a)
        if exclude is not None:
            own_keys, own_counts, own_first, own_first_counts = exclude
            rows = torch.arange(first.shape[0], device=first.device).view(-1, *([1] * (first.dim() - 1)))
            after = after - self._lookup(own_keys, own_counts, rows * self.vocab_size**2 + pair)
            following = following - self._lookup(own_first, own_first_counts, rows * self.vocab_size + first)
        log_after = torch.log1p(after.clamp(min=0))
        return torch.stack([log_after, log_after - torch.log1p(following.clamp(min=0))], dim=-1).float()

    def _log_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log(1 + c) [N], log(1 + n) [V]) as float32, recomputed only when the buffers change (`count`, loading);
        inside a compiled graph every time (a few elementwise ops there: a graph cannot trace the cache's key)."""
        if torch.compiler.is_compiling():
            return self._logs()
        key = tuple((b._version, b.data_ptr(), b.device) for b in (self.pair_counts, self.first_counts))
        cached = getattr(self, "_log_cache", None)
        if cached is None or cached[0] != key:
            cached = self._log_cache = (key, self._logs())
        return cached[1]

    def _logs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.log1p(self.pair_counts.double()).float(), torch.log1p(self.first_counts.double()).float()

    @staticmethod
    def _lookup(keys: torch.Tensor, counts: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The count of each query hash in the sorted keys, 0 where absent, as float64 [query's shape]."""
        if keys.numel() == 0:  # e.g. a training row with no pair of its own
            return torch.zeros(query.shape, dtype=torch.float64, device=query.device)
        index, found = _find_sorted(keys, query)
        return torch.where(found, counts[index].double(), 0.0)


def prefix_first_walk(transition_scores: torch.Tensor, first_slot_scores: torch.Tensor | None = None) -> torch.Tensor:
    """The paper's walk: slot 1 takes the drafter argmax (candidate 0), then the best successor of the chosen one.

    transition_scores: [B, P, K, K] -> chosen candidate index per slot [B, P + 1]. first_slot_scores [B, K], when
    given, picks slot 1 instead (the anchor -> slot 1 scores of `correct_first_slot`; the drafter's own sorted
    logits pick candidate 0, as without them).
    """
    batch, pairs, _, _ = transition_scores.shape
    # Every candidate's best successor at once (the first of equal maxima, as argmax picks); the walk then only
    # follows pointers, one gather per slot, so a draft pays a few small ops for it rather than a few per candidate.
    best_successor = transition_scores.argmax(-1)  # [B, P, K]
    if first_slot_scores is None:
        current = best_successor.new_zeros(batch, 1)  # [B, 1]
    else:
        current = first_slot_scores.argmax(-1, keepdim=True)
    chosen = [current]
    for p in range(pairs):
        current = best_successor[:, p].gather(1, current)  # [B, 1]
        chosen.append(current)
    return torch.cat(chosen, dim=1)  # [B, P + 1]


def viterbi_walk(
    transition_scores: torch.Tensor, first_slot_scores: torch.Tensor, decay: float = 1.0
) -> torch.Tensor:
    """Best global path: argmax over paths of s_1(k_1) + sum_p decay**p * S_p(k_p, k_{p+1}).

    decay = 1 is the paper's "global-sum" control; decay < 1 its "geometric" control. first_slot_scores [B, K]:
    the drafter's slot-1 logits l_1, or the anchor -> slot 1 scores with `correct_first_slot`.
    """
    batch, pairs, k, _ = transition_scores.shape
    best = first_slot_scores.to(transition_scores.dtype)  # [B, K] best path score ending at each candidate
    backptr = []
    for p in range(pairs):
        total = best[:, :, None] + (decay**p) * transition_scores[:, p]  # [B, K(prev), K(next)]
        best, arg = total.max(dim=1)
        backptr.append(arg)
    chosen = transition_scores.new_zeros((batch, pairs + 1), dtype=torch.long)
    chosen[:, -1] = best.argmax(-1)
    for p in range(pairs - 1, -1, -1):
        chosen[:, p] = backptr[p].gather(1, chosen[:, p + 1, None]).squeeze(1)
    return chosen


WALKS = ("prefix_first", "viterbi", "geometric")
# Checkpoints before 0.2 named the prefix-first walk "greedy", which also names greedy decoding; they still load.
_LEGACY_WALKS = {"greedy": "prefix_first"}


def walk_name(selection: str) -> str:
    """The walk `selection` names ("prefix_first", "viterbi", "geometric"; the legacy "greedy" is "prefix_first")."""
    name = _LEGACY_WALKS.get(selection, selection)
    if name not in WALKS:
        raise ValueError(f"selection={selection!r} is unknown; choose one of {WALKS}.")
    return name


def select_candidates(
    selection: str, transition_scores: torch.Tensor, first_slot_scores: torch.Tensor, geometric_lambda: float
) -> torch.Tensor:
    """Dispatch to the configured walk; returns the chosen candidate index per slot [B, P + 1].

    first_slot_scores [B, K]: slot 1's drafter logits (the paper) or its anchor -> slot 1 scores.
    """
    selection = walk_name(selection)
    if selection == "prefix_first":
        return prefix_first_walk(transition_scores, first_slot_scores)
    if selection == "viterbi":
        return viterbi_walk(transition_scores, first_slot_scores)
    if selection == "geometric":
        return viterbi_walk(transition_scores, first_slot_scores, decay=geometric_lambda)
    raise AssertionError(selection)  # walk_name admits only the walks above
