"""The dcoco-hf runtime of a drafter: `DCOCODrafter`, the network (`modeling_dcoco.DCOCODraftModel`) bound to a target.

`attach(target)` checks the pair, borrows the target's embedding and lm_head, taps its hidden states (`tap.py`) and
tunes both for the device (`tuning.py`); `target.generate(**inputs, assistant_model=drafter)` then speculates
losslessly through one `DCOCOCandidateGenerator` per call (`candidate_generator.py`) and its `SpeculationEngine`
(`engine.py`), each cycle drafting a block and correcting it (`propose`). Loading and saving also live here: public DFlash folders and their draft vocabulary
(`d2t`), public LiLiCorr folders, head-only folders naming a base drafter (`config.base_drafter`).

A Hub folder carries the network's code only; `import dcoco_hf` registers this class for the folder's model type, so
`AutoModel.from_pretrained(folder, trust_remote_code=True)` builds it.
"""

from __future__ import annotations

import glob
import inspect
import json
import logging
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from .candidate_generator import DCOCOCandidateGenerator, check_stopping_criteria
from ..network.configuration_dcoco import DECODING_FIELDS, DCOCOConfig, DecodingChoices
from .context_cache import DraftContextCache, StaticDraftContextCache
from .device import device_sync
from .drafting import DraftProposal
from .hf_compat import (
    TRANSFORMERS_VERSION,
    assisted_driver,
    assisted_loop_scores,
    assisted_stopping_criteria,
    cache_kwargs,
    output_cache,
)
from ..network.lilicorr import is_public_folder, save_public
from .logs import log, logger
from ..network.modeling_dcoco import DCOCODraftModel
from .precision import precision_notes
from .proposal import COST_SCHEDULE, AcceptanceModel, CycleCosts, ProposalSchedule, chain_prior, check_schedule
from .tap import TargetTap, decoder_layers
from .tuning import Tuning, unpack_for_capture, untune
from .tuning import tune as tune_for_device


class DCOCOGenerationConfig(GenerationConfig):
    """Generation defaults of a drafter, read by transformers' assisted generation from the ASSISTANT's config."""

    @classmethod
    def from_model_config(cls, model_config: DCOCOConfig) -> GenerationConfig:
        config = model_config.to_dict()
        config.pop("top_k", None)  # the corrector's candidate count, not a sampling setting
        generation_config = GenerationConfig.from_model_config(config)
        # num_assistant_tokens caps each cycle's proposal; the cost-aware schedule sizes it per cycle (proposal.py),
        # and assistant_confidence_threshold is a floor on a slot's predicted acceptance.
        generation_config.num_assistant_tokens = model_config.block_size - 1
        generation_config.num_assistant_tokens_schedule = COST_SCHEDULE
        generation_config.assistant_confidence_threshold = 0.0
        # The decoding choices: defaults, or what a config.json written before they moved here holds.
        for name, value in {**asdict(DecodingChoices()), **model_config.legacy_decoding}.items():
            setattr(generation_config, name, value)
        # Our own keys (the decoding choices) are dropped by transformers when it loads a
        # generation_config.json marked as derived from the model config.
        generation_config._from_model_config = False
        return generation_config


