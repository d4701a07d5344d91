r"""Write samples of regenerated answer sets as one-shard folders (plus SOURCE.txt naming the records).

Used where a recipe trains on part of the answer sets, e.g. the LiLiCorr head (recipes/smollm2/lilicorr.yaml), whose
target-feature cache on a 2-core machine could not hold the whole sets. Two ways:

    # draw a new sample (fixed seed), leaving out records earlier samples took
    python scripts/sample_records.py --source model_cards/smollm2-135m-code-answers --output data/lili/code-d \
        --count 96 --exclude data/lili/code data/lili/code-b
    # rebuild the exact folders a recipe names from their committed record lists
    python scripts/sample_records.py --from-list recipes/smollm2/lilicorr-records.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from dcoco_hf.training.data import load_shards, save_shard, shard_path


def sampled_indices(total: int, count: int, seed: int, exclude: set[int]) -> list[int]:
    """`count` sorted record indices of `range(total)` outside `exclude`, drawn with `seed`."""
    pool = [index for index in range(total) if index not in exclude]
    if count > len(pool):
        raise SystemExit(f"--count {count}: only {len(pool)} records are left to sample; ask for fewer")
    return sorted(random.Random(seed).sample(pool, count))


def listed_indices(folder: Path) -> list[int]:
    """The record indices a sampled folder's SOURCE.txt lists."""
    source = folder / "SOURCE.txt"
    if not source.exists():
        raise SystemExit(f"{folder}: no SOURCE.txt there (it must be a folder this script wrote)")
    return [int(index) for index in re.findall(r"\d+", source.read_text().split(":", 1)[1])]


def write_sample(source: Path, records: list[dict], output: Path, indices: list[int], note: str) -> None:
    if indices and max(indices) >= len(records):
        raise SystemExit(f"{output}: record {max(indices)} is not in {source} ({len(records)} records); regenerate "
                         "the answer set that list was drawn from")
    output.mkdir(parents=True, exist_ok=True)
    save_shard([records[index] for index in indices], shard_path(output, 0))
    (output / "SOURCE.txt").write_text(f"{len(indices)} records {note} from {source}: {indices}\n")
    print(f"{output}: {len(indices)} of {len(records)} records")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-list", type=Path, help="JSON {output folder: {source, indices}}: rebuild every folder")
    p.add_argument("--source", type=Path, help="a regenerated data folder (shard-* files) to sample")
    p.add_argument("--output", type=Path, help="the folder to write (shard-00000.safetensors and SOURCE.txt)")
    p.add_argument("--count", type=int, help="records to sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", type=Path, nargs="*", default=[], help="sampled folders whose records to leave out")
    args = p.parse_args()
    if args.from_list is not None:
        for output, entry in json.loads(args.from_list.read_text()).items():
            source = Path(entry["source"])
            write_sample(source, load_shards(source), Path(output), entry["indices"], f"listed in {args.from_list}")
        return
    if args.source is None or args.output is None or args.count is None:
        p.error("give --from-list FILE, or --source, --output and --count to draw a new sample")
    exclude = {index for folder in args.exclude for index in listed_indices(folder)}
    records = load_shards(args.source)
    indices = sampled_indices(len(records), args.count, args.seed, exclude)
    write_sample(args.source, records, args.output, indices, f"sampled (random.seed({args.seed}))")


if __name__ == "__main__":
    main()
