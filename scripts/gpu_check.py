"""Everything one GPU run can tell about dcoco-hf, in one command: under 8 minutes on one H100 / H200.

    python scripts/gpu_check.py                          # -> docs/results/gpu_check.json and gpu_check.md
    python scripts/gpu_check.py --device cpu --smoke     # the same code paths on tiny models (CPU, under 2 minutes)

Sections, each under its own wall-clock budget (a section that runs out stops measuring and says so; one that fails
records why, and the others still run):

  exactness   tiny random targets on the device: greedy identity with plain generate() (fp32 and bf16; in bf16 every
              parting is checked for a near-tie, see NEAR_TIE), sampling against the exact distribution, stopping
              rules, the batched loop with ragged rows on a dynamic and a static target cache, the batched loop with
              compiled drafting (outputs and per-cycle acceptance against eager drafting), assisted generation on
              transformers' static cache, SDPA / eager / FlashAttention-2.
  shipped     the shipped drafter's real weights on a random fp32 target of SmolLM2-135M's shapes: a plain step, verify
              forwards, the draft and the corrector, combined with the tau the card measured on CPU with the real
              target into a PROJECTED tokens/s ratio per block size.
  costs       a Qwen3-8B-shaped target and a DFlash-sized drafter (random weights, bf16): plain step, verify forwards
              of 2..16 rows, the draft and each corrector at batch 1..32, eager and with each draft captured
              (`compile_drafting`: backbone and corrector in one CUDA graph per block shape).
  projection  those costs with the papers' published tau for Qwen3-8B: PROJECTED speedups, not measurements.
  trees       the verify cost of a draft tree's N + 1 rows at those shapes against a chain's, combined with the tau
              docs/results/trees.json measured on CPU (trees and the same drafter's chain, same run) into a
              PROJECTED tree-over-chain speedup per budget; the exactness section checks trees and chains.

Random weights accept almost nothing, so no speedup here is measured end to end: costs are, speedups are projected.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.requirements import Requirement
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import StoppingCriteria, StoppingCriteriaList

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this checkout, also where it is not pip-installed
from dcoco_hf import DCOCODrafter, speculative_generate  # noqa: E402
from dcoco_hf.runtime.prompts import left_pad  # noqa: E402
from dcoco_hf.runtime.block_choice import set_block_size  # noqa: E402
from dcoco_hf.runtime.device import device_sync  # noqa: E402
from dcoco_hf.runtime.hf_compat import ASSISTED_STATIC_CACHE, assisted_static_cache  # noqa: E402
from dcoco_hf.training import fit_on_own_answers  # noqa: E402
from gpu_batched_bench import CORRECTORS, QWEN3_8B, TINY  # noqa: E402  (scripts/ is on the path: this script's folder)

SHIPPED = ROOT / "model_cards" / "dcoco-smollm2-135m"
# SmolLM2-135M-Instruct's shapes, as its GGUF gives them (the default target of the CPU results).
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)
# Published tau for Qwen3-8B (thinking off, T = 0, blocks of 16; B200, vLLM). DCOCO paper (arXiv:2610.12570), Table 2:
# DCOCO 4.985, DFlash 3.913. LiLiCorr paper (arXiv:2608.20530): +9% to +19% tau over DFlash, no Qwen3-8B mean given.
PUBLISHED_TAU = {"dflash": 3.913, "dcoco": 4.985, "lilicorr (DFlash +9%)": 3.913 * 1.09,
                 "lilicorr (DFlash +19%)": 3.913 * 1.19}
PUBLISHED_SOURCE = ("DCOCO paper (arXiv:2610.12570) Table 2, Qwen3-8B, thinking off, T=0, block 16, B200/vLLM: tau "
                    "DCOCO 4.985, DFlash 3.913; LiLiCorr paper (arXiv:2608.20530): tau +9% to +19% over DFlash")
# A bf16 greedy parting is a near-tie when the two tokens' logit gap at the parting step is at most NEAR_TIE times
# the largest difference between that step's logits and the same position's logits from one multi-row forward of
# the whole prefix: rounding of that size alone can then decide which token wins.
NEAR_TIE = 2.0


@dataclass(frozen=True)
class Sizes:
    """How much each section measures, and its wall-clock budget in seconds (checked before each measurement;
    the full run stays under 8 minutes with model builds and start-up)."""

    budgets: dict[str, float]
    archs: tuple[str, ...]  # tiny target architectures of the greedy checks
    fit: dict[str, int]  # fit_on_own_answers sizes
    prompts: int  # greedy outputs per case
    new_tokens: int
    samples: int  # sampling check
    batch_rows: int  # batched check
    shipped_context: int
    shipped_blocks: int  # the first N block sizes the card measured
    target_shape: dict[str, Any]  # costs section
    drafter_layers: int
    batches: tuple[int, ...]
    verify_rows: tuple[int, ...]
    context: int
    reps: int


FULL = Sizes(budgets={"exactness": 150.0, "shipped": 60.0, "costs": 180.0}, archs=("llama", "qwen3"), fit={},
             prompts=6, new_tokens=32, samples=20000, batch_rows=16, shipped_context=512, shipped_blocks=7,
             target_shape=QWEN3_8B, drafter_layers=5, batches=(1, 4, 16, 32),
             verify_rows=(2, 4, 5, 8, 9, 12, 16, 17, 33), context=512, reps=10)
# Every code path of FULL on tiny models, in under 3 minutes on a 2-core CPU.
SMOKE = Sizes(budgets={"exactness": 90.0, "shipped": 30.0, "costs": 30.0}, archs=("llama",),
              fit=dict(steps=60, prompts=16, new_tokens=24), prompts=2, new_tokens=16, samples=1500, batch_rows=3,
              shipped_context=16, shipped_blocks=1, target_shape=TINY, drafter_layers=1, batches=(1, 2),
              verify_rows=(2, 8, 9, 16, 17), context=32, reps=1)


# ---------------------------------------------------------------------------------------------------- helpers


class Deadline:
    """A section's wall-clock budget: loops ask `expired` before each new measurement."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    def expired(self, what: str) -> bool:
        if time.monotonic() < self.end:
            return False
        self.skipped.append(what)
        return True


