"""Benchmark of lossless decoding methods on one target: plain generate, prompt lookup, DFlash and DCOCO.

Every method is a plain `target.generate(...)` call, so the numbers are what a transformers user gets:

* ``vanilla``: `target.generate(...)`.
* ``prompt_lookup``: `target.generate(..., prompt_lookup_num_tokens=10)` (n-gram drafts from the prompt).
* ``dflash``: `assistant_model=drafter` with the corrector off (`generation_config.use_corrector=False`): plain
  DFlash argmax blocks from our engine, with the same weights, draft vocabulary, layouts and block, so that
  ``dcoco`` against ``dflash`` isolates the corrector.
* ``dflash-hf``: transformers' own DFlash path, `speculation_type="dflash"`, with the very same drafter weights
  (whole vocabulary, transformers' loop).
* ``dcoco`` / ``dcoco-viterbi`` / ``dcoco-geometric``: `assistant_model=drafter` with the corrector's walk set to
  the drafter config's default / "viterbi" / "geometric" for that call.
* ``dcoco-paper``: the paper's prefix-first walk with slot 1 kept at the drafter argmax, i.e. ``dcoco`` without our
  `correct_first_slot` extension (the same as ``dcoco`` for a drafter that does not use it).
* ``speculative``: `speculative_generate(target, input_ids, drafter=drafter, ...)`, the batched loop, one prompt at
  a time, with the drafter's schedule and tree budget.

Methods run interleaved (for each prompt, every method once, in an order shuffled per prompt), so slow phases of a
shared, noisy machine hit all methods alike and the speed ratios stay fair. Speedup is a ratio of tokens per second
against ``vanilla`` on the same prompts: under sampling the methods' outputs differ in length, so a ratio of times
would credit a method for writing less.

Acceptance numbers come from one measuring stick for all methods (`ForwardTrace`): a forward pre-hook on the target
records the cache length and input length of every target forward, from which the drafted and accepted tokens of each
verification follow. tau = new tokens / target forwards. DCOCO-only numbers (top-1/top-K coverage, the ceilings of
tau for the prefix-first walk and for any walk, drafter and corrector time) come from `drafter.generation_stats`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..runtime.prompts import prompt_input_ids
from ..runtime.block_choice import block_size_for_call, check_block_size, set_block_size  # noqa: F401 (re-exported)
from ..runtime.device import device_sync
from ..runtime.hf_compat import cache_kwargs, require_assisted_static_cache
from ..runtime.logs import log
from ..runtime.drafter import DCOCODrafter
from ..runtime.generation import speculative_generate
from ..runtime.stats import DCOCOStats
from ..runtime.tap import forward_inputs

METHODS = (
    "vanilla", "prompt_lookup", "dflash", "dflash-hf", "dcoco", "dcoco-paper", "dcoco-viterbi", "dcoco-geometric",
    "speculative",
)
"""All benchmark methods, in their default order."""

DRAFTER_METHODS = frozenset(
    {"dflash", "dflash-hf", "dcoco", "dcoco-paper", "dcoco-viterbi", "dcoco-geometric", "speculative"}
)
"""Methods that need the DCOCO drafter."""

# The walk (a generation-config field) each method of our engine sets for its calls; "dcoco" keeps the drafter's
# own. "dcoco-paper" is the paper's walk with slot 1 left at the drafter argmax (a config field, since the first-slot
# score is part of the trained corrector): against "dcoco" it isolates `correct_first_slot`.
DCOCO_WALKS: dict[str, dict[str, Any]] = {
    "dflash": {},
    "dcoco": {},
    "speculative": {},
    "dcoco-paper": {"selection": "prefix_first"},
    "dcoco-viterbi": {"selection": "viterbi"},
    "dcoco-geometric": {"selection": "geometric"},
}
DCOCO_CONFIG_FIELDS: dict[str, dict[str, Any]] = {"dcoco-paper": {"correct_first_slot": False}}

PROMPT_LOOKUP_TOKENS = 10


def split_method(name: str) -> tuple[str, int | None]:
    """"dcoco@3" -> ("dcoco", 3): a drafter method run with blocks of 3 (anchor + 2 drafted tokens); "dcoco" ->
    ("dcoco", None), the drafter's own block size. Several block sizes of one method then run interleaved on the same
    prompts, which is how DScout's tau / cycle-time criterion can be compared on a noisy machine."""
    base, at, block = name.partition("@")
    if not at:
        return name, None
    if base not in DRAFTER_METHODS or not block.isdigit() or int(block) < 2:
        raise ValueError(
            f"method {name!r}: a block size suffix needs a drafter method ({', '.join(sorted(DRAFTER_METHODS))}) "
            "and a block of at least 2 (the anchor plus one drafted token), e.g. dcoco@3"
        )
    return base, int(block)


