r"""How fast the target writes training answers: `dcoco-hf train`'s answer phase against `regenerate_data.py` as it
was before answers were length-sorted, on the same prompts in one process, each setting timed in turn (order
alternated per round).

    python scripts/answer_throughput.py --prompts 256 --rounds 2 --json docs/results/answer_throughput.json

The prompts are a fixed sample of `dcoco-hf train`'s own sources for SmolLM2 (half "complete the function" tasks
from library functions, half chat, writing and reasoning tasks). `dcoco-hf train` answers them shortest first in
batches of 64 (`training.data.regenerate`); the earlier script answered them in the order given, 64 per shard,
sorted inside each shard, in batches of 32, each a batched `generate()` call, whose finished rows go on decoding
until the batch's longest answer ends (reproduced here). `dcoco-hf train`'s rows leave the batch as their answers end
(`training.data.greedy_answers`). Greedy, 192 new tokens. Reports answers per hour, answer tokens per second, the
ratio, and whether both wrote the same answers.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from dcoco_hf.assets import load_default_target
from dcoco_hf.runtime.prompts import eos_token_ids, left_pad, padding_id, prompt_input_ids
from dcoco_hf.training.data import load_shards, regenerate
from dcoco_hf.training.run import TrainRun
from dcoco_hf.training.prompt_sources import library_code_prompts, task_prompts

SETTINGS = {"regenerate_data.py": 32, "dcoco-hf train": TrainRun.answer_batch_size}  # prompts per generate() call
SHARD = 64  # prompts per shard, in both


def answer(name: str, target, tokenizer, prompts: list[str], folder: Path, max_new_tokens: int) -> list[list[int]]:
    """Each answered prompt's tokens (prompt + answer) as one setting writes them: `regenerate` over all prompts
    (sorted by length), or the earlier script's shards of 64, each sorted on its own, 32 rows per `generate()`."""
    if name == "dcoco-hf train":
        regenerate(target, tokenizer, prompts, folder, max_new_tokens, SETTINGS[name], shard_size=SHARD)
        return [r["input_ids"].tolist() for r in load_shards(folder)]
    written = []
    eos = eos_token_ids(target.generation_config.eos_token_id)
    for start in range(0, len(prompts), SHARD):
        shard = sorted((prompt_input_ids(tokenizer, p)[0] for p in prompts[start : start + SHARD]), key=len)
        for batch in (shard[i : i + SETTINGS[name]] for i in range(0, len(shard), SETTINGS[name])):
            ids, mask = left_pad(batch, padding_id(tokenizer))
            rows = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
            for prompt, row in zip(batch, rows[:, ids.shape[1] :].tolist()):
                ends = [i for i, token in enumerate(row) if token in eos]
                written.append(prompt.tolist() + row[: ends[0] + 1 if ends else len(row)])
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    target, tokenizer = load_default_target()
    rng = random.Random(7)
    prompts = rng.sample(library_code_prompts(), args.prompts // 2) + task_prompts(args.prompts - args.prompts // 2,
                                                                                  seed=7)
    rng.shuffle(prompts)
    seconds = {name: [] for name in SETTINGS}
    records = {}
    for round_ in range(args.rounds):
        names = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
        for name in names:
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                written = answer(name, target, tokenizer, prompts, Path(folder), args.max_new_tokens)
                seconds[name].append(time.perf_counter() - start)
                records[name] = {tuple(r) for r in written}
    tokens = sum(len(r) for r in records["dcoco-hf train"]) - sum(
        len(prompt_input_ids(tokenizer, p)[0]) for p in prompts)
    same = len(records["dcoco-hf train"] & records["regenerate_data.py"])
    report = {
        "command": "python " + " ".join(sys.argv),
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
