"""The LiLiCorr corrector: one bidirectional pass over a block's candidate lattice, cosine transition scores.

Paper: "LiLiCorr: Lightweight Likelihood Correlation of Parallel Drafts for Speculative Decoding" (Rusanovsky et al.,
NVIDIA, arXiv:2608.20530). Like DCOCO it keeps each drafted slot's top-K candidates and re-selects among them, but
instead of an MLP per transition it runs one small transformer over all S x K candidates of the block at once and
gives each candidate an "out" vector (how it continues) and an "in" vector (what it follows):

1. candidate input: token_proj(E[c]) + pass_hidden_proj(h_slot) + feature_mlp([log p, p, log p - max log p,
   rank / (K - 1), is_top1]) + slot_embedding[slot] + rank_embedding[rank], where log p is the drafter's log-prob;
2. `num_layers` pre-norm transformer layers over the flattened S*K lattice, bidirectional, with a learned per-head
   bias by relative slot distance plus one for "same slot";
3. each candidate's state is joined with the anchor, the drafter's fused target context of the position just before
   the block (`hidden_norm(fc(target states))`), as [x; a; x * a] -> factor_input_proj -> SiLU, and read by two
   heads into unit vectors out(c) and in(c); the anchor gets its own unit vector anchor_out;
4. score(a -> b) = logit_scale * cos(out(a), in(b)) for every adjacent slot pair, all of them as one batched matmul,
   [B, S - 1, K, K] exactly like DCOCO's transition scores, and start(b) = logit_scale * cos(anchor_out, in(b)) for
   slot 1, [B, K]. The same walks (`corrector.select_candidates`) read them; with the default greedy walk slot 1 is
   the best start and every next slot the best successor of the one chosen.

Drafting computes that function with three shortcuts, the same numbers up to float rounding (tests check them against
the formula): token_proj(E[c]) is a row of a table over the vocabulary (`candidate_tokens`); the anchor's part of
factor_input_proj becomes a per-block weight (`vectors`); and the anchor is a slot 0 of K equal candidates, so start
and pair scores are one product (`forward`).

Architecture, parameter names and config keys follow the public implementations (NVIDIA Model-Optimizer's training
plugin, the SGLang and vLLM serving heads), so checkpoints move both ways (`to_public_format`,
`public_state_dict`); the weights live under `corrector.` here and `lilicorr.` there.

Our one addition is a gate, a zero-initialised scalar (`score_gate`, times GATE_RATE) that multiplies every score: an
untrained head scores every candidate 0, so the walk returns the drafter's own argmax (the first of equal maxima, which
is candidate 0, the drafter's top-1), exactly as DCOCO's zero-initialised output layer does. The public head has no such
gate and no additive log-prob prior (the log-probs only enter as features), and its freshly initialised factor heads
give random scores; the gate keeps the public scoring function intact, since logit_scale * gate is just that function's
`logit_scale`: exporting folds it in, and loading a public checkpoint sets the gate to 1.

Our extension, off unless the config turns on `context_bigrams` or `corpus_bigrams` (the DCOCO corrector's two
pair inputs, `corrector.py`): `PairEvidence`, a small MLP added to every start and transition score, reads what the
text says about the pair, m(a, b) (b already followed a in the committed text) and the pair's counts in the target's
training answers, next to the head's own score and the successor's log-prob gap. The cosine of two vectors computed
before the pair is known cannot read a pair fact, so it is added after; it is the only new information a block's
first slot can get (the lattice holds no more than the drafter knew). Its output layer starts at zero, so it changes
nothing until trained, and training it alone (`train_drafter.py --evidence-only`) leaves the public head as it was:
the public format has no place for it, and exporting drops it (with a warning), giving back exactly that head.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .corrector import BlockLattice, Corrector, CorpusBigrams, zero_linear

PUBLIC_ARCHITECTURE = "LiLiCorrDraftModel"
PUBLIC_PREFIX = "lilicorr."
# dflash_config keys of the public format -> our DCOCOConfig fields (candidate_topk is our `top_k`).
PUBLIC_FIELDS = {
    "lilicorr_hidden_size": "lilicorr_hidden_size",
    "lilicorr_num_layers": "lilicorr_num_layers",
    "lilicorr_num_heads": "lilicorr_num_heads",
    "lilicorr_mlp_ratio": "lilicorr_mlp_ratio",
    "lilicorr_factor_dim": "lilicorr_factor_dim",
    "lilicorr_vector_eps": "lilicorr_vector_eps",
    "lilicorr_logit_scale": "lilicorr_logit_scale",
    "lilicorr_candidate_topk": "top_k",
}
NUM_CANDIDATE_FEATURES = 5  # [log p, p, log p - max log p, rank fraction, is top-1], in the public order
# The score gate is GATE_RATE * score_gate: Adam moves a parameter by about lr per step whatever its scale, so a gate
# stored as is would need ~1/lr steps to open, and the softmax over the scores would stay flat (temperature
# ~1/(lr * steps)) for most of a short training run; stored this way it opens in tens of steps.
GATE_RATE = 100.0

logger = logging.getLogger("dcoco_hf")


class LiLiCorrAttention(nn.Module):
    """Bidirectional multi-head self-attention over the lattice with an additive bias.

    Parameters carry `nn.MultiheadAttention`'s names (`in_proj_weight`, `in_proj_bias`, `out_proj`), the layout the
    public checkpoints were trained and exported with; the forward is the same math (scale 1/sqrt(d)), written out.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"lilicorr_hidden_size={hidden_size} is not divisible by lilicorr_num_heads={num_heads}; pick a head "
                "count that divides the head width."
            )
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden_size))
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        nn.init.xavier_uniform_(self.in_proj_weight)  # nn.MultiheadAttention's own start

    def forward(self, hidden_states: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """hidden_states [R, L, h], bias [heads, L, L] (broadcast over R) -> [R, L, h]."""
        rows, length, width = hidden_states.shape
        q, k, v = F.linear(hidden_states, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(rows, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # [R, heads, L, d]
        # Written out rather than SDPA: a lattice of S*K <= a few hundred candidates is too small for a fused
        # kernel to pay, and SDPA's checks and math fallback with a float mask cost more than the product itself.
        weights = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)) + bias.to(q.dtype)  # [R, heads, L, L]
        out = torch.matmul(weights.softmax(-1), v)  # [R, heads, L, d]
        return self.out_proj(out.transpose(1, 2).reshape(rows, length, width))


class LiLiCorrLayer(nn.Module):
    """Pre-norm lattice attention, then a SiLU MLP (public names: attn_norm, attn, mlp_norm, mlp.0, mlp.2)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        width = int(hidden_size * mlp_ratio)
        self.attn_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.attn = LiLiCorrAttention(hidden_size, num_heads)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, width), nn.SiLU(), nn.Linear(width, hidden_size))

    def forward(self, hidden_states: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), bias)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class PairEvidence(nn.Module):
    """An additive score for each candidate pair (a, b) from pair facts the lattice cannot see (module docstring).

    Inputs per pair, in this order: [head score / logit_scale, log p(b) - max log p], then m(a, b) with `seen`, then
    the two `CorpusBigrams.inputs` with `corpus`; one linear map over all of them (a draft's head cost is mostly its
    count of small ops, so one matmul rather than one per group), SiLU over `hidden` units, a zero-initialised
    output. The corpus group can be added to trained evidence (`add_corpus_input`): its columns start at zero.
    """

    def __init__(self, seen: bool, corpus: bool, hidden: int = 32) -> None:
        super().__init__()
        self.reads_seen, self.reads_corpus = seen, False
        self.inputs = nn.Linear(2 + int(seen), hidden)
        self.out = zero_linear(hidden, 1, bias=True)
        if corpus:
            self.add_corpus_input()

    def add_corpus_input(self) -> None:
        if self.reads_corpus:
            return
        old = self.inputs
        self.inputs = nn.Linear(old.in_features + CorpusBigrams.NUM_INPUTS, old.out_features).to(old.weight)
        with torch.no_grad():
            self.inputs.weight.zero_()[:, :old.in_features] = old.weight
            self.inputs.bias.copy_(old.bias)
        self.reads_corpus = True

    def forward(
        self, scores: torch.Tensor, gap: torch.Tensor, seen: torch.Tensor | None, corpus: torch.Tensor | None
    ) -> torch.Tensor:
        """scores [...] the head's scores (divided by logit_scale), gap [...] broadcastable to them, seen [...] and
        corpus [..., 2] of the same pairs (None: not read) -> the evidence score [...]."""
        if (self.reads_seen and seen is None) or (self.reads_corpus and corpus is None):
            raise ValueError(
                "this LiLiCorr head reads pair evidence (config context_bigrams / corpus_bigrams) that was not "
                "given: pass context_ids to propose(), or load a corpus table with set_corpus_bigrams."
            )
        dtype = self.inputs.weight.dtype
        facts = torch.stack(torch.broadcast_tensors(scores, gap, *([seen] if self.reads_seen else [])), dim=-1)
        if self.reads_corpus:
            facts = torch.cat([facts, corpus.to(facts.dtype)], dim=-1)  # [..., inputs]
        return self.out(F.silu(self.inputs(facts.to(dtype)))).squeeze(-1).float()


class LiLiCorrCorrector(Corrector):
    """Start and transition scores of a block's candidate lattice (module docstring).

    Args:
        model_hidden_size: width H of the drafter (slot hiddens, target embeddings, fused context).
        block_size: the largest block the head serves (anchor + slots); sizes its slot embedding and slot bias.
        top_k: the largest candidate count K; sizes its rank embedding.
        hidden_size: the head's own width h (0: as wide as the drafter, then `token_proj` is the identity).
        num_layers, num_heads, mlp_ratio: the lattice transformer.
        factor_dim: width of the in / out vectors.
        vector_eps: floor of the norm when the vectors are normalised.
        logit_scale: the fixed multiplier of the cosines (times `score_gate`, see the module docstring).
        rms_norm_eps: epsilon of the head's RMSNorms.
        context_bigrams, corpus_bigrams: add `PairEvidence` reading these pair facts (ours; module docstring).
    """

    def __init__(
        self,
        model_hidden_size: int,
        block_size: int,
        top_k: int,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        factor_dim: int = 64,
        vector_eps: float = 1e-4,
        logit_scale: float = 10.0,
        rms_norm_eps: float = 1e-6,
        context_bigrams: bool = False,
        corpus_bigrams: bool = False,
    ) -> None:
        super().__init__()
        width = hidden_size or model_hidden_size
        self.block_size, self.top_k, self.vector_eps, self.logit_scale = block_size, top_k, vector_eps, logit_scale
        self.token_proj = nn.Identity() if width == model_hidden_size else nn.Linear(model_hidden_size, width)
        self.pass_hidden_proj = nn.Linear(model_hidden_size, width)
        self.feature_mlp = nn.Sequential(
            nn.LayerNorm(NUM_CANDIDATE_FEATURES), nn.Linear(NUM_CANDIDATE_FEATURES, width), nn.SiLU(),
            nn.Linear(width, width),
        )
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, block_size - 1, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, top_k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(num_heads))
        self.context_proj = nn.Linear(model_hidden_size, width)
        self.layers = nn.ModuleList(LiLiCorrLayer(width, num_heads, mlp_ratio, rms_norm_eps) for _ in range(num_layers))
        self.output_norm = nn.RMSNorm(width, eps=rms_norm_eps)
        self.anchor_norm = nn.RMSNorm(width, eps=rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, factor_dim)
        self.in_head = nn.Linear(width, factor_dim)
        self.anchor_out_head = nn.Linear(width, factor_dim)
        # Ours, zero at start: every score 0, so the walk returns the drafter argmax (module docstring).
        self.score_gate = nn.Parameter(torch.zeros(()))
        self.evidence = PairEvidence(context_bigrams, corpus_bigrams) if context_bigrams or corpus_bigrams else None

    def add_corpus_input(self) -> None:
        """Read the corpus pair counts too (`DCOCODrafter.set_corpus_bigrams`); zero weights, so nothing changes
        until trained."""
        if self.evidence is None:
            self.evidence = PairEvidence(False, True).to(self.score_gate)
        self.evidence.add_corpus_input()

    @property
    def gate(self) -> torch.Tensor:
        """The factor every score is multiplied by, on top of logit_scale (0 for a fresh head, 1 for a public one)."""
        return GATE_RATE * self.score_gate

    def set_gate(self, value: float) -> None:
        with torch.no_grad():
            self.score_gate.fill_(value / GATE_RATE)

    reads_log_probs = True
    reads_anchor_state = True
    sized_by_block = True
    chain_loss = True

    @classmethod
    def scores_first_slot(cls, config: Any) -> bool:
        return True  # its start scores are the anchor -> slot 1 transitions

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.lilicorr_hidden_size % config.lilicorr_num_heads:
            raise ValueError(
                f"lilicorr_hidden_size={config.lilicorr_hidden_size} is not divisible by lilicorr_num_heads="
                f"{config.lilicorr_num_heads}; pick a head count that divides the head width."
            )
        bad = {name: getattr(config, name) for name in (
            "lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
            "lilicorr_vector_eps", "lilicorr_logit_scale") if not getattr(config, name) > 0}
        if bad:
            raise ValueError(f"LiLiCorr fields {bad} must be positive.")

    def score(
        self,
        config: Any,
        lattice: BlockLattice,
        embedding: nn.Module | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # It reads the pair lattice whole, anchor pairs first.
        tokens = self.candidate_tokens(lattice.candidates, embedding)  # [R, S, K, h]
        anchor_rows, anchor_valid = lattice.anchor
        return self(lattice.block_hidden[..., 1:, :], tokens, lattice.log_probs, anchor_rows, anchor_valid,
                    lattice.seen, lattice.corpus)

    @classmethod
    def from_config(cls, config: Any) -> LiLiCorrCorrector:
        """The head a `DCOCOConfig` for this corrector describes."""
        return cls(
            config.hidden_size, config.block_size, config.top_k, config.lilicorr_hidden_size,
            config.lilicorr_num_layers, config.lilicorr_num_heads, config.lilicorr_mlp_ratio,
            config.lilicorr_factor_dim, config.lilicorr_vector_eps, config.lilicorr_logit_scale, config.rms_norm_eps,
            config.context_bigrams, bool(config.corpus_bigrams),
        )

    def init_weights(self) -> None:
        """The start of a fresh head, through transformers' `init` helpers so loaded tensors are left alone
        (called by `DCOCOPreTrainedModel._init_weights`; the Linear layers get transformers' own init)."""
        for param in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias,
                      self.score_gate):
            init.zeros_(param)
        for layer in self.layers:
            init.xavier_uniform_(layer.attn.in_proj_weight)
            init.zeros_(layer.attn.in_proj_bias)

    def forward(
        self,
        slot_hidden: torch.Tensor,
        candidate_tokens: torch.Tensor,
        candidate_log_probs: torch.Tensor,
        anchor_hidden: torch.Tensor,
        anchor_valid: torch.Tensor,
        seen: torch.Tensor | None = None,
        corpus: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score the lattice of R blocks.

        Args:
            slot_hidden: [R, S, H] drafter hidden of each drafted slot.
            candidate_tokens: [R, S, K, h] token_proj(E[c]) of each slot's top-K candidates c, best first
                (`candidate_tokens`).
            candidate_log_probs: [R, S, K] their drafter log-probs (log-softmax over the proposal vocabulary).
            anchor_hidden: [R, H] fused target context of the position before the block (`hidden_norm(fc(.))`).
            anchor_valid: [R] False where that position does not exist (the anchor row is then zero).
            seen: with `context_bigrams`, m(a, b) over the pair lattice [R, S, K, K]: the anchor -> slot 1 pairs
                (K equal rows), then the slot pairs (`DCOCODrafter.candidate_bigrams`).
            corpus: with `corpus_bigrams`, their corpus inputs [R, S, K, K, 2].
        Returns:
            start [R, K] (anchor -> slot 1) and pair scores [R, S - 1, K, K]; entry [r, p, a, b] scores candidate b
            at slot p + 1 after candidate a at slot p.
        """
        anchor_out, out_vec, in_vec = self.vectors(
            slot_hidden, candidate_tokens, candidate_log_probs, anchor_hidden, anchor_valid
        )
        rows, _, k, _ = out_vec.shape
        # The anchor as a slot 0 of K equal candidates (the pair lookups' lattice): the start scores and the slot
        # pairs are then one product and one evidence pass, [R, S, K, K] with the start in row 0 of pair 0.
        before = torch.cat([anchor_out[:, None, None].expand(rows, 1, k, -1), out_vec[:, :-1]], dim=1)  # [R, S, K, f]
        scores = self.gate * torch.matmul(before, in_vec.transpose(-1, -2)).float()  # [R, S, K, K]
        if self.evidence is None:
            scores = self.logit_scale * scores
        else:
            gap = candidate_log_probs.float() - candidate_log_probs[..., :1].float()  # [R, S, K]
            evidence = self.evidence(scores, gap[:, :, None, :], seen, corpus)  # [R, S, K, K]
            scores = torch.add(evidence, scores, alpha=self.logit_scale)  # the evidence is trained on this sum
        return scores[:, 0, 0], scores[:, 1:]

    def candidate_tokens(self, candidates: torch.LongTensor, embedding: nn.Module) -> torch.Tensor:
        """token_proj(E[c]) of candidate ids [..., K] -> [..., K, h]; `embedding` is the target's input embedding.

        Drafting gathers rows of one table token_proj(E) over the whole vocabulary (`_token_table`): the projection
        of every candidate, the head's widest product, becomes a gather. With autograd on (training) it is computed
        as written, so gradients reach token_proj; both give the same numbers up to float rounding.
        """
        if torch.is_grad_enabled() or isinstance(self.token_proj, nn.Identity):
            return self.token_proj(embedding(candidates).to(self.pass_hidden_proj.weight.dtype))
        return F.embedding(candidates, self._token_table(embedding))

    def prepare_capture(self, embedding: nn.Module) -> None:
        """The token table (`_token_table`), built for the graph to read."""
        if not isinstance(self.token_proj, nn.Identity):  # without a projection there is no table to read
            with torch.no_grad():
                # A fixed address: CUDA graphs read it in place instead of copying it in at every replay.
                torch._dynamo.mark_static_address(self._token_table(embedding))

    def _token_table(self, embedding: nn.Module) -> torch.Tensor:
        """token_proj(E) [V, h], rebuilt only when the embedding or token_proj changes (training, loading, `.to`).

        Built through the embedding module itself (some scale their rows in forward), a chunk of ids at a time so a
        large vocabulary never holds its [V, H] copy at once; it costs V x h numbers (25 MB for SmolLM2 in fp32)."""
        cached = getattr(self, "_token_cache", None)
        if torch.compiler.is_compiling() and cached is not None:
            return cached[1]  # a compiled graph cannot trace the key: it reads the table `prepare_capture` built
        params = (*embedding.parameters(), *self.token_proj.parameters())
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if cached is None or cached[0] != key:
            weight, rows = self.pass_hidden_proj.weight, embedding.weight
            ids = torch.arange(rows.shape[0], device=rows.device)
            table = torch.cat([self.token_proj(embedding(chunk).to(weight)) for chunk in ids.split(8192)])
            cached = self._token_cache = (key, table)
        return cached[1]

    def vectors(
        self,
        slot_hidden: torch.Tensor,
        candidate_tokens: torch.Tensor,
        candidate_log_probs: torch.Tensor,
        anchor_hidden: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unit vectors (anchor_out [R, f], out [R, S, K, f], in [R, S, K, f]) of `forward`'s inputs."""
        rows, slots, k, width = candidate_tokens.shape
        if slots > self.block_size - 1 or k > self.top_k:
            raise ValueError(
                f"This LiLiCorr head serves blocks of up to {self.block_size} with up to {self.top_k} candidates, "
                f"not {slots + 1} with {k}: draft a smaller block (set_block_size) or train a head for this size."
            )
        dtype = self.pass_hidden_proj.weight.dtype
        x = candidate_tokens.to(dtype) + self.pass_hidden_proj(slot_hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self._features(candidate_log_probs).to(dtype))  # [R, S, K, h]
        x = x + self.slot_embedding[0, :, :slots] + self.rank_embedding[0, :, :, :k]
        x = x.reshape(rows, slots * k, width)  # [R, S*K, h] the lattice, slot-major
        bias = self._attention_bias(slots, k)  # [heads, S*K, S*K]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x)  # [R, S*K, h]
        anchor = self.context_proj(anchor_hidden.to(dtype)) * anchor_valid.to(dtype)[:, None]  # [R, h]
        anchor = self.anchor_norm(anchor)
        # factor_input_proj([x; a; x * a]) = x (W_x + W_xa diag(a))^T + (a W_a^T + b): the anchor is one per row, so
        # its two thirds fold into a per-row weight and shift, and the candidates take one [S*K, h] x [h, h] product
        # instead of [S*K, 3h] x [3h, h] on a concatenated copy.
        w_x, w_a, w_xa = self.factor_input_proj.weight.split(width, dim=1)  # [h, h] each
        weight = torch.addcmul(w_x, w_xa, anchor[:, None, :]).transpose(1, 2)  # [R, h_in, h_out]
        shift = F.linear(anchor, w_a, self.factor_input_proj.bias)  # [R, h]
        factor = F.silu(torch.baddbmm(shift[:, None], x, weight)).view(rows, slots, k, width)  # [R, S, K, h]
        out_vec = F.normalize(self.out_head(factor), dim=-1, eps=self.vector_eps)  # [R, S, K, f]
        in_vec = F.normalize(self.in_head(factor), dim=-1, eps=self.vector_eps)  # [R, S, K, f]
        anchor_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.vector_eps)  # [R, f]
        return anchor_out, out_vec, in_vec

    def _features(self, log_probs: torch.Tensor) -> torch.Tensor:
        """The five per-candidate features of the public head from log-probs [R, S, K] -> [R, S, K, 5]."""
        log_probs = log_probs.float()
        k = log_probs.shape[-1]
        key = (k, log_probs.device)
        # A compiled graph builds the ranks in the graph: caching them there would change the module it guards on.
        cached = None if torch.compiler.is_compiling() else getattr(self, "_rank_cache", None)
        if cached is None or cached[0] != key:  # [rank / (K - 1), is top-1] per candidate: top-1 (0, 1), last (1, 0)
            rank = torch.arange(k, device=log_probs.device, dtype=torch.float32) / max(k - 1, 1)
            cached = (key, torch.stack([rank, (rank == 0).float()], dim=-1))  # [K, 2]
            if not torch.compiler.is_compiling():
                self._rank_cache = cached
        gap = log_probs - log_probs[..., :1]  # candidates come best first: the slot's max is candidate 0
        ranks = cached[1].expand(*log_probs.shape, 2)  # [R, S, K, 2]
        return torch.cat([torch.stack([log_probs, log_probs.exp(), gap], dim=-1), ranks], dim=-1)

    def _attention_bias(self, slots: int, k: int) -> torch.Tensor:
        """Per-head bias by relative slot distance plus a same-slot term -> [heads, S*K, S*K].

        Drafting builds it once per lattice shape (a handful of small ops per cycle otherwise); training, or any
        change of the two bias parameters, builds it afresh."""
        params = (self.relative_slot_bias, self.same_slot_bias)
        # A compiled graph cannot trace the key's data pointers; it builds the bias in the graph (the same ops).
        fresh = torch.is_grad_enabled() or torch.compiler.is_compiling()
        key = None if fresh else (slots, k, *(p._version for p in params), *(p.data_ptr() for p in params),
                                  self.same_slot_bias.dtype)
        cached = getattr(self, "_bias_cache", None)
        if fresh or cached is None or cached[0] != key:
            slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(k)  # [S*K]
            relative = slot[:, None] - slot[None, :] + self.block_size - 1  # centred on the trained table
            same = (slot[:, None] == slot[None, :]).to(self.same_slot_bias.dtype)
            bias = self.relative_slot_bias[:, relative] + same * self.same_slot_bias[:, None, None]
            if fresh:
                return bias
            cached = self._bias_cache = (key, bias)
        return cached[1]


# ----------------------------------------------------------------------------------------------- the public format


def config_from_public(dflash_config: dict[str, Any]) -> dict[str, Any] | None:
    """Our config fields from a public `dflash_config` ({} fields -> None: a plain DFlash drafter).

    Every geometry key is required, as the public loaders require it: `logit_scale` and `vector_eps` change the scores
    without changing a tensor shape, so a guessed default would load cleanly and score another function.
    """
    if not any(key.startswith("lilicorr_") for key in dflash_config) or not dflash_config.get("lilicorr_enabled", True):
        return None
    missing = sorted(key for key in PUBLIC_FIELDS if key not in dflash_config)
    if missing:
        raise ValueError(
            f"dflash_config lacks {missing}: a LiLiCorr checkpoint must record its whole head geometry. Add the keys "
            "the checkpoint was trained with (they are in the training recipe) to config.json."
        )
    fields = {ours: dflash_config[key] for key, ours in PUBLIC_FIELDS.items()}
    fields["corrector_type"] = "lilicorr"  # the head is sized for dflash_config's block_size, read as ours
    return fields


def public_config(config: Any, gate: float) -> dict[str, Any]:
    """config.json of the public format for a drafter `config` whose head has score gate `gate`."""
    if gate <= 0:
        raise ValueError(
            f"The LiLiCorr head's score gate is {gate}: an untrained head (it scores every candidate equally) has no "
            "public form, whose logit_scale must be positive. Train it first (scripts/train_drafter.py --corrector "
            "lilicorr)."
        )
    if config.top_k > 16 or config.top_k & (config.top_k - 1):
        raise ValueError(
            f"top_k={config.top_k}: the public LiLiCorr servers take a power of two <= 16 candidates per slot; train a "
            "head with such a top_k to export it."
        )
    rope = dict(config.rope_parameters)
    dflash = {
        "block_size": config.block_size, "mask_token_id": config.mask_token_id,
        "target_layer_ids": config.target_layer_ids,
        "projector_type": "lilicorr", "lilicorr_enabled": True, "lilicorr_candidate_topk": config.top_k,
        "lilicorr_hidden_size": 0 if config.lilicorr_hidden_size == config.hidden_size else config.lilicorr_hidden_size,
        "lilicorr_num_layers": config.lilicorr_num_layers, "lilicorr_num_heads": config.lilicorr_num_heads,
        "lilicorr_mlp_ratio": config.lilicorr_mlp_ratio, "lilicorr_factor_dim": config.lilicorr_factor_dim,
        "lilicorr_vector_eps": config.lilicorr_vector_eps, "lilicorr_logit_scale": config.lilicorr_logit_scale * gate,
    }
    return {
        "architectures": [PUBLIC_ARCHITECTURE], "model_type": "qwen3", "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope.get("rope_theta"), "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias, "tie_word_embeddings": False, "layer_types": list(config.layer_types),
        "num_target_layers": config.num_target_layers, "dflash_config": dflash,
    }


def public_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """Our drafter state dict -> (the public tensors: DFlash backbone + `lilicorr.*`, the score gate).

    Dropped: the gate (folded into logit_scale by `public_config`) and the draft vocabulary, which the public format
    has no place for (its servers propose from the whole vocabulary), and our pair evidence with the corpus counts it
    reads (`PairEvidence`), which the public servers cannot compute; the caller warns about that (`save_public`).
    """
    tensors, gate = {}, None
    for name, tensor in state.items():
        if name == "corrector.score_gate":
            gate = GATE_RATE * float(tensor)
        elif name.startswith("corrector.evidence."):
            continue
        elif name.startswith("corrector."):
            tensors[PUBLIC_PREFIX + name[len("corrector."):]] = tensor.detach().contiguous()
        elif name.startswith(("fc.", "hidden_norm.", "layers.", "norm.")):
            tensors[name] = tensor.detach().contiguous()
    if gate is None:
        raise ValueError("This drafter has no LiLiCorr head (config.corrector_type must be 'lilicorr') to export.")
    return tensors, gate


def save_public(drafter: nn.Module, folder: str | Path) -> None:
    """Write `drafter` (a LiLiCorr drafter) as a folder in the public format: config.json and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if getattr(drafter.corrector, "evidence", None) is not None:
        logger.warning(
            f"{folder}: the public LiLiCorr format has no place for this head's pair evidence (context / corpus "
            "bigrams), so the exported head scores without it: it drafts as this drafter loaded with "
            "context_bigrams=False, corpus_bigrams=None."
        )
    folder.mkdir(parents=True, exist_ok=True)
    tensors, gate = public_state_dict(drafter.state_dict())
    config = public_config(drafter.config, gate)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def is_public_folder(config: Any) -> bool:
    """Whether a loaded config came from a public-format folder (its weights are named `lilicorr.*`)."""
    return PUBLIC_ARCHITECTURE in (getattr(config, "architectures", None) or [])


__all__ = ["LiLiCorrCorrector", "config_from_public", "is_public_folder", "public_config", "public_state_dict",
           "save_public"]
