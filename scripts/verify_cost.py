"""What a verify forward costs: one target forward of n new tokens relative to a 1-token step, side by side with
torch's plain GEMM and with the few-rows W @ x^T layout (dcoco_hf/cpu_linear.py).

Both layouts run interleaved on the same cached context, so the ratios are comparable within the run even on a noisy
machine. Speculation pays only when cost(n) / cost(1) is well under the tokens a cycle commits (tau).

    python scripts/verify_cost.py                      # the default SmolLM2-135M target
    python scripts/verify_cost.py --target FOLDER --context 400 --tokens 1,2,4,8,16 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dcoco_hf.assets import load_default_target
from dcoco_hf.cpu_linear import restore_linear, use_few_rows_linear


def forward_seconds(target, context: torch.LongTensor, new_tokens: int) -> float:
    """Time one forward of the last `new_tokens` ids of `context` [1, T] on a cache holding the rest."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(context[:, :-new_tokens], past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        target(context[:, -new_tokens:], past_key_values=cache, use_cache=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--context", type=int, default=200, help="cached context length (default 200)")
    parser.add_argument("--tokens", default="1,2,4,6,8", help="new-token counts to time (default 1,2,4,6,8)")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per setting; median kept (default 9)")
    args = parser.parse_args()
    if args.target is None:
        target, _ = load_default_target()
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    counts = sorted({int(n) for n in args.tokens.split(",")} | {1})
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.config.vocab_size, (1, args.context + max(counts)), generator=generator)
    layouts = {"torch GEMM": restore_linear, "W @ x^T": use_few_rows_linear}
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in layouts for n in counts}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, switch in layouts.items():
            switch(target)
            for n in counts:
                times[name, n].append(forward_seconds(target, context, n))
    restore_linear(target)
    print(f"context {args.context}, threads {torch.get_num_threads()}, median of {args.repeats}")
    print("new tokens | " + " | ".join(f"{name}: ms, x 1-token step" for name in layouts))
    for n in counts:
        cells = []
        for name in layouts:
            ms = statistics.median(times[name, n][1:]) * 1e3
            step = statistics.median(times[name, 1][1:]) * 1e3
            cells.append(f"{ms:7.1f} ms {ms / step:5.2f}x")
        print(f"{n:10d} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
