"""Sampling with a drafter is exact: the output has the same distribution as plain sampling.

    python examples/sampling.py --samples 200

The drafter's proposal is a point mass, so the target accepts a drafted token with exactly its own probability and
otherwise samples from its distribution without that token (DCOCO appendix G). This example checks it the way a
statistician would: it samples the first few tokens of one prompt many times, with and without the drafter, and
compares the two empirical distributions of the first new token (total variation distance; two plain runs with
different seeds give the noise floor).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf.assets import default_target_path
from dcoco_hf.cli.common import default_drafter_path


def first_tokens(target, inputs, samples: int, seed: int, drafter=None) -> Counter:
    torch.manual_seed(seed)
    counts: Counter = Counter()
    width = inputs["input_ids"].shape[1]
    for _ in range(samples):
        out = target.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=4,
                              assistant_model=drafter)
        counts[int(out[0, width])] += 1
    return counts


def total_variation(a: Counter, b: Counter) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / n_a - b[t] / n_b) for t in set(a) | set(b))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter folder or Hub id (default: the shipped one)")
    parser.add_argument("--prompt", default="Name a colour.")
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)

    target_path = args.target or default_target_path()  # a plain Hugging Face folder, built once on first use
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = AutoModel.from_pretrained(args.drafter or default_drafter_path(), trust_remote_code=True).attach(target)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        plain = first_tokens(target, inputs, args.samples, seed=0)
        plain_again = first_tokens(target, inputs, args.samples, seed=1)
        speculative = first_tokens(target, inputs, args.samples, seed=2, drafter=drafter)
        greedy = target.generate(**inputs, do_sample=False, max_new_tokens=1)[0, -1]
    noise, gap = total_variation(plain, plain_again), total_variation(plain, speculative)
    print(f"{args.samples} samples of the first new token, total variation distance to plain sampling:")
    print(f"  another plain run (noise floor) {noise:.3f}")
    print(f"  with the drafter                {gap:.3f}")
    return {"noise": noise, "gap": gap, "plain": plain, "greedy_token": int(greedy)}


if __name__ == "__main__":
    main()
