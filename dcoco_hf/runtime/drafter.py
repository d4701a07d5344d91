"""The dcoco-hf runtime of a drafter: `DCOCODrafter`, the network (`network.modeling_dcoco.DCOCODraftModel`) bound
to a target.

Its jobs: load and save (the network's strict loading, plus the decoding choices of its generation config), attach
(check the pair, borrow the target's embedding and lm_head, tap its hidden states, tune both for the device), and
`propose` (one drafted and corrected block, `drafting.py`). The calls it serves are not its own:
`target.generate(**inputs, assistant_model=drafter)` reaches the adapter (`candidate_generator.py`, through the
`generate` delegate below), the batched loop is `generation.py`, and each call's lifetime and statistics are the
engine's (`engine.py`).

A Hub folder carries the network's code only; its class hands loading over to this one wherever the package is
installed (`DCOCODraftModel.from_pretrained`), so `AutoModel.from_pretrained(folder, trust_remote_code=True)` builds
a `DCOCODrafter`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from ..network.configuration_dcoco import DECODING_FIELDS, DCOCOConfig, DecodingChoices
from ..network.lilicorr import save_public
from ..network.modeling_dcoco import HUB_KEYWORDS, DCOCODraftModel, read_tensors, register_runtime, resolve_base
from .candidate_generator import assisted_cycle
from .context_cache import DraftContextCache, StaticDraftContextCache
from .drafting import DraftInputs, DraftProposal, Walk, block_of, draft, whole_draft
from .engine import call_statistics
from .hf_compat import keep_own_keys
from .logs import log, logger
from .precision import precision_notes
from .acceptance import AcceptanceModel, chain_prior
from .costs import CycleCosts
from .proposal import COST_SCHEDULE, CostModel, check_schedule
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
        keep_own_keys(generation_config)
        return generation_config


@register_runtime  # a Hub folder's copy of the network hands its loading over to this class
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
        self._cost_model: CostModel | None = None  # what the cost-aware schedule knows, kept across calls
        self._compiled_draft: Any = None  # `compile_drafting`: the compiled whole draft, or None (eager)
        self.last_call: Any = None  # what `generation_stats` reads (`engine.keep_call_statistics`)

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
            rope_parameters=_full_attention_rope(tcfg),  # None: the config's default base
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
            _warm_start(target, drafter)
        return drafter.attach(target, tune=False)  # an untrained drafter: tune once it is trained

    def attach(self, target: PreTrainedModel, tune: bool = True, **tune_options: Any) -> "DCOCODrafter":
        """Bind the drafter to `target`: borrow its embedding and lm_head and tap its hidden states. Returns self.

        With `tune` (the default), also make both fast on the device at hand and log one line saying how
        (`dcoco_hf.runtime.tuning.tune`: on CPU the GQA-aware attention and the measured few-rows linear layouts, on
        every device the block size of highest recorded tau per timed cycle; measured once per machine and model pair,
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
        self._tap, self._tuning, self._cost_model = None, None, None
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
    def cost_model(self) -> CostModel:
        """What the cost-aware schedule knows of this drafter on this machine: the cycle costs `attach` timed here
        (None untuned: then the largest block is drafted and every slot proposed), those timed at other batch sizes
        (`tuning.time_batch`), the tau per block size, and the acceptance fit, which learns across calls from the
        drafter's `block_tau` prior on. Assign `drafter.cycle_costs` to use other costs, at every batch size."""
        slots = self.config.block_size - 1
        model = self._cost_model
        if model is None or model.acceptance.slots != slots:
            costs = model.costs if model is not None else (self._tuning.costs if self._tuning else None)
            timed = dict(model.batch_costs if model is not None else self._tuning.batch_costs if self._tuning
                         else {})
            block_tau = {int(b): float(t) for b, t in (self.decoding.block_tau or {}).items()}
            prior = chain_prior(self.decoding.block_tau, slots)
            model = self._cost_model = CostModel(costs, AcceptanceModel(prior), block_tau, timed)
        return model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        """Use `model`'s costs and learned state from the next call on (e.g. a copy kept per setting, so that what
        one setting's cycles teach does not steer another's)."""
        if not isinstance(model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(model).__name__}")
        self._cost_model = model

    @property
    def cycle_costs(self) -> CycleCosts | None:
        return self.cost_model.costs

    @cycle_costs.setter
    def cycle_costs(self, costs: CycleCosts | None) -> None:
        """Costs set by hand stand for every batch size: batched calls time nothing then."""
        model = self.cost_model
        model.costs, model.batch_costs, model.per_batch = costs, {}, False

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
        keep_own_keys(generation)  # else saved keys would not load back (DCOCOGenerationConfig)

    @property
    def tuning(self) -> Tuning | None:
        """What `attach` did to make target and drafter fast here (None with `tune=False`)."""
        return self._tuning

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_tap=None, _tuning=None, _unhook=None, _cost_model=None, _compiled_draft=None, last_call=None)
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
        inputs = DraftInputs(
            block_of(anchor_ids, block_size, self.config.mask_token_id), context_hidden_states, position_ids,
            attention_mask, cache, context_ids, context_valid,
        )
        decoding = self.decoding
        corrected = correct and (block_size > 2 or self.scores_first_slot)
        walk = Walk(selection or decoding.selection, decoding.geometric_lambda) if corrected else None
        return draft(self, inputs, walk, timed=timed, compiled=self._compiled_draft)

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
        compiled = torch.compile(whole_draft, **options)
        cuda_graphs = options.get("mode") in ("reduce-overhead", "max-autotune")

        def captured(walk: Walk | None, **fields: Any) -> tuple:
            if not cuda_graphs:
                return compiled(self, walk, **fields)
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the graph reuses its output memory
            return tuple(None if x is None else x.clone() for x in compiled(self, walk, **fields))

        self._compiled_draft = captured
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

    # ------------------------------------------------------------------ the calls it serves

    def generate(self, input_ids: torch.LongTensor | None = None, generation_config=None, **kwargs: Any):
        """Called by `target.generate(..., assistant_model=drafter)` once per speculation cycle: the adapter's
        (`candidate_generator.assisted_cycle`)."""
        return assisted_cycle(self, input_ids, generation_config, kwargs)

    def generation_stats(self, sequences: torch.LongTensor | None = None):
        """Statistics of the last `target.generate(..., assistant_model=self)` or `speculative_generate` call (one
        `DCOCOStats`, or one per row). Pass the returned sequences to also count the final cycle (transformers stops
        without telling the drafter)."""
        return call_statistics(self, sequences)

    # ------------------------------------------------------------------ loading and saving

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """The network's strict loading (`DCOCODraftModel.from_pretrained`: complete, head-only, DFlash and LiLiCorr
        folders), then the drafter's decoding choices. Decoding choices given as keywords (`selection`,
        `geometric_lambda`, `block_tau`, ...) override the folder's generation_config.json; other keywords override
        config.json as usual."""
        want_info = kwargs.pop("output_loading_info", False)
        decoding = {name: kwargs.pop(name) for name in DECODING_FIELDS if name in kwargs}
        _check_generation_config_file(args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
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
        tensors whose values differ from that drafter's (a backbone stored there in bf16 and upcast here counts as the
        same), and names it in config.json.
        """
        if format == "lilicorr":
            if base_drafter is not None:
                raise ValueError("format='lilicorr' writes complete weights: the public format names no base drafter.")
            return save_public(self, save_directory)
        if format != "dcoco":
            raise ValueError(f"format={format!r} is unknown: use 'dcoco' (ours, the default) or 'lilicorr' (public).")
        if base_drafter is not None:
            state = kwargs.pop("state_dict", None) or self.state_dict()
            base = read_tensors(resolve_base(save_directory, base_drafter), "model.safetensors", set(state), {},
                                named_by=(save_directory, base_drafter))
            kwargs["state_dict"] = {name: t for name, t in state.items() if not _same_tensor(t, base.get(name))}
        loaded_from, self.config.base_drafter = self.config.base_drafter, base_drafter
        try:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.base_drafter = loaded_from
        save_network_code(save_directory)
        return saved


def _check_generation_config_file(source: Any, kwargs: dict[str, Any]) -> None:
    """Raise a ValueError naming the folder's generation_config.json unless it holds a JSON object: transformers
    would replace it by defaults without a word, losing the decoding choices and num_assistant_tokens it holds.
    `kwargs`: from_pretrained's, of which those saying where to find the file are used."""
    where = {name: kwargs[name] for name in (*HUB_KEYWORDS, "revision", "subfolder") if name in kwargs}
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


