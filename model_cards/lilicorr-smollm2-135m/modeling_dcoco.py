"""DCOCO drafter network: the DFlash parallel drafter backbone with a corrector on top.

DFlash: the drafter fuses hidden states of a few target layers (`fc`, then `hidden_norm`) and injects them as extra
keys/values in every drafter layer; one forward over the block [anchor, MASK x (B-1)] (bidirectional inside the block,
full attention to the context, absolute RoPE positions) predicts slot k = the token at anchor + k, through the
target's own lm_head. DCOCO (arXiv:2610.12570) keeps each slot's top-K candidates and re-selects them with transition
scores between adjacent slots; LiLiCorr links them with cosine scores (`corrector.py`, `lilicorr.py`, one `Corrector`
interface, chosen by `config.corrector_type` through `correctors.py`).

This file is the network only, and the network is what a Hub folder carries, with the loading of the folders it
comes in (complete, head-only naming a `base_drafter`, public DFlash exports with `d2t`, public LiLiCorr). The runtime
(`attach`, the target tap, `generate(assistant_model=...)`, tuning) is the dcoco-hf package's `DCOCODrafter`, a
subclass of `DCOCODraftModel`: a folder's own copy of this class hands its loading over to it wherever the package is
installed, imported or not (`installed_runtime`). The network never names the runtime: the runtime registers its
drafter class here (`register_runtime`) when it is imported. The drafter borrows the target's embedding and lm_head
(frozen, never saved) once bound to it (`bind_target`). Weight names follow the public DFlash checkpoints (`fc`,
`hidden_norm`, `layers.{i}...`, `norm`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import cached_file
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from .configuration_dcoco import DCOCOConfig
from .corrector import BlockLattice, ContextBigrams, CorpusBigrams, Corrector, select_candidates
from .correctors import corrector_class
from .lilicorr import is_public_folder

def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DCOCOAttention(nn.Module):
    """Qwen3-style attention whose keys/values also cover the fused target context."""

    def __init__(self, config: DCOCOConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim,
                                bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any | None,
    ) -> torch.Tensor:
        """hidden_states [B, Q, H] (block), context [B, N, H] (new fused context rows) -> [B, Q, H]."""
        batch, q_len, _ = hidden_states.shape
        kv_input = torch.cat([context, hidden_states], dim=1)  # [B, N + Q, H]
        q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings  # [B, N + Q, D]
        q = _apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        implementation = self.config._attn_implementation
        if attention_mask is not None and implementation not in ("eager", "sdpa", "sdpa_cpu_gqa"):
            # Kernels without arbitrary masks (FlashAttention) only serve the unmasked path. "sdpa_cpu_gqa" is
            # dcoco_hf's masked-GQA variant of sdpa (dcoco_hf/runtime/cpu_attention.py).
            implementation = "sdpa"
        attn_fn = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, _eager_attention)
        out, _ = attn_fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, is_causal=False)
        return self.o_proj(out.reshape(batch, q_len, -1))


def _eager_attention(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **_):
    """Plain softmax attention with GQA; attention_mask is additive [B, 1, Q, K] or None."""
    k = k.repeat_interleave(module.num_key_value_groups, dim=1)
    v = v.repeat_interleave(module.num_key_value_groups, dim=1)
    weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = weights.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


class DCOCODecoderLayer(nn.Module):
    def __init__(self, config: DCOCOConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DCOCOAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, cache):
        # The fused context enters as keys/values only; it never joins the residual stream.
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _additive_mask(mask: torch.Tensor | None, q_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Key mask [B, K] (1 = visible) or boolean/additive [B, 1, Q, K] -> additive float [B, 1, Q, K], or None."""
    if mask is None:
        return None
    if mask.dim() == 2:
        if bool(mask.all()):
            return None  # everything visible: let SDPA / FlashAttention take their unmasked path
        mask = mask[:, None, None, :].expand(-1, 1, q_len, -1)
    if mask.dtype == torch.bool or not mask.is_floating_point():
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask.bool(), torch.finfo(dtype).min
        )
    return mask.to(dtype)


@dataclass
class DraftOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus `context_states` [B, N, H], the new context rows as every layer read them
    (`fuse_target_states`), so LiLiCorr's anchor row is taken from them instead of fusing the row again."""

    context_states: torch.Tensor | None = None