def median_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall-clock seconds of `fn` over `reps` calls, after one untimed warm-up call."""
    sync = device_sync(device)
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def materialize(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors are made in `dtype` on `device`: no fp32 detour through host memory for an 8B model."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(saved)


def build(model_class: type, config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight model, in eval mode without gradients."""
    torch.manual_seed(seed)
    with materialize(device, dtype):
        return model_class(config).eval().requires_grad_(False)


def tiny_target(arch: str, device: torch.device, dtype: torch.dtype, attn: str, vocab: int = 32, seed: int = 0):
    """A tiny random-weight Llama or Qwen3, built on CPU in fp32 and then moved: the same weights on every device,
    dtype and attention implementation."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0, attn_implementation=attn)
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(head_dim=16, **common)
    model_class = LlamaForCausalLM if arch == "llama" else Qwen3ForCausalLM
    return build(model_class, config, torch.device("cpu"), torch.float32, seed).to(device, dtype)


def scramble(drafter: DCOCODrafter, seed: int) -> DCOCODrafter:
    """Random corrector weights, large enough to overrule the drafter's argmax: corrections really change drafts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.corrector.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 3.0 / param.shape[-1] ** 0.5)
    return drafter


@functools.cache
def fitted(arch: str, seed: int = 0, fit: tuple[tuple[str, int], ...] = ()) -> DCOCODrafter:
    """A drafter fitted for a few seconds (on CPU, fp32) to the tiny target of `arch`, so that drafts get accepted
    and the acceptance path is checked too; its corrector scrambled."""
    target = tiny_target(arch, torch.device("cpu"), torch.float32, "sdpa", seed=seed)
    torch.manual_seed(seed)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    return scramble(fit_on_own_answers(drafter, target, seed=seed, **dict(fit)), seed)


def tiny_pair(arch: str, device: torch.device, dtype: torch.dtype, attn: str, sizes: Sizes):
    """The tiny target of `arch` on `device` in `dtype` with `attn`, and a copy of its fitted drafter attached."""
    target = tiny_target(arch, device, dtype, attn)
    drafter = copy.deepcopy(fitted(arch, 0, tuple(sizes.fit.items()))).to(device, dtype).attach(target, tune=False)
    return target, drafter


def random_prompts(count: int, vocab: int, device: torch.device, seed: int = 0) -> list[torch.LongTensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator).tolist()
    return [torch.randint(1, vocab, (1, n), generator=generator).to(device) for n in lengths]


