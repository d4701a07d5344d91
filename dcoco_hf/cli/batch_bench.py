"""Batch-size benchmark: aggregate output tokens/s of plain batched `generate()` vs batched DFlash vs batched DCOCO.

* ``vanilla``: `target.generate(batch, attention_mask=...)` (left-padded).
* ``dflash``: `speculative_generate(..., correct=False)`: the drafter's backbone, same weights, its chain the argmax
  block.
* ``dcoco``: `speculative_generate(...)` with the corrector: its walk's chain.
* ``dflash-trees``, ``dcoco-trees``: the same with `tree_budget=16`: draft trees of the slots' marginals (DDTree's)
  or of the corrector's transition scores, sized per cycle by the cost schedule.

Before measuring, the cycle's costs are timed at each batch size (`tuning.time_batch`, cached per machine), so
no timed call pays for it; the report names the tuning line and each batch size's timed costs, and per batch size
each method's cycles: plain steps, chain proposals per length, tree cycles.

For each batch size, the prompts are cut into batches (the prompt list is cycled to fill the last one) and every
batch runs every method back to back, in an order shuffled per batch, so slow phases of a shared machine hit all
methods alike and the ratios measured in one run stay fair; `--rounds N` runs every batch N times. Speedups: the
summed tokens/s over plain's, and the median over batch runs of each run's ratio to plain on the same batch. tau =
committed tokens / target forwards, summed over rows (one batched forward counts once per row it serves).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..runtime.prompts import eos_token_ids, left_pad, padding_id, prompt_input_ids
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
from .bench import run_order
from ..runtime.drafter import DCOCODrafter
from ..runtime.generation import new_token_counts, speculative_generate
from ..runtime.logs import log
from ..runtime.proposal import COST_SCHEDULE
from ..runtime.stats import DCOCOStats
from ..runtime.tuning import VERIFY_REFERENCE_ROWS, time_batch

BATCH_METHODS = ("vanilla", "dflash", "dcoco", "dflash-trees", "dcoco-trees")
TREE_BUDGET = 16  # the -trees methods' budget
DEFAULT_METHODS = ("vanilla", "dflash", "dcoco")


def _run_method(
    target, drafter, method, ids, mask, kwargs
) -> tuple[torch.LongTensor, float, list[DCOCOStats] | None]:
    """(sequences, seconds, each row's statistics; None for vanilla) of one batched call."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    if method == "vanilla":
        sequences, stats = target.generate(ids, attention_mask=mask, **kwargs), None
    else:
        options = {"correct": method.startswith("dcoco")}
        if method.endswith("-trees"):
            options["tree_budget"] = TREE_BUDGET
        out = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, **options, **kwargs)
        sequences, stats = out.sequences, out.stats
    sync()
    return sequences, time.perf_counter() - start, stats


