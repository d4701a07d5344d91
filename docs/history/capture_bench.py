"""What the static target cache and compiled drafting cost and save on this machine, with random weights.

    python docs/history/capture_bench.py                 # CPU or the GPU at hand; prints one JSON object
    python docs/history/capture_bench.py --backends inductor aot_eager --batch 1 8

It answered what the static target cache and captured drafting cost on a CPU (docs/gpu.md); its run is
docs/history/capture_bench_cpu.json. The two cache kinds run interleaved per call on random weights, a comparison of
machinery that `dcoco-hf bench` (methods on real prompts) does not make.

1. The batched loop (`speculative_generate`, greedy) on a dynamic and on a static target cache: median seconds of a
   whole call, the two kinds interleaved, and whether their outputs are identical.
2. Compiled drafting (`drafter.compile_drafting`: backbone, candidates and correction in one graph per block shape,
   over the static context cache): the first draft after capture (compiling, and on a GPU recording the graph,
   included) and the median seconds of a whole draft (`propose(timed=True)`), eager and captured with each backend,
   at each batch size; eagerly also the corrector phase's share of it.

Random weights accept almost no draft: these are costs of the machinery, not speedups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the package of this checkout
from dcoco_hf import DCOCODrafter, speculative_generate  # noqa: E402

TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)


def models(device: torch.device) -> tuple[torch.nn.Module, DCOCODrafter]:
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET)).to(device).eval().requires_grad_(False)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=16, top_k=16).eval()
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return target, drafter


def cache_kinds(target, drafter, device: torch.device, batch: int, new_tokens: int, reps: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 64, (batch,), generator=generator).tolist()
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):  # left-padded, ragged
        ids[row, -length:] = torch.randint(1, TARGET["vocab_size"], (length,), generator=generator)
        mask[row, -length:] = 1
    common = dict(attention_mask=mask.to(device), max_new_tokens=new_tokens, do_sample=False)
    seconds, outputs = {"dynamic": [], "static": []}, {}
    for _ in range(reps + 1):  # the first round warms up
        for kind in seconds:
            start = time.perf_counter()
            outputs[kind] = speculative_generate(target, ids.to(device), drafter=drafter, cache_implementation=kind,
                                                 **common).sequences
            seconds[kind].append(time.perf_counter() - start)
    return {"batch": batch, "new_tokens": new_tokens, "identical": torch.equal(outputs["dynamic"], outputs["static"]),
            **{f"{kind}_s": statistics.median(times[1:]) for kind, times in seconds.items()}}


def draft_times(drafter, batch: int, context: int, reps: int) -> tuple[float, float, float]:
    """(seconds of the first draft after the prompt's, median seconds of the next `reps` drafts, median corrector
    seconds of those) with `context` rows cached. The prompt's draft reads more rows than a block and runs eagerly;
    the next one compiles its graph. The corrector's time is 0 when the draft is captured (one graph, timed whole)."""
    cfg, device = drafter.config, drafter.device
    states = torch.randn(batch, context + 2, len(cfg.target_layer_ids) * cfg.hidden_size, device=device)
    ids = torch.randint(1, cfg.vocab_size, (batch, context + 2), device=device)
    cache = drafter.draft_cache(context + 4 * cfg.block_size)
    with torch.no_grad():
        drafter.propose(ids[:, context - 1], states[:, :context],
                        torch.arange(context + cfg.block_size, device=device).expand(batch, -1), cache)
        positions = torch.arange(context, context + 2 + cfg.block_size, device=device).expand(batch, -1)
        drafts, seconds = [], []
        for _ in range(reps + 1):  # the first one compiles
            start = time.perf_counter()
            drafts.append(drafter.propose(ids[:, -1], states[:, context:], positions, cache, timed=True))
            seconds.append(time.perf_counter() - start)
            cache.truncate(context)
    return (seconds[0], statistics.median(d.backbone_seconds + d.corrector_seconds for d in drafts[1:]),
            statistics.median(d.corrector_seconds for d in drafts[1:]))


def capture(drafter, device: torch.device, backends: list[str], batches: list[int], reps: int) -> list[dict]:
    rows = []
    for backend in ["eager", *backends]:
        torch._dynamo.reset()
        if backend == "eager":
            drafter.compile_drafting(enabled=False)
        else:
            drafter.compile_drafting(**({} if device.type == "cuda" and backend == "inductor" else
                                        {"backend": backend}))
        for batch in batches:
            first, draft, corrector = draft_times(drafter, batch, 128, reps)
            rows.append({"drafting": backend, "batch": batch, "first_draft_s": first, "draft_s": draft,
                         **({"corrector_s": corrector} if backend == "eager" else {})})
    drafter.compile_drafting(enabled=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    target, drafter = models(device)
    drafter.attach(target, tune=False)
    report = {"command": " ".join(["python", *sys.argv]), "device": str(device), "torch": torch.__version__,
              "transformers": transformers.__version__, "target": TARGET,
              "cache": [cache_kinds(target, drafter, device, b, args.new_tokens, args.reps) for b in args.batch],
              "capture": capture(drafter, device, args.backends, args.batch, args.reps)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