def attention_kinds(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The attention implementations to check here, and the skipped ones with the reason."""
    kinds, skipped = ["sdpa", "eager"], {}
    if device.type != "cuda":
        skipped["flash_attention_2"] = "needs a CUDA device"
    elif importlib.util.find_spec("flash_attn") is None:
        skipped["flash_attention_2"] = "flash_attn is not installed"
    else:
        kinds.append("flash_attention_2")
    return kinds, skipped


def section(name: str, fn: Callable[[], dict]) -> dict:
    """Run one section; an exception is recorded (type, message, last frames) instead of ending the run."""
    start = time.monotonic()
    try:
        result = fn()
        result.setdefault("status", "ok")
    except Exception as error:  # noqa: BLE001 - a failing section must not hide the others' results
        result = {"status": "failed", "reason": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc(limit=4)}
    result["seconds"] = round(time.monotonic() - start, 1)
    print(f"[gpu_check] {name}: {result['status']} in {result['seconds']} s", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------- (a) exactness


def parting(plain, spec: torch.LongTensor, prompt_len: int) -> int | None:
    """Index (among new tokens) of the first token where the two greedy outputs differ, or None if identical."""
    a, b = plain.sequences[0, prompt_len:], spec[0, prompt_len:]
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).nonzero()
    if len(differs):
        return int(differs[0])
    return None if len(a) == len(b) else n


def near_tie(target, plain, spec: torch.LongTensor, prompt_len: int, at: int) -> dict:
    """The logit gap of the two parted tokens at the parting step against the rounding there (see NEAR_TIE)."""
    step = plain.logits[at][0].float()  # [V] the plain 1-token step's logits
    with torch.no_grad():
        whole = target(plain.sequences[:, : prompt_len + at]).logits[0, -1].float()  # [V] one multi-row forward
    mine, theirs = int(plain.sequences[0, prompt_len + at]), int(spec[0, prompt_len + at])
    gap, rounding = float(step[mine] - step[theirs]), float((step - whole).abs().max())
    return {"at": at, "gap": gap, "rounding": rounding, "near_tie": gap <= NEAR_TIE * rounding}


def greedy_case(arch: str, dtype: torch.dtype, attn: str, device: torch.device, sizes: Sizes) -> dict:
    target, drafter = tiny_pair(arch, device, dtype, attn, sizes)
    prompts, tokens = sizes.prompts, sizes.new_tokens
    identical, partings, committed, forwards = 0, [], 0, 0
    for ids in random_prompts(prompts, target.config.vocab_size, device):
        common = dict(max_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        plain = target.generate(ids, output_logits=True, return_dict_in_generate=True, **common)
        spec = target.generate(ids, assistant_model=drafter, **common)
        stats = drafter.generation_stats(spec)
        committed, forwards = committed + stats.committed_tokens, forwards + stats.target_forwards
        at = parting(plain, spec, ids.shape[1])
        if at is None:
            identical += 1
        else:
            partings.append(near_tie(target, plain, spec, ids.shape[1], at))
    # fp32 promises identity; bf16 promises it up to near-ties.
    ok = identical == prompts if dtype == torch.float32 else all(p["near_tie"] for p in partings)
    return {"arch": arch, "dtype": str(dtype).removeprefix("torch."), "attention": attn, "outputs": prompts,
            "identical": identical, "partings": partings, "tau": committed / max(forwards, 1), "ok": ok}


def exact_distribution(target, prompt: torch.LongTensor, steps: int) -> torch.Tensor:
    """P(first `steps` new tokens) [V ** steps] by enumerating every continuation (temperature 1, no warpers)."""
    vocab = target.config.vocab_size
    probs = torch.ones(1, device=prompt.device)
    prefixes = prompt
    for _ in range(steps):
        with torch.no_grad():
            logits = target(prefixes).logits[:, -1].float()  # [V ** t, V]
        probs = (probs[:, None] * logits.softmax(-1)).flatten()  # [V ** (t + 1)]
        nxt = torch.arange(vocab, device=prompt.device).repeat(prefixes.shape[0])
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), nxt[:, None]], dim=1)
    return probs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> dict:
    """Goodness of fit of `counts` to `probs`; cells expecting fewer than 5 are pooled into one. Passes below
    df + 6 sqrt(2 df), about six standard deviations of the statistic above its mean."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    limit = df + 6 * (2 * df) ** 0.5
    return {"chi_square": stat, "df": df, "limit": limit, "ok": stat < limit}


def sampling_check(device: torch.device, samples: int, steps: int = 3, vocab: int = 6) -> dict:
    """`samples` rows of one prompt sampled at once by the batched loop, against the exact distribution of the
    first `steps` new tokens of a tiny peaked target (small vocabulary: random drafts get accepted often)."""
    target = tiny_target("llama", device, torch.float32, "sdpa", vocab=vocab, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)  # peaked but not degenerate next-token distributions
    torch.manual_seed(1)  # an unfitted drafter: over 6 tokens, random drafts get accepted often enough
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=3, top_k=4)
    drafter = scramble(drafter, seed=1).eval().attach(target, tune=False)
    prompt = torch.tensor([[1, 2, 3, 4, 0]], device=device)
    rows = prompt.repeat(samples, 1)
    torch.manual_seed(0)
    out = speculative_generate(target, rows, attention_mask=torch.ones_like(rows), drafter=drafter,
                               max_new_tokens=steps, do_sample=True, temperature=1.0, top_k=None, top_p=None)
    new = out.sequences[:, prompt.shape[1]:]  # [samples, steps]
    index = (new * vocab ** torch.arange(steps - 1, -1, -1, device=device)).sum(1)
    counts = torch.bincount(index, minlength=vocab ** steps).float()
    return {"samples": samples, "steps": steps, "vocab": vocab, **chi_square(counts, exact_distribution(
        target, prompt, steps))}


class StopAfter(StoppingCriteria):
    """Stops a row once its last tokens equal `stop` (what stop_strings does, on token ids: no tokenizer here)."""

    def __init__(self, stop: list[int]) -> None:
        self.stop = torch.tensor(stop)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        n = len(self.stop)
        return (input_ids[:, -n:] == self.stop.to(input_ids.device)).all(1)


def stopping_check(device: torch.device, sizes: Sizes) -> dict:
    """eos, a stop sequence and max_new_tokens, each with assisted generate() and (where it takes them) the batched
    loop, against plain generate() with the same rule."""
    target, drafter = tiny_pair(sizes.archs[-1], device, torch.float32, "sdpa", sizes)
    ids = random_prompts(1, target.config.vocab_size, device, seed=2)[0]
    mask = torch.ones_like(ids)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    rules = {
        "eos_token_id": dict(eos_token_id=free[9], max_new_tokens=24),
        "stop sequence": dict(stopping_criteria=StoppingCriteriaList([StopAfter(free[6:8])]), max_new_tokens=24),
        "max_new_tokens": dict(max_new_tokens=7),
    }
    result = {}
    for name, rule in rules.items():
        plain = target.generate(ids, attention_mask=mask, do_sample=False, **rule)
        assisted = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=drafter, **rule)
        row = {"assisted_identical": assisted.tolist() == plain.tolist(), "new_tokens": plain.shape[1] - ids.shape[1]}
        if "stopping_criteria" not in rule:  # the batched loop refuses custom criteria (it cannot see their state)
            batched = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, do_sample=False, **rule)
            row["batched_identical"] = batched.sequences.tolist() == plain.tolist()
        result[name] = row
    result["ok"] = all(v for row in result.values() for k, v in row.items() if k.endswith("identical"))
    return result


