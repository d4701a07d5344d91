"""Configuration of the DCOCO drafter: a DFlash parallel drafter plus the DCOCO contextual corrector.

DFlash (block diffusion drafter) reads hidden states of a few target layers and predicts a whole block in one forward;
DCOCO ("Contextual Correction of Parallel Drafts for Speculative Decoding", arXiv:2610.12570) re-selects each slot's
token among its top-K candidates with a transition score between adjacent slots.

The backbone fields are the Qwen3 ones, so public DFlash checkpoints (whose `config.json` says `model_type: qwen3`)
load into this class. Their DFlash fields may sit at the top level or inside `dflash_config`; both are accepted.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from transformers import PreTrainedConfig

from .corrector import WALKS, walk_name
from .correctors import corrector_class
from .lilicorr import config_from_public

SELECTIONS = WALKS
# The RoPE base of a config that names none: the public DFlash checkpoints' (Qwen3's 1e6). `from_target` copies the
# target's own RoPE settings, which every RoPE model's transformers 5 config holds, so this applies there only to a
# target without RoPE (learned positions), whose drafter may use any base.
DEFAULT_ROPE_THETA = 1_000_000.0
# AutoModel only: a drafter cannot generate on its own (it needs the target's states), so no AutoModelForCausalLM.
AUTO_MAP = {
    "AutoConfig": "configuration_dcoco.DCOCOConfig",
    "AutoModel": "modeling_dcoco.DCOCODraftModel",
}


# What a config.json value must be, by the field's declared type (None allowed where the declaration allows it):
# checked before any conversion, so `block_size: "abc"` or `2.5` in a config.json is refused naming the field.
_INT, _FLOAT, _BOOL, _STR, _INTS, _STRS = "an integer", "a number", "true or false", "a string", "a list of integers", (
    "a list of strings")
_KINDS = {"int": _INT, "float": _FLOAT, "bool": _BOOL, "str": _STR, "list[int]": _INTS, "list[str]": _STRS}


def _has_type(value: Any, kind: str) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == _INT:
        return is_int
    if kind == _FLOAT:
        return is_int or isinstance(value, float)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    item = _INT if kind == _INTS else _STR
    return isinstance(value, (list, tuple)) and all(_has_type(v, item) for v in value)


def check_field_types(values: Mapping[str, Any]) -> None:
    """Raise a ValueError naming the first field of `values` (config.json's fields) whose value has the wrong type."""
    for name, kind in {**_FIELD_TYPES, **_LEGACY_FIELD_TYPES}.items():
        value = values.get(name)
        if value is not None and not _has_type(value, kind):
            raise ValueError(f"config field {name}={value!r} must be {kind}; fix it in config.json.")


class DCOCOConfig(PreTrainedConfig):
    r"""
    Args:
        vocab_size: vocabulary of the target (the drafter borrows its embedding and lm_head).
        hidden_size: width of the drafter, equal to the target's hidden size.
        intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
        rms_norm_eps, rope_theta, rope_parameters, max_position_embeddings, attention_bias, attention_dropout:
            Qwen3-style decoder layers of the drafter backbone.
        block_size: the block (anchor, i.e. the last committed token, plus `block_size - 1` mask slots) the drafter
            was trained to draft, the longest it drafts; a LiLiCorr head is sized for it. Each cycle drafts a block
            of at most this size: the cost-aware schedule plans one per cycle, and the generation config's
            `num_assistant_tokens` (transformers' own name) caps the slots proposed. A config.json written with
            the older `max_block_size` (the longest block of mixed-horizon training) loads with that as block_size.
        mask_token_id: token id whose (target) embedding fills the mask slots.
        target_layer_ids: 0-based target decoder layers whose outputs feed the drafter (`hidden_states[i + 1]`).
        num_target_layers: number of decoder layers of the target the drafter was built for.
        top_k: candidates kept per slot by the corrector (K).
        corrector_rank: width r of the candidate representations and slot-pair state.
        corrector_hidden: hidden width of the transition MLP (3r + 2 -> corrector_hidden -> 1).
        correct_first_slot: also score the anchor -> slot 1 transitions, so the walk may re-select slot 1 (our
            extension; the paper's walk keeps slot 1 at the drafter argmax). Needs a corrector trained with it.
        context_bigrams: the corrector also reads whether each candidate pair (a, b) already occurs in the
            committed text (our extension, dcoco_hf/network/corrector.py; a LiLiCorr head reads it through its pair
            evidence, dcoco_hf/network/lilicorr.py). Needs a corrector trained with it.
        corpus_bigrams: when set, the corrector also reads how often each candidate pair was written in the
            target's training answers; the value is the number of distinct pairs counted, whose counts are stored
            with the weights (`CorpusBigrams`, our extension; LiLiCorr: as context_bigrams). Needs a corrector
            trained with it. None: off.
        draft_vocab_size: when set, the drafter proposes only from this many target tokens (a frequency-ranked
            draft vocabulary, as in FR-Spec; the ids are stored with the weights as `draft_token_ids`). Outputs are
            unchanged since the target verifies every token; the drafter's lm_head gets vocab_size /
            draft_vocab_size times cheaper. None: the whole vocabulary.
        corrector_type: which corrector re-selects the candidates: "dcoco" (the transition MLP, default; every config
            written before this field loads as "dcoco"), "lilicorr" (`dcoco_hf/network/lilicorr.py`: one lattice
            transformer, cosine scores) or "dflash2" (`dcoco_hf/network/selector.py`: DFlash2's low-rank bilinear
            candidate selector). All feed the same walks. A public LiLiCorr checkpoint (`dflash_config.lilicorr_*`)
            loads as "lilicorr".
        lilicorr_hidden_size, lilicorr_num_layers, lilicorr_num_heads, lilicorr_mlp_ratio, lilicorr_factor_dim,
        lilicorr_vector_eps, lilicorr_logit_scale: the LiLiCorr head's width (0: the drafter's), lattice transformer,
            in/out vector width, norm floor and cosine scale, named as in the public format's `dflash_config`.
        selector_rank: width r of the DFlash2 candidate selector's token codes (`corrector_type="dflash2"`,
            `dcoco_hf/network/selector.py`); its candidates per slot are `top_k` (the public `selector_top_k`).
        base_drafter: when set, this folder's model.safetensors holds only the tensors that differ from another
            drafter's (e.g. a corrector head trained on a frozen backbone), and `from_pretrained` reads the rest from
            that drafter, as PEFT adapters name their base model: a path relative to this folder, starting with ./ or
            ../ (`"../dcoco-smollm2-135m"`; from a Hub repository "org/name" it names "org/dcoco-smollm2-135m"), an
            absolute path, or a Hub id (`"org/dcoco-smollm2-135m"`). None: the file is complete.
            `save_pretrained(folder)` writes complete weights; `save_pretrained(folder, base_drafter=...)` writes
            only what differs from that drafter.

    How the drafter decodes (the corrector's walk, the measured tau per block size) is no architecture: it lives in
    the drafter's generation config (`DecodingChoices`). `selection`, `geometric_lambda` and `block_tau`, which
    config.json held before, are still accepted here and kept in `legacy_decoding` (never saved) for the drafter to
    move into its generation config.
    """

    model_type = "dcoco"

    # Declared fields: typed, and recognised by transformers as model settings (it refuses to save an undeclared
    # `top_k`, taking it for a sampling parameter).
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    layer_types: list[str] | None = None
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    top_k: int = 16
    corrector_rank: int = 128
    corrector_hidden: int = 256
    correct_first_slot: bool = False
    context_bigrams: bool = False
    corpus_bigrams: int | None = None
    draft_vocab_size: int | None = None
    corrector_type: str = "dcoco"
    lilicorr_hidden_size: int = 128
    lilicorr_num_layers: int = 2
    lilicorr_num_heads: int = 4
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_factor_dim: int = 64
    lilicorr_vector_eps: float = 1e-4
    lilicorr_logit_scale: float = 10.0
    selector_rank: int = 16
    base_drafter: str | None = None

    def __init__(
        self, rope_theta: float | None = None, dflash_config: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Every field is a keyword named and defaulted once, in the declarations above. `rope_theta` is the older
        spelling of `rope_parameters["rope_theta"]`; `dflash_config` is where public DFlash checkpoints keep their
        DFlash fields (and a public LiLiCorr checkpoint its head's), read when the top level lacks them."""
        given = {name: kwargs.pop(name) for name in _DECLARED if name in kwargs}
        _read_legacy_block_sizes(given, kwargs)
        dflash_config = dict(dflash_config or {})
        for name in ("block_size", "mask_token_id", "target_layer_ids"):
            if given.get(name) is None and name in dflash_config:
                given[name] = dflash_config[name]
        check_field_types({**given, "rope_theta": rope_theta})
        given.update(config_from_public(dflash_config) or {})  # a LiLiCorr head's geometry (candidate_topk: top_k)
        if given.get("block_size") is None:  # block_size=None: the checkpoint's own, else the declared default
            given.pop("block_size", None)
        values = {**_DECLARED, **given}
        hidden, layers = values["hidden_size"], values["num_hidden_layers"]
        values.update(
            head_dim=values["head_dim"] if values["head_dim"] is not None else hidden // values["num_attention_heads"],
            rope_parameters=_rope_parameters(rope_theta, values["rope_parameters"]),
            layer_types=(
                list(values["layer_types"]) if values["layer_types"] is not None else ["full_attention"] * layers
            ),
            block_size=int(values["block_size"]),
            target_layer_ids=list(values["target_layer_ids"]) if values["target_layer_ids"] is not None else None,
            correct_first_slot=bool(values["correct_first_slot"]),
            context_bigrams=bool(values["context_bigrams"]),
            corpus_bigrams=int(values["corpus_bigrams"]) if values["corpus_bigrams"] is not None else None,
            lilicorr_hidden_size=int(values["lilicorr_hidden_size"]) or hidden,  # 0 means the drafter's width
        )
        for name in ("lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_factor_dim"):
            values[name] = int(values[name])
        for name in ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale"):
            values[name] = float(values[name])
        for name, value in values.items():
            setattr(self, name, value)
        # Decoding choices a config.json written before they moved to generation_config.json still holds.
        self.legacy_decoding = {name: kwargs.pop(name) for name in DECODING_FIELDS if name in kwargs}
        kwargs.setdefault("tie_word_embeddings", False)
        # Always our own classes, also when the folder came from a public DFlash checkpoint with its own auto_map.
        kwargs["auto_map"] = dict(AUTO_MAP)
        super().__init__(**kwargs)
        self.check_dcoco_fields()

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("legacy_decoding", None)  # moved into the drafter's generation config, saved there
        return output

    def check_dcoco_fields(self) -> None:
        """Raise a ValueError naming the bad field and the fix."""
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}: a block needs the anchor plus at least one mask slot (>= 2)."
            )
        positions = self.max_position_embeddings
        if isinstance(positions, int) and self.block_size > positions:
            raise ValueError(
                f"block_size={self.block_size} is more than max_position_embeddings={positions}: the drafter cannot "
                "hold a block longer than its positions. Fix block_size in config.json (the block the drafter was "
                "trained on)."
            )
        self.check_corrector_fields()
        if self.top_k < 1 or self.top_k > self.vocab_size:
            raise ValueError(f"top_k={self.top_k} must lie in [1, vocab_size={self.vocab_size}].")
        if self.draft_vocab_size is not None and not self.top_k <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must lie in [top_k={self.top_k}, "
                f"vocab_size={self.vocab_size}]; use None to propose from the whole vocabulary."
            )
        if self.corpus_bigrams is not None and self.corpus_bigrams < 1:
            raise ValueError(
                f"corpus_bigrams={self.corpus_bigrams} must be the number of pairs counted (>= 1), or None for off."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers.")
        unsupported = sorted(set(self.layer_types) - {"full_attention"})
        if unsupported:
            raise ValueError(
                f"layer_types {unsupported} are not supported: DCOCO drafters use full (bidirectional-in-block) "
                "attention in every layer. Convert the checkpoint or use a full-attention DFlash drafter."
            )
        if self.target_layer_ids is not None:
            if len(self.target_layer_ids) == 0:
                raise ValueError("target_layer_ids is empty; list at least one target decoder layer.")
            if min(self.target_layer_ids) < 0:
                raise ValueError(f"target_layer_ids={self.target_layer_ids} holds a negative layer index.")
            if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
                raise ValueError(
                    f"target_layer_ids={self.target_layer_ids} is out of range for a target with "
                    f"num_target_layers={self.num_target_layers} (valid: 0..{self.num_target_layers - 1})."
                )


    def check_corrector_fields(self) -> None:
        """Raise a ValueError naming the bad corrector field and the fix (the corrector checks its own fields)."""
        corrector_class(self.corrector_type).check_config(self)


# Each field's default and checked type, as declared on DCOCOConfig (the one place a field is named, typed and
# defaulted); `rope_theta` is the older spelling of a RoPE setting.
CONFIG_FIELDS = tuple(DCOCOConfig.__annotations__)
_DECLARED = {name: getattr(DCOCOConfig, name) for name in CONFIG_FIELDS}
# Fields older config.json files hold, read into the declared ones (`_read_legacy_block_sizes`).
_LEGACY_FIELD_TYPES = {"max_block_size": _INT, "lilicorr_block_size": _INT}
_FIELD_TYPES = {
    name: _KINDS[annotation.removesuffix(" | None")]
    for name, annotation in {**DCOCOConfig.__annotations__, "rope_theta": "float"}.items()
    if annotation.removesuffix(" | None") in _KINDS
}


@dataclass(frozen=True)
class DecodingChoices:
    r"""How a drafter decodes, read from its generation config (generation_config.json; `DCOCODrafter.decoding`).

    Args:
        selection: how the block is read off the transition scores: "prefix_first" (the paper's walk; "greedy" in
            older checkpoints), "viterbi" (best global path, paper's control) or "geometric" (global path with
            transitions weighted by `geometric_lambda ** p`, paper's second control).
        geometric_lambda: decay of the geometric walk.
        block_tau: tau measured at each block size, {"B": tau}, with the corrector on, on held-out prompts (the
            model card says which). With cycle times timed on the machine at hand it picks the block size of highest
            tau / cycle time (DScout; dcoco_hf/runtime/block_choice.py). None: not measured; the drafter drafts
            `block_size`.
        use_corrector: False drafts plain DFlash argmax blocks (the bench's baseline).
        time_phases: wait for the device before reading the clock in each phase (exact GPU phase times at one sync
            per phase, which the bench asks for; on CPU times are exact anyway).
        tree_budget: the most nodes a cycle's draft tree may have in the batched loop (`speculative_generate`, the
            Hub `custom_generate` folder): trees of the candidates ranked by the corrector's transition scores,
            sized per cycle by the cost model (dcoco_hf/runtime/trees.py). 0 (the default): chains only, since
            trees measured no faster than chains on the CPUs timed (docs/trees.md); set it where they are.
            transformers' assisted loop verifies chains whatever it says.
    """

    selection: str = "prefix_first"
    geometric_lambda: float = 0.75
    block_tau: dict[str, float] | None = None
    use_corrector: bool = True
    time_phases: bool = False
    tree_budget: int = 0

    @classmethod
    def read(cls, values: Mapping[str, Any], config: DCOCOConfig) -> DecodingChoices:
        """The choices in `values` (a generation config's attributes; a missing one takes its default), checked
        against the drafter's `config`. Raises a ValueError naming the bad field and the fix."""
        defaults = cls()
        selection = values.get("selection", defaults.selection)
        if not isinstance(selection, str):
            raise ValueError(f"selection={selection!r} (generation config) must be a string, one of {list(WALKS)}.")
        selection = walk_name(selection)  # a legacy "greedy" is "prefix_first"
        geometric_lambda = values.get("geometric_lambda", defaults.geometric_lambda)
        if not _has_type(geometric_lambda, _FLOAT) or not 0.0 < geometric_lambda <= 1.0:
            raise ValueError(f"geometric_lambda={geometric_lambda} (generation config) must lie in (0, 1].")
        block_tau = values.get("block_tau", defaults.block_tau)
        if block_tau is not None:
            if not isinstance(block_tau, Mapping) or not all(
                str(b).isdigit() and _has_type(t, _FLOAT) for b, t in block_tau.items()
            ):
                raise ValueError(f"block_tau={block_tau!r} (generation config) must map block sizes to measured tau, "
                                 'e.g. {"2": 1.6, "3": 2.0}; use None when it was not measured.')
            # JSON keys are strings, so the table is keyed by str(B) whichever way it was written.
            block_tau = {str(b): float(t) for b, t in sorted((int(b), t) for b, t in block_tau.items())}
            largest = config.block_size
            bad = {b: t for b, t in block_tau.items() if not (2 <= int(b) <= largest and 1.0 <= t <= int(b))}
            if bad or not block_tau:
                raise ValueError(
                    f"block_tau={block_tau} (generation config): needs one tau per measured block size B in [2, "
                    f"{largest}] (the largest trained block), each in [1, B]; wrong: {bad}. Use None when it was not "
                    "measured (scripts/record_block_tau.py records it from bench JSON files)."
                )
        switches = {name: values.get(name, getattr(defaults, name)) for name in ("use_corrector", "time_phases")}
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} (generation config) must be true or false.")
        tree_budget = check_tree_budget(values.get("tree_budget", defaults.tree_budget), "(generation config) ")
        return cls(selection, geometric_lambda, block_tau, **switches, tree_budget=tree_budget)


# The largest draft tree a cycle may verify: its nodes are one verify forward's columns, which the tuning times.
MAX_TREE_BUDGET = 64


def check_tree_budget(value: Any, where: str = "") -> int:
    """`value` as a tree budget (an integer in [0, MAX_TREE_BUDGET]: a Python, NumPy or 0-d tensor integer), or a
    ValueError naming `tree_budget`."""
    try:
        budget = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        budget = None
    if budget is None or not 0 <= budget <= MAX_TREE_BUDGET:
        raise ValueError(
            f"tree_budget={value!r} {where}must be an integer in [0, {MAX_TREE_BUDGET}]: the most nodes a cycle's "
            "draft tree may have (0: chains only)."
        )
    return budget


DECODING_FIELDS = tuple(field.name for field in fields(DecodingChoices))


def _read_legacy_block_sizes(given: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Fold the block sizes older config.json files kept beside `block_size` into it: `max_block_size` (the longest
    block of mixed-horizon training, block_size then the default drafted one) and `lilicorr_block_size` (the block a
    LiLiCorr head is sized for, which its weights fix)."""
    longest, head = kwargs.pop("max_block_size", None), kwargs.pop("lilicorr_block_size", None)
    check_field_types({"max_block_size": longest, "lilicorr_block_size": head})
    if head is not None:
        given["block_size"] = head
    elif longest is not None:
        given["block_size"] = max(int(given.get("block_size") or 0), longest)


def _rope_parameters(rope_theta: float | None, rope_parameters: dict[str, Any] | None) -> dict[str, Any]:
    """Accept both spellings of RoPE settings: transformers 4 `rope_theta` and transformers 5 `rope_parameters`."""
    params = dict(rope_parameters or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    if rope_theta is not None:
        params.setdefault("rope_theta", rope_theta)
    params.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    return params


__all__ = ["CONFIG_FIELDS", "DCOCOConfig", "DecodingChoices", "MAX_TREE_BUDGET", "check_tree_budget"]
