"""Batch-size benchmark: aggregate output tokens/s of plain batched `generate()` vs batched DFlash vs batched DCOCO.

* ``vanilla``: `target.generate(batch, attention_mask=...)` (left-padded).
* ``dflash``: `speculative_generate(..., correct=False)`: the drafter's backbone, argmax blocks, same weights.
* ``dcoco``: `speculative_generate(...)` with the corrector.

For each batch size, the prompts are cut into batches (the prompt list is cycled to fill the last one) and every
batch runs every method back to back, in an order rotated per batch, so slow phases of a shared machine hit all
methods alike and the ratios measured in one run stay fair. tau = committed tokens / target forwards, summed over
rows (one batched forward counts once per row it serves).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..assets import eos_token_ids, left_pad, padding_id
from .common import (
    CLIError,
    add_prompt_arguments,
    attach_drafter,
    check_arguments,
    collect_prompts,
    load_models,
    write_results,
)
from ..runtime.cpu_linear import few_rows_plan
from ..runtime.generation import speculative_generate
from ..runtime.logs import log
from ..runtime.drafter import DCOCODrafter

BATCH_METHODS = ("vanilla", "dflash", "dcoco")


def new_token_counts(sequences: torch.LongTensor, prompt_len: int, eos: set[int]) -> list[int]:
    """Generated tokens per row, up to and including its first EOS (the padding after it is not output)."""
    counts = []
    for row in sequences[:, prompt_len:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        counts.append(ends[0] + 1 if ends else len(row))
    return counts


def _run_method(target, drafter, method, ids, mask, kwargs) -> tuple[torch.LongTensor, float, int, int]:
    """(sequences, seconds, committed tokens, row-forwards) of one batched call."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    if method == "vanilla":
        sequences = target.generate(ids, attention_mask=mask, **kwargs)
        committed = forwards = None
    else:
        out = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, correct=method == "dcoco",
                                   **kwargs)
        sequences = out.sequences
        committed = sum(s.committed_tokens for s in out.stats)
        forwards = sum(s.target_forwards for s in out.stats)
    sync()
    return sequences, time.perf_counter() - start, committed, forwards