@dataclass
class SlotCandidates:
    """One draft forward's blocks and each slot's top-K candidates (`DCOCODraftModel.draft_candidates`)."""

    block_hidden: torch.Tensor  # [B, block, H] the drafter output: anchor row, then the slots
    context_states: torch.Tensor | None  # [B, N, H] the new context rows as every layer read them (DraftOutput)
    candidates: torch.LongTensor  # [B, S, K] token ids, best first
    logits: torch.Tensor  # [B, S, K] their drafter logits
    log_probs: torch.Tensor | None  # [B, S, K] under each slot's softmax, when the corrector reads them


@dataclass
class Correction:
    """The corrector's reading of one draft's candidates (`DCOCODraftModel.correct_candidates`)."""

    chosen: torch.LongTensor  # [B, S] the walk's candidate index per slot
    first_slot_scores: torch.Tensor | None  # [B, K] anchor -> slot 1 scores, when the corrector scores them
    transition_scores: torch.Tensor  # [B, S - 1, K, K]; [b, p, a, c] scores candidate c at slot p + 1 after a


class DCOCOPreTrainedModel(PreTrainedModel):
    config_class = DCOCOConfig
    config: DCOCOConfig
    base_model_prefix = "dcoco"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DCOCODecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if getattr(module, "zero_init", False):  # the corrector's output layer: untrained = plain DFlash argmax
            init.zeros_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, Corrector):  # its own parameters; the Linear layers got the default above
            module.init_weights()