class DCOCODrafter(DCOCODraftModel, GenerationMixin):
    """DFlash backbone + corrector, bound to a target. Build with `DCOCODrafter(config)`,
    `DCOCODrafter.from_target(target)` or `from_pretrained(folder)`; bind to its target with `attach(target)`; use as
    `assistant_model=drafter`."""

    generation_config_class = DCOCOGenerationConfig
    # Saved folders name the network class for AutoModel (config.AUTO_MAP) and carry its code, not this module's.
    _auto_class = None

    def __init__(self, config: DCOCOConfig) -> None:
        super().__init__(config)
        self._tap: TargetTap | None = None
        self._tuning: Tuning | None = None
        self._unhook: weakref.finalize | None = None
        self._running: weakref.ReferenceType | None = None  # the handle of the generate() call in progress
        self._schedule: ProposalSchedule | None = None  # the cost-aware schedule's state, kept across calls
        self._compiled_draft: Any = None  # `compile_drafting`: the compiled `_draft`, or None (eager)

    # ------------------------------------------------------------------ construction and attachment

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        top_k: int = 16,
        num_target_layers_read: int = 5,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
        init_from_target: bool = False,
        **config_kwargs: Any,
    ) -> "DCOCODrafter":
        """An untrained drafter sized for `target`, already attached to it.

        `init_from_target=True` starts the drafter layers from the target's last decoder layers and the final norm
        from the target's (where shapes agree): a warm start that matters when training compute is scarce.

        Reads `num_target_layers_read` target layers spread evenly from layer 1 to layer L-3 (the early and the
        last layers carry little about the next tokens). The mask token defaults to the last row of the target's
        embedding table: any fixed id works, the drafter learns what its embedding means, and the last row is a
        rarely used padding or special token in common tokenizers. Pass `mask_token_id` to choose another.

        Other keywords are `DCOCOConfig` fields, except the decoding choices (`selection`, `geometric_lambda`,
        `block_tau`), which go to the generation config (`decoding`).
        """
        tcfg = target.config.get_text_config()
        depth = tcfg.num_hidden_layers
        vocab = target.get_input_embeddings().weight.shape[0]
        heads = config_kwargs.pop("num_attention_heads", tcfg.num_attention_heads)
        decoding = {name: config_kwargs.pop(name) for name in DECODING_FIELDS if name in config_kwargs}
        config = DCOCOConfig(
            vocab_size=vocab,
            hidden_size=tcfg.hidden_size,
            intermediate_size=intermediate_size or tcfg.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=config_kwargs.pop("num_key_value_heads", getattr(tcfg, "num_key_value_heads", heads)),
            head_dim=config_kwargs.pop("head_dim", getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads),
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_parameters=getattr(tcfg, "rope_parameters", None),  # None: the config's default base
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", 32768),
            block_size=block_size,
            mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
            target_layer_ids=spread_layer_ids(depth, num_target_layers_read),
            num_target_layers=depth,
            top_k=top_k,
            **config_kwargs,
        )
        drafter = cls(config).to(device=target.device, dtype=target.dtype)
        drafter._settle_decoding(decoding)
        if init_from_target:
            _copy_matching(target.get_decoder().layers[-num_hidden_layers:], drafter.layers)
            _copy_matching(target.get_decoder().norm, drafter.norm)
        return drafter.attach(target, tune=False)  # an untrained drafter: tune once it is trained

    def attach(self, target: PreTrainedModel, tune: bool = True, **tune_options: Any) -> "DCOCODrafter":
        """Bind the drafter to `target`: borrow its embedding and lm_head and tap its hidden states. Returns self.

        With `tune` (the default), also make both fast on the device at hand and log one line saying how
        (`dcoco_hf.runtime.tuning.tune`: on CPU the GQA-aware attention and the measured few-rows linear layouts, on every
        device the block size of highest recorded tau per timed cycle; measured once per machine and model pair,
        then read from a disk cache). `tune_options` go to `tune` (e.g. `block_size=4`, `batch_size=8`).
        Plain `generate()` of the target stays bit-identical while attached; `detach()` undoes everything.
        """
        check_compatible(self.config, target)
        if not tune and tune_options:
            raise TypeError(f"attach(tune=False) takes no tuning options; got {sorted(tune_options)}.")
        self.detach()
        self.bind_target(target)
        self._tap = TargetTap(target, self.config.target_layer_ids)
        self._unhook = weakref.finalize(self, self._tap.remove)  # a drafter dropped without detach() leaves no hooks
        notes = precision_notes(self, target)  # the drafter computes in the target's dtype, on every path
        if tune:
            try:
                self._tuning = tune_for_device(target, self, **tune_options)
            except Exception:
                self.detach()  # a refused tuning leaves no hooks on the target
                raise
            if self._compiled_draft is not None:
                unpack_for_capture(self, self._tuning)  # the compiled drafts take no packed weights
            self._tuning.notes += notes
            log(self._tuning.summary())
        elif notes:
            log("; ".join(notes))
        return self

    def detach(self) -> "DCOCODrafter":
        """Undo `attach`: remove the hooks and restore the target's linear layers and attention. Returns self."""
        target = self._target_ref() if self._target_ref is not None else None
        if self._unhook is not None:
            self._unhook()  # removes the tap's hooks, once
        self._unhook = None
        if self._tuning is not None and target is not None:
            untune(target, self, self._tuning)
        self.bind_target(None)
        self._tap, self._tuning, self._schedule = None, None, None
        return self

    @property
    def time_phases(self) -> bool:
        """Whether drafting and the tap wait for the device to time each phase (`generation_config.time_phases`;
        exact times on a GPU at one sync per phase, which the bench asks for; on CPU times are exact anyway)."""
        return self.decoding.time_phases

    @property
    def draft_block_size(self) -> int:
        """The block a cycle drafts where no schedule plans it per cycle (the constant and heuristic schedules, and
        `propose`'s default): the generation config's drafts per cycle (`num_assistant_tokens`, transformers' own
        name; `set_block_size`) plus the anchor, at most the trained `config.block_size`."""
        slots = getattr(self.generation_config, "num_assistant_tokens", None) or self.config.block_size - 1
        return max(2, min(int(slots) + 1, self.config.block_size))

    @property
    def proposal_schedule_name(self) -> str:
        """How each cycle's proposal length is chosen (`generation_config.num_assistant_tokens_schedule`): "cost"
        (the default: the length of most expected tokens per second, `proposal.py`), "constant" (every slot of the
        block, up to `num_assistant_tokens`) or transformers' "heuristic"."""
        # Unset (a folder without generation_config.json, e.g. a public DFlash checkpoint): the cost-aware default.
        return check_schedule(getattr(self.generation_config, "num_assistant_tokens_schedule", None) or COST_SCHEDULE)

    @property
    def proposal_schedule(self) -> ProposalSchedule:
        """The cost-aware schedule's state for the block drafted now: the cycle costs `attach` timed here (None
        untuned: then every slot is proposed) and the acceptance fit, which learns across calls from the drafter's
        `block_tau` prior on. Assign `drafter.cycle_costs` to use other costs."""
        slots = self.config.block_size - 1
        schedule = self._schedule
        if schedule is None or schedule.acceptance.slots != slots:
            costs = schedule.costs if schedule is not None else (self._tuning.costs if self._tuning else None)
            prior = chain_prior(self.decoding.block_tau, slots)
            schedule = self._schedule = ProposalSchedule(costs, AcceptanceModel(prior))
        return schedule

    @property
    def cycle_costs(self) -> CycleCosts | None:
        return self.proposal_schedule.costs

    @cycle_costs.setter
    def cycle_costs(self, costs: CycleCosts | None) -> None:
        self.proposal_schedule.costs = costs

    @property
    def decoding(self) -> DecodingChoices:
        """How this drafter decodes: the corrector's walk and the tau measured per block size, checked. They live in
        the generation config (saved as generation_config.json); set them there, e.g.
        `drafter.generation_config.selection = "viterbi"`."""
        return DecodingChoices.read(vars(self.generation_config), self.config)

    def _settle_decoding(self, overrides: dict[str, Any]) -> None:
        """Give the generation config every decoding choice, checked and in its current spelling: `overrides` (a
        constructor's keywords) first, then its own, then a legacy config.json's (`config.legacy_decoding`), then
        the default."""
        generation = self.generation_config
        legacy = {name: value for name, value in self.config.legacy_decoding.items() if name not in vars(generation)}
        for name, value in {**legacy, **overrides}.items():
            setattr(generation, name, value)
        for name, value in asdict(self.decoding).items():
            setattr(generation, name, value)
        generation._from_model_config = False  # see DCOCOGenerationConfig: else saved keys would not load back

    @property
    def tuning(self) -> Tuning | None:
        """What `attach` did to make target and drafter fast here (None with `tune=False`)."""
        return self._tuning

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_tap=None, _tuning=None, _unhook=None, _running=None, _last_engine=None, _schedule=None,
                     _compiled_draft=None)
        return state

    @property
    def tap(self) -> TargetTap:
        self.target  # noqa: B018 -- raises the clear "not attached" error
        return self._tap

    # ------------------------------------------------------------------ drafting: the one code path

    @torch.no_grad()
    def propose(
        self,
        anchor_ids: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        cache: DraftContextCache | StaticDraftContextCache,
        attention_mask: torch.Tensor | None = None,
        selection: str | None = None,
        correct: bool = True,
        context_ids: torch.LongTensor | None = None,
        context_valid: torch.BoolTensor | None = None,
        timed: bool = False,
        block_size: int | None = None,
    ) -> DraftProposal:
        """Draft one block per row and correct it.

        Args:
            anchor_ids: [B] last committed token of each row.
            context_hidden_states: [B, N, n_layers * H] target states of the rows committed since the last draft.
            position_ids: [B, N + block_size] positions of those rows, then of the block.
            cache: the drafter context cache (`draft_cache`); it keeps the new context rows and drops the block
                afterwards. A static one (captured drafting) drafts through the compiled graph.
            attention_mask: key mask [B, cached + N + block_size] or full mask [B, 1, block_size, cached + N +
                block_size], or None when every key is visible (a key mask is read for that, a sync on a GPU).
            selection: "prefix_first" | "viterbi" | "geometric"; default the generation config's (`decoding`).
            correct: False skips the corrector (plain DFlash argmax proposals, for baselines).
            context_ids: [B, L] committed tokens of each row, anchor included (needed with `context_bigrams`).
            context_valid: [B, L] False at padding of `context_ids`, or None when every position is a token.
            timed: wait for the device before reading the clock, so the phase times are exact on a GPU (on CPU they
                are exact either way); without it nothing here waits for the device.
            block_size: the block to draft (anchor + slots), at most `config.block_size`; default
                `draft_block_size`. The cost-aware schedule drafts a block per cycle.
        """
        block_size = block_size or self.draft_block_size
        sync = device_sync(anchor_ids.device, timed)
        start = time.perf_counter()
        mask_ids = anchor_ids.new_full((anchor_ids.shape[0], block_size - 1), self.config.mask_token_id)
        block_ids = torch.cat([anchor_ids[:, None], mask_ids], dim=1)  # [B, block]
        kept = cache.get_seq_length() + context_hidden_states.shape[1]
        corrected = correct and (block_size > 2 or self.scores_first_slot)
        decoding = self.decoding
        selection = selection or decoding.selection
        inputs = (block_ids, context_hidden_states, position_ids, attention_mask, cache, context_ids, context_valid)
        captured = False
        if isinstance(cache, StaticDraftContextCache):
            inputs, captured = self._static_layout(*inputs)
            captured = captured and self._compiled_draft is not None
        if captured:  # one graph: backbone, candidates and correction, timed whole (as the backbone's time)
            candidates, candidate_logits, chosen, first_scores, scores = self._compiled_draft(
                *inputs, selection, decoding.geometric_lambda, corrected
            )
            sync()
            backbone_seconds, corrector_seconds = time.perf_counter() - start, 0.0
        else:
            draft = self._draft_block(*inputs[:5])
            candidates, candidate_logits = draft[2], draft[3]
            sync()
            backbone_seconds = time.perf_counter() - start
            start = time.perf_counter()
            chosen = first_scores = scores = None
            if corrected:
                chosen, first_scores, scores = self.correct_candidates(
                    *draft, inputs[2], block_ids[:, 0], *inputs[5:], selection, decoding.geometric_lambda
                )  # [B, S], [B, K] or None, [B, S - 1, K, K]
            sync()
            corrector_seconds = time.perf_counter() - start if corrected else 0.0
        cache.truncate(kept)
        if chosen is None:
            chosen = torch.zeros(candidates.shape[:2], dtype=torch.long, device=candidates.device)
        tokens = candidates.gather(-1, chosen[..., None]).squeeze(-1)  # [B, S]
        return DraftProposal(
            tokens, candidates, candidate_logits, chosen, scores, first_scores, backbone_seconds, corrector_seconds
        )

    def _draft_block(
        self,
        block_ids: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        cache: DraftContextCache | StaticDraftContextCache,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.LongTensor, torch.Tensor, torch.Tensor | None]:
        """The backbone phase of `propose`: one forward over the block, then each slot's top-K candidates ->
        (block_hidden [B, block, H], context_states [B, N, H], candidates [B, S, K], their logits [B, S, K], their
        log-probabilities [B, S, K] or None)."""
        out = self(self.embed(block_ids), context_hidden_states, position_ids, attention_mask, cache)
        block_hidden = out.last_hidden_state  # [B, block, H]
        logits, column_tokens = self.proposal_logits(block_hidden[:, 1:])  # [B, S, V'] over the draft vocabulary
        return block_hidden, out.context_states, *self.slot_candidates(logits, column_tokens)

    def _draft(
        self,
        block_ids: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        cache: StaticDraftContextCache,
        context_ids: torch.LongTensor | None,
        context_valid: torch.BoolTensor | None,
        selection: str,
        geometric_lambda: float,
        corrected: bool,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor | None, torch.Tensor | None, torch.Tensor | None]:
        """A whole draft, what `compile_drafting` captures: (candidates, candidate logits, chosen, first-slot scores,
        transition scores), the last three None without correction."""
        draft = self._draft_block(block_ids, context_hidden_states, position_ids, attention_mask, cache)
        if not corrected:
            return draft[2], draft[3], None, None, None
        correction = self.correct_candidates(
            *draft, position_ids, block_ids[:, 0], context_ids, context_valid, selection, geometric_lambda
        )
        return draft[2], draft[3], *correction

    def _static_layout(
        self,
        block_ids: torch.LongTensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        cache: StaticDraftContextCache,
        context_ids: torch.LongTensor | None,
        context_valid: torch.BoolTensor | None,
    ) -> tuple[tuple, bool]:
        """`propose`'s inputs laid out for a static cache: (inputs, whether they have the block's one captured shape).

        A captured draft reads a fixed number of new context rows, `config.block_size` (the most one verify commits),
        so fewer are padded (zero states at position -2, masked; the next draft overwrites them) and the context ids
        span the whole buffer; more (a prompt, a run of plain steps) run eagerly on the same buffers.
        """
        (batch, block), new_rows = block_ids.shape, context_hidden_states.shape[1]
        padded_rows = max(new_rows, self.config.block_size)
        pad = padded_rows - new_rows
        visible = _visible_keys(attention_mask, batch, block, cache.length + new_rows + block, block_ids.device)
        mask = cache.place(batch, new_rows, padded_rows, block, visible, block_ids.device)  # [B, 1, block, capacity]
        positions = position_ids.expand(batch, -1)
        positions = torch.cat([positions[:, :new_rows], positions.new_full((batch, pad), -2), positions[:, new_rows:]], 1)
        context = nn.functional.pad(context_hidden_states, (0, 0, 0, pad))  # [B, padded rows, n_layers * H]
        if context_ids is not None:
            width = max(cache.capacity, context_ids.shape[1])
            valid = context_valid if context_valid is not None else torch.ones_like(context_ids, dtype=torch.bool)
            context_ids = nn.functional.pad(context_ids, (0, width - context_ids.shape[1]))
            context_valid = nn.functional.pad(valid, (0, width - valid.shape[1]))  # padding: no pair
        inputs = (block_ids, context, positions, mask, cache, context_ids, context_valid)
        return inputs, padded_rows == self.config.block_size

    def compile_drafting(self, enabled: bool = True, **compile_options: Any) -> "DCOCODrafter":
        """Capture every draft (the backbone forward over the block, each slot's top-K candidates, the transition
        scores of all K x K candidate pairs of each slot pair and the walk) as one compiled graph per block shape,
        or draft eagerly again with `enabled=False`. Returns self.

        Both engines then keep the drafter's context in a `StaticDraftContextCache`: its buffers have one shape and
        address for the whole call, each draft reads a fixed number of new context rows (`config.block_size`,
        padded and masked), so a (batch, block) shape is one graph; a draft with more new rows (a prompt, a run of
        plain steps) runs eagerly on the same buffers. `compile_options` go to `torch.compile`; the default is CUDA
        graphs on a GPU (`mode="reduce-overhead"`: one recorded graph per shape, replayed in one launch) and
        inductor's default elsewhere. Set it after `attach`, before generating.

        Lossless either way: the target verifies every draft. The drafts equal eager drafting on the same static
        cache wherever the compiled kernels round as the eager ones do (`backend="aot_eager"` runs the same kernels;
        inductor may fuse and reorder float sums, which can only swap candidates whose scores tie within rounding).
        A captured draft is timed whole (`DraftProposal.backbone_seconds`; the corrector's share is measured
        eagerly). Tables the corrector derives from the weights are built here, for the graph to read: after
        changing the weights (training, loading, `.to`), call it again. A drafter laid out with MKL's packed GEMM
        drafts through plain linear layers from then on (`unpack_for_capture`).
        """
        if not enabled:
            self._compiled_draft = None
            return self
        options = {"mode": "reduce-overhead"} if self.device.type == "cuda" and not compile_options else compile_options
        unpack_for_capture(self, self._tuning)  # no compiler takes MKL's packed weights
        self.corrector.prepare_capture(self.input_embedding())  # what the graph reads but cannot build
        compiled = torch.compile(self._draft, **options)
        cuda_graphs = options.get("mode") in ("reduce-overhead", "max-autotune")

        def draft(*args: Any) -> tuple:
            if not cuda_graphs:
                return compiled(*args)
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the graph reuses its output memory
            return tuple(None if x is None else x.clone() for x in compiled(*args))

        self._compiled_draft = draft
        return self

    def draft_cache(self, capacity: int) -> DraftContextCache | StaticDraftContextCache:
        """A context cache for one call: static (`capacity` columns to start with) when drafting is captured, else
        growing."""
        if self._compiled_draft is None:
            return DraftContextCache()
        cfg = self.config
        return StaticDraftContextCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                                       self.fc.weight.dtype, cfg.block_size)

    @property
    def drafting_compiled(self) -> bool:
        """Whether `compile_drafting` is on."""
        return self._compiled_draft is not None

    # ------------------------------------------------------------------ transformers assisted generation

    def generate(self, input_ids: torch.LongTensor | None = None, generation_config=None, **kwargs: Any):
        """Called by `target.generate(..., assistant_model=drafter)` once per speculation cycle.

        transformers' AssistedCandidateGenerator hands back whatever we return as `cache` on the next call of the
        same `generate()`: that is how one `DCOCOCandidateGenerator` (hooks, drafter context, statistics) lives
        exactly as long as one target `generate()` call.
        """
        if generation_config is None or not getattr(generation_config, "is_assistant", False):
            raise TypeError(
                "DCOCODrafter does not generate text by itself. Use "
                "`target.generate(**inputs, assistant_model=drafter)` (after `drafter.attach(target)`), or "
                "`dcoco_hf.speculative_generate(target, drafter, ...)` for batches."
            )
        handle = output_cache(kwargs)
        if not isinstance(handle, _EngineHandle):
            handle = self._start_call(generation_config)
        max_new_tokens = kwargs.get("max_new_tokens") or self.config.block_size - 1
        candidate_ids, candidate_logits = handle.engine.get_candidates(
            input_ids, max_new_tokens=max_new_tokens, scores=assisted_loop_scores()
        )
        return GenerateDecoderOnlyOutput(
            sequences=candidate_ids, scores=tuple(candidate_logits.unbind(1)), **cache_kwargs(handle)
        )

    def _start_call(self, generation_config: GenerationConfig) -> "_EngineHandle":
        """The first cycle of a target `generate()` call: a new engine, living as long as the call does.

        transformers drops our handle when the call returns or raises; the handle's finaliser then ends the engine,
        so the tap stops recording the target right there. One drafter serves one call at a time: a call from a
        second thread while one runs would mix their target states, so it is refused.
        """
        criteria = assisted_stopping_criteria()
        check_stopping_criteria(criteria, scores_requested=assisted_loop_scores() is not None)
        if criteria is None and getattr(generation_config, "stop_strings", None):
            raise ValueError(
                "stop_strings with a DCOCO drafter need transformers' assisted loop as of 5.17-5.25 (its stopping "
                "criteria could not be found); drop stop_strings or cut the text after generate()."
            )
        driver = assisted_driver()
        if driver is None:
            raise RuntimeError(
                f"transformers {TRANSFORMERS_VERSION}'s assisted loop could not be found calling the drafter, so its "
                "verifications cannot reach it. dcoco-hf supports the transformers releases in its pyproject.toml; "
                "install one of those, or use dcoco_hf.speculative_generate(target, input_ids, drafter=drafter)."
            )
        handle = _EngineHandle()
        self._claim(handle)  # before the engine exists: a refused call must not touch the running call's tap
        correct = self.decoding.use_corrector
        engine = handle.engine = DCOCOCandidateGenerator(
            self, generation_config, correct=correct, stopping_criteria=criteria, driver=driver
        )
        weakref.finalize(handle, engine.end_call)
        self.keep_call_statistics(engine)
        return handle

    def _claim(self, call: "_Call") -> None:
        """Make `call` (alive exactly as long as one generate() call) this drafter's call in progress."""
        with _CLAIM_LOCK:
            running = self._running() if self._running is not None else None
            if running is not None and running.thread != call.thread:
                raise RuntimeError(
                    "this drafter is already generating in another thread: one drafter serves one generate() call at "
                    "a time. Give each thread its own drafter (copy.deepcopy(drafter).attach(target, tune=False)) "
                    "and target, or serialise the calls."
                )
            self._running = weakref.ref(call)

    @contextmanager
    def one_call(self) -> Iterator[None]:
        """The duration of one generate() call of our own loop (`speculative_generate`); see `_claim`."""
        call = _Call()
        self._claim(call)
        try:
            yield
        finally:
            if self._running is not None and self._running() is call:
                self._running = None

    def keep_call_statistics(self, call: Any) -> None:
        """Make `call` what `generation_stats()` reads: the last generate() call's engine, or the batched loop's
        run (each has `stats` and `close(sequences)`)."""
        self._last_engine = call

    def generation_stats(self, sequences: torch.LongTensor | None = None):
        """Statistics of the last `target.generate(..., assistant_model=self)` call.

        Pass the returned sequences to also count the final cycle (transformers stops without telling the drafter).
        """
        engine = getattr(self, "_last_engine", None)
        if engine is None:
            raise RuntimeError(
                "No generate() call has consulted this drafter yet (a call with fewer than 2 new tokens never drafts)."
            )
        if sequences is not None:
            engine.close(sequences)
        return engine.stats

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """`PreTrainedModel.from_pretrained`, but a checkpoint missing backbone weights is an error, not a warning.

        A missing corrector is fine: public DFlash checkpoints have none, and a fresh (zero-output) corrector
        reproduces their argmax proposals exactly. Decoding choices given as keywords (`selection`, `geometric_lambda`,
        `block_tau`) override the folder's generation_config.json; other keywords override config.json as usual.
        """
        want_info = kwargs.pop("output_loading_info", False)
        decoding = {name: kwargs.pop(name) for name in DECODING_FIELDS if name in kwargs}
        # A public LiLiCorr folder names its head `lilicorr.*` (ours: `corrector.*`); other folders have no such keys.
        kwargs.setdefault("key_mapping", {r"^(model\.)?lilicorr\.": "corrector."})
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        hub = {name: kwargs[name] for name in _HUB_KEYWORDS if name in kwargs}
        _check_generation_config_file(source, kwargs)
        try:
            # transformers would report the backbone of a head-only folder as "newly initialized"; it is read next.
            with _quiet_loading_report(_names_base(source, kwargs.get("config"), hub)):
                model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except SafetensorError as error:  # safetensors' own message names neither the file nor the fix
            source = str(source)
            files = sorted(glob.glob(os.path.join(source, "*.safetensors"))) if os.path.isdir(source) else []
            raise OSError(
                f"Cannot read the drafter weights in {', '.join(files) or source} ({error}): the file is truncated "
                "or corrupt, e.g. by an interrupted download or save. Delete it, then download or save the checkpoint "
                "again."
            ) from error
        if model.config.base_drafter is not None:  # a head-only folder: the rest comes from the drafter it names
            info["missing_keys"] = model._fill_from_base(source, info.get("missing_keys", ()), hub)
        if "draft_token_ids" in info.get("missing_keys", ()):  # a DFlash export's draft vocabulary comes as `d2t`
            info["missing_keys"] = model._adopt_d2t(args[0] if args else kwargs["pretrained_model_name_or_path"], info)
        missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith("corrector."))
        if missing:
            raise ValueError(
                f"The checkpoint lacks {len(missing)} drafter weight(s), e.g. {missing[:4]}: it is not a complete "
                "DFlash/DCOCO drafter. Re-download or re-save the folder (model.safetensors must hold fc, hidden_norm, "
                "layers.* and norm)."
            )
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not _FOREIGN_KEY.match(k))
        overridden = sorted(set(kwargs) & set(vars(model.config)))
        if unexpected and overridden:  # the caller's config keywords turned those parts off: dropped on purpose
            logger.warning(f"config keywords {overridden} leave {len(unexpected)} saved weight(s) unused, e.g. "
                           f"{unexpected[:4]}")
        elif unexpected:  # weights the config has no place for: a config.json that does not describe them
            raise ValueError(
                f"The checkpoint holds {len(unexpected)} weight(s) this config has no place for, e.g. "
                f"{unexpected[:4]}: config.json does not describe these weights (e.g. corrector_type differs from the "
                "corrector saved, or num_hidden_layers is smaller than the layers saved). Fix config.json to match the "
                "weights, or load the folder the checkpoint was saved with."
            )
        mismatched = info.get("mismatched_keys") or []
        if mismatched:
            raise ValueError(f"Checkpoint tensors do not match the config's shapes: {list(mismatched)[:4]}.")
        if is_public_folder(model.config):
            model._adopt_public_lilicorr(info.get("missing_keys", ()))
        if model.config.legacy_decoding:
            logger.warning(
                f"config.json holds the decoding choices {sorted(model.config.legacy_decoding)}, which now live in "
                "generation_config.json; they were moved there on load (a value already there wins). Save the drafter "
                "again (save_pretrained) to write them where they belong."
            )
        # transformers also copies config keywords into the generation config; they belong to config.json alone.
        for name in set(kwargs) & set(vars(model.config)) - set(vars(GenerationConfig())):
            vars(model.generation_config).pop(name, None)
        model._settle_decoding(decoding)  # transformers replaced the generation config with the folder's
        return (model, info) if want_info else model

    @torch.no_grad()
    def _fill_from_base(self, source: str | os.PathLike, missing_keys: Any, hub: dict[str, Any]) -> list[str]:
        """After loading a folder that names a `base_drafter`: read the tensors its file lacks from the base's file.
        Returns the keys still missing (the caller's checks name them)."""
        missing = set(missing_keys)
        base = base_tensors(source, self.config.base_drafter, missing, **hub)
        self.load_state_dict(base, strict=False)
        self._draft_head = None  # the draft vocabulary may have come from the base
        missing -= set(base)
        head = sorted(name for name in missing if name.startswith("corrector."))
        if head:  # neither file has them: a fresh head would score a believable but wrong function
            raise ValueError(f"{source} and its base_drafter lack {len(head)} corrector tensor(s), e.g. {head[:4]}.")
        return sorted(missing)

    def _adopt_d2t(self, source: str | os.PathLike, info: dict) -> list[str]:
        """After loading a DFlash folder whose config names a draft vocabulary (`dcoco_hf.serving.export`, vLLM's layout): set
        it from the folder's `d2t` (draft column i proposes target token i + d2t[i]). Returns the keys still missing."""
        with safe_open(cached_file(str(source), "model.safetensors"), "pt") as file:
            if "d2t" not in set(file.keys()):  # neither our buffer nor d2t: the caller's error names what is missing
                return list(info["missing_keys"])
            d2t = file.get_tensor("d2t").long()
        self.set_draft_vocabulary(torch.arange(d2t.numel()) + d2t)
        return [k for k in info["missing_keys"] if k != "draft_token_ids"]

    def _adopt_public_lilicorr(self, missing_keys: Any) -> None:
        """After loading a public LiLiCorr folder: its head must be complete (a partly fresh head would score a
        believable but wrong function), and its scores are logit_scale * cos, i.e. our score gate at 1."""
        head = sorted(k for k in missing_keys if k.startswith("corrector.") and k != "corrector.score_gate")
        if head:
            raise ValueError(
                f"This LiLiCorr checkpoint lacks {len(head)} head tensor(s), e.g. {head[:4]} (named lilicorr.* in the "
                "file): check lilicorr_hidden_size, lilicorr_num_layers and lilicorr_factor_dim in its dflash_config."
            )
        self.corrector.set_gate(1.0)
        self.config.architectures = [type(self).__name__]  # from now on it is one of ours (saved as corrector.*)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args: Any,
        format: str = "dcoco",
        base_drafter: str | None = None,
        **kwargs: Any,
    ):
        """`PreTrainedModel.save_pretrained`; `format="lilicorr"` writes the public LiLiCorr format instead
        (`LiLiCorrDraftModel`, `dflash_config.lilicorr_*`, weights `lilicorr.*` next to the DFlash backbone, the score
        gate folded into `lilicorr_logit_scale`, no draft vocabulary), which the public servers load.

        Weights are written complete, also for a drafter loaded from a head-only folder. `base_drafter` (a folder
        relative to `save_directory`, an absolute path or a Hub id; see `DCOCOConfig.base_drafter`) writes only the
        tensors that are not bit-identical to that drafter's, and names it in config.json.
        """
        if format == "lilicorr":
            if base_drafter is not None:
                raise ValueError("format='lilicorr' writes complete weights: the public format names no base drafter.")
            return save_public(self, save_directory)
        if format != "dcoco":
            raise ValueError(f"format={format!r} is unknown: use 'dcoco' (ours, the default) or 'lilicorr' (public).")
        if base_drafter is not None:
            state = kwargs.pop("state_dict", None) or self.state_dict()
            base = base_tensors(save_directory, base_drafter, state)
            kwargs["state_dict"] = {name: t for name, t in state.items() if not _same_tensor(t, base.get(name))}
        loaded_from, self.config.base_drafter = self.config.base_drafter, base_drafter
        try:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.base_drafter = loaded_from
        save_network_code(save_directory)
        return saved