# ---------------------------------------------------------------------------------------------------------------
# Measuring one generate() call
# ---------------------------------------------------------------------------------------------------------------


class ForwardTrace:
    """Records, for every forward of `target` while recording, its cache length and input length.

    In assisted generation the cache always holds all committed tokens but the last one before a verification, so
    consecutive cache lengths give the tokens each verification committed, and the input length gives how many
    tokens were drafted. This works alike for every method (plain, prompt lookup, DFlash, DCOCO), dynamic or static
    cache, without touching transformers' internals.

    The hook is registered once and switched on and off, and torch.compile never traces it: generate() compiles the
    target's `__call__` (hooks included) on GPUs with a static cache, and a hook added per call would force a
    recompilation each time.
    """

    def __init__(self, target: PreTrainedModel) -> None:
        self.calls: list[tuple[Any, int]] = []  # (cache length, possibly a device tensor; input length)
        self.recording = False
        self._handle = target.register_forward_pre_hook(torch.compiler.disable(self._on_forward), with_kwargs=True)

    @contextmanager
    def record(self) -> Iterator[ForwardTrace]:
        self.calls, self.recording = [], True
        try:
            yield self
        finally:
            self.recording = False

    def remove(self) -> None:
        self._handle.remove()

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.recording:
            return
        _, width, start = forward_inputs(args, kwargs)
        # Copying a static cache's live length tensor instead of int() avoids a device sync per forward on GPUs.
        self.calls.append((start.clone() if isinstance(start, torch.Tensor) else start, width))

    def acceptance(self, prompt_len: int, final_len: int) -> DCOCOStats:
        """Drafted/accepted tokens per verification of a call that turned `prompt_len` tokens into `final_len`."""
        starts = [int(start) for start, _ in self.calls]
        widths = [width for _, width in self.calls]
        result = DCOCOStats(target_forwards=len(starts))
        committed = prompt_len  # committed tokens when forward i runs
        for i, (start, width) in enumerate(zip(starts, widths)):
            drafted = width - (committed - start)  # inputs beyond the committed tokens are drafts
            # The next forward starts where this one's committed tokens end, minus the one not yet in the cache.
            next_committed = starts[i + 1] + 1 if i + 1 < len(starts) else final_len
            if drafted > 0:
                result.observe_draft(drafted, max(0, min(drafted, next_committed - committed - 1)))
            committed = next_committed
        return result


@dataclass
class RunRecord:
    """One timed generate() call of one method on one prompt."""

    suite: str
    prompt_index: int
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    acceptance: DCOCOStats  # drafts and acceptance of every method, from the trace of target forwards
    dcoco: DCOCOStats | None = None
    output: list[int] | None = None  # kept until compared with vanilla, then dropped
    equal_to_vanilla: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "prompt_index": self.prompt_index,
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "target_forwards": self.acceptance.target_forwards,
            "tau": self.new_tokens / max(self.acceptance.target_forwards, 1),
            "equal_to_vanilla": self.equal_to_vanilla,
        }


