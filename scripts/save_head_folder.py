r"""Write a trained corrector head as a head-only folder naming its base drafter, in half precision when that drafts
the same.

A corrector trained on a frozen backbone (`--corrector-only`) differs from its base drafter in the head alone, so its
folder holds only the head (`save_pretrained(..., base_drafter=...)`). With `--head-dtype bfloat16` or `float16` the
head's tensors are rounded to that dtype first (half the bytes), and kept so only if every block drafted on the check
positions is the one the fp32 head drafts: the greedy answers to `--check-prompts` prompts of each suite, every
position an anchor. Otherwise the head is written in fp32, and the report says how many blocks differed.

    python scripts/save_head_folder.py runs/dflash2-selector-1200/final model_cards/dflash2-selector-smollm2-135m \
        --base ../dcoco-smollm2-135m --head-dtype float16
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import load_default_target, suite_prompts
from dcoco_hf.runtime.prompts import chat_input_ids
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.training import target_context

HEAD_PREFIX = "corrector."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", type=Path, help="the trained drafter folder (complete weights)")
    p.add_argument("output", type=Path, help="the head-only folder to write")
    p.add_argument("--base", required=True, help="the base drafter, relative to OUTPUT (e.g. ../dcoco-smollm2-135m)")
    p.add_argument("--head-dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--suites", default="humaneval,mtbench")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts per suite whose answers are checked")
    p.add_argument("--max-new-tokens", type=int, default=64)
    return p.parse_args()


def rounded_head(drafter: DCOCODrafter, dtype: torch.dtype) -> DCOCODrafter:
    """A copy whose head tensors went through `dtype` (the values a folder stored in it loads back as)."""
    copied = copy.deepcopy(drafter)
    with torch.no_grad():
        for name, tensor in copied.state_dict().items():
            if name.startswith(HEAD_PREFIX) and tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype))
    return copied


@torch.no_grad()
def drafted_blocks(drafter: DCOCODrafter, target, answers: list[tuple[torch.LongTensor, int]]) -> list[torch.Tensor]:
    """The block drafted with each answer token as the anchor: answers are (prompt and greedy continuation [1, T],
    prompt length P) -> [T - P, S] per answer (the last prompt token anchors the first block)."""
    blocks = []
    for ids, prompt_length in answers:
        states, _ = target_context(target, drafter.config.target_layer_ids, ids)
        rows = []
        for anchor in range(prompt_length - 1, ids.shape[1] - 1):
            positions = torch.arange(anchor + drafter.config.block_size)[None]
            proposal = drafter.propose(ids[:, anchor], states[:, :anchor], positions, DraftContextCache(),
                                       context_ids=ids[:, : anchor + 1])  # what a corrector's context bigrams read
            rows.append(proposal.tokens[0])
        blocks.append(torch.stack(rows))
    return blocks


def main() -> None:
    args = parse_args()
    target, tokenizer = load_default_target()
    drafter = DCOCODrafter.from_pretrained(args.drafter).eval().attach(target, tune=False)
    state = drafter.state_dict()
    report = {"head_dtype": args.head_dtype, "head_tensors": sorted(k for k in state if k.startswith(HEAD_PREFIX))}
    dtype = DTYPES[args.head_dtype]
    if dtype != torch.float32:
        answers = []
        for suite in args.suites.split(","):
            for text in suite_prompts(suite)[:args.check_prompts]:
                ids = chat_input_ids(tokenizer, text)
                answers.append((target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=args.max_new_tokens), ids.shape[1]))
        rounded = rounded_head(drafter, dtype).attach(target, tune=False)
        ours, theirs = drafted_blocks(drafter, target, answers), drafted_blocks(rounded, target, answers)
        differing = sum(int((a != b).any(-1).sum()) for a, b in zip(ours, theirs))
        report.update(checked_blocks=sum(len(a) for a in ours), differing_blocks=differing)
        if differing:
            report["head_dtype"] = "float32"  # the rounded head drafts other blocks: keep the trained values
        else:
            state = {k: v.to(dtype) if k.startswith(HEAD_PREFIX) and v.is_floating_point() else v
                     for k, v in state.items()}
    drafter.save_pretrained(args.output, base_drafter=args.base, state_dict=state)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
