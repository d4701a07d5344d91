"""Batched throughput and the corrector's share of a cycle on a full-size random-weight target (GPU).

Builds a Qwen3-8B-shaped target (bf16, random weights, sdpa) directly on the GPU and a matching untrained drafter
(`DCOCODrafter.from_target`, 5 layers, block 16, top-K 16) with the chosen corrector (`--corrector`: DCOCO, the
public LiLiCorr head, or that head with our pair evidence), then for each batch size runs plain batched generate(),
batched DFlash (corrector off) and the batched corrected drafter on the same left-padded random prompts and prints a
table: aggregate output tokens/s, ratios, tau, mean cycle time, and the drafter's and corrector's shares of a cycle.

Random weights accept almost no drafts (tau ~ 1), so the speed ratios here measure the machinery's overhead per
cycle, not a trained drafter's speedup; the corrector's share of a cycle is the number that transfers. Runs in well
under 5 minutes on one H200. `--tiny` runs a small fp32 model on CPU (smoke check).

    python scripts/gpu_batched_bench.py [--corrector dcoco|lilicorr|lilicorr-evidence] [--batch-sizes 1,2,4,8,16,32]
        [--max-new-tokens 64] [--tiny]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dcoco_hf import DCOCODrafter, speculative_generate
from dcoco_hf.runtime.prompts import left_pad

QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
)


# The corrector under test -> its drafter config fields. "lilicorr-evidence" adds the pair evidence on m(a, b) only:
# the corpus counts need a table built for the target's vocabulary, which a random-weight target has no data for.
CORRECTORS = {
    "dcoco": {},
    "lilicorr": {"corrector_type": "lilicorr"},
    "lilicorr-evidence": {"corrector_type": "lilicorr", "context_bigrams": True},
}


def build(tiny: bool, corrector: str) -> tuple[Qwen3ForCausalLM, DCOCODrafter]:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = Qwen3Config(**(TINY if tiny else QWEN3_8B), attn_implementation="sdpa",
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the final dtype, on the final device: no 32 GB fp32 detour
    try:
        with device:
            target = Qwen3ForCausalLM(config).eval().requires_grad_(False)
            drafter = DCOCODrafter.from_target(target, num_hidden_layers=1 if tiny else 5, block_size=16, top_k=16,
                                               **CORRECTORS[corrector])
    finally:
        torch.set_default_dtype(saved)
    # Exact phase times on a GPU: a sync per phase, a few microseconds a cycle.
    drafter.generation_config.time_phases = True
    return target, drafter.eval().requires_grad_(False)


def prompts(batch: int, vocab: int, length: int, device: torch.device) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Random prompts of mixed lengths (length/2 .. length), left-padded."""
    generator = torch.Generator().manual_seed(batch)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator).tolist()
    rows = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    ids, mask = left_pad(rows, pad_token_id=0)
    return ids.to(device), mask.to(device)


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def runs(target, drafter, ids, mask, name: str, common: dict) -> dict:
    """The three methods on one batch, as calls: plain generate(), DFlash (corrector off), the corrected drafter."""

    def speculative(correct: bool):
        return speculative_generate(target, ids, attention_mask=mask, drafter=drafter, correct=correct, **common)

    return {
        "vanilla": lambda: target.generate(ids, attention_mask=mask, **common),
        "dflash": lambda: speculative(False).sequences,
        name: lambda: speculative(True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small fp32 model on CPU (smoke check)")
    parser.add_argument("--corrector", choices=sorted(CORRECTORS), default="dcoco")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()
    batch_sizes = [int(s) for s in args.batch_sizes.split(",")]

    (target, drafter), build_s = timed(lambda: build(args.tiny, args.corrector))
    params = sum(p.numel() for p in target.parameters()) / 1e9
    head = sum(p.numel() for p in drafter.corrector.parameters()) / 1e6
    print(f"target {params * 1e3:.1f}M params ({target.dtype}, {target.device}), drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.0f}M ({args.corrector} head {head:.2f}M), "
          f"built in {build_s:.1f}s")
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": 0}
    name = args.corrector
    w = len(name) + 7  # column width of the corrected drafter's three columns
    header = (f"{'batch':>5} {'vanilla tok/s':>13} {'dflash tok/s':>12} {name + ' tok/s':>{w}} {name + '/van':>{w}} "
              f"{name + '/dflash':>{w}} {'tau':>5} {'cycle ms':>8} {'drafter share':>13} {'corrector share':>15}")
    print(header)
    for batch in batch_sizes:
        ids, mask = prompts(batch, target.config.vocab_size, args.prompt_len, target.device)
        methods = runs(target, drafter, ids, mask, name, common)
        # One untimed pass of each first: the first run at a new batch size pays for new allocator blocks and
        # kernel choices, which once favoured whichever method ran last.
        for run in methods.values():
            run()
        (plain, plain_s), (flat, flat_s), (corrected, corrected_s) = (timed(run) for run in methods.values())
        assert flat.shape == corrected.sequences.shape == plain.shape
        speed = {m: plain[:, ids.shape[1]:].numel() / s for m, s in zip(methods, (plain_s, flat_s, corrected_s))}
        longest = max(corrected.stats, key=lambda s: s.cycles)  # lived through every cycle: its times are the batch's
        cycle_s = corrected_s / max(longest.cycles, 1)
        tau = sum(s.committed_tokens for s in corrected.stats) / sum(s.target_forwards for s in corrected.stats)
        print(f"{batch:>5} {speed['vanilla']:>13.1f} {speed['dflash']:>12.1f} {speed[name]:>{w}.1f} "
              f"{speed[name] / speed['vanilla']:>{w - 1}.2f}x {speed[name] / speed['dflash']:>{w - 1}.2f}x "
              f"{tau:>5.2f} {cycle_s * 1e3:>8.1f} "
              f"{(longest.drafter_seconds + longest.corrector_seconds) / corrected_s:>13.1%} "
              f"{longest.corrector_seconds / corrected_s:>15.1%}", flush=True)


if __name__ == "__main__":
    main()
