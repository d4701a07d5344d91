r"""Regenerate drafter training data: the target answers held-out-safe prompts greedily (resumable).

    python scripts/regenerate_data.py --out data/smollm2 --code 480 --chat 320 [--shards 4]
    python scripts/regenerate_data.py --out data/smollm2-code-answers --code 768 --chat 0 --whole-stdlib \
        --exclude data/smollm2
    python scripts/regenerate_data.py --out data/smollm2-exercises --code 0 --chat 0 --exercises 512
    python scripts/regenerate_data.py --out data/smollm2-exercises2 --code 0 --chat 0 --exercises 1536 --seed 1 \
        --exclude data/smollm2-exercises

Prompts: documented Python stdlib functions ("complete the function"), and questions and programming exercises
the target writes itself.
Never HumanEval or MT-Bench, which stay held out for evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dcoco_hf.assets import humaneval_prompts, load_default_target
from dcoco_hf.training.data import (
    regenerate,
    self_instruct_exercises,
    self_instruct_prompts,
    stdlib_code_prompts,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--code", type=int, default=480, help="number of stdlib code prompts")
    parser.add_argument("--chat", type=int, default=320, help="number of self-instruct chat prompts")
    parser.add_argument("--exercises", type=int, default=0,
                        help="number of 'complete the function' prompts for programming exercises the target writes "
                             "itself (functions named as in HumanEval are dropped)")
    parser.add_argument("--whole-stdlib", action="store_true",
                        help="code prompts from every documented function and method of the standard library (~2100) "
                             "instead of a curated ~520 functions")
    parser.add_argument("--exclude", type=Path, nargs="*", default=[],
                        help="data folders whose prompts.json prompts are left out (a second folder that does not "
                             "repeat the first)")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shards", type=int, default=None,
                        help="stop after the first N shards of 64 answers (rerun without it to go on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    excluded = set()
    for folder in args.exclude:  # checked before the target loads: a typo should not cost a generation
        if not (folder / "prompts.json").exists():
            parser.error(f"--exclude {folder}: no prompts.json there; pass a folder written by this script")
        excluded.update(json.loads((folder / "prompts.json").read_text()))
    if args.target is None:
        target, tokenizer = load_default_target()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target, tokenizer = (
            AutoModelForCausalLM.from_pretrained(args.target).eval(), AutoTokenizer.from_pretrained(args.target)
        )
    prompts_file = args.out / "prompts.json"  # written by regenerate(): resume with exactly the same prompts
    if prompts_file.exists():
        prompts = json.loads(prompts_file.read_text())
    else:
        chat = self_instruct_prompts(target, tokenizer, args.chat, seed=args.seed) if args.chat else []
        exercises = (
            self_instruct_exercises(
                target, tokenizer, args.exercises, seed=args.seed, exclude=[*humaneval_prompts(), *excluded]
            )
            if args.exercises
            else []
        )
        code = stdlib_code_prompts(args.code, seed=args.seed, whole_stdlib=args.whole_stdlib, exclude=excluded)
        prompts = code + [p for p in exercises + chat if p not in excluded]
        prompts = [prompts[i] for i in torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed))]
    regenerate(target, tokenizer, prompts, args.out, args.max_new_tokens, args.batch_size, max_shards=args.shards)


if __name__ == "__main__":
    main()