def capture_options(device: torch.device) -> dict[str, str]:
    """How drafting is captured here (`compile_drafting`): its default on a GPU (CUDA graphs, inductor's
    'reduce-overhead'); on CPU the traced graph on the eager kernels (backend 'aot_eager', no C++ build)."""
    return {} if device.type == "cuda" else {"backend": "aot_eager"}


def ragged_batch(target, drafter, device: torch.device, sizes: Sizes, **options: Any):
    """The batched loop's greedy run over `sizes.batch_rows` ragged left-padded prompts: (output, prompts, width)."""
    prompts = [p[0].cpu() for p in random_prompts(sizes.batch_rows, target.config.vocab_size, device, seed=3)]
    ids, mask = left_pad(prompts, pad_token_id=0)  # [B, longest]
    out = speculative_generate(target, ids.to(device), attention_mask=mask.to(device), drafter=drafter,
                               max_new_tokens=20, do_sample=False, **options)
    return out, prompts, ids.shape[1]


def rows_alone(target, out, prompts: list[torch.LongTensor], width: int, device: torch.device) -> int:
    """How many rows of the batched output equal plain generate() of that row alone."""
    same = 0
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt[None].to(device), attention_mask=torch.ones_like(prompt[None]).to(device),
                                max_new_tokens=20, do_sample=False)[0, len(prompt):]
        same += out.sequences[row, width:].tolist() == alone.tolist()
    return same


def batched_check(device: torch.device, sizes: Sizes, cache: str, tree_budget: int = 16) -> dict:
    """Ragged rows, left-padded: the batched loop's greedy output of each row, on a `cache` ("dynamic" or "static")
    target cache, verifying draft trees of `tree_budget` nodes every cycle (0: chains), against plain generate() of
    that row alone."""
    target, drafter = tiny_pair(sizes.archs[0], device, torch.float32, "sdpa", sizes)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # the budget's tree (or chain) every cycle
    out, prompts, width = ragged_batch(target, drafter, device, sizes, cache_implementation=cache,
                                       tree_budget=tree_budget)
    same = rows_alone(target, out, prompts, width, device)
    return {"cache": cache, "tree_budget": tree_budget, "rows": len(prompts), "identical": same,
            "prompt_lengths": [len(p) for p in prompts], "ok": same == len(prompts),
            "tau": [round(s.tau, 3) for s in out.stats], "tree_cycles": sum(s.tree_cycles for s in out.stats)}


def compiled_drafting_check(device: torch.device, sizes: Sizes) -> dict:
    """The batched loop (static cache) with `compile_drafting()`: each row against plain generate() of that row
    alone, and every row's accepted drafts per cycle against the same run with eager drafting (the same drafts
    give the same counts)."""
    target, drafter = tiny_pair(sizes.archs[0], device, torch.float32, "sdpa", sizes)
    eager, _, _ = ragged_batch(target, drafter, device, sizes, cache_implementation="static")
    torch._dynamo.reset()  # a fresh graph cache: no earlier capture counts against dynamo's recompile limit
    options = capture_options(device)
    start = time.perf_counter()
    drafter.compile_drafting(**options)
    out, prompts, width = ragged_batch(target, drafter, device, sizes, cache_implementation="static")
    first_call = time.perf_counter() - start  # compiling and recording the graphs included
    same = rows_alone(target, out, prompts, width, device)
    same_cycles = sum(a.accepted == b.accepted for a, b in zip(out.stats, eager.stats))
    return {"capture": f"compile_drafting({', '.join(f'{k}={v!r}' for k, v in options.items())})",
            "rows": len(prompts), "identical": same, "acceptance_as_eager": same_cycles,
            "first_call_s": round(first_call, 2), "ok": same == len(prompts) == same_cycles}


def static_cache_check(device: torch.device, sizes: Sizes) -> dict:
    """Assisted generate() with `cache_implementation="static"` against plain generate() with the same cache."""
    if not assisted_static_cache():
        return {"status": "skipped", "ok": True,
                "reason": f"skipped: transformers {transformers.__version__} runs assisted generation on a dynamic "
                          f"cache only (static from {ASSISTED_STATIC_CACHE})"}
    target, drafter = tiny_pair(sizes.archs[-1], device, torch.float32, "sdpa", sizes)
    identical = 0
    prompts = random_prompts(3, target.config.vocab_size, device, seed=4)
    for ids in prompts:
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                      cache_implementation="static")
        plain = target.generate(ids, **common)
        identical += target.generate(ids, assistant_model=drafter, **common).tolist() == plain.tolist()
    return {"outputs": len(prompts), "identical": identical, "ok": identical == len(prompts)}