def _same_tensor(tensor: torch.Tensor, other: torch.Tensor | None) -> bool:
    """Whether `tensor` holds exactly the values of the base's `other`. Floating tensors compare by value (float64
    holds every fp32, bf16 and fp16 value exactly), so a head trained in fp32 on a frozen backbone stored in bf16 still
    finds its backbone in the base: loading reads the base's values, which are the same numbers."""
    if other is None or tensor.shape != other.shape:
        return False
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point() and other.is_floating_point():
        return torch.equal(tensor.double(), other.double())
    return tensor.dtype == other.dtype and torch.equal(tensor, other)


@torch.no_grad()
def _full_attention_rope(text_config: Any) -> dict | None:
    """The target's RoPE settings for the drafter, whose attention reads the whole context: a target with settings
    per layer type (Gemma 3: a local base for sliding layers, a global one for full ones) gives its full-attention
    ones."""
    rope = getattr(text_config, "rope_parameters", None)
    kinds = set(getattr(text_config, "layer_types", None) or ())
    if isinstance(rope, dict) and rope and set(rope) <= kinds:
        return rope.get("full_attention") or next(iter(rope.values()))
    return rope


@torch.no_grad()
def _warm_start(target: PreTrainedModel, drafter: DCOCODrafter) -> None:
    """Start the drafter's layers and final norm from the target's last layers and final norm, where the target's
    layers compute what the drafter's do.

    A layer is copied only from a target layer of the drafter's own make (no parameter the drafter's lacks, a SiLU
    MLP); a drafter layer may hold what the target's does not (Llama has no QK-norm, which then starts as the
    identity). Norms are copied by their effective scale, so a target whose RMSNorm multiplies by 1 + w gives the
    drafter's x * w norm the same function. A Gemma layer normalizes around its attention and MLP and runs a GELU:
    such a target leaves every drafter layer, and the final norm, fresh. That norm's scale (about 26 on Gemma 3 270M)
    fits the target's own last states, not a fresh drafter's: on Gemma 3 270M's answers a fresh drafter's slot loss
    started at 34, at 577 with the norm copied as stored and at 604 by its effective scale."""
    decoder = target.get_decoder()
    sources = decoder.layers[-len(drafter.layers):]
    activation = getattr(target.config.get_text_config(), "hidden_act", None)
    if activation not in ("silu", "swish") or any(not _structure(s) <= _structure(d) for s, d in
                                                  zip(sources, drafter.layers)):
        log(f"init_from_target: the target's {type(sources[0]).__name__} computes another function than a drafter "
            "layer (norm placement or activation); the drafter starts fresh")
        return
    _copy_norm(decoder.norm, drafter.norm)
    for source, layer in zip(sources, drafter.layers):
        theirs = dict(source.named_parameters())
        for name, param in layer.named_parameters():
            owner = name.rpartition(".")[0]
            if name not in theirs or theirs[name].shape != param.shape:
                continue
            if owner.endswith("norm"):
                _copy_norm(source.get_submodule(owner), layer.get_submodule(owner))
            else:
                param.copy_(theirs[name])


def _structure(layer: nn.Module) -> set[str]:
    """The names of a layer's parameters: what it computes with."""
    return {name for name, _ in layer.named_parameters()}


@torch.no_grad()
def _copy_norm(source: nn.Module, destination: nn.Module) -> None:
    """Give the drafter's RMSNorm (x / rms(x) * w) the effective per-channel scale of the target's: its output on a
    vector of ones (rms 1) is that scale over sqrt(1 + eps), whatever the target stores (w, or 1 + w's w)."""
    weight = destination.weight
    if getattr(source, "weight", None) is None or source.weight.shape != weight.shape:
        return
    eps = getattr(source, "variance_epsilon", getattr(source, "eps", 1e-6))
    ones = torch.ones(1, weight.shape[0], dtype=source.weight.dtype, device=source.weight.device)
    weight.copy_((source(ones)[0].float() * math.sqrt(1.0 + eps)).to(weight.dtype))


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


__all__ = ["DCOCODrafter", "DCOCOGenerationConfig", "check_compatible", "network_code_files", "save_network_code",
           "spread_layer_ids"]