def network_code_files() -> list[Path]:
    """The network's code: modeling_dcoco.py and the package modules it imports (the configuration's included), the
    files a saved folder's auto_map needs."""
    source = Path(inspect.getfile(DCOCODraftModel))
    return sorted({source, *map(Path, get_relative_import_files(str(source)))})


def save_network_code(folder: str | os.PathLike) -> list[str]:
    """Copy the network's code into `folder` (a Hub folder carries the model; the runtime comes from the installed
    package) and return the file names."""
    files = network_code_files()
    for path in files:
        shutil.copyfile(path, Path(folder) / path.name)
    return [path.name for path in files]


# Tensors a DFlash folder may carry for other engines that this drafter reads elsewhere or not at all: the draft
# vocabulary's lm_head rows and its maps (EAGLE-3 style, `dcoco_hf.serving.export`), the target's embedding.
_FOREIGN_KEY = re.compile(r"^(model\.)?(d2t|t2d|lm_head\.weight|embed_tokens\.weight)$")

_CLAIM_LOCK = threading.Lock()


class _Call:
    """Alive exactly as long as one generate() call, in the thread that runs it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()


class _EngineHandle(_Call):
    """What transformers' AssistedCandidateGenerator stores as our `cache` between cycles: it lives exactly as long
    as one target `generate()` call.

    It only asks a cache for its length and to crop it; the engine re-synchronises from token ids itself, so both
    are no-ops here.
    """

    engine: DCOCOCandidateGenerator

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, max_length: int) -> None:
        return None


# from_pretrained keywords that say where and how to fetch files, passed on when fetching the base drafter.
_HUB_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "proxies", "token")


def _names_base(source: Any, config: Any, hub: dict[str, Any]) -> bool:
    """Whether the folder `source` (or the `config` passed with it) names a base drafter."""
    if config is not None or source is None:
        return getattr(config, "base_drafter", None) is not None
    try:
        return DCOCOConfig.get_config_dict(source, **hub)[0].get("base_drafter") is not None
    except OSError:  # no config to read: from_pretrained itself says what is wrong with the source
        return False


def _check_generation_config_file(source: Any, kwargs: dict[str, Any]) -> None:
    """Raise a ValueError naming the folder's generation_config.json unless it holds a JSON object: transformers
    would replace it by defaults without a word, losing the decoding choices and num_assistant_tokens it holds.
    `kwargs`: from_pretrained's, of which those saying where to find the file are used."""
    where = {name: kwargs[name] for name in (*_HUB_KEYWORDS, "revision", "subfolder") if name in kwargs}
    try:
        path = None if source is None else cached_file(
            str(source), GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False, **where
        )
    except OSError:  # no such folder or repository: from_pretrained itself says what is wrong with the source
        return
    if path is None:  # no generation config: the defaults, as transformers makes them
        return
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # a torn file, or bytes that are no text
        problem = str(error)
    else:
        problem = None if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object"
    if problem is not None:
        raise ValueError(
            f"{path} cannot be read as a generation config ({problem}). Fix the file, delete it to decode with the "
            "defaults, or save the drafter again (save_pretrained writes it)."
        )