def train_check(device: torch.device) -> dict:
    """`dcoco-hf train` end to end (prompts given, answers, features, both stages, the drafter folder) on a tiny base
    model saved to disk, the target on the device the command picks (a GPU where there is one); the folder's drafter
    then decodes exactly what the target decodes alone, on `device`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dcoco_hf.cli.main import main as command

    vocab = 64
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(vocab - 2)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    target = tiny_target("qwen3", torch.device("cpu"), torch.float32, "sdpa", vocab=vocab)
    with tempfile.TemporaryDirectory() as root:
        folder, out, prompts = Path(root) / "target", Path(root) / "run", Path(root) / "prompts.json"
        target.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        prompts.write_text(json.dumps([" ".join(f"w{(5 * i + j) % 60}" for j in range(5)) for i in range(20)]))
        code = command(["train", "--target", str(folder), "--out", str(out), "--prompts", str(prompts), "--steps", "3",
                        "--stage2-steps", "2", "--held-out", "2", "--max-new-tokens", "8", "--batch-size", "2",
                        "--block-size", "4", "--top-k", "4", "--num-anchors", "4", "--max-length", "48",
                        "--tau-tokens", "8"])
        drafter = DCOCODrafter.from_pretrained(out / "drafter")
    target = target.to(device)
    drafter = drafter.attach(target, tune=False)
    equal = 0
    for ids in random_prompts(4, vocab, device, seed=7):
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        spec = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               assistant_model=drafter)
        equal += int(torch.equal(plain, spec))
    trained_on = "cuda" if torch.cuda.is_available() else "cpu"
    return {"ok": code == 0 and equal == 4, "exit_code": code, "rows_equal": f"{equal}/4", "trained_on": trained_on}


def exactness(device: torch.device, sizes: Sizes, deadline: Deadline) -> dict:
    kinds, skipped = attention_kinds(device)
    greedy = []
    for attn in kinds:
        for dtype in (torch.float32, torch.bfloat16):
            for arch in sizes.archs:
                if not deadline.expired(f"greedy {arch} {dtype} {attn}"):
                    case = section(f"greedy {arch} {dtype} {attn}",
                                   lambda: greedy_case(arch, dtype, attn, device, sizes))
                    greedy.append({**case, "arch": arch, "dtype": str(dtype).removeprefix("torch."), "attention": attn})
    checks = {
        "sampling": lambda: sampling_check(device, sizes.samples),
        "stopping": lambda: stopping_check(device, sizes),
        "batched": lambda: batched_check(device, sizes, "dynamic"),
        "static_batched": lambda: batched_check(device, sizes, "static"),
        "batched_chains": lambda: batched_check(device, sizes, "dynamic", tree_budget=0),
        "compiled_drafting": lambda: compiled_drafting_check(device, sizes),
        "static_cache": lambda: static_cache_check(device, sizes),
        "train": lambda: train_check(device),
    }
    result = {"greedy": greedy, "attention_skipped": skipped}
    for name, check in checks.items():
        if not deadline.expired(name):
            result[name] = section(name, check)
    result["not_run_budget"] = deadline.skipped
    return result


# ---------------------------------------------------------------------------------------------------- timing pieces


def step_and_verify_seconds(target, batch: int, context: int, rows: list[int], reps: int) -> dict[int, float]:
    """Seconds of one target forward of n new rows per sequence after `context` cached positions, for n in rows
    (n = 1: a plain decoding step; n = k + 1: verifying k drafted tokens), the cache cropped back after each."""
    device, vocab = target.device, target.config.vocab_size
    cache = DynamicCache(config=target.config)
    prefix = torch.randint(1, vocab, (batch, context), device=device)
    with torch.no_grad():
        target(prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)  # not [B, context, V] logits
        result = {}
        for n in rows:
            new = torch.randint(1, vocab, (batch, n), device=device)  # [B, n]

            def forward() -> None:
                target(new, past_key_values=cache, use_cache=True)
                cache.crop(-n)  # back to the context (a negative crop counts from the end, on 5.x)

            result[n] = median_seconds(forward, device, reps)
    return result


def draft_seconds(drafter: DCOCODrafter, batch: int, context: int, reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of one draft (backbone + top-K) and of the corrector (scores + walk) for `batch` rows, with
    `context` committed positions cached and 2 new context rows per cycle (after `warmup` untimed drafts: a compiled
    drafter compiles and records its graphs there). Eagerly from propose()'s own phase timing; captured
    (`compile_drafting`, one graph per draft) as the corrected draft's time less the uncorrected one's (its own
    graph), since a graph has no phases to time."""
    cfg, device = drafter.config, drafter.device
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    states = torch.randn(batch, context + 2, width, device=device, dtype=drafter.dtype)  # [B, N, layers * H]
    ids = torch.randint(1, cfg.vocab_size, (batch, context + 2), device=device)  # [B, N] committed tokens
    block = drafter.draft_block_size  # the block set_block_size chose
    cache = drafter.draft_cache(context + 4 * cfg.block_size)

    def timed(correct: bool) -> list[tuple[float, float]]:
        phases = []
        for _ in range(warmup + reps):
            out = drafter.propose(ids[:, -1], states[:, context:], positions, cache, context_ids=ids, timed=True,
                                  correct=correct)
            cache.truncate(context)
            phases.append((out.backbone_seconds, out.corrector_seconds))
        return phases[warmup:]

    with torch.no_grad():
        positions = torch.arange(context + block, device=device).expand(batch, -1)
        # Fills the cache with the context rows; context_ids feed a corrector that reads the committed text.
        drafter.propose(ids[:, context - 1], states[:, :context], positions, cache, context_ids=ids[:, :context])
        positions = torch.arange(context, context + 2 + block, device=device).expand(batch, -1)
        corrected = timed(correct=True)
        if not drafter.drafting_compiled:
            return {"draft": statistics.median(p[0] for p in corrected),
                    "corrector": statistics.median(p[1] for p in corrected)}
        whole = statistics.median(p[0] for p in corrected)
        bare = statistics.median(p[0] for p in timed(correct=False))
    return {"draft": bare, "corrector": whole - bare}


