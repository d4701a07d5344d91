"""Should rows that keep failing stop drafting while the others draft? The batched loop's measured costs decide.

    python scripts/split_costs.py --json docs/results/split_costs.json

`speculative_generate` verifies a batch in one forward: a rectangle of B rows x (k + 1) columns, so a row proposing
nothing (k = 0) still pays its k + 1 columns, masked. Only a second forward saves them: a plain step of the m rows
that stop drafting, and a verify of the other B - m rows. This script attaches the shipped drafter to the default
target as a user does, takes the cycle costs `speculative_generate` uses at each batch size (`tuning.time_batch`:
read from the tuning cache, timed where missing) and prints, for half the rows failing, the one forward's time
against the two forwards' (before the second forward's own loop overhead, which only adds to the split), per batch
size and proposal length. Below 1: splitting would pay.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoModel, AutoModelForCausalLM

from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.tuning import time_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import DEFAULT_DRAFTER  # noqa: E402


def split_ratio(costs: dict, batch: int, failing: int, columns: int) -> float:
    """(plain step of `failing` rows + verify of the others' `columns`) / verify of all rows' `columns`."""
    split = costs[failing].verify_seconds(1) + costs[batch - failing].verify_seconds(columns)
    return split / costs[batch].verify_seconds(columns)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="2,4,8,16", help="powers of two (the sizes the costs are timed at)")
    parser.add_argument("--max-proposal", type=int, default=7, help="largest k to compare (k + 1 columns)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    if any(size < 2 or size & (size - 1) for size in sizes):
        raise SystemExit(f"--batch-sizes {args.batch_sizes}: powers of two from 2 (halves must be timed sizes)")

    target = AutoModelForCausalLM.from_pretrained(default_target_path()).eval()
    drafter = AutoModel.from_pretrained(DEFAULT_DRAFTER, trust_remote_code=True).attach(target)
    tuning = drafter.tuning.summary()
    print(tuning)
    costs = {1: drafter.cycle_costs}
    for size in sorted({half for size in sizes for half in (size // 2, size)} - {1}):
        costs[size] = time_batch(drafter, size)
    ratios = {size: {k: split_ratio(costs, size, size // 2, k + 1) for k in range(1, args.max_proposal + 1)}
              for size in sizes}
    print("two forwards / one forward, half the rows failing (below 1: splitting pays)")
    print("batch " + " ".join(f"k={k:<5}" for k in range(1, args.max_proposal + 1)))
    for size, row in ratios.items():
        print(f"{size:>5} " + " ".join(f"{ratio:7.2f}" for ratio in row.values()))
    report = {"command_line": ["python", "scripts/split_costs.py", *argv], "tuning": tuning,
              "plain_ms": {size: 1e3 * cost.plain for size, cost in costs.items()},
              "ratios": {str(size): {str(k): ratio for k, ratio in row.items()} for size, row in ratios.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