def _not_a_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in record.getMessage()


@contextmanager
def _quiet_loading_report(quiet: bool) -> Iterator[None]:
    """Drop transformers' per-key loading report (one warning, logged by modeling_utils) while `quiet`."""
    report = logging.getLogger("transformers.modeling_utils")
    if quiet:
        report.addFilter(_not_a_load_report)
    try:
        yield
    finally:
        report.removeFilter(_not_a_load_report)  # a no-op when it was not added


def resolve_base(source: str | os.PathLike, base: str) -> str:
    """Where the base drafter named by the folder `source` (`config.base_drafter`) lives. A `base` starting with ./ or
    ../ is relative to `source`: a local folder, or for a Hub id `source` the repository it names ("../dcoco" from
    "org/lilicorr" is "org/dcoco"). Any other `base` is an absolute path or a Hub id as it stands."""
    if base.startswith(("./", "../")):
        return os.path.normpath(os.path.join(source, base))
    return base


def base_tensors(source: str | os.PathLike, base: str, names: Any, **hub: Any) -> dict[str, torch.Tensor]:
    """The tensors among `names` in the model.safetensors of the base drafter `base` named by the folder `source`."""
    where = resolve_base(source, base)
    try:
        path = cached_file(where, "model.safetensors", **hub)
    except OSError as error:
        raise OSError(
            f"{source} names base_drafter={base!r} for the weights its model.safetensors does not hold (the backbone), "
            f"but no drafter was found at {where} ({error}). Put the base drafter's folder at that path, or set "
            f"base_drafter in {source}'s config.json to its folder or Hub id."
        ) from error
    with safe_open(path, "pt") as file:
        return {name: file.get_tensor(name) for name in set(file.keys()) & set(names)}