# ---------------------------------------------------------------------------------------------------- (b) shipped


def shipped_tau() -> tuple[dict[int, float], str]:
    """tau per block size the card measured with the real target on CPU, and which prompts it ran."""
    bench = json.loads((SHIPPED / "bench_block_sizes.json").read_text())
    tau = {int(name.split("@")[1]): summary["tau"] for name, summary in bench["methods"].items()
           if name.startswith("dcoco@")}
    return tau, f"{SHIPPED.relative_to(ROOT)}/bench_block_sizes.json: `{' '.join(bench['config']['command_line'])}`"


def shipped(device: torch.device, sizes: Sizes, deadline: Deadline) -> dict:
    """fp32 on every device: the regime in which the card measured tau (greedy outputs identical to plain)."""
    dtype = torch.float32
    tau, source = shipped_tau()
    target = build(LlamaForCausalLM, LlamaConfig(**SMOLLM2_135M), device, dtype)
    drafter = DCOCODrafter.from_pretrained(SHIPPED).to(device, dtype).eval().attach(target, tune=False)
    context, reps = sizes.shipped_context, 2 * sizes.reps
    blocks = sorted(tau)[: sizes.shipped_blocks]
    forwards = step_and_verify_seconds(target, 1, context, [1, *blocks], reps)
    rows = []
    for block in blocks:
        if deadline.expired(f"block {block}"):
            break
        set_block_size(drafter, block)
        phases = draft_seconds(drafter, 1, context, reps)
        cycle = phases["draft"] + phases["corrector"] + forwards[block]
        rows.append({"block": block, "verify_s": forwards[block], **{f"{k}_s": v for k, v in phases.items()},
                     "cycle_s": cycle, "tau_cpu": tau[block], "projected_ratio": tau[block] * forwards[1] / cycle})
    return {"dtype": str(dtype).removeprefix("torch."), "context": context, "plain_step_s": forwards[1],
            "tau_source": source, "rows": rows, "not_run_budget": deadline.skipped,
            "note": "PROJECTION: tau measured on CPU with the real target; costs timed here with random weights"}


# ---------------------------------------------------------------------------------------------------- (c) costs


def capture(drafter: DCOCODrafter, device: torch.device) -> str:
    """Capture the drafter's drafts (`compile_drafting`, `capture_options`). Returns how."""
    options = capture_options(device)
    drafter.compile_drafting(**options)
    return f"compile_drafting({', '.join(f'{k}={v!r}' for k, v in options.items())})"


def costs(device: torch.device, dtype: torch.dtype, sizes: Sizes, deadline: Deadline) -> dict:
    config = Qwen3Config(**sizes.target_shape, attn_implementation="sdpa", pad_token_id=0)
    target = build(Qwen3ForCausalLM, config, device, dtype)
    with materialize(device, dtype):  # DFlash-sized: 5 layers at the target's width, blocks of 16
        drafters = {kind: DCOCODrafter.from_target(target, num_hidden_layers=sizes.drafter_layers, block_size=16,
                                                   top_k=16, **CORRECTORS[kind]).eval().attach(target, tune=False)
                    for kind in ("dcoco", "lilicorr")}
    batches, verify_rows, context, reps = sizes.batches, sizes.verify_rows, sizes.context, sizes.reps
    rows = []
    for captured in (False, True):
        mode = "eager"
        if captured:
            try:
                torch._dynamo.reset()  # a fresh graph cache: no earlier capture counts against the recompile limit
                mode = {capture(d, device) for d in drafters.values()}.pop()
            except Exception as error:  # noqa: BLE001 - recorded; the eager rows stand
                rows.append({"mode": "captured", "status": "failed", "reason": f"{type(error).__name__}: {error}"})
                break
        for batch in batches:
            if deadline.expired(f"{'captured' if captured else 'eager'} batch {batch}"):
                continue
            row = {"mode": mode, "batch": batch}
            if not captured:  # the target's forwards do not change with the drafter's capture
                forwards = step_and_verify_seconds(target, batch, context, [1, *verify_rows], reps)
                row["plain_step_s"] = forwards.pop(1)
                row["verify_s"] = forwards
            for kind, drafter in drafters.items():
                if captured and deadline.expired(f"captured batch {batch} {kind}"):  # compiling takes a while
                    continue
                try:
                    phases = draft_seconds(drafter, batch, context, reps, warmup=3 if captured else 1)
                except Exception as error:  # noqa: BLE001 - e.g. a capture that fails only when called
                    row[kind] = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
                    continue
                row[kind] = {"draft_s": phases["draft"], "corrector_s": phases["corrector"]}
            rows.append(row)
    params = sum(p.numel() for p in target.parameters())
    return {"dtype": str(dtype).removeprefix("torch."), "target_params": params, "target_shape": sizes.target_shape,
            "context": context,
            "drafter_layers": drafters["dcoco"].config.num_hidden_layers, "block_size": 16, "top_k": 16,
            "rows": rows, "not_run_budget": deadline.skipped}


# ---------------------------------------------------------------------------------------------------- (d) projection


