"""The speed a Transformers user gets: `from_pretrained`, `attach`, `generate`, and nothing else.

    python scripts/api_bench.py                                   # 16 held-out chat + code prompts (mixed-heldout)
    python scripts/api_bench.py --suites humaneval:20,mtbench:20,mixed-heldout,hard-to-draft --json out.json
    python scripts/api_bench.py --methods plain,assisted,batched  # also speculative_generate, one prompt at a time
    python scripts/api_bench.py --processes 3 --json out.json     # 3 fresh processes, each with a fresh tuning cache

The target and the drafter load with `from_pretrained` (the drafter through `AutoModel` with remote code, as from
the Hub), `drafter.attach(target)` tunes both for this machine, and every run is a plain `target.generate()` call,
with or without `assistant_model=drafter` ("assisted"); "batched" is `speculative_generate` on the one prompt (the
batched loop at batch 1: draft trees, `tree_budget`). For each prompt the methods run back to back, in an order
shuffled per prompt, so slow spells of a noisy machine slow all alike (the runner of `dcoco-hf bench`: "plain",
"assisted" and "batched" are its vanilla, dcoco and speculative methods). Printed per suite: tau (tokens committed per
target forward, from `drafter.generation_stats`), the speedup as the ratio of tokens per second to plain, the
corrector's share of the drafter's time, and how many outputs are identical to plain greedy decoding; first, the
tuning line of the run (plain step, verify of 8 rows as a multiple of it), on which every speedup depends: compare
yours with it. Suites: humaneval and mtbench (their first N prompts with `name:N`, after `--skip`), or a prompts
file in scripts/prompts/ by its name. With `--processes N` the whole run repeats in N fresh processes, each tuning
from scratch (its own empty tuning cache), and the report gives each process's figures and their spread: how far a
user's speed can swing from one start to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf.assets import SUITES, load_prompts_file, suite_prompts
from dcoco_hf.cli.common import resolve_target
from dcoco_hf.cli.bench import BenchSettings, PromptItem, RunRecord, run_bench
from dcoco_hf.runtime.proposal import SCHEDULES
from dcoco_hf.runtime.tuning import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = ROOT / "model_cards" / "dcoco-smollm2-135m"
PROMPT_FILES = ROOT / "scripts" / "prompts"
METHODS = ("plain", "assisted", "batched")
# Each as the bench names it: plain generate(), generate(assistant_model=drafter), speculative_generate at batch 1.
BENCH_METHOD = {"plain": "vanilla", "assisted": "dcoco", "batched": "speculative"}
API_METHOD = {bench: api for api, bench in BENCH_METHOD.items()}


def load_suite(spec: str, skip: int) -> tuple[str, list[str]]:
    """("humaneval", prompts) from "humaneval" or "humaneval:20" (its first 20 after `skip`); a prompts file of
    scripts/prompts/ by its name ("mixed-heldout")."""
    name, _, limit = spec.partition(":")
    if name in SUITES:
        prompts = suite_prompts(name)
    elif (PROMPT_FILES / f"{name}.jsonl").is_file():
        prompts = load_prompts_file(PROMPT_FILES / f"{name}.jsonl")
    else:
        raise SystemExit(f"--suites {spec}: no suite or scripts/prompts/{name}.jsonl; suites: {', '.join(SUITES)}")
    prompts = prompts[skip:]
    return name, prompts[: int(limit)] if limit else prompts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None,
                        help="target folder, Hub id or known name, e.g. gemma3-270m (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter folder or Hub id")
    parser.add_argument("--suites", default="mixed-heldout",
                        help="comma-separated suites: humaneval[:N], mtbench[:N], or a scripts/prompts/ file's name")
    parser.add_argument("--skip", type=int, default=0, help="leave out each suite's first N prompts")
    parser.add_argument("--methods", default="plain,assisted", help=f"comma-separated, from {','.join(METHODS)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None,
                        help="attach(target, block_size=B) instead of the block attach chooses for this machine")
    parser.add_argument("--schedule", default=None, choices=SCHEDULES,
                        help="the drafter's num_assistant_tokens_schedule (default: its generation config's, 'cost')")
    parser.add_argument("--json", default=None, help="write per-prompt records and the totals here")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the whole run in N fresh processes, each with an empty tuning cache")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    methods = [m for m in args.methods.split(",") if m]
    if "plain" not in methods or set(methods) - set(METHODS):
        raise SystemExit(f"--methods {args.methods}: plain and any of {','.join(METHODS[1:])}")
    if args.processes > 1:
        return repeat_in_processes(args, argv)
    suites = dict(load_suite(spec, args.skip) for spec in args.suites.split(","))

    target_path = resolve_target(args.target)
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    options = {} if args.block_size is None else {"block_size": args.block_size}
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True)
    if args.schedule is not None:
        drafter.generation_config.num_assistant_tokens_schedule = args.schedule
    drafter.attach(target, **options)
    tuning = drafter.tuning.summary() if drafter.tuning else "untuned"
    print(f"target {target_path}, drafter {args.drafter}, {args.max_new_tokens} new tokens max\n{tuning}")

    report = {"command_line": ["python", "scripts/api_bench.py", *argv], "machine": machine(), "tuning": tuning,
              "max_new_tokens": args.max_new_tokens, "methods": methods, "suites": {}}
    items = [PromptItem(name, index, text) for name, prompts in suites.items() for index, text in enumerate(prompts)]
    # The bench's runner: every method on each prompt, in an order shuffled per prompt (`dcoco-hf bench`).
    records = run_bench(target, tokenizer, drafter, items, [BENCH_METHOD[m] for m in methods],
                        BenchSettings(max_new_tokens=args.max_new_tokens))
    for name, prompts in suites.items():
        suite = [record(prompts[index], [r for r in records if (r.suite, r.prompt_index) == (name, index)])
                 for index in range(len(prompts))]
        totals = summarise(suite, methods)
        report["suites"][name] = {"prompts": len(prompts), "totals": totals, "records": suite}
        for method in methods[1:]:
            t = totals[method]
            print(f"{name}: {method} tau {t['tau']:.2f} | speedup {t['speedup']:.2f}x (tokens/s, same run) | "
                  f"corrector share {100 * t['corrector_share']:.1f}% | identical {t['identical']}/{len(prompts)} "
                  f"| cycles per proposal length (0 = plain step) {t['proposal_lengths']}, "
                  f"trees {t['tree_cycles']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n", encoding="utf-8")
    return report


def chat_inputs(tokenizer, prompt: str) -> dict:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


def record(prompt: str, runs: list[RunRecord]) -> dict:
    """One prompt's figures per method, from the bench's records of its runs."""
    methods = {}
    for run in runs:
        entry = {"tokens": run.new_tokens, "seconds": run.seconds}
        if run.dcoco is not None:
            total = run.dcoco
            entry.update(tau=total.tau, target_forwards=total.target_forwards, drafter_seconds=total.drafter_seconds,
                         corrector_seconds=total.corrector_seconds, target_seconds=total.target_seconds,
                         prefill_seconds=total.prefill_seconds, identical=bool(run.equal_to_vanilla),
                         proposal_lengths=total.proposal_lengths, tree_cycles=total.tree_cycles)
        methods[API_METHOD[run.method]] = entry
    return {"prompt": prompt, "methods": methods}


def machine() -> str:
    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def repeat_in_processes(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run this script's measurement in `args.processes` fresh processes one after another, each with its own empty
    tuning cache, and report every process's report and the spread of each suite's and method's speedups."""
    child_argv = _without_option(_without_option(argv, "--processes"), "--json")
    runs = []
    with tempfile.TemporaryDirectory(prefix="dcoco-hf-api-bench-") as scratch:
        for index in range(args.processes):
            out = Path(scratch) / f"run-{index}.json"
            env = {**os.environ, "DCOCO_HF_TUNING_DIR": str(Path(scratch) / f"tuning-{index}")}
            subprocess.run([sys.executable, __file__, *child_argv, "--json", str(out)], env=env, check=True)
            runs.append(json.loads(out.read_text()))
    spread = {}
    for suite in runs[0]["suites"]:
        for method in runs[0]["methods"][1:]:
            speedups = [run["suites"][suite]["totals"][method]["speedup"] for run in runs]
            spread[f"{suite}/{method}"] = {"speedups": speedups, "min": min(speedups), "max": max(speedups),
                                           "median": statistics.median(speedups)}
            print(f"{suite} {method}: {len(runs)} fresh processes, speedups {', '.join(f'{x:.2f}x' for x in speedups)}")
    report = {"command_line": ["python", "scripts/api_bench.py", *argv], "machine": machine(), "spread": spread,
              "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n", encoding="utf-8")
    return report


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv less `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == name:
            skip = True
        elif not item.startswith(f"{name}="):
            out.append(item)
    return out


def summarise(records: list[dict], methods: list[str]) -> dict:
    """Per method: tau, speedup over plain (tokens per second, summed over the prompts), corrector share, identical
    outputs, cycles per proposal length and tree cycles."""
    plain_rate = sum(r["methods"]["plain"]["tokens"] for r in records) / sum(
        r["methods"]["plain"]["seconds"] for r in records)
    totals = {"plain": {"tokens_per_s": plain_rate}}
    for method in methods[1:]:
        runs = [r["methods"][method] for r in records]
        tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        totals[method] = {
            "tau": tokens / sum(r["target_forwards"] for r in runs),
            "speedup": tokens / seconds / plain_rate,
            "tokens_per_s": tokens / seconds,
            "corrector_share": sum(r["corrector_seconds"] for r in runs) / seconds,
            "time_split": time_split(runs),
            "identical": sum(r["identical"] for r in runs),
            "proposal_lengths": _summed([r["proposal_lengths"] for r in runs]),
            "tree_cycles": sum(r["tree_cycles"] for r in runs),
        }
    return totals


def time_split(runs: list[dict]) -> dict[str, float]:
    """Where a method's time went, as shares of it: the prompt's target forward (prefill), the drafter's backbone
    with its lm_head and top-K (draft), the corrector's scoring and walk, the target's verify forwards, and the rest
    (transformers' loop, the schedule, moving tokens): the split a faster drafter, corrector or target would shrink."""
    seconds = sum(r["seconds"] for r in runs)
    parts = {"prefill": sum(r["prefill_seconds"] for r in runs), "draft": sum(r["drafter_seconds"] for r in runs),
             "corrector": sum(r["corrector_seconds"] for r in runs),
             "verify": sum(r["target_seconds"] - r["prefill_seconds"] for r in runs)}
    return {**{name: part / seconds for name, part in parts.items()}, "other": 1 - sum(parts.values()) / seconds}


def _summed(counts: list[list[int]]) -> dict[str, int]:
    """Per-index counts summed over all prompts: cycles per proposal length ({"0": plain steps, "1": ...}), drafts
    per block size."""
    width = max((len(c) for c in counts), default=0)
    totals = [sum(c[k] for c in counts if k < len(c)) for k in range(width)]
    return {str(k): n for k, n in enumerate(totals) if n}


if __name__ == "__main__":
    main()
