"""Training-mode slot accuracy of a drafter: on its training records vs on held-out answers of the target.

    python scripts/slot_accuracy.py --drafter model_cards/dcoco-smollm2-135m --data data/smollm2 --limit 5

The same packed forward as training (`drafter_loss`, every response position an anchor, top-1 over the tokens
the drafter may propose: its draft vocabulary if it has one, labels outside it left out) runs on (a) the first
records of each training folder and (b) the target's own greedy answers to the first `--limit` HumanEval and
MT-Bench prompts. A large gap between the two is a generalisation gap (more varied data helps). The last two columns
measure the corrector: over adjacent slot pairs whose true tokens are both in the top-K, given the true predecessor,
how often the true successor is the drafter's top-1 and how often it is the corrector's best successor (the
prefix-first walk's pick). With `correct_first_slot` two more columns compare the same two picks at slot 1, after
the anchor, over blocks whose slot-1 token is in the top-K. Coverage measured during generation (`dcoco-hf bench`) runs
lower than (b) by design: cycles start right after a rejection, at the harder positions. Train/inference
mismatches are caught by tests/test_train_inference_parity.py instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import load_default_target, suite_prompts
from dcoco_hf.runtime.prompts import chat_input_ids
from dcoco_hf.cli.bench import check_block_size
from dcoco_hf.training import drafter_loss, target_context
from dcoco_hf.training.data import load_shards


@torch.no_grad()
def slot_accuracy(
    drafter: DCOCODrafter, input_ids: torch.LongTensor, loss_mask: torch.BoolTensor, block_size: int | None = None
) -> torch.Tensor:
    """Over every anchor of one sequence [1, T] (anchors before response tokens), blocks of `block_size` (default:
    the drafter's): top-1 accuracy per slot, then the successor accuracy of the drafter and of the corrector given
    the true predecessor, then the same two at slot 1 after the anchor (NaN without `correct_first_slot`) -> [S + 4]."""
    states, argmax = target_context(drafter.target, drafter.config.target_layer_ids, input_ids)
    anchors = int(loss_mask.sum())
    out = drafter_loss(drafter, input_ids, loss_mask, states, argmax, num_anchors=anchors, block_size=block_size)
    first = out.first_slot_accuracy or (torch.tensor(float("nan")),) * 2
    return torch.cat([out.slot_accuracy, torch.stack(out.successor_accuracy), torch.stack(first)])


def held_out_answers(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, suite: str, limit: int, max_new_tokens: int
) -> Iterator[tuple[torch.LongTensor, torch.BoolTensor]]:
    """The target's greedy answers [1, T] to the first `limit` prompts of `suite`, with their response masks."""
    for prompt in suite_prompts(suite)[:limit]:
        ids = chat_input_ids(tokenizer, prompt)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        mask = torch.zeros_like(out, dtype=torch.bool)
        mask[:, ids.shape[1] :] = True
        yield out, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter folder")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="training data folders (shard-* files)")
    parser.add_argument("--limit", type=int, default=5, help="records per data folder and prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None,
                        help="blocks to measure (default: the drafter's config.block_size; at most the largest it "
                             "was trained on)")
    args = parser.parse_args()

    target, tokenizer = load_default_target()
    drafter = DCOCODrafter.from_pretrained(args.drafter).attach(target).eval()
    if args.block_size is not None:
        try:
            check_block_size(drafter, args.block_size)
        except ValueError as err:
            parser.error(f"--block-size: {err}")
    sources = {
        f"train {folder}": (
            (r["input_ids"][None], r["loss_mask"][None].bool()) for r in load_shards(folder)[: args.limit]
        )
        for folder in args.data
    }
    for suite in ("humaneval", "mtbench"):
        sources[f"held-out {suite}"] = held_out_answers(target, tokenizer, suite, args.limit, args.max_new_tokens)
    first_slot = drafter.config.correct_first_slot
    print("per-slot top-1 accuracy (slot 1 first) | successor accuracy given the true predecessor, both in the "
          "top-K: drafter top-1, corrector" + (" | the same at slot 1 after the anchor" if first_slot else "")
          + " (mean over sequences)")
    for name, sequences in sources.items():
        accuracy = torch.stack(
            [slot_accuracy(drafter, ids, mask, args.block_size) for ids, mask in sequences]
        ).nanmean(0).tolist()
        line = (f"{name:32s} " + " ".join(f"{a:.2f}" for a in accuracy[:-4])
                + " | {:.2f} {:.2f}".format(*accuracy[-4:-2]))
        print(line + (" | {:.2f} {:.2f}".format(*accuracy[-2:]) if first_slot else ""))


if __name__ == "__main__":
    main()
