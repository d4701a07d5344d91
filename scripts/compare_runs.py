r"""Compare `dcoco-hf train` runs at equal steps: held-out tau and slot acceptance at each checkpoint of one stage.

    dcoco-hf train --recipe recipes/train/smollm2-135m.yaml --out runs/abl-layers2 \
        --data-from runs/smollm2-16k --layers 2 --steps 1000 --until stage1
    python scripts/compare_runs.py runs/smollm2-16k runs/abl-layers2 --stage 1 --json docs/results/training_choices.json

The first run is the reference; each other run is named by the options where it differs from it. Runs trained with
`--data-from` on the reference's answers read the same records and measure on the same held-out prompts, so a row's
difference is the option's alone (the step count and learning-rate schedule aside: compare at the steps both reached).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from dcoco_hf.training.run import STATE_FILE, read_progress

# Options that say where a run's files are or how it was paced, not what drafter it trains.
NOT_A_CHOICE = {"out", "data_from", "until", "hours", "steps", "stage2_steps", "save_steps", "threads", "recipe"}


def read_run(folder: Path, stage: int) -> dict[str, Any]:
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        raise SystemExit(f"{folder}: no {STATE_FILE}; pass the --out folder of a `dcoco-hf train` run")
    state = json.loads(state_file.read_text())
    progress = [{key: line[key] for key in ("step", "tau", "chain_accept")}
                for line in read_progress(folder) if line["stage"] == stage]
    if not progress:
        raise SystemExit(f"{folder}: no stage-{stage} checkpoint measured yet (progress.jsonl)")
    return {"run": folder.name, "command": state.get("command"), "options": state["options"], "progress": progress}


def differences(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The options that shape `other`'s drafter differently from `reference`'s."""
    return {key: value for key, value in other.items()
            if key not in NOT_A_CHOICE and reference.get(key) != value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="`dcoco-hf train` --out folders; the first is the reference")
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = [read_run(folder, args.stage) for folder in args.runs]
    reference = runs[0]["options"]
    for run in runs:
        run["differs"] = differences(reference, run["options"])
    steps = sorted(set.intersection(*({line["step"] for line in run["progress"]} for run in runs)))
    if not steps:
        raise SystemExit("the runs share no checkpoint step: give them the same --save-steps")
    report = {"command_line": ["python", "scripts/compare_runs.py", *sys.argv[1:]], "stage": args.stage,
              "steps": steps, "runs": runs, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__}
    for run in runs:
        taus = {line["step"]: line["tau"] for line in run["progress"]}
        name = ", ".join(f"{k}={v}" for k, v in run["differs"].items()) or "reference"
        print(f"{run['run']:<24} {name:<40} " + "  ".join(f"{step}: {taus[step]:.3f}" for step in steps))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
