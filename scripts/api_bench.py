"""The speed a Transformers user gets: `from_pretrained`, `attach`, `generate`, and nothing else.

    python scripts/api_bench.py                                   # 16 held-out chat + code prompts (mixed-heldout)
    python scripts/api_bench.py --suite humaneval --limit 20 --json docs/api_bench_humaneval.json
    python scripts/api_bench.py --processes 3 --json out.json     # 3 fresh processes, each with a fresh tuning cache

The target and the drafter load with `from_pretrained` (the drafter through `AutoModel` with remote code, as from
the Hub), `drafter.attach(target)` tunes both for this machine, and every run is a plain `target.generate()` call,
with or without `assistant_model=drafter`. For each prompt the two run back to back, in an order alternated per
prompt, so slow spells of a noisy machine slow both alike. Printed: tau (tokens committed per target forward, from
`drafter.generation_stats`), the speedup as the ratio of tokens per second, the corrector's share of the
speculative runs' time, and how many outputs are identical to plain greedy decoding. With `--processes N` the
whole run repeats in N fresh processes, each tuning from scratch (its own empty tuning cache), and the report gives
each process's figures and their spread: how far a user's speed can swing from one start to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf.assets import default_target_path, load_prompts_file, suite_prompts
from dcoco_hf.runtime.proposal import SCHEDULES
from dcoco_hf.runtime.tuning import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = ROOT / "model_cards" / "dcoco-smollm2-135m"
DEFAULT_PROMPTS = ROOT / "scripts" / "prompts" / "mixed-heldout.jsonl"


def load_prompts(args: argparse.Namespace) -> list[str]:
    prompts = suite_prompts(args.suite) if args.suite else load_prompts_file(args.prompts)
    return prompts[args.skip : None if args.limit is None else args.skip + args.limit]


def timed_generate(target, inputs, **kwargs) -> tuple[torch.LongTensor, float]:
    start = time.perf_counter()
    out = target.generate(**inputs, **kwargs)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter folder or Hub id")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help='jsonl file, one {"prompt": ...} per line')
    parser.add_argument("--suite", default=None, choices=("humaneval", "mtbench"), help="a suite instead of --prompts")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None)
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
    if args.processes > 1:
        return repeat_in_processes(args, argv)

    target_path = args.target or default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    options = {} if args.block_size is None else {"block_size": args.block_size}
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True)
    if args.schedule is not None:
        drafter.generation_config.num_assistant_tokens_schedule = args.schedule
    drafter.attach(target, **options)

    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    records = []
    prompts = load_prompts(args)
    with torch.no_grad():
        for index, prompt in enumerate(["Say hi.", *prompts]):  # the first one only warms both paths up
            inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
            runs = {}
            for method in (("plain", "drafter") if index % 2 else ("drafter", "plain")):
                extra = {"assistant_model": drafter} if method == "drafter" else {}
                runs[method] = timed_generate(target, inputs, **settings, **extra)
                if method == "drafter":
                    stats = drafter.generation_stats(runs[method][0])
            if index == 0:
                continue
            (plain, plain_s), (fast, fast_s) = runs["plain"], runs["drafter"]
            new = plain.shape[1] - inputs["input_ids"].shape[1]
            fast_new = fast.shape[1] - inputs["input_ids"].shape[1]
            records.append({
                "prompt": prompt, "plain_tokens": new, "plain_seconds": plain_s, "drafter_tokens": fast_new,
                "drafter_seconds": fast_s, "target_forwards": stats.target_forwards,
                "corrector_seconds": stats.corrector_seconds, "identical": torch.equal(plain, fast),
                "proposal_lengths": stats.proposal_lengths, "drafted_blocks": stats.drafted_blocks,
                "seconds_saved": stats.seconds_saved,
            })
            print(f"[{index}/{len(prompts)}] tau {fast_new / stats.target_forwards:.2f}, plain {plain_s:.2f} s, "
                  f"drafter {fast_s:.2f} s, identical {records[-1]['identical']}", file=sys.stderr, flush=True)

    totals = summarise(records)
    print(f"{len(records)} prompts, {args.max_new_tokens} new tokens max, target {target_path}, drafter "
          f"{args.drafter}\n{drafter.tuning.summary() if drafter.tuning else 'untuned'}")
    print(f"tau {totals['tau']:.2f} | speedup {totals['speedup']:.2f}x (tokens/s, same run) | plain "
          f"{totals['plain_tokens_per_s']:.1f} tok/s, drafter {totals['drafter_tokens_per_s']:.1f} tok/s | "
          f"corrector share {100 * totals['corrector_share']:.1f}% | identical {totals['identical']}/{len(records)}")
    print(f"cycles per proposal length (0 = plain step): {totals['proposal_lengths']}")
    print(f"drafts per drafted block size: {totals['drafted_blocks']}")
    if args.json:
        report = {"command_line": ["python", "scripts/api_bench.py", *argv], "machine": machine(),
                  "tuning": drafter.tuning.summary() if drafter.tuning else None, "totals": totals,
                  "records": records}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n", encoding="utf-8")
    return totals


def machine() -> str:
    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def repeat_in_processes(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run this script's measurement in `args.processes` fresh processes one after another, each with its own empty
    tuning cache, and report every process's totals and the spread of their speedups."""
    child_argv = _without_option(_without_option(argv, "--processes"), "--json")
    runs = []
    with tempfile.TemporaryDirectory(prefix="dcoco-hf-api-bench-") as scratch:
        for index in range(args.processes):
            out = Path(scratch) / f"run-{index}.json"
            env = {**os.environ, "DCOCO_HF_TUNING_DIR": str(Path(scratch) / f"tuning-{index}")}
            subprocess.run([sys.executable, __file__, *child_argv, "--json", str(out)], env=env, check=True)
            runs.append(json.loads(out.read_text()))
    speedups = [run["totals"]["speedup"] for run in runs]
    middle = runs[sorted(range(len(runs)), key=speedups.__getitem__)[len(runs) // 2]]  # the median run
    spread = {"speedups": speedups, "min": min(speedups), "max": max(speedups),
              "max_over_min": max(speedups) / min(speedups), "median": statistics.median(speedups)}
    print(f"{len(runs)} fresh processes: speedups {', '.join(f'{x:.2f}x' for x in speedups)} "
          f"(max/min {spread['max_over_min']:.3f})")
    if args.json:
        report = {"command_line": ["python", "scripts/api_bench.py", *argv], "machine": machine(),
                  "totals": middle["totals"], "records": middle["records"], "spread": spread, "runs": runs}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n", encoding="utf-8")
    return middle["totals"]


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


def summarise(records: list[dict]) -> dict:
    plain_rate = sum(r["plain_tokens"] for r in records) / sum(r["plain_seconds"] for r in records)
    drafter_tokens = sum(r["drafter_tokens"] for r in records)
    drafter_seconds = sum(r["drafter_seconds"] for r in records)
    return {
        "tau": drafter_tokens / sum(r["target_forwards"] for r in records),
        "speedup": drafter_tokens / drafter_seconds / plain_rate,
        "plain_tokens_per_s": plain_rate,
        "drafter_tokens_per_s": drafter_tokens / drafter_seconds,
        "corrector_share": sum(r["corrector_seconds"] for r in records) / drafter_seconds,
        "identical": sum(r["identical"] for r in records),
        "proposal_lengths": _summed([r.get("proposal_lengths", []) for r in records]),
        "drafted_blocks": _summed([r.get("drafted_blocks", []) for r in records]),
    }


def _summed(counts: list[list[int]]) -> dict[str, int]:
    """Per-index counts summed over all prompts: cycles per proposal length ({"0": plain steps, "1": ...}), drafts
    per block size."""
    width = max((len(c) for c in counts), default=0)
    totals = [sum(c[k] for c in counts if k < len(c)) for k in range(width)]
    return {str(k): n for k, n in enumerate(totals) if n}


if __name__ == "__main__":
    main()
