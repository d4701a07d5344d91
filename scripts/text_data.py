"""Build teacher-forced drafter training data from existing text (no generation; resumable).

    python scripts/text_data.py --out data/smollm2-text --code 1200

Chat records whose assistant turn is real text: standard-library functions' source answering their "complete the
function" prompt, and the Python reference documentation answering "explain this topic". Training labels each slot
with the target's own greedy token, only while the text follows the target's greedy path (see training/losses.py), so
this data teaches what the target accepts even though the target did not write it. HumanEval and MT-Bench stay held out.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from transformers import AutoTokenizer

from dcoco_hf.assets import default_target_path
from dcoco_hf.training.data import (
    python_docs_pairs,
    stdlib_source_pairs,
    teacher_forced_shards,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=None, help="target folder or Hub id, for its tokenizer (default: SmolLM2)")
    parser.add_argument("--code", type=int, default=1200, help="number of stdlib function sources (of ~2100)")
    parser.add_argument("--code-skip", type=int, default=0,
                        help="skip this many shuffled sources first (a second folder that does not repeat the first)")
    parser.add_argument("--docs", type=int, default=None, help="number of documentation pieces (default: all)")
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.target or default_target_path())
    rng = random.Random(args.seed)
    code, docs = stdlib_source_pairs(), python_docs_pairs()
    rng.shuffle(code)
    rng.shuffle(docs)
    pairs = code[args.code_skip : args.code_skip + args.code] + docs[: args.docs]
    rng.shuffle(pairs)
    teacher_forced_shards(tokenizer, pairs, args.out, max_length=args.max_length)


if __name__ == "__main__":
    main()