def run_batch_bench(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    prompts: Sequence[torch.LongTensor],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    methods: Sequence[str] = BATCH_METHODS,
    temperature: float = 0.0,
    pad_token_id: int = 0,
    eos_token_id: int | list[int] | None = None,
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure every method at every batch size; returns {"config": ..., "results": {bs: {method: summary}}}."""
    unknown = [m for m in methods if m not in BATCH_METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or methods}; choose from {','.join(BATCH_METHODS)}")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    device = target.device
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0,
                              "pad_token_id": pad_token_id}
    if temperature > 0:
        kwargs["temperature"] = temperature
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    eos = set(eos_token_ids(eos_token_id if eos_token_id is not None else target.generation_config.eos_token_id))
    results: dict[str, Any] = {}
    for batch_size in batch_sizes:
        count = max(len(prompts), batch_size)
        chosen = [prompts[i % len(prompts)] for i in range(-(-count // batch_size) * batch_size)]
        batches = [left_pad(chosen[i : i + batch_size], pad_token_id) for i in range(0, len(chosen), batch_size)]
        for _ in range(warmup):  # untimed: one-off allocation and kernel selection costs
            ids, mask = batches[0]
            for method in methods:
                _run_method(target, drafter, method, ids.to(device), mask.to(device), {**kwargs, "max_new_tokens": 4})
        totals = {m: {"seconds": 0.0, "new_tokens": 0, "committed": 0, "forwards": 0, "equal": 0} for m in methods}
        for index, (ids, mask) in enumerate(batches):
            ids, mask = ids.to(device), mask.to(device)
            outputs = {}
            for method in methods[index % len(methods) :] + methods[: index % len(methods)]:
                torch.manual_seed(seed + index)
                sequences, seconds, committed, forwards = _run_method(target, drafter, method, ids, mask, kwargs)
                outputs[method] = sequences
                new = new_token_counts(sequences, ids.shape[1], eos)
                total = totals[method]
                total["seconds"] += seconds
                total["new_tokens"] += sum(new)
                total["committed"] += sum(new) if committed is None else committed
                total["forwards"] += sum(new) if forwards is None else forwards
            if "vanilla" in outputs:
                for method, sequences in outputs.items():
                    totals[method]["equal"] += int(torch.equal(sequences.cpu(), outputs["vanilla"].cpu()))
        results[str(batch_size)] = _summarise(totals, len(batches), temperature == 0.0 and "vanilla" in methods)
        log(f"batch size {batch_size}: " + ", ".join(
            f"{m} {s['tokens_per_s']:.1f} tok/s (tau {s['tau']:.2f})" for m, s in results[str(batch_size)].items()
        ))
    config = {"batch_sizes": list(batch_sizes), "methods": list(methods), "prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "temperature": temperature, "block_size": drafter.draft_block_size,
              "device": str(device), "dtype": str(target.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads()}
    return {"config": config, "results": results}


def _summarise(totals: dict[str, dict[str, Any]], batches: int, greedy: bool) -> dict[str, dict[str, Any]]:
    vanilla = totals.get("vanilla")
    summary = {}
    for method, total in totals.items():
        speed = total["new_tokens"] / total["seconds"] if total["seconds"] else 0.0
        base = vanilla["new_tokens"] / vanilla["seconds"] if vanilla and vanilla["seconds"] else None
        summary[method] = {
            "tokens_per_s": speed,
            "speedup": speed / base if base else None,
            "tau": total["committed"] / max(total["forwards"], 1),
            "new_tokens": total["new_tokens"],
            "seconds": total["seconds"],
            "batches": batches,
            "equal_to_vanilla": (total["equal"] == batches) if greedy else None,
        }
    return summary


def format_batch_table(report: dict[str, Any]) -> str:
    methods = report["config"]["methods"]
    header = f"{'batch':>5} " + " ".join(f"{m + ' tok/s':>14} {m + ' tau':>10}" for m in methods)
    if "vanilla" in methods:
        header += " " + " ".join(f"{m + '/van':>11}" for m in methods if m != "vanilla")
    if {"dflash", "dcoco"} <= set(methods):
        header += f" {'dcoco/dflash':>12}"
    lines = [header]
    for batch_size, row in report["results"].items():
        cells = [f"{batch_size:>5}"]
        cells += [f"{row[m]['tokens_per_s']:>14.1f} {row[m]['tau']:>10.2f}" for m in methods]
        if "vanilla" in methods:
            cells += [f"{row[m]['speedup']:>10.2f}x" for m in methods if m != "vanilla"]
        if {"dflash", "dcoco"} <= set(methods):
            cells.append(f"{row['dcoco']['tokens_per_s'] / row['dflash']['tokens_per_s']:>11.2f}x")
        lines.append(" ".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# `dcoco-hf bench-batch`
# ----------------------------------------------------------------------------------------------------------------


def add_bench_batch_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "bench-batch",
        parents=[common],
        help="throughput of batched vanilla / DFlash / DCOCO decoding per batch size",
        description="For each batch size, runs plain batched generate(), batched DFlash (speculative_generate with "
        "the corrector off) and batched DCOCO interleaved on the same left-padded batches; reports aggregate output "
        "tokens/s, ratios and tau.",
    )
    parser.add_argument("--batch-size", default="1,4,8,16,32", help="comma-separated batch sizes (default 1,4,8,16,32)")
    parser.add_argument("--methods", default=",".join(BATCH_METHODS),
                        help=f"comma-separated subset of {','.join(BATCH_METHODS)} (default: all)")
    add_prompt_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per row (default 64)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed short rounds per batch size (default 1)")
    parser.add_argument("--random-drafter", action="store_true",
                        help="use an untrained DCOCODrafter.from_target(target) (smoke tests; tau ~ 1)")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write the results as JSON")
    parser.set_defaults(handler=cmd_bench_batch)


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size {text!r}: give positive integers separated by commas, e.g. 1,4,8")
    return sizes


def cmd_bench_batch(args: argparse.Namespace) -> int:
    check_arguments(args)  # the same checks as bench: numbers, model folders, the --json path
    try:
        batch_sizes = parse_batch_sizes(args.batch_size)
    except ValueError as err:
        raise CLIError(str(err)) from None
    methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not methods or set(methods) - set(BATCH_METHODS):
        raise CLIError(f"--methods {args.methods}: choose from {','.join(BATCH_METHODS)}")
    items = collect_prompts(args)
    if args.random_drafter:
        loaded = load_models(args, need_drafter=False)
        drafter = DCOCODrafter.from_target(loaded.target).eval()
        attach_drafter(args, loaded.target, drafter, batch=max(batch_sizes), choose_block=False)
        drafter_name = "random (DCOCODrafter.from_target)"
    else:
        # bench-batch drafts the configured block: the start-up choice times one-row cycles, not batched ones.
        loaded = load_models(args, need_drafter=True, batch=max(batch_sizes), choose_block=False)
        drafter, drafter_name = loaded.drafter, loaded.drafter_name
    from .bench import encode_prompt

    tokenizer = loaded.tokenizer
    prompts = [encode_prompt(tokenizer, item.text)[0] for item in items]
    log(f"batched benchmark of {','.join(methods)} on {len(prompts)} prompt(s), batch sizes {batch_sizes}")
    report = run_batch_bench(
        loaded.target, drafter, prompts, batch_sizes, args.max_new_tokens, methods, temperature=args.temperature,
        pad_token_id=padding_id(tokenizer), warmup=args.warmup, seed=args.seed,
    )
    report["config"].update(
        target=loaded.target_name, drafter=drafter_name, command_line=["dcoco-hf", *args.argv],
        few_rows_linear=few_rows_plan(loaded.target),
    )
    print(format_batch_table(report))
    write_results(report, args.json)
    return 0


__all__ = ["BATCH_METHODS", "format_batch_table", "run_batch_bench"]