class DCOCODraftModel(DCOCOPreTrainedModel):
    """The drafter network: DFlash backbone + corrector. What `AutoModel.from_pretrained(folder,
    trust_remote_code=True)` builds from a Hub folder's own code; with the dcoco-hf package imported, AutoModel builds
    its subclass `dcoco_hf.DCOCODrafter` instead, which adds `attach` and speculative generation."""

    # A DFlash export's draft vocabulary (`d2t` and its lm_head rows) is read by the runtime's loader instead.
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq", r"^d2t$", r"^t2d$", r"^lm_head\.weight$"]

    def __init__(self, config: DCOCOConfig) -> None:
        super().__init__(config)
        if config.target_layer_ids is None:
            raise ValueError(
                "DCOCOConfig.target_layer_ids is missing: the drafter must know which target layers it reads. "
                "Use DCOCODrafter.from_target(target) or set target_layer_ids explicitly."
            )
        num_layers = len(config.target_layer_ids)
        self.fc = nn.Linear(num_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DCOCODecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.corrector = corrector_class(config.corrector_type).from_config(config)
        # The pair counts the corrector reads with `corpus_bigrams`, saved with the weights (`set_corpus_bigrams`).
        pairs = config.corpus_bigrams
        self.corpus_bigrams = CorpusBigrams(config.vocab_size, pairs) if pairs else None
        # Saved with the weights when the config has a draft vocabulary; None proposes from the whole vocabulary.
        size = config.draft_vocab_size
        self.register_buffer("draft_token_ids", torch.zeros(size, dtype=torch.long) if size else None)
        self._target_ref: weakref.ReferenceType | None = None
        self._draft_head: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None
        if config.base_drafter is not None:
            # The folder holds only what differs from its base: `from_pretrained` reads the rest from the base and
            # checks what neither holds, so the loader's own report of missing keys would only mislead.
            self._keys_to_ignore_on_load_missing = [r".*"]
        self.post_init()

    def attach(self, target: PreTrainedModel, **options: Any) -> Any:
        raise RuntimeError(self._network_alone())

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "generation_config":
                raise
            # What transformers reads first off an `assistant_model=`: the network alone cannot draft for generate().
            raise AttributeError(self._network_alone()) from None

    def _network_alone(self) -> str:
        return (
            f"{type(self).__name__} is the drafter network alone (a folder's own code, loaded where the dcoco-hf "
            "package is not installed, or the network class itself); attach() and speculative generate() are the "
            "package's. `pip install dcoco-hf`, then load the folder again: AutoModel.from_pretrained(folder, "
            "trust_remote_code=True) then returns a drafter; pass assistant_model=drafter.attach(target)."
        )

    def bind_target(self, target: PreTrainedModel | None) -> None:
        """Borrow `target`'s embedding and lm_head (held weakly: the drafter never keeps its target alive), or drop
        the binding with None. The runtime's `attach` checks the pair first."""
        self._target_ref = weakref.ref(target) if target is not None else None
        self._draft_head = None

    @property
    def bound_target(self) -> PreTrainedModel | None:
        """The target whose embedding and lm_head the network borrows, or None while unbound."""
        return self._target_ref() if self._target_ref is not None else None

    @property
    def target(self) -> PreTrainedModel:
        target = self.bound_target
        if target is None:
            raise RuntimeError(
                "This DCOCODrafter is not attached to a target model. Call `drafter.attach(target)` once "
                "(it returns the drafter), then pass `assistant_model=drafter` to `target.generate`."
            )
        return target

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles carry weights, not the binding to a live target (re-attach the copy).
        return {**super().__getstate__(), "_target_ref": None, "_draft_head": None}

    def get_input_embeddings(self) -> nn.Module | None:
        target = self.bound_target
        return target.get_input_embeddings() if target is not None else None

    def get_output_embeddings(self) -> nn.Module | None:
        return None  # the lm_head is the target's; it is neither tied nor saved here

    # ------------------------------------------------------------------ loading a folder

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.from_pretrained`, strict: the network loads complete or not at all.

        A folder's own copy of this class hands the loading over to the installed dcoco-hf package's `DCOCODrafter`
        (the network plus the runtime), so `AutoModel.from_pretrained(folder, trust_remote_code=True).attach(target)`
        works without importing the package first. Otherwise: a folder naming a `base_drafter` takes every tensor
        its file lacks from the base's file; a DFlash export's draft vocabulary comes from its `d2t`; a public
        LiLiCorr folder (`lilicorr.*` weights) loads as ours. A missing backbone or head tensor, a weight the config
        has no place for, a shape that differs or an unreadable file is an error naming what and where: a fresh
        tensor would draft a believable but wrong function. Only a missing corrector is fine: public DFlash
        checkpoints have none, and a fresh (zero-output) corrector proposes their argmax blocks exactly.
        """
        runtime = installed_runtime(cls)
        if runtime is not None:
            config = kwargs.pop("config", None)
            if config is not None and not isinstance(config, runtime.config_class):  # the folder's own config class
                config = runtime.config_class.from_dict({**config.to_dict(), **getattr(config, "legacy_decoding", {})})
            return runtime.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
        source = pretrained_model_name_or_path
        want_info = kwargs.pop("output_loading_info", False)
        # A public LiLiCorr folder names its head `lilicorr.*` (ours: `corrector.*`); other folders have no such keys.
        kwargs.setdefault("key_mapping", {r"^(model\.)?lilicorr\.": "corrector."})
        hub = {name: kwargs[name] for name in HUB_KEYWORDS if name in kwargs}
        try:
            model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        except SafetensorError as error:  # safetensors' own message names neither the file nor the fix
            raise unreadable_weights(source, error) from error
        missing = set(info.get("missing_keys", ()))
        if model.config.base_drafter is not None:  # a head-only folder: the rest comes from the drafter it names
            missing = model._fill_from_base(source, hub)
        if "draft_token_ids" in missing:  # a DFlash export's draft vocabulary comes as `d2t`
            missing = model._adopt_d2t(source, missing, hub)
        if is_public_folder(model.config):
            model._adopt_public_lilicorr(missing)
        model._check_loaded(missing, info, overridden=sorted(set(kwargs) & set(vars(model.config))))
        info["missing_keys"] = missing
        return (model, info) if want_info else model

    def _check_loaded(self, missing: set[str], info: dict[str, Any], overridden: list[str]) -> None:
        """Raise a ValueError for what `from_pretrained` must not hand over half-loaded (see there)."""
        backbone = sorted(k for k in missing if not k.startswith("corrector."))
        if backbone:
            raise ValueError(
                f"The checkpoint lacks {len(backbone)} drafter weight(s), e.g. {backbone[:4]}: it is not a complete "
                "DFlash/DCOCO drafter. Re-download or re-save the folder (model.safetensors must hold fc, hidden_norm, "
                "layers.* and norm)."
            )
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not _FOREIGN_KEY.match(k))
        if unexpected and not overridden:  # weights the config has no place for: a config.json that misdescribes them
            raise ValueError(
                f"The checkpoint holds {len(unexpected)} weight(s) this config has no place for, e.g. "
                f"{unexpected[:4]}: config.json does not describe these weights (e.g. corrector_type differs from the "
                "corrector saved, or num_hidden_layers is smaller than the layers saved). Fix config.json to match the "
                "weights, or load the folder the checkpoint was saved with."
            )
        mismatched = info.get("mismatched_keys") or []
        if mismatched:
            raise ValueError(f"Checkpoint tensors do not match the config's shapes: {list(mismatched)[:4]}.")

    @torch.no_grad()
    def _fill_from_base(self, source: str | os.PathLike, hub: dict[str, Any]) -> set[str]:
        """After loading a folder that names a `base_drafter`: read every tensor its file lacks from the base's file.
        Returns the keys neither holds."""
        own = set(read_tensors(source, "model.safetensors", None, hub, keys_only=True))
        wanted = set(self.state_dict()) - own
        where = resolve_base(source, self.config.base_drafter)
        base = read_tensors(where, "model.safetensors", wanted, hub, named_by=(source, self.config.base_drafter))
        self.load_state_dict(base, strict=False)
        self._draft_head = None  # the draft vocabulary may have come from the base
        missing = wanted - set(base)
        head = sorted(name for name in missing if name.startswith("corrector."))
        if head:  # neither file has them: a fresh head would score a believable but wrong function
            raise ValueError(f"{source} and its base_drafter lack {len(head)} corrector tensor(s), e.g. {head[:4]}.")
        return missing

    def _adopt_d2t(self, source: str | os.PathLike, missing: set[str], hub: dict[str, Any]) -> set[str]:
        """After loading a DFlash folder whose config names a draft vocabulary (`dcoco-hf export`, vLLM's layout): set
        it from the folder's `d2t` (draft column i proposes target token i + d2t[i]). Returns the keys still missing."""
        d2t = read_tensors(source, "model.safetensors", {"d2t"}, hub).get("d2t")
        if d2t is None:  # neither our buffer nor d2t: the caller's error names what is missing
            return missing
        self.set_draft_vocabulary(torch.arange(d2t.numel()) + d2t.long())
        return missing - {"draft_token_ids"}

    def _adopt_public_lilicorr(self, missing: set[str]) -> None:
        """After loading a public LiLiCorr folder: its head must be complete (a partly fresh head would score a
        believable but wrong function), and its scores are logit_scale * cos, i.e. our score gate at 1."""
        head = sorted(k for k in missing if k.startswith("corrector.") and k != "corrector.score_gate")
        if head:
            raise ValueError(
                f"This LiLiCorr checkpoint lacks {len(head)} head tensor(s), e.g. {head[:4]} (named lilicorr.* in the "
                "file): check lilicorr_hidden_size, lilicorr_num_layers and lilicorr_factor_dim in its dflash_config."
            )
        self.corrector.set_gate(1.0)
        self.config.architectures = [type(self).__name__]  # from now on it is one of ours (saved as corrector.*)

    # ------------------------------------------------------------------ the backbone

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        **kwargs: Any,
    ) -> DraftOutput:
        """One DFlash backbone pass (also the interface of transformers' `speculation_type="dflash"` path).

        Args:
            noise_embeds: [B, Q, H] target embeddings of the block(s) (anchor, then mask slots).
            context_hidden_states: [B, N, n_layers * H] concatenated target hidden states of new context rows.
            position_ids: [B, N + Q] absolute positions of the context rows then the block tokens.
            attention_mask: None (all visible), a key mask [B, cached + N + Q] or a full mask [B, 1, Q, keys].
            cache: keys/values of earlier context rows (`DraftContextCache` or a transformers DFlash cache).
        Returns:
            `last_hidden_state` [B, Q, H] after the final norm, ready for the target's lm_head, and `context_states`
            [B, N, H], the fused context rows.
        """
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # transformers < 5.24's name
        context = self.fuse_target_states(context_hidden_states)
        hidden = noise_embeds.to(self.fc.weight.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        mask = _additive_mask(attention_mask, hidden.shape[1], hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, context, position_embeddings, mask, cache)
        return DraftOutput(last_hidden_state=self.norm(hidden), context_states=context)

    def fuse_target_states(self, target_states: torch.Tensor) -> torch.Tensor:
        """The drafter's context rows: target states [..., n_layers * H] -> `hidden_norm(fc(.))` [..., H] (the keys /
        values of every layer, and LiLiCorr's anchor row)."""
        return self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))

    def slot_logits(self, slot_hidden: torch.Tensor) -> torch.Tensor:
        """Target lm_head on drafter slot hiddens [..., H] -> [..., V]."""
        lm_head = self.target.get_output_embeddings()
        return lm_head(slot_hidden.to(lm_head.weight.dtype))

    def set_draft_vocabulary(self, token_ids: torch.Tensor | list[int] | None) -> "DCOCODraftModel":
        """Propose only from `token_ids` (e.g. the target's most frequent tokens), or from every token with None.

        FR-Spec's observation: a small drafter spends most of its forward in the lm_head over the whole vocabulary
        (49152 x 576 for SmolLM2, 151936 x 4096 for Qwen3), while the target writes a few thousand tokens almost
        all of the time. Outputs cannot change, since the target verifies every token; a token outside the draft
        vocabulary is simply never proposed. `scripts/draft_vocab.py` builds one from training data. Returns self.
        """
        if token_ids is None:
            self.draft_token_ids, self.config.draft_vocab_size, self._draft_head = None, None, None
            return self
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        vocab = self.config.vocab_size
        if ids.numel() < self.config.top_k:
            raise ValueError(
                f"The draft vocabulary has {ids.numel()} tokens, fewer than top_k={self.config.top_k} candidates per "
                "slot; pass more tokens or lower config.top_k."
            )
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"Draft vocabulary ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}.")
        if ids.unique().numel() != ids.numel():
            raise ValueError("The draft vocabulary lists a token twice; pass each token id once.")
        # Stored ascending, so the same set of tokens always gives the same buffer (and the same saved file).
        self.draft_token_ids = ids.sort().values.to(self.fc.weight.device)
        self.config.draft_vocab_size = ids.numel()
        self._draft_head = None
        return self

    def set_corpus_bigrams(self, table: CorpusBigrams) -> "DCOCODraftModel":
        """Let the corrector read these pair counts (`CorpusBigrams.count` over the training answers); returns self.

        A corrector that did not read them yet gains the input with zero weights (it scores as before until trained,
        what `train_drafter.py --corpus-bigrams` starts from); one that did keeps its weights, with the new counts.
        """
        if table.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"The table counts a vocabulary of {table.vocab_size}; the target's has {self.config.vocab_size}."
            )
        self.corrector.add_corpus_input()
        self.corpus_bigrams = table.to(self.fc.weight.device)
        self.config.corpus_bigrams = table.num_pairs
        return self

    def proposal_logits(self, slot_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor | None]:
        """Float logits [..., V'] over the tokens the drafter may propose, and the token id of each column
        (None: column = token id, the whole vocabulary)."""
        if self.draft_token_ids is None:
            return self.slot_logits(slot_hidden).float(), None
        weight, bias = self.draft_lm_head()
        return nn.functional.linear(slot_hidden.to(weight.dtype), weight, bias).float(), self.draft_token_ids

    def draft_columns(self, token_ids: torch.LongTensor) -> torch.LongTensor:
        """The column of each token in `proposal_logits` (-1 for a token outside the draft vocabulary); without a
        draft vocabulary, the token ids themselves."""
        if self.draft_token_ids is None:
            return token_ids
        ids = self.draft_token_ids
        # Built once per vocabulary: drafting asks for columns every cycle (the DFlash2 selector's codebook rows).
        key = (ids.data_ptr(), 0 if ids.is_inference() else ids._version, token_ids.device)
        cached = getattr(self, "_column_cache", None)
        if cached is None or cached[0] != key:
            column_of = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
            column_of[ids.to(token_ids.device)] = torch.arange(ids.numel(), device=token_ids.device)
            cached = self._column_cache = (key, column_of)
        return cached[1][token_ids]

    def draft_lm_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target lm_head's rows of the draft vocabulary, sliced once per (lm_head, vocabulary)."""
        lm_head = self.target.get_output_embeddings()
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        # _version catches in-place weight updates (load_state_dict); inference tensors have no version counter.
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, weight.device, weight.dtype, self.draft_token_ids.data_ptr())
        if self._draft_head is None or self._draft_head[0] != key:
            ids = self.draft_token_ids.to(weight.device)
            self._draft_head = (key, weight.detach()[ids], None if bias is None else bias.detach()[ids])
        return self._draft_head[1], self._draft_head[2]

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        return self.input_embedding()(token_ids)

    def input_embedding(self) -> nn.Module:
        """The target's token embedding: the drafter embeds its block with it, the corrector its candidates."""
        return self.target.get_input_embeddings()

    # ------------------------------------------------------------------ candidates and their transition scores

    def slot_candidates(
        self, logits: torch.Tensor, column_tokens: torch.LongTensor | None
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor | None]:
        """Each slot's top-K candidates, the one way drafting and training take them from `proposal_logits`
        (logits [..., V'] and the token id of each column): token ids [..., K] best first, their logits [..., K], and
        their log-probabilities [..., K] under the slot's softmax when the LiLiCorr head reads them (else None)."""
        candidate_logits, columns = logits.topk(min(self.config.top_k, logits.shape[-1]), dim=-1)
        candidates = columns if column_tokens is None else column_tokens[columns]  # columns -> token ids
        if not self.corrector.reads_log_probs:
            return candidates, candidate_logits, None
        return candidates, candidate_logits, candidate_logits - logits.logsumexp(-1, keepdim=True)

    def score_candidates(
        self,
        block_hidden: torch.Tensor,
        anchor_ids: torch.LongTensor,
        candidates: torch.LongTensor,
        candidate_logits: torch.Tensor,
        candidate_log_probs: torch.Tensor | None = None,
        anchor: tuple[torch.Tensor, torch.BoolTensor] | None = None,
        context_ids: torch.LongTensor | None = None,
        context_valid: torch.BoolTensor | None = None,
        anchor_positions: torch.LongTensor | None = None,
        exclude: tuple[torch.LongTensor, torch.BoolTensor] | None = None,
        rows: torch.BoolTensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The corrector's transition scores of each block's candidates (`slot_candidates`), the one way drafting and
        training both compute them: (first-slot scores [R, K], transition scores [R, S - 1, K, K]).

        The first-slot scores are the anchor -> slot 1 transitions: LiLiCorr's start scores, or DCOCO's with
        `correct_first_slot` (None without). block_hidden [..., block, H] the drafter output of each block (anchor,
        then slots); anchor_ids [...]; candidates / candidate_logits / candidate_log_probs [..., S, K]. anchor: the
        LiLiCorr anchor rows ([..., H], valid [...], `anchor_rows`). context_ids / context_valid [B, L] with
        `context_bigrams` (see `candidate_bigrams`, also for anchor_positions); exclude with `corpus_bigrams` (see
        `candidate_corpus_inputs`). rows [...], in training, scores only the blocks that teach something (the K^2
        transitions make the corrector the costly part): R = rows.sum(); without it R is every block.
        """

        def scored(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
            return [x if x is None or rows is None else x[rows] for x in tensors]

        seen = self.candidate_bigrams(anchor_ids, candidates, context_ids, context_valid, anchor_positions)
        corpus = self.candidate_corpus_inputs(anchor_ids, candidates, exclude)
        # The pair inputs read the whole text of each block's sequence, so they come before choosing the rows.
        block_hidden, anchor_ids, candidates, candidate_logits, seen, corpus = scored(
            block_hidden, anchor_ids, candidates, candidate_logits, seen, corpus
        )
        candidate_log_probs, = scored(candidate_log_probs)
        anchor = None if anchor is None else tuple(scored(*anchor))
        if self.corrector.reads_draft_columns:  # its token tables are draft-vocabulary sized
            anchor_ids, candidates = self.draft_columns(anchor_ids), self.draft_columns(candidates)
        lattice = BlockLattice(block_hidden, anchor_ids, candidates, candidate_logits, candidate_log_probs, anchor,
                               seen, corpus)
        return self.corrector.score(self.config, lattice, self.input_embedding())

    def draft_candidates(
        self,
        block_ids: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
    ) -> SlotCandidates:
        """The backbone phase of a draft: one forward over the blocks (`forward`'s arguments; block_ids [B, block]
        anchor then mask slots), then each slot's top-K candidates over the draft vocabulary (`slot_candidates`)."""
        out = self(self.embed(block_ids), context_hidden_states, position_ids, attention_mask, cache)
        block_hidden = out.last_hidden_state  # [B, block, H]
        logits, column_tokens = self.proposal_logits(block_hidden[:, 1:])  # [B, S, V'] over the draft vocabulary
        candidates, candidate_logits, log_probs = self.slot_candidates(logits, column_tokens)
        return SlotCandidates(block_hidden, out.context_states, candidates, candidate_logits, log_probs)

    def correct_candidates(
        self,
        drafted: SlotCandidates,
        anchor_ids: torch.LongTensor,
        *,
        position_ids: torch.LongTensor | None = None,
        context_ids: torch.LongTensor | None = None,
        context_valid: torch.BoolTensor | None = None,
        selection: str = "prefix_first",
        geometric_lambda: float = 0.75,
    ) -> Correction:
        """The corrector phase of a draft: the candidates' transition scores and the walk through them. anchor_ids
        [B]; position_ids [B, N + block] (as `forward` had them) locate LiLiCorr's anchor row in
        `drafted.context_states` only (`anchor_rows`; None serves the other correctors); context_ids / context_valid
        [B, L] the committed text, read with `context_bigrams`; selection: "prefix_first" | "viterbi" | "geometric"."""
        anchor = None
        if self.corrector.reads_anchor_state:
            anchor = self.anchor_rows(drafted.context_states, position_ids)
        first_scores, scores = self.score_candidates(
            drafted.block_hidden, anchor_ids, drafted.candidates, drafted.logits, drafted.log_probs, anchor=anchor,
            context_ids=context_ids, context_valid=context_valid,
        )
        # The paper's walk starts from the drafter's own slot-1 logits when nothing scores the anchor's transitions.
        first = first_scores if first_scores is not None else drafted.logits[:, 0]
        chosen = select_candidates(selection, scores.float(), first.float(), geometric_lambda)  # [B, S]
        return Correction(chosen, first_scores, scores)

    def anchor_rows(
        self, context_states: torch.Tensor, position_ids: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.BoolTensor]:
        """The LiLiCorr anchor of each row: the fused target context (`hidden_norm(fc(.))`) of the position just
        before the block, the newest committed row, as in the public head. context_states [B, N, H] the forward's
        fused rows (`DraftOutput.context_states`), position_ids [B, N + block] -> ([B, H], valid [B]); not valid
        (zero) where that row is not among the new context rows (padding and rows past a row's accepted tokens have
        other positions)."""
        n = context_states.shape[1]
        batch = context_states.shape[0]
        positions = position_ids.expand(batch, -1)
        match = positions[:, :n] == positions[:, n:n + 1] - 1  # [B, N]
        valid = match.any(1)  # [B]
        last = n - 1 - match.flip(1).long().argmax(1) if n else torch.zeros_like(valid, dtype=torch.long)  # [B]
        if n == 0:
            return context_states.new_zeros(batch, self.config.hidden_size), valid
        return context_states[torch.arange(batch, device=last.device), last], valid  # [B, H]

    @property
    def scores_first_slot(self) -> bool:
        """Whether the corrector scores the anchor -> slot 1 transitions: LiLiCorr's start scores always, DCOCO's
        with `correct_first_slot`."""
        return self.corrector.scores_first_slot(self.config)

    def candidate_bigrams(
        self,
        anchor_ids: torch.LongTensor,
        candidates: torch.LongTensor,
        context_ids: torch.LongTensor | None,
        context_valid: torch.BoolTensor | None = None,
        anchor_positions: torch.LongTensor | None = None,
    ) -> torch.BoolTensor | None:
        """m(a, b) of every transition of the pair lattice (`Corrector.pair_lattice`) [B, ..., P, K, K], as drafting and
        training both compute them; None without `context_bigrams`. P = S - 1 slot pairs, after the anchor -> slot 1
        pairs (P = S, K equal rows) when `scores_first_slot`; `Corrector.split_anchor_pairs` parts them.

        anchor_ids [B, ...] and candidates [B, ..., S, K] (drafting: one block per row, [B]; training: m blocks per
        sequence, [N, m]); context_ids / context_valid [B, L]; anchor_positions [B, ...], in training, restricts
        each block to the text up to its anchor (drafting's context ends at the anchor already).
        """
        if not self.config.context_bigrams:
            return None
        if context_ids is None:
            raise ValueError(
                "this drafter's corrector reads context bigrams (config.context_bigrams=True): pass the committed "
                "tokens as context_ids to propose()."
            )
        bigrams, ends = ContextBigrams(context_ids, self.config.vocab_size, context_valid), anchor_positions
        lattice = self.corrector.pair_lattice(self.config, anchor_ids, candidates)
        return bigrams.seen(
            lattice[..., :-1, :, None], lattice[..., 1:, None, :], None if ends is None else ends[..., None, None, None]
        )

    def candidate_corpus_inputs(
        self,
        anchor_ids: torch.LongTensor,
        candidates: torch.LongTensor,
        exclude: tuple[torch.LongTensor, torch.BoolTensor] | None = None,
    ) -> torch.Tensor | None:
        """The corpus inputs of every transition of the pair lattice [B, ..., P, K, K, 2] (as `candidate_bigrams`),
        as drafting and training both compute them; None without `corpus_bigrams`. anchor_ids [B, ...], candidates
        [B, ..., S, K]; exclude, in training, the records' (input_ids [B, T], loss_mask [B, T]), whose own pairs leave
        the counts (leave-one-out).
        """
        if self.corpus_bigrams is None:
            return None
        table = self.corpus_bigrams
        own = None if exclude is None else table.own_counts(*exclude)
        lattice = self.corrector.pair_lattice(self.config, anchor_ids, candidates)
        return table.inputs(lattice[..., :-1, :, None], lattice[..., 1:, None, :], own)


# from_pretrained keywords that say where and how to fetch files, passed on when reading a folder's files (a revision
# names one repository's, so it is not passed on to the base drafter's).
HUB_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "proxies", "token")
# Tensors a DFlash folder may carry for other engines that this drafter reads elsewhere or not at all: the draft
# vocabulary's lm_head rows and its maps (EAGLE-3 style, `dcoco-hf export`), the target's embedding.
_FOREIGN_KEY = re.compile(r"^(model\.)?(d2t|t2d|lm_head\.weight|embed_tokens\.weight)$")


# The runtime's drafter class for each model type, filled by the runtime as it is imported (`register_runtime`), so
# that the network layer depends on no runtime module while a folder's copy of the network still finds the runtime.
RUNTIMES: dict[str, type] = {}


def register_runtime(drafter_class: type) -> type:
    """Record `drafter_class` (the runtime's subclass of this network) as what a Hub folder's copy of the network
    hands its loading over to; a class decorator, so the registration cannot drift from the class."""
    RUNTIMES[drafter_class.config_class.model_type] = drafter_class
    return drafter_class


def installed_runtime(network_class: type) -> type | None:
    """The installed dcoco-hf package's runtime drafter class when `network_class` is a Hub folder's own copy of the
    network (a `transformers_modules` class) and the package is installed, else None. The copy reads the registry of
    the package's own network module: importing that imports the package first, whose runtime registers itself."""
    if network_class.__module__.partition(".")[0] == "dcoco_hf" or importlib.util.find_spec("dcoco_hf") is None:
        return None
    package_network = importlib.import_module("dcoco_hf.network.modeling_dcoco")  # broken: its import error says why
    return package_network.RUNTIMES[network_class.config_class.model_type]


def resolve_base(source: str | os.PathLike, base: str) -> str:
    """Where the base drafter named by the folder `source` (`config.base_drafter`) lives. A `base` starting with ./ or
    ../ is relative to `source`: a local folder, or for a Hub id `source` the repository it names ("../dcoco" from
    "org/lilicorr" is "org/dcoco"). Any other `base` is an absolute path or a Hub id as it stands."""
    if base.startswith(("./", "../")):
        return os.path.normpath(os.path.join(source, base))
    return base


def read_tensors(
    folder: str | os.PathLike,
    name: str,
    keys: set[str] | None,
    hub: dict[str, Any],
    named_by: tuple[str | os.PathLike, str] | None = None,
    keys_only: bool = False,
) -> dict[str, torch.Tensor | None]:
    """The tensors `keys` (None: all) of the safetensors file `name` in `folder` (a local folder or a Hub id), or with
    `keys_only` their names (mapped to None). `named_by` (a folder, its `base_drafter`) says who named `folder` as
    its base, for the errors: a missing or unreadable file is an OSError naming the file and what to do."""
    try:
        path = cached_file(str(folder), name, **hub)
    except OSError as error:
        if named_by is None:
            raise
        source, base = named_by
        raise OSError(
            f"{source} names base_drafter={base!r} for the weights its model.safetensors does not hold (the backbone), "
            f"but no drafter was found at {folder} ({error}). Put the base drafter's folder at that path, or set "
            f"base_drafter in {source}'s config.json to its folder or Hub id."
        ) from error
    try:
        with safe_open(path, "pt") as file:
            names = set(file.keys()) if keys is None else set(file.keys()) & keys
            return dict.fromkeys(names) if keys_only else {key: file.get_tensor(key) for key in names}
    except SafetensorError as error:
        raise unreadable_weights(path, error, named_by) from error


def unreadable_weights(
    where: str | os.PathLike, error: Exception, named_by: tuple[str | os.PathLike, str] | None = None
) -> OSError:
    """The error for a weights file safetensors cannot read: which file, who named it, and what to do."""
    files = sorted(str(f) for f in Path(where).glob("*.safetensors")) if Path(where).is_dir() else [str(where)]
    role = "" if named_by is None else f" (the base_drafter={named_by[1]!r} that {named_by[0]} names)"
    return OSError(
        f"Cannot read the drafter weights in {', '.join(files)}{role} ({error}): the file is truncated or corrupt (or "
        "not a safetensors file), e.g. by an interrupted download or save. Delete it, then download or save the "
        "checkpoint again."
    )


__all__ = ["Correction", "DCOCODraftModel", "DCOCOPreTrainedModel", "DraftOutput", "SlotCandidates",
           "RUNTIMES", "installed_runtime", "read_tensors", "register_runtime", "resolve_base"]