def run_batch_bench(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    prompts: Sequence[torch.LongTensor],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    methods: Sequence[str] = DEFAULT_METHODS,
    temperature: float = 0.0,
    pad_token_id: int = 0,
    eos_token_id: int | list[int] | None = None,
    warmup: int = 1,
    seed: int = 0,
    rounds: int = 1,
) -> dict[str, Any]:
    """Measure every method at every batch size, every batch `rounds` times (a batch size with one batch is one run
    per method otherwise, at the mercy of a noisy spell); returns {"config": ..., "results": {bs: {method: ...}}}."""
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
    eos_ids = eos_token_ids(eos_token_id if eos_token_id is not None else target.generation_config.eos_token_id)
    eos = torch.tensor(eos_ids, dtype=torch.long) if eos_ids else None
    timed = {}
    if drafter.tuning is not None and drafter.proposal_schedule_name == COST_SCHEDULE:
        for batch_size in batch_sizes:  # timed now, so that no measured call pays for it
            costs = time_batch(drafter, batch_size) if batch_size > 1 else drafter.cycle_costs
            timed[str(batch_size)] = {"timed_batch": costs.batch, "plain_ms": 1e3 * costs.plain,
                                      "verify_8_over_plain": costs.verify_seconds(VERIFY_REFERENCE_ROWS) / costs.plain}
    results: dict[str, Any] = {}
    for batch_size in batch_sizes:
        count = max(len(prompts), batch_size)
        chosen = [prompts[i % len(prompts)] for i in range(-(-count // batch_size) * batch_size)]
        batches = [left_pad(chosen[i : i + batch_size], pad_token_id) for i in range(0, len(chosen), batch_size)]
        for _ in range(warmup):  # untimed: one-off allocation and kernel selection costs
            ids, mask = batches[0]
            for method in methods:
                _run_method(target, drafter, method, ids.to(device), mask.to(device), {**kwargs, "max_new_tokens": 4})
        totals = {m: {"seconds": 0.0, "new_tokens": 0, "stats": DCOCOStats(), "equal": 0, "rates": [], "drafting": [],
                      "correcting": []} for m in methods}
        for index, (ids, mask) in enumerate(batches * rounds):
            ids, mask = ids.to(device), mask.to(device)
            outputs = {}
            for method in run_order(methods, index):
                torch.manual_seed(seed + index)
                sequences, seconds, stats = _run_method(target, drafter, method, ids, mask, kwargs)
                outputs[method] = sequences
                new = new_token_counts(sequences, ids.shape[1], eos)
                total = totals[method]
                total["seconds"] += seconds
                total["new_tokens"] += sum(new)
                total["rates"].append(sum(new) / seconds)
                if stats is None:  # plain decoding: one token per row and forward
                    stats = [DCOCOStats(committed_tokens=sum(new), target_forwards=sum(new))]
                # Every active row books the batch's phase times; the row that lived longest saw every cycle.
                longest = max(stats, key=lambda row: row.cycles)
                total["drafting"].append((longest.drafter_seconds + longest.corrector_seconds) / seconds)
                total["correcting"].append(longest.corrector_seconds / seconds)
                total["stats"] = total["stats"].merge(sum(stats, DCOCOStats()))
            if "vanilla" in outputs:
                for method, sequences in outputs.items():
                    totals[method]["equal"] += int(torch.equal(sequences.cpu(), outputs["vanilla"].cpu()))
        results[str(batch_size)] = _summarise(totals, len(batches) * rounds,
                                              temperature == 0.0 and "vanilla" in methods)
        log(f"batch size {batch_size}: " + ", ".join(
            f"{m} {s['tokens_per_s']:.1f} tok/s (tau {s['tau']:.2f}"
            + (f", median per batch {s['median_speedup']:.2f}x)" if s["median_speedup"] is not None else ")")
            for m, s in results[str(batch_size)].items()
        ))
    config = {"batch_sizes": list(batch_sizes), "methods": list(methods), "prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "temperature": temperature, "block_size": drafter.draft_block_size,
              "tree_budget": drafter.decoding.tree_budget, "rounds": rounds, "device": str(device),
              "dtype": str(target.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "tuning": drafter.tuning.summary() if drafter.tuning is not None else None, "batch_costs": timed}
    return {"config": config, "results": results}


def _summarise(totals: dict[str, dict[str, Any]], batches: int, greedy: bool) -> dict[str, dict[str, Any]]:
    vanilla = totals.get("vanilla")
    summary = {}
    for method, total in totals.items():
        speed = total["new_tokens"] / total["seconds"] if total["seconds"] else 0.0
        base = vanilla["new_tokens"] / vanilla["seconds"] if vanilla and vanilla["seconds"] else None
        stats = total["stats"]
        summary[method] = {
            "tokens_per_s": speed,
            "speedup": speed / base if base else None,
            # each batch run's tokens/s over plain's on the same batch, run beside it: the median shrugs off a
            # noisy spell that the summed time takes in whole
            "median_speedup": statistics.median(
                rate / plain for rate, plain in zip(total["rates"], vanilla["rates"])
            ) if vanilla else None,
            "tau": stats.tau,
            "new_tokens": total["new_tokens"],
            "seconds": total["seconds"],
            "batches": batches,
            "equal_to_vanilla": (total["equal"] == batches) if greedy else None,
            # row-cycles: plain steps ("0"), chain proposals per length, tree verifications
            "proposal_lengths": {str(k): n for k, n in enumerate(stats.proposal_lengths) if n},
            "tree_cycles": stats.tree_cycles,
            "mean_tree_nodes": stats.tree_nodes / stats.tree_cycles if stats.tree_cycles else None,
            # of a call's wall time: the drafter's phases (backbone and corrector), and the corrector's alone
            "drafter_share": statistics.mean(total["drafting"]),
            "corrector_share": statistics.mean(total["correcting"]),
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
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated subset of {','.join(BATCH_METHODS)} (default: "
                        f"{','.join(DEFAULT_METHODS)})")
    add_prompt_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per row (default 64)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed short rounds per batch size (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed runs of every batch per method, each in its own shuffled order (default 1)")
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
    if args.rounds < 1:
        raise CLIError(f"--rounds {args.rounds}: give at least 1 (timed runs of every batch per method)")
    methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not methods or set(methods) - set(BATCH_METHODS):
        raise CLIError(f"--methods {args.methods}: choose from {','.join(BATCH_METHODS)}")
    items = collect_prompts(args)
    # Attached as a user attaches it: under the cost-aware schedule every cycle plans its block, priced at the
    # batch's own shape (`time_batch`, below).
    if args.random_drafter:
        loaded = load_models(args, need_drafter=False)
        drafter = DCOCODrafter.from_target(loaded.target).eval()
        attach_drafter(args, loaded.target, drafter, batch=max(batch_sizes))
        drafter_name = "random (DCOCODrafter.from_target)"
    else:
        loaded = load_models(args, need_drafter=True, batch=max(batch_sizes))
        drafter, drafter_name = loaded.drafter, loaded.drafter_name

    tokenizer = loaded.tokenizer
    prompts = [prompt_input_ids(tokenizer, item.text)[0] for item in items]
    log(f"batched benchmark of {','.join(methods)} on {len(prompts)} prompt(s), batch sizes {batch_sizes}")
    report = run_batch_bench(
        loaded.target, drafter, prompts, batch_sizes, args.max_new_tokens, methods, temperature=args.temperature,
        pad_token_id=padding_id(tokenizer), warmup=args.warmup, seed=args.seed, rounds=args.rounds,
    )
    report["config"].update(
        target=loaded.target_name, drafter=drafter_name, command_line=["dcoco-hf", *args.argv],
        few_rows_linear=few_rows_plan(loaded.target),
    )
    print(format_batch_table(report))
    if report["config"]["tuning"]:
        print(report["config"]["tuning"])
    for size, costs in report["config"]["batch_costs"].items():
        print(f"batch {size}: costs timed at batch {costs['timed_batch']}, plain step {costs['plain_ms']:.1f} ms, "
              f"verify of 8 columns {costs['verify_8_over_plain']:.2f}x it")
    write_results(report, args.json)
    return 0


__all__ = ["BATCH_METHODS", "DEFAULT_METHODS", "format_batch_table", "run_batch_bench"]
