"""Write a fixed-seed sample of a regenerated data folder as a one-shard folder (plus SOURCE.txt naming the records).

Used where a recipe trains on part of an answer set, e.g. the LiLiCorr head (recipes/smollm2/lilicorr.yaml), whose
feature cache on a 2-core machine could not hold the whole set:

    python scripts/sample_records.py model_cards/smollm2-135m-code-answers data/lili2/code --count 96 \
        --exclude data/lili/code
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch

from dcoco_hf.training.data import load_shards


def sampled_indices(total: int, count: int, seed: int, exclude: set[int]) -> list[int]:
    """`count` sorted record indices of `range(total)` outside `exclude`, drawn with `seed`."""
    pool = [index for index in range(total) if index not in exclude]
    if count > len(pool):
        raise SystemExit(f"--count {count}: only {len(pool)} records are left to sample; ask for fewer")
    return sorted(random.Random(seed).sample(pool, count))


def listed_indices(folder: Path) -> set[int]:
    """The record indices a sampled folder's SOURCE.txt lists."""
    source = folder / "SOURCE.txt"
    if not source.exists():
        raise SystemExit(f"--exclude {folder}: no SOURCE.txt there (it must be a folder this script wrote)")
    return {int(index) for index in re.findall(r"\d+", source.read_text().split(":", 1)[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="a regenerated data folder (shard-*.pt)")
    p.add_argument("output", type=Path, help="the folder to write (shard-00000.pt and SOURCE.txt)")
    p.add_argument("--count", type=int, required=True, help="records to sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", type=Path, nargs="*", default=[], help="sampled folders whose records to leave out")
    args = p.parse_args()
    records = load_shards(args.source)
    exclude = set().union(*(listed_indices(folder) for folder in args.exclude))
    indices = sampled_indices(len(records), args.count, args.seed, exclude)
    args.output.mkdir(parents=True, exist_ok=True)
    torch.save([records[index] for index in indices], args.output / "shard-00000.pt")
    (args.output / "SOURCE.txt").write_text(
        f"{len(indices)} records sampled (random.seed({args.seed})) from {args.source}"
        + (f", none of {', '.join(map(str, args.exclude))}" if args.exclude else "") + f": {indices}\n"
    )
    print(f"{args.output}: {len(indices)} of {len(records)} records")


if __name__ == "__main__":
    main()