def projection(costs_result: dict) -> dict:
    """Published tau x (plain step / cycle), cycle = draft + corrector + verify of 16 rows, per batch size and mode
    (the verify and plain times of a mode's batch come from the eager rows)."""
    eager = {r["batch"]: r for r in costs_result.get("rows", []) if r.get("mode") == "eager"}
    rows = []
    for row in costs_result.get("rows", []):
        base = eager.get(row.get("batch"))
        if base is None or "dcoco" not in row or "verify_s" not in base or 16 not in base["verify_s"]:
            continue
        for method, tau in PUBLISHED_TAU.items():
            kind = method.split(" ")[0]
            phases = row["dcoco"] if kind == "dflash" else row.get(kind, {})
            if "draft_s" not in phases:
                continue
            corrector = 0.0 if kind == "dflash" else phases["corrector_s"]
            cycle = phases["draft_s"] + corrector + base["verify_s"][16]
            rows.append({"mode": row["mode"], "batch": row["batch"], "method": method, "tau_published": tau,
                         "cycle_s": cycle, "corrector_share": corrector / cycle,
                         "projected_speedup": tau * base["plain_step_s"] / cycle})
    return {"source": PUBLISHED_SOURCE, "rows": rows,
            "note": "PROJECTION: published tau (B200, vLLM, trained drafters) with costs timed here (random weights, "
                    "transformers eager forwards); not a measured speedup"}


def trees(costs_result: dict) -> dict:
    """Draft trees against the same drafter's chain: tau measured on CPU (docs/results/trees.json: each fixed tree
    budget and the whole-block chain, same run) with the verify costs timed here (eager, batch 1) into a PROJECTED
    tree-over-chain speedup: (tau_tree / tau_chain) x (draft + verify of the block) / (draft + verify of N + 1)."""
    measured = ROOT / "docs" / "results" / "trees.json"
    if not measured.is_file():
        return {"status": "skipped", "reason": f"no {measured.relative_to(ROOT)}: run the trees bench first"}
    bench = json.loads(measured.read_text())
    base = next((r for r in costs_result.get("rows", []) if r.get("mode") == "eager" and r.get("batch") == 1), None)
    if base is None or "dcoco" not in base:
        return {"status": "skipped", "reason": "no eager batch-1 costs were timed"}
    verify, draft = base["verify_s"], base["dcoco"]["draft_s"] + base["dcoco"]["corrector_s"]
    rows = []
    for suite, methods in bench["suites"].items():
        chain = methods.get("chain-constant")  # the whole block every cycle: a verify of the anchor and its slots
        if chain is None:
            continue
        chain_rows = bench["config"]["block_size"]
        for name, result in methods.items():
            nodes = result.get("tree_budget")
            fixed = result.get("schedule") == "constant" and result.get("corrector")  # the budget's tree, every cycle
            if not nodes or not fixed or nodes + 1 not in verify or chain_rows not in verify:
                continue
            ratio = (result["tau"] / chain["tau"]) * (draft + verify[chain_rows]) / (draft + verify[nodes + 1])
            rows.append({"suite": suite, "method": name, "nodes": nodes, "tau_tree": result["tau"],
                         "tau_chain": chain["tau"], "verify_chain_s": verify[chain_rows],
                         "verify_tree_s": verify[nodes + 1], "projected_tree_over_chain": ratio})
    return {"status": "ok", "source": f"{measured.relative_to(ROOT)}: `{' '.join(bench['config']['command_line'])}`",
            "rows": rows, "note": "PROJECTION: tau measured on CPU with SmolLM2-135M and its drafter; costs timed here "
                                  "at the costs section's shapes with random weights; not a measured speedup"}


# ---------------------------------------------------------------------------------------------------- report