def _same_tensor(tensor: torch.Tensor, other: torch.Tensor | None) -> bool:
    return other is not None and tensor.shape == other.shape and tensor.dtype == other.dtype and torch.equal(
        tensor.detach().cpu(), other)


@torch.no_grad()
def _copy_matching(source: nn.Module, destination: nn.Module) -> None:
    """Copy every parameter that exists under the same name and shape in both modules."""
    theirs = dict(source.named_parameters())
    for name, param in destination.named_parameters():
        if name in theirs and theirs[name].shape == param.shape:
            param.copy_(theirs[name])


def _visible_keys(
    mask: torch.Tensor | None, batch: int, block: int, keys: int, device: torch.device
) -> torch.BoolTensor:
    """`propose`'s attention mask (None, a key mask [B, keys], or a full mask [B, 1, block, keys]: 1 / True or an
    additive 0 where visible) -> which keys each block row sees, [B, block, keys]."""
    if mask is None:
        return torch.ones(batch, block, keys, dtype=torch.bool, device=device)
    if mask.is_floating_point():
        mask = mask > torch.finfo(mask.dtype).min / 2  # additive: 0 visible, a large negative (or -inf) masked
    mask = mask.bool()
    return mask[:, None, :].expand(-1, block, -1) if mask.dim() == 2 else mask[:, 0]


