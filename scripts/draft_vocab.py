r"""Give a drafter a frequency-ranked draft vocabulary: it then proposes only the target's most frequent tokens.

    python scripts/draft_vocab.py --drafter runs/stage2/final --data data/smollm2 data/smollm2-text --size 8192 \
        --output runs/stage2/final
    python scripts/draft_vocab.py --compare 8192 16384 32768 65536 0 --target gemma3-270m \
        --data runs/gemma3-270m/data --layers 2 --json docs/results/draft_vocab_gemma3.json

The tokens are counted in the learned spans of training data (never the evaluation prompts). Outputs stay identical
(the target verifies every token); the drafter's lm_head costs vocab_size / size times less. `--size 0` removes it.

`--compare` chooses the size: for each one, the share of the target's answer tokens it holds (a token outside it can
never be proposed), both over the answers it is chosen from and over answers it never saw (chosen from every other
record, measured on the rest: what a new prompt's answer meets), and the timed cost of drafting blocks of 2, 4 and 8
with a drafter of that shape (untrained: the cost does not depend on the weights), in plain target steps, beside the
verify costs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.cli.common import resolve_target
from dcoco_hf.runtime.block_choice import measure_cycle_costs
from dcoco_hf.runtime.prompts import eos_token_ids
from dcoco_hf.training.data import draft_vocabulary, learned_token_counts, load_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="drafter folder")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="training data folders (shard-* files)")
    parser.add_argument("--size", type=int, help="tokens in the draft vocabulary (0: whole vocabulary)")
    parser.add_argument("--output", type=Path, help="folder to save the drafter to (may be --drafter)")
    parser.add_argument("--target", default=None, help="target folder, Hub id or known name, for its end-of-turn ids")
    parser.add_argument("--compare", type=int, nargs="+", metavar="SIZE",
                        help="measure these sizes instead (0: the whole vocabulary)")
    parser.add_argument("--layers", type=int, default=1, help="--compare: drafter layers (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="--compare: write the table here")
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    if args.drafter is None or args.size is None or args.output is None:
        parser.error("--drafter, --size and --output are required (or --compare SIZE ...)")

    drafter = DCOCODrafter.from_pretrained(args.drafter)
    if args.size == 0:
        drafter.set_draft_vocabulary(None)
        print("draft vocabulary removed: the drafter proposes from all tokens")
    else:
        eos = eos_token_ids(GenerationConfig.from_pretrained(args.target or default_target_path()).eos_token_id)
        records = [record for folder in args.data for record in load_shards(folder)]
        ids, coverage = draft_vocabulary(records, drafter.config.vocab_size, args.size, always=eos)
        drafter.set_draft_vocabulary(ids)
        print(f"draft vocabulary: {ids.numel()} of {drafter.config.vocab_size} tokens, covering {coverage:.2%} of "
              f"the learned tokens of {len(records)} records")
    drafter.save_pretrained(args.output)


def compare(args: argparse.Namespace) -> None:
    target_name = resolve_target(args.target)
    target = AutoModelForCausalLM.from_pretrained(target_name, dtype=torch.float32).eval()
    eos = eos_token_ids(target.generation_config.eos_token_id)
    records = [record for folder in args.data for record in load_shards(folder)]
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=args.layers, block_size=8).eval()
    drafter.attach(target, tune=False)
    rows = []
    unseen = learned_token_counts(records[1::2], target.config.vocab_size)  # [V] of the half the split leaves out
    for size in args.compare:
        if size:
            ids, coverage = draft_vocabulary(records, target.config.vocab_size, size, always=eos)
            split, _ = draft_vocabulary(records[::2], target.config.vocab_size, size, always=eos)
            held_out = float(unseen[split].sum() / unseen.sum())
            drafter.set_draft_vocabulary(ids)
        else:
            coverage = held_out = 1.0
            drafter.set_draft_vocabulary(None)
        with torch.no_grad():
            costs = measure_cycle_costs(target, drafter, [2, 4, 8], max_rows=8)
        row = {"size": size or target.config.vocab_size, "coverage": round(coverage, 5),
               "held_out_coverage": round(held_out, 5),
               "plain_ms": round(1e3 * costs.plain, 2),
               "draft": {b: round(costs.draft[b] / costs.plain, 3) for b in (2, 4, 8)},
               "verify": {n: round(costs.verify[n - 1] / costs.plain, 3) for n in (2, 4, 8)},
               "spread": round(costs.spread, 3)}
        rows.append(row)
        print(f"{row['size']:>7} tokens: {100 * coverage:6.2f}% of answer tokens ({100 * held_out:6.2f}% of unseen "
              f"answers' tokens); draft of 2/4/8 "
              f"{row['draft'][2]:.3f}/{row['draft'][4]:.3f}/{row['draft'][8]:.3f} plain steps "
              f"(plain {row['plain_ms']} ms; verify of 2/4/8 {row['verify'][2]:.2f}/{row['verify'][4]:.2f}/"
              f"{row['verify'][8]:.2f}; spread {100 * row['spread']:.0f}%)")
    report = {"command": "python " + " ".join(sys.argv), "target": target_name, "records": len(records),
              "layers": args.layers, "threads": torch.get_num_threads(),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}", "sizes": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
