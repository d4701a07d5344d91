r"""How fast the target writes training answers: `dcoco-hf train`'s answer phase against `regenerate_data.py`'s
settings, on the same prompts in one process, each setting timed in turn (order rotated per round).

    python scripts/answer_throughput.py --prompts 128 --rounds 2 --json docs/results/answer_throughput.json

Both run `training.data.regenerate` (length-sorted batches of one shard, greedy, 192 new tokens); they differ in
how many prompts one generate() call answers. Reports answers per hour, answer tokens per second, the ratio, and
whether both wrote the same answers.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from dcoco_hf.assets import load_default_target
from dcoco_hf.training.data import load_shards, regenerate
from dcoco_hf.training.pipeline import TrainRun
from dcoco_hf.training.prompt_sources import task_prompts

SETTINGS = {"regenerate_data.py": 32, "dcoco-hf train": TrainRun.answer_batch_size}  # prompts per generate() call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    target, tokenizer = load_default_target()
    prompts = task_prompts(args.prompts, seed=7)  # chat, writing and reasoning requests of the kind training asks
    seconds = {name: [] for name in SETTINGS}
    records = {}
    for round_ in range(args.rounds):
        names = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
        for name in names:
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                regenerate(target, tokenizer, prompts, folder, args.max_new_tokens, SETTINGS[name],
                           shard_size=max(SETTINGS.values()))
                seconds[name].append(time.perf_counter() - start)
                records[name] = load_shards(folder)
    tokens = sum(int(r["loss_mask"].sum()) for r in records["dcoco-hf train"])
    same = sum(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(*records.values()))
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}",
        "prompts": len(prompts), "answer_tokens": tokens, "identical_answers": same,
        "settings": {name: {"batch": SETTINGS[name], "seconds": min(s),
                            "answers_per_hour": 3600 * len(prompts) / min(s), "tokens_per_s": tokens / min(s)}
                     for name, s in seconds.items()},
    }
    report["ratio"] = report["settings"]["dcoco-hf train"]["tokens_per_s"] / \
        report["settings"]["regenerate_data.py"]["tokens_per_s"]
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