@dataclass
class BenchSettings:
    """How every method is called. temperature 0 means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    warmup: int = 1
    seed: int = 0
    static_cache: bool = False
    rounds: int = 1  # timed runs of every method per prompt; each method's median counts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@contextmanager
def _fields_for_call(holder: Any | None, fields: dict[str, Any]) -> Iterator[None]:
    """Set attributes `fields` of `holder` (a drafter's config or generation config; None: nothing) for the duration
    of one call, then put back the value each had, or no value at all where it had none (the drafter's default)."""
    if holder is None or not fields:
        yield
        return
    saved = {name: vars(holder)[name] for name in fields if name in vars(holder)}
    for name, value in fields.items():
        setattr(holder, name, value)
    try:
        yield
    finally:
        for name in fields:
            if name in saved:
                setattr(holder, name, saved[name])
            else:
                delattr(holder, name)


class MethodRunner:
    """Runs one method on one prompt and measures it. Call `close()` when done (it removes the target hook)."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DCOCODrafter | None,
        settings: BenchSettings,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.settings = settings
        self._sync = device_sync(target.device)
        self.trace = ForwardTrace(target)

    def close(self) -> None:
        self.trace.remove()

    def generate_kwargs(self, method: str, prompt_len: int, max_new_tokens: int | None = None) -> dict[str, Any]:
        settings = self.settings
        method, _ = split_method(method)
        max_new_tokens = settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": not settings.greedy}
        if not settings.greedy:
            kwargs["temperature"] = settings.temperature
        if method == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif method in DRAFTER_METHODS:
            if self.drafter is None:
                raise ValueError(f"method {method!r} needs a drafter, but none was loaded")
            kwargs["drafter" if method == "speculative" else "assistant_model"] = self.drafter
            if method == "dflash-hf":
                kwargs["speculation_type"] = "dflash"
        elif method != "vanilla":
            raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
        if settings.static_cache:
            if method != "vanilla":
                require_assisted_static_cache(f"bench --cache static with method {method!r}")
            kwargs.update(cache_kwargs(self._static_cache(prompt_len + max_new_tokens)))
        return kwargs

    def _static_cache(self, length: int) -> StaticCache:
        """A static cache with room for the longest draft past max_new_tokens.

        `cache_implementation="static"` sizes the cache to exactly prompt + max_new_tokens, and transformers' own
        prompt lookup and DFlash generators draft past that end (IndexError in the cache's index_copy_), so every
        method gets this roomier cache instead; the results are unchanged.
        """
        block = self.drafter.config.block_size if self.drafter is not None else 0
        headroom = max(block, PROMPT_LOOKUP_TOKENS) + 1
        return StaticCache(config=self.target.config, max_cache_len=length + headroom)

    def run(
        self,
        method: str,
        suite: str,
        index: int,
        input_ids: torch.LongTensor,
        streamer: Any | None = None,
        max_new_tokens: int | None = None,
    ) -> RunRecord:
        """Time `method` on `input_ids` [1, T]. `streamer` (e.g. a TextStreamer) receives the tokens as they come;
        `max_new_tokens` overrides the settings' value (short warm-up runs)."""
        prompt_len = input_ids.shape[1]
        base, block_size = split_method(method)
        attention_mask = torch.ones_like(input_ids)
        torch.manual_seed(self.settings.seed + index)  # same sampling seed for every method on this prompt
        with (
            block_size_for_call(self.drafter, block_size),
            self.trace.record() as trace,
            _fields_for_call(self.drafter and self.drafter.config, DCOCO_CONFIG_FIELDS.get(base, {})),
            # use_corrector off drafts plain DFlash argmax blocks; time_phases gives exact phase times on a GPU; a
            # method@B proposes whole blocks of B (the constant schedule), a bare method the drafter's schedule
            _fields_for_call(self.drafter and self.drafter.generation_config, {
                **DCOCO_WALKS.get(base, {}), "use_corrector": base != "dflash", "time_phases": True,
                **({} if block_size is None else {"num_assistant_tokens_schedule": "constant"}),
            }),
        ):
            kwargs = self.generate_kwargs(method, prompt_len, max_new_tokens)
            if streamer is not None:
                kwargs["streamer"] = streamer
            self._sync()
            start = time.perf_counter()
            if base == "speculative":
                output = speculative_generate(self.target, input_ids, attention_mask=attention_mask, **kwargs).sequences
            else:
                output = self.target.generate(input_ids, attention_mask=attention_mask, **kwargs)
            self._sync()
            seconds = time.perf_counter() - start
            dcoco = self._dcoco_stats(output) if base in DCOCO_WALKS else None
        return RunRecord(
            suite=suite,
            prompt_index=index,
            method=method,
            prompt_tokens=prompt_len,
            new_tokens=output.shape[1] - prompt_len,
            seconds=seconds,
            acceptance=trace.acceptance(prompt_len, output.shape[1]),
            dcoco=dcoco,
            output=output[0].tolist(),
        )

    def _dcoco_stats(self, output: torch.LongTensor) -> DCOCOStats:
        stats = self.drafter.generation_stats(output)  # also stops the target tap recording
        return sum(stats, DCOCOStats()) if isinstance(stats, list) else stats  # the batched loop's: one per row


# ---------------------------------------------------------------------------------------------------------------
# The benchmark loop
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PromptItem:
    suite: str
    index: int  # position inside its suite
    text: str


def run_order(methods: Sequence[str], turn: int) -> list[str]:
    """The order `methods` run in on turn `turn` (a prompt's round): a permutation drawn from a generator seeded with
    the turn, so runs are repeatable and, over the turns, every method runs first, last and right after every other
    about equally often. A rotation would keep the cyclic order, so one method would always follow the same one
    (vanilla's plain loop, say) and carry whatever that one leaves behind in the allocator and caches."""
    order = list(methods)
    random.Random(turn).shuffle(order)
    return order


class BenchInterrupted(Exception):
    """Ctrl-C during `run_bench`: `records` holds the prompts that had finished (every method run on each)."""

    def __init__(self, records: list[RunRecord], total_prompts: int) -> None:
        super().__init__(f"interrupted after {len(records)} record(s)")
        self.records, self.total_prompts = records, total_prompts


def run_bench(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DCOCODrafter | None,
    prompts: Sequence[PromptItem],
    methods: Sequence[str],
    settings: BenchSettings,
    progress: bool = True,
) -> list[RunRecord]:
    """Run every method on every prompt, interleaved, and return one record per (prompt, method). Ctrl-C raises
    `BenchInterrupted` with the records of the prompts that had finished."""
    if not prompts:
        raise ValueError("no prompts to benchmark")
    encoded = [prompt_input_ids(tokenizer, item.text).to(target.device) for item in prompts]
    runner = MethodRunner(target, drafter, settings)
    try:
        for round_index in range(settings.warmup):
            # Untimed: first calls pay for lazy initialisation, allocator growth, kernel selection (and compilation).
            item = prompts[round_index % len(prompts)]
            for method in methods:
                runner.run(method, item.suite, item.index, encoded[round_index % len(prompts)])
        records: list[RunRecord] = []
        for position, (item, input_ids) in enumerate(zip(prompts, encoded)):
            try:
                runs = [runner.run(method, item.suite, item.index, input_ids)
                        for turn in range(settings.rounds)
                        for method in run_order(methods, position * settings.rounds + turn)]
            except KeyboardInterrupt:  # a half-run prompt is dropped: every method must have run on each prompt
                raise BenchInterrupted(records, len(prompts)) from None
            row = [_median_run([run for run in runs if run.method == method]) for method in methods]
            _compare_with_vanilla(row, settings.greedy)
            records += row
            if progress:
                timings = ", ".join(f"{r.method} {r.seconds:.2f}s" for r in records[-len(methods):])
                log(f"prompt {position + 1}/{len(prompts)} ({item.suite} #{item.index}): {timings}")
    finally:
        runner.close()
    return records


def _median_run(runs: list[RunRecord]) -> RunRecord:
    """Of one method's rounds on one prompt, the run of median seconds (the lower middle of an even count): a slow
    spell of the machine during one round does not count."""
    return sorted(runs, key=lambda run: run.seconds)[(len(runs) - 1) // 2]


def _compare_with_vanilla(row: list[RunRecord], greedy: bool) -> None:
    """Greedy: mark each record equal or not to the vanilla output of the same prompt. Sampling: leave None (a
    lossless method matches vanilla in distribution, not token for token)."""
    vanilla = next((record for record in row if record.method == "vanilla"), None)
    for record in row:
        if greedy and vanilla is not None:
            record.equal_to_vanilla = record.output == vanilla.output
    for record in row:
        record.output = None


# ---------------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------------


def summarise_method(records: list[RunRecord], vanilla_rate: float | None) -> dict[str, Any]:
    """Totals of one method over some prompts. `vanilla_rate`: vanilla's tokens per second on the same prompts."""
    seconds = sum(r.seconds for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    rate = new_tokens / seconds if seconds > 0 else None
    acceptance = sum((r.acceptance for r in records), DCOCOStats())
    equal = [r.equal_to_vanilla for r in records]
    summary: dict[str, Any] = {
        "prompts": len(records),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        "speedup": rate / vanilla_rate if rate and vanilla_rate else None,  # tokens/s ratio, fair under sampling
        "tau": new_tokens / max(acceptance.target_forwards, 1),
        "target_forwards": acceptance.target_forwards,
        "cycles": len(acceptance.accepted),
        "mean_accepted": acceptance.mean_accepted,
        "accept_hist": acceptance.accept_hist(),
        "per_slot_accept": acceptance.per_slot_accept(),
        "chain_accept": acceptance.chain_accept(),
        "coverage_top1": None,
        "coverage_topk": None,
        "argmax_prefix_tau": None,
        "topk_ceiling_tau": None,
        "walk_ceiling_tau": None,
        "corrector_share": None,
        "cycle_share": None,
        "prefill_seconds": None,
        "drafter_seconds": None,
        "corrector_seconds": None,
        "proposal_lengths": None,
        "drafted_blocks": None,
        "predicted_accept": None,
        "observed_accept": None,
        "seconds_saved": None,
        "equal_to_vanilla": None if any(e is None for e in equal) else sum(equal) / len(equal),
    }
    dcoco = [r.dcoco for r in records if r.dcoco is not None]
    if dcoco:
        merged = sum(dcoco[1:], dcoco[0])
        totals = merged.as_dict()
        summary.update(
            {key: totals[key] for key in (
                "coverage_top1", "coverage_topk", "argmax_prefix_tau", "topk_ceiling_tau", "walk_ceiling_tau",
                "proposal_lengths", "drafted_blocks", "predicted_accept", "observed_accept", "seconds_saved")},
            corrector_share=merged.corrector_seconds / seconds if seconds > 0 else None,
            # the same share of the cycles alone: the prompt's prefill, paid once per call, left out
            cycle_share=merged.corrector_seconds / (seconds - merged.prefill_seconds) if seconds > 0 else None,
            prefill_seconds=merged.prefill_seconds,
            drafter_seconds=merged.drafter_seconds,
            corrector_seconds=merged.corrector_seconds,
            top_k=merged.top_k,
        )
    return summary


def summarise(records: list[RunRecord], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per-method summaries of `records` (all on the same prompts), in `methods` order."""
    vanilla = [r for r in records if r.method == "vanilla"]
    seconds = sum(r.seconds for r in vanilla)
    vanilla_rate = sum(r.new_tokens for r in vanilla) / seconds if vanilla and seconds > 0 else None
    return {method: summarise_method([r for r in records if r.method == method], vanilla_rate) for method in methods}


def build_report(records: list[RunRecord], methods: Sequence[str], config: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's JSON document: overall and per-suite summaries, the run configuration, every call."""
    suites = list(dict.fromkeys(r.suite for r in records))
    return {
        "methods": summarise(records, methods),
        "suites": {suite: summarise([r for r in records if r.suite == suite], methods) for suite in suites},
        "config": config,
        "runs": [r.as_dict() for r in records],
    }


# ---------------------------------------------------------------------------------------------------------------
# Text table
# ---------------------------------------------------------------------------------------------------------------

_COLUMNS = (
    "method", "prompts", "tokens", "seconds", "tok/s", "speedup", "tau", "walk ceiling", "top-K ceiling", "equal",
    "corrector/cycles", "corrector/all",
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(summaries: dict[str, dict[str, Any]], title: str) -> str:
    """A fixed-width table of per-method summaries under a title line."""
    rows = [_COLUMNS]
    for method, s in summaries.items():
        rows.append((
            method,
            str(s["prompts"]),
            str(s["new_tokens"]),
            _cell(s["seconds"], ".2f"),
            _cell(s["tokens_per_s"], ".1f"),
            "-" if s["speedup"] is None else f"{s['speedup']:.2f}x",
            _cell(s["tau"], ".2f"),
            _cell(s["walk_ceiling_tau"], ".2f"),
            _cell(s["topk_ceiling_tau"], ".2f"),
            _cell(s["equal_to_vanilla"], ".2f"),
            *("-" if s[key] is None else f"{100 * s[key]:.1f}%" for key in ("cycle_share", "corrector_share")),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [title]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_proposals(method: str, summary: dict[str, Any]) -> str | None:
    """What the proposal schedule did for one drafter method: cycles per proposal length (0: a plain step instead
    of a draft), drafts per block size, predicted against observed chain acceptance per slot, and the time saved
    against plain steps."""
    lengths = summary.get("proposal_lengths")
    if not lengths:
        return None
    line = f"{method}: cycles per proposal length {{{', '.join(f'{k}: {n}' for k, n in lengths.items())}}}"
    blocks = summary.get("drafted_blocks")
    if blocks:
        line += f"; drafts per block size {{{', '.join(f'{b}: {n}' for b, n in blocks.items())}}}"
    pairs = [(p, o) for p, o in zip(summary["predicted_accept"] or [], summary["observed_accept"] or [])
             if p is not None and o is not None]
    if pairs:
        line += "; slot acceptance predicted/observed " + ", ".join(f"{p:.2f}/{o:.2f}" for p, o in pairs)
    if summary.get("seconds_saved") is not None:
        line += f"; {summary['seconds_saved']:+.1f} s against plain steps (cost model)"
    return line


def greedy_mismatch_reason(dtype: str, quantization: str | None = None) -> str:
    """Why a greedy speculative output may differ from plain `generate()` in `dtype`: a bug unless it is half precision.

    A verify forward of n tokens runs other GEMM and attention kernels than n 1-token steps. In float32 that moves
    logits by ~1e-5, far below any argmax gap seen; in bfloat16 / float16 by ~0.4 (SmolLM2-135M, measured), enough
    to flip a near-tie. This holds for any speculative decoder (transformers' own assisted generation included).
    """
    if dtype in ("bfloat16", "float16"):
        return (f"in {dtype} a multi-token verify forward rounds differently from plain decoding's 1-token steps, so "
                "greedy paths can part at a near-tie (transformers' own assisted generation too); use --dtype float32 "
                "for token-exact output")
    if quantization is not None:  # `precision.describe_quantization` of the target
        return (f"the target is {quantization}: bitsandbytes rounds each activation row (to int8, or to bfloat16 in "
                "its 4-bit kernel on AVX512-BF16 CPUs), which turns a verify forward's float32 rounding into larger "
                "steps, so greedy paths can part at a near-tie (docs/quantized.md); drop --quantize for token-exact "
                "output")
    return f"please report this: in {dtype} greedy speculation must be token-exact"


def format_report(report: dict[str, Any]) -> str:
    """Tables per suite, then overall, then why outputs differ where greedy ones do."""
    config = report["config"]
    mode = "greedy" if config.get("temperature", 0.0) == 0.0 else f"sampling T={config['temperature']}"
    detail = f"{mode}, max {config.get('max_new_tokens')} new tokens"
    if config.get("block_size") is not None:
        vocab = config.get("draft_vocab_size")
        detail += f", block {config['block_size']}, {f'draft vocab {vocab}' if vocab else 'full vocab'}"
    parts = [format_table(summary, f"== suite {suite} ({detail}) ==") for suite, summary in report["suites"].items()]
    parts.append(format_table(report["methods"], f"== overall ({detail}) =="))
    parts.extend(filter(None, (format_proposals(method, s) for method, s in report["methods"].items())))
    equal = [s["equal_to_vanilla"] for s in report["methods"].values()]
    if mode == "greedy" and any(e is not None and e < 1 for e in equal):
        parts.append("outputs differ from plain generate(): "
                     f"{greedy_mismatch_reason(config.get('dtype', '?'), config.get('quantization'))}")
    return "\n\n".join(parts)


__all__ = [
    "DRAFTER_METHODS",
    "METHODS",
    "BenchInterrupted",
    "BenchSettings",
    "ForwardTrace",
    "MethodRunner",
    "PromptItem",
    "RunRecord",
    "build_report",
    "check_block_size",
    "format_proposals",
    "format_report",
    "format_table",
    "greedy_mismatch_reason",
    "run_order",
    "run_bench",
    "set_block_size",
    "split_method",
    "summarise",
]
