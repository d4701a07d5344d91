"""Batched speculative decoding: a left-padded batch, each row accepting its own number of drafts per cycle.

    python examples/batched.py

transformers' assisted generation serves one sequence at a time; `speculative_generate` serves batches through the
same drafting code path, either called directly or as `generate(custom_generate=...)`. Each cycle may verify a
draft tree (up to `tree_budget` nodes, default 16) instead of a chain where the cost model expects it to pay;
`tree_budget=0` drafts chains only. Greedy rows equal plain batched `generate()` token for token either way.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf import speculative_generate
from dcoco_hf.assets import default_target_path
from dcoco_hf.cli.common import default_drafter_path

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France?",
    "Explain recursion in one paragraph.",
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter folder or Hub id (default: the shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    target_path = args.target or default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = AutoModel.from_pretrained(args.drafter or default_drafter_path(), trust_remote_code=True).attach(target)

    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # rows are left-padded to one width
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    batch = tokenizer(chats, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.no_grad():
        out = speculative_generate(target, batch.input_ids, attention_mask=batch.attention_mask, drafter=drafter,
                                   **settings)
        via_generate = target.generate(**batch, custom_generate=speculative_generate, drafter=drafter, **settings)
        chains = speculative_generate(target, batch.input_ids, attention_mask=batch.attention_mask, drafter=drafter,
                                      tree_budget=0, **settings)
        plain = target.generate(**batch, **settings)

    width = batch.input_ids.shape[1]
    for prompt, row, stats in zip(PROMPTS, out.sequences, out.stats):
        print(f"--- {prompt}  (tau {stats.tau:.2f}; {stats.tree_cycles} of {stats.cycles} cycles verified a tree)")
        print(tokenizer.decode(row[width:], skip_special_tokens=True).strip())
    identical = all(torch.equal(other, plain) for other in (out.sequences, via_generate, chains.sequences))
    print(f"\nidentical to plain batched generate() (trees, custom_generate, chains only): {identical}")
    return {"identical": identical, "tau": [stats.tau for stats in out.stats]}


if __name__ == "__main__":
    main()
