"""What a verify forward costs: one target forward of n new tokens relative to a 1-token step, side by side for
every few-rows linear layout of dcoco_hf/runtime/cpu_linear.py (torch's GEMM, W @ x^T, MKL's packed GEMM where torch has
it), and the plan `use_few_rows_linear` measures on this machine. All of them run on the "sdpa_cpu_gqa" attention
(dcoco_hf/runtime/cpu_attention.py, the CLI's CPU default); a last column runs the plan on transformers' "sdpa", which
expands a grouped-head target's keys/values in every masked multi-token forward.

The layouts run interleaved on the same cached context, so the ratios are comparable within the run even on a noisy
machine. Every layout computes a 1-token step with torch's own F.linear, so that column is plain decoding's cost.
Speculation pays only when cost(n) / cost(1) is well under the tokens a cycle commits (tau). The last line is the
rounding a verify forward adds: the largest logit difference between one forward of n tokens and n 1-token steps
(float32 ~1e-5; in half precision enough to flip a near-tie, so greedy outputs are token-exact in float32 only).

    python scripts/verify_cost.py                      # the default SmolLM2-135M target
    python scripts/verify_cost.py --dtype bfloat16     # half precision (no packed GEMM: it is sgemm)
    python scripts/verify_cost.py --target FOLDER --context 400 --tokens 1,2,4,8,16 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dcoco_hf.assets import load_default_target
from dcoco_hf.runtime.cpu_attention import CPU_GQA_ATTENTION
from dcoco_hf.runtime.cpu_linear import (
    available_layouts,
    restore_linear,
    tune_few_rows_layout,
    use_few_rows_linear,
)
from dcoco_hf.runtime.hf_compat import cache_kwargs


def cache_before(target, context: torch.LongTensor, new_tokens: int) -> DynamicCache:
    """A cache holding all of `context` [1, T] but its last `new_tokens` ids."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(context[:, :-new_tokens], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache


def forward_seconds(target, context: torch.LongTensor, new_tokens: int) -> float:
    """Time one forward of the last `new_tokens` ids of `context` [1, T] on a cache holding the rest."""
    cache = cache_before(target, context, new_tokens)
    with torch.no_grad():
        start = time.perf_counter()
        target(context[:, -new_tokens:], **cache_kwargs(cache), use_cache=True)
        return time.perf_counter() - start


@torch.no_grad()
def verify_rounding(target, context: torch.LongTensor, new_tokens: int) -> float:
    """Largest |logit| difference between one forward of the last `new_tokens` ids of `context` [1, T] and as many
    1-token steps, both on a cache of the rest."""
    logits = []
    for chunks in ([new_tokens], [1] * new_tokens):
        cache = cache_before(target, context, new_tokens)
        start = context.shape[1] - new_tokens
        for size in chunks:
            step = target(context[:, start : start + size], **cache_kwargs(cache), use_cache=True)
            logits.append(step.logits[0].float())
            start += size
    block, steps = logits[0], torch.cat(logits[1:])  # [n, V] each
    return (block - steps).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--context", type=int, default=200, help="cached context length (default 200)")
    parser.add_argument("--tokens", default="1,2,4,6,8", help="new-token counts to time (default 1,2,4,6,8)")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per setting; median kept (default 9)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and activations")
    args = parser.parse_args()
    if args.target is None:
        target, _ = load_default_target()
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    target.to(getattr(torch, args.dtype))
    counts = sorted({int(n) for n in args.tokens.split(",")} | {1})
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.config.vocab_size, (1, args.context + max(counts)), generator=generator)
    rows = range(2, max(counts) + 1)
    layouts = [name for name in available_layouts() if name != "packed" or args.dtype == "float32"]  # sgemm only
    measured = tune_few_rows_layout(target, rows)
    plans = {name: ({r: name for r in rows}, CPU_GQA_ATTENTION) for name in layouts}
    plans["measured plan"] = (measured, CPU_GQA_ATTENTION)
    plans["measured plan, sdpa"] = (measured, "sdpa")
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in plans for n in counts}
    for _ in range(args.repeats + 1):  # the first round warms up (and packs) and is dropped
        for name, (plan, attention) in plans.items():
            use_few_rows_linear(target, layout=plan)
            target.set_attn_implementation(attention)
            for n in counts:
                times[name, n].append(forward_seconds(target, context, n))
    restore_linear(target)
    target.set_attn_implementation(CPU_GQA_ATTENTION)
    print(f"context {args.context}, threads {torch.get_num_threads()}, {args.dtype}, median of {args.repeats}")
    print(f"measured plan: {measured}")
    step = statistics.median(times["gemm", 1][1:]) * 1e3
    print("new tokens | " + " | ".join(f"{name}: ms, x plain step" for name in plans))
    for n in counts:
        ms = [statistics.median(times[name, n][1:]) * 1e3 for name in plans]
        cells = [f"{value:7.1f} ms {value / step:5.2f}x" for value in ms]
        print(f"{n:10d} | " + " | ".join(cells))
    n = max(counts)
    print(f"max |logits of one {n}-token forward - logits of {n} 1-token steps| (torch's GEMM, {CPU_GQA_ATTENTION}): "
          f"{verify_rounding(target, context, n):.3g}")


if __name__ == "__main__":
    main()
