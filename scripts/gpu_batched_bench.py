"""Batched throughput and the corrector's share of a cycle on a full-size random-weight target (GPU).

Builds a Qwen3-8B-shaped target (bf16, random weights, sdpa) directly on the GPU and a matching untrained drafter
(`DCOCODrafter.from_target`, 5 layers, block 16, top-K 16) with the chosen corrector (`--corrector`: DCOCO, the
public LiLiCorr head, or that head with our pair evidence), then for each batch size runs plain batched generate(),
batched DFlash (corrector off) and the batched corrected drafter on the same left-padded random prompts, through
`dcoco-hf bench-batch`'s runner (methods interleaved per batch, outputs compared with plain generate()), and prints
its table (tokens/s, tau, ratios) and the drafter's and corrector's shares of the corrected calls' time.

Random weights accept almost no drafts (tau ~ 1), so the speed ratios here measure the machinery's overhead per
cycle, not a trained drafter's speedup; the corrector's share of a cycle is the number that transfers. Runs in well
under 5 minutes on one H200. `--tiny` runs a small fp32 model on CPU (smoke check).

    python scripts/gpu_batched_bench.py [--corrector dcoco|lilicorr|lilicorr-evidence] [--batch-sizes 1,2,4,8,16,32]
        [--prompts 8] [--max-new-tokens 64] [--json report.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dcoco_hf import DCOCODrafter
from dcoco_hf.cli.batch_bench import format_batch_table, run_batch_bench

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


def random_prompts(count: int, vocab: int, length: int) -> list[torch.LongTensor]:
    """`count` random prompts of mixed lengths (length/2 .. length); the bench left-pads each batch."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small fp32 model on CPU (smoke check)")
    parser.add_argument("--corrector", choices=sorted(CORRECTORS), default="dcoco")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--prompts", type=int, default=8, help="random prompts (a larger batch repeats them)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    batch_sizes = [int(s) for s in args.batch_sizes.split(",")]

    start = time.perf_counter()
    target, drafter = build(args.tiny, args.corrector)
    params = sum(p.numel() for p in target.parameters()) / 1e9
    head = sum(p.numel() for p in drafter.corrector.parameters()) / 1e6
    print(f"target {params * 1e3:.1f}M params ({target.dtype}, {target.device}), drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.0f}M ({args.corrector} head {head:.2f}M), "
          f"built in {time.perf_counter() - start:.1f}s")
    prompts = random_prompts(args.prompts, target.config.vocab_size, args.prompt_len)
    # bench-batch's runner: methods interleaved per batch, outputs compared with plain batched generate()
    report = run_batch_bench(target, drafter, prompts, batch_sizes, args.max_new_tokens,
                             methods=("vanilla", "dflash", "dcoco"), pad_token_id=0)
    report["config"]["corrector"] = args.corrector
    print(format_batch_table(report).replace("dcoco", args.corrector))
    name = args.corrector
    print(f"{'batch':>5} {name + ' tok/s':>{len(name) + 6}} {'tau':>5} {'drafter share':>13} {'corrector share':>15}")
    for batch, row in report["results"].items():
        corrected = row["dcoco"]
        print(f"{batch:>5} {corrected['tokens_per_s']:>{len(name) + 6}.1f} {corrected['tau']:>5.2f} "
              f"{corrected['drafter_share']:>13.1%} {corrected['corrector_share']:>15.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