def transformers_requirement() -> tuple[str, bool]:
    """The package's transformers requirement (pyproject.toml) and whether the installed version meets it: a run on
    an older transformers records which checks fail on it instead of stopping."""
    requirement = Requirement(re.search(r'"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text())[1])
    return str(requirement), requirement.specifier.contains(transformers.__version__, prereleases=True)


def environment(device: torch.device) -> dict:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    required, met = transformers_requirement()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "transformers_required": required, "transformers_requirement_met": met,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "commit": commit.stdout.strip() or None, "command": " ".join(sys.argv),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# gpu_check: {env['device']}", "",
             f"`{env['command']}` (commit {env['commit']}, torch {env['torch']}, transformers {env['transformers']}, "
             f"{env['date_utc']} UTC). Every figure below is in the JSON file written by the same run.", ""]
    if not env["transformers_requirement_met"]:
        lines += [f"**transformers {env['transformers']} does not meet the package's {env['transformers_required']}**: "
                  "the checks that fail below may fail for that reason alone (each row says why).", ""]
    ex = report["exactness"]
    lines += ["## Exactness", "", "| case | identical | partings (near-tie?) | tau | ok |",
              "| --- | --- | --- | --- | --- |"]
    for case in ex.get("greedy", []):
        name = f"greedy {case.get('arch')} {case.get('dtype')} {case.get('attention')}"
        if case["status"] != "ok":
            lines.append(f"| {name} | {case['status']}: {case['reason']} | | | no |")
            continue
        parts = ", ".join(f"{p['at']} ({'yes' if p['near_tie'] else 'NO'})" for p in case["partings"]) or "-"
        lines.append(f"| {name} | {case['identical']}/{case['outputs']} | {parts} | {case['tau']:.2f} | "
                     f"{'yes' if case['ok'] else 'NO'} |")
    for name in ("sampling", "stopping", "batched", "static_batched", "batched_chains", "compiled_drafting",
                 "static_cache"):
        if name in ex:
            check = ex[name]
            detail = check.get("reason") or ", ".join(f"{k}={v}" for k, v in check.items()
                                                     if k not in ("ok", "status", "seconds", "traceback"))
            lines.append(f"| {name} | {detail} | | | {'yes' if check.get('ok') else 'NO'} |")
    for name, why in ex.get("attention_skipped", {}).items():
        lines.append(f"| {name} | skipped: {why} | | | |")
    sh = report["shipped"]
    lines += ["", "## Shipped drafter at SmolLM2-135M's shapes (PROJECTION)", ""]
    if sh["status"] == "ok":
        lines += [f"Random-weight target, {sh['dtype']}, context {sh['context']}, plain step {ms(sh['plain_step_s'])} "
                  f"ms; tau from {sh['tau_source']}.", "",
                  "| block | verify ms | draft ms | corrector ms | cycle ms | tau (CPU, real target) "
                  "| projected ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['block']} | {ms(r['verify_s'])} | {ms(r['draft_s'])} | {ms(r['corrector_s'])} | "
                  f"{ms(r['cycle_s'])} | {r['tau_cpu']:.3f} | {r['projected_ratio']:.2f}x |" for r in sh["rows"]]
    else:
        lines.append(f"{sh['status']}: {sh.get('reason')}")
    co = report["costs"]
    lines += ["", "## Costs of a cycle's parts (random weights, measured)", ""]
    if co["status"] == "ok":
        lines += [f"Target: {co['target_params'] / 1e9:.2f}B parameters ({co['target_shape']['num_hidden_layers']} "
                  f"layers, hidden {co['target_shape']['hidden_size']}), {co['dtype']}, context {co['context']}; "
                  f"drafter {co['drafter_layers']} layers, blocks of {co['block_size']}, top-{co['top_k']}.", "",
                  "| mode | batch | plain step ms | verify 16 rows ms | draft ms | dcoco ms | lilicorr ms |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in co["rows"]:
            if "batch" not in r:
                lines.append(f"| {r['mode']} | {r['status']}: {r['reason']} | | | | | |")
                continue
            d, li = r.get("dcoco", {}), r.get("lilicorr", {})
            lines.append(f"| {r['mode']} | {r['batch']} | {ms(r.get('plain_step_s'))} | "
                         f"{ms(r.get('verify_s', {}).get(16))} | {ms(d.get('draft_s'))} | {ms(d.get('corrector_s'))} | "
                         f"{ms(li.get('corrector_s'))} |")
    else:
        lines.append(f"{co['status']}: {co.get('reason')}")
    pr = report["projection"]
    lines += ["", "## Projected speedups for Qwen3-8B (PROJECTION, not measured)", "", pr["source"] + ".", "",
              "| mode | batch | method | tau (published) | cycle ms | corrector share | projected speedup |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['batch']} | {r['method']} | {r['tau_published']:.3f} | {ms(r['cycle_s'])} | "
              f"{r['corrector_share']:.1%} | {r['projected_speedup']:.2f}x |" for r in pr["rows"]]
    tr = report.get("trees", {})
    lines += ["", "## Draft trees over the chain (PROJECTION, not measured)", ""]
    if tr.get("status") == "ok":
        lines += [tr["source"] + ".", "", "| suite | method | nodes | tau tree / chain | verify tree / chain ms | "
                  "projected tree over chain |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['suite']} | {r['method']} | {r['nodes']} | {r['tau_tree']:.2f} / {r['tau_chain']:.2f} | "
                  f"{ms(r['verify_tree_s'])} / {ms(r['verify_chain_s'])} | {r['projected_tree_over_chain']:.2f}x |"
                  for r in tr["rows"]]
    else:
        lines.append(f"{tr.get('status')}: {tr.get('reason')}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every code path, in under 2 minutes on CPU")
    parser.add_argument("--json", type=Path, help="default: docs/results/gpu_check.json (smoke: a temp folder)")
    parser.add_argument("--table", type=Path, help="default: docs/results/gpu_check.md (smoke: a temp folder)")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="gpu_check-")) if args.smoke else ROOT / "docs" / "results"
    json_path, table_path = args.json or out / "gpu_check.json", args.table or out / "gpu_check.md"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: the dtype of the CPU results
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny models: a second thread only adds contention on a small machine
    sizes = SMOKE if args.smoke else FULL
    budgets = sizes.budgets
    report = {"environment": environment(device), "sizes": asdict(sizes), "near_tie_factor": NEAR_TIE}
    report["exactness"] = section("exactness", lambda: exactness(device, sizes, Deadline(budgets["exactness"])))
    report["shipped"] = section("shipped", lambda: shipped(device, sizes, Deadline(budgets["shipped"])))
    report["costs"] = section("costs", lambda: costs(device, dtype, sizes, Deadline(budgets["costs"])))
    report["projection"] = section("projection", lambda: projection(report["costs"]))
    report["trees"] = section("trees", lambda: trees(report["costs"]))
    for path, text in ((json_path, json.dumps(report, indent=1, default=str)), (table_path, markdown(report))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"[gpu_check] wrote {path}")


if __name__ == "__main__":
    main()
