r"""Give a drafter a frequency-ranked draft vocabulary: it then proposes only the target's most frequent tokens.

    python scripts/draft_vocab.py --drafter runs/stage2/final --data data/smollm2 data/smollm2-text --size 8192 \
        --output runs/stage2/final

The tokens are counted in the learned spans of training data (never the evaluation prompts). Outputs stay identical
(the target verifies every token); the drafter's lm_head costs vocab_size / size times less. `--size 0` removes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import GenerationConfig

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.prompts import eos_token_ids
from dcoco_hf.training.data import draft_vocabulary, load_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter folder")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="training data folders (shard-* files)")
    parser.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary (0: whole vocabulary)")
    parser.add_argument("--output", type=Path, required=True, help="folder to save the drafter to (may be --drafter)")
    parser.add_argument("--target", default=None, help="target folder or Hub id, for its end-of-turn ids")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