def spread_layer_ids(depth: int, count: int) -> list[int]:
    """`count` distinct target layers spread evenly from 1 to depth - 3 (clamped to the target's range)."""
    if depth < 1:
        raise ValueError("The target has no decoder layers.")
    low, high = min(1, depth - 1), max(min(1, depth - 1), depth - 3)
    count = max(1, min(count, high - low + 1))
    if count == 1:
        return [(low + high) // 2]
    return sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)})


def check_compatible(config: DCOCOConfig, target: PreTrainedModel) -> None:
    """Raise a ValueError naming the mismatch between a drafter config and a target, and the fix."""
    tcfg = target.config
    if getattr(tcfg, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(target).__name__} is an encoder-decoder model; DCOCO drafters speculate for decoder-only causal "
            "LMs (AutoModelForCausalLM)."
        )
    text = tcfg.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    # `conv` (LFM2-style short convolutions) keeps no recurrent state: transformers 5.24 crops it like attention.
    recurrent = sorted(layer_types - {"full_attention", "sliding_attention", "chunked_attention", "conv"})
    if recurrent:
        raise ValueError(
            f"The target has {recurrent} layers whose cache cannot be cropped after a rejected draft; speculative "
            "decoding needs a croppable (attention) KV cache."
        )
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if embeddings is None or lm_head is None:
        raise ValueError(f"{type(target).__name__} has no input embeddings or lm_head to lend the drafter.")
    if text.hidden_size != config.hidden_size:
        raise ValueError(
            f"Hidden size mismatch: the drafter is {config.hidden_size} wide, the target {text.hidden_size}. "
            "A drafter only fits the target (family) it was built for; build one with DCOCODrafter.from_target(target)."
        )
    vocab = embeddings.weight.shape[0]
    if vocab != config.vocab_size or lm_head.weight.shape[0] != vocab:
        raise ValueError(
            f"Vocabulary mismatch: the drafter expects {config.vocab_size} tokens, the target's embedding has {vocab} "
            f"and its lm_head {lm_head.weight.shape[0]}. Use the target the drafter was trained for."
        )
    positions = getattr(text, "max_position_embeddings", None)
    if isinstance(positions, int) and config.block_size > positions:
        raise ValueError(
            f"block_size={config.block_size} is more than the target's max_position_embeddings={positions}: a verify "
            "forward of one block would not fit the target. Use a drafter built for this target."
        )
    depth = len(decoder_layers(target))
    if max(config.target_layer_ids) >= depth:
        raise ValueError(
            f"target_layer_ids={config.target_layer_ids} is out of range: the target has {depth} decoder layers "
            f"(valid ids 0..{depth - 1}). The drafter was built for a deeper target; use a matching one."
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < vocab:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is not a token of the target's {vocab}-row embedding table; set "
            "config.mask_token_id to the id the drafter was trained with."
        )




__all__ = ["DCOCODrafter", "DCOCOGenerationConfig", "check_compatible", "network_code_files", "save_network_code", "spread_layer_ids"]
