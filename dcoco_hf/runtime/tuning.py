"""Fast by default: what `drafter.attach(target)` does to make speculation pay on the device at hand.

Speculation wins only when a verify forward of B tokens costs about one decoding step. On a GPU it does; on a CPU
three things decide it, each measured once per machine and model pair:

* the target's attention: transformers' masked multi-token SDPA copies the key/value cache to every query head;
  ``"sdpa_cpu_gqa"`` (`cpu_attention.py`) lets torch's CPU kernel do grouped heads itself;
* the linear layers: torch's CPU GEMM is slow for 2-16 rows, so each model gets the few-rows layout measured fastest
  here (`cpu_linear.py`);
* the cycle's costs: a plain step, a verify forward of 2..B rows (and of a draft tree's, up to `tree_budget` + 1), a
  draft (`block_choice.measure_cycle_costs`), which the default cost-aware schedule weighs every cycle to size its
  proposal (`proposal.py`), and from which the constant schedule takes DScout's block of highest recorded tau per
  cycle time; on a GPU these are the only ones. A batched call times the same parts at its batch size the first
  time one is needed (`time_batch`, a power of two at or above it; sizes between timed ones are interpolated).

Plain 1-token steps keep transformers' own attention and `F.linear`, so plain `generate()` of the target is
bit-identical while attached, and `untune` (called by `drafter.detach()`) restores it exactly.

The measurements are cached on disk (`cache_dir()`), keyed by the machine, torch, the thread count and both models'
configs, so a second process reuses them: loading from the cache takes no timing at all; batch sizes timed later are
added to the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .block_choice import (
    BlockSizeChoice,
    candidate_block_sizes,
    check_block_size,
    choose_block_size,
    measure_cycle_costs,
    set_block_size,
)
from .cpu_attention import CPU_GQA_ATTENTION
from .cpu_linear import (
    DEFAULT_MAX_ROWS,
    available_layouts,
    few_rows_plan,
    restore_linear,
    use_few_rows_linear,
)
from .hf_compat import attention_implementation
from .logs import log, logger
from .costs import MAX_TIMED_BLOCK, CycleCosts
from .proposal import COST_SCHEDULE

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter

# The verify width the tuning line reports (`Tuning.summary`), beside the plain step: what a speedup depends on.
VERIFY_REFERENCE_ROWS = 8

# A timing whose spread (median relative interquartile range) is above this was taken beside other work: the
# SmolLM2-135M tunings behind the published figures spread 7-31% on a 2-core machine, one taken beside another job
# 64%. Such a tuning is timed once more, and if still this noisy, used by this process only, never cached.
NOISY_SPREAD = 0.5

# Bumped whenever what a cache file holds, or how it is measured, changes: old files are then measured anew.
_CACHE_VERSION = 5


@dataclass
class Tuning:
    """What `tune` did to a target and its drafter, so that `untune` can undo exactly that."""

    device: str
    attention: tuple[str, str] | None = None  # (before, after) when the target's attention was switched
    target_layout: dict[int, str] | None = None  # few-rows plan {rows: layout}, CPU only
    drafter_layout: dict[int, str] | None = None
    block_choice: BlockSizeChoice | None = None
    costs: CycleCosts | None = None  # the cycle's parts timed here: what the cost-aware schedule weighs
    batch_costs: dict[int, CycleCosts] = field(default_factory=dict)  # the same at other batch sizes (`time_batch`)
    block_size: int | None = None  # the block drafted after tuning
    configured_block_size: int | None = None  # the drafter's block before it
    cache_file: Path | None = None
    from_cache: bool = False
    notes: list[str] = field(default_factory=list)  # e.g. the drafter cast to the target's dtype

    def summary(self) -> str:
        """The one log line `attach` prints."""
        parts = [f"tuned for {self.device}"]
        if self.attention is not None:
            parts.append(f"attention {self.attention[0]} -> {self.attention[1]}")
        if self.target_layout is not None:
            parts.append(f"few-rows linear layouts (target: {plan_text(self.target_layout)}; drafter: "
                         f"{plan_text(self.drafter_layout or {})})")
        if self.block_choice is not None:
            choice = self.block_choice
            sizes = sorted(choice.tau)
            parts.append(f"block size {self.block_size} (highest tau per cycle time among {sizes[0]}-{sizes[-1]})")
        elif self.block_size is not None:
            parts.append(f"block size {self.block_size}")
        if self.costs is not None:
            parts.append(tuning_line(self.costs))
        parts.extend(self.notes)
        if self.cache_file is not None:
            parts.append(f"{'measurements read from' if self.from_cache else 'measured and cached in'} "
                         f"{self.cache_file}")
        return "; ".join(parts)


def tuning_line(costs: CycleCosts) -> str:
    """"plain step 48.9 ms, verify of 8 rows 1.46x it (spread 7%)": what a speedup on this machine depends on, at one
    verify width for every machine and drafter, so a reader can compare theirs."""
    rows = min(VERIFY_REFERENCE_ROWS, costs.max_rows)
    ratio = costs.verify_seconds(rows) / costs.plain
    spread = f"spread {100 * costs.spread:.0f}%"
    return f"plain step {1e3 * costs.plain:.1f} ms, verify of {rows} rows {ratio:.2f}x it ({spread})"


def plan_text(plan: dict[int, str]) -> str:
    """{2: "gemm", 3: "packed", 4: "packed"} -> "2 rows gemm, 3-4 rows packed"."""
    runs: list[list] = []
    for rows, name in sorted(plan.items()):
        if runs and runs[-1][2] == name and runs[-1][1] == rows - 1:
            runs[-1][1] = rows
        else:
            runs.append([rows, rows, name])
    return ", ".join(f"{a}{'' if a == b else f'-{b}'} rows {name}" for a, b, name in runs) or "none"


def cache_dir() -> Path:
    """Where measurements are cached: $DCOCO_HF_TUNING_DIR, else tuning/ under $DCOCO_HF_CACHE or ~/.cache/dcoco-hf
    (the root the default target is cached in too)."""
    if os.environ.get("DCOCO_HF_TUNING_DIR"):
        return Path(os.environ["DCOCO_HF_TUNING_DIR"]).expanduser()
    root = os.environ.get("DCOCO_HF_CACHE") or Path.home() / ".cache" / "dcoco-hf"
    return Path(root).expanduser() / "tuning"


def tune(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    block_size: int | str = "auto",
    extra_block_sizes: Sequence[int] = (),
    batch_size: int = 1,
    few_rows_linear: bool = True,
    gqa_attention: bool = True,
    use_cache: bool = True,
    refresh: bool = False,
) -> Tuning:
    """Make `target` and its attached `drafter` fast on their device; returns what was done (see `Tuning`).

    block_size: "auto" drafts the largest trained block under the cost-aware schedule (each cycle proposes the share
        of it that pays), and under the constant one the block of highest recorded tau (`drafter.decoding.block_tau`)
        per cycle timed here (the configured block when no tau is recorded); or a fixed size. Blocks beyond
        `MAX_TIMED_BLOCK` (64) are refused before anything is timed.
    extra_block_sizes: further blocks the caller will draft (e.g. a bench's dcoco@5), laid out for on CPU.
    batch_size: rows per forward the CPU layouts must cover (a batched verify has batch_size blocks).
    few_rows_linear / gqa_attention: the two CPU measures, each on by default.
    use_cache: read and write the measurements in `cache_dir()`.
    refresh: measure again and overwrite the cached measurements (e.g. ones taken while the machine was busy).
    """
    device = next(target.parameters()).device
    configured = drafter.draft_block_size
    auto = block_size == "auto"
    cost_aware = drafter.proposal_schedule_name == COST_SCHEDULE
    choices = candidate_block_sizes(drafter) if auto and drafter.decoding.block_tau is not None else []
    drafted = configured
    if not auto:
        drafted = int(block_size)
        check_block_size(drafter, drafted)
    elif cost_aware:  # up to the largest block; each cycle drafts the block, and proposes the share of it, that pays
        drafted = drafter.config.block_size
        choices = choices or draft_sizes(drafted)
    blocks = sorted({drafted, *choices, *extra_block_sizes})
    check_timed_blocks(blocks)  # before anything is switched or timed
    if not auto or cost_aware:
        set_block_size(drafter, drafted)
    on_cpu = device.type == "cpu"
    widest = verify_width(drafter, blocks)
    # The widest forwards the few-row layouts serve: two blocks' rows per sequence, or a draft tree's and its anchor.
    max_rows = max(DEFAULT_MAX_ROWS, 2 * max(blocks) * batch_size, widest * batch_size)
    tuning = Tuning(device=device_name(device), configured_block_size=configured)

    if on_cpu and gqa_attention and attention_implementation(target) == "sdpa":
        for model in (target, drafter):
            if attention_implementation(model) == "sdpa":
                model.set_attn_implementation(CPU_GQA_ATTENTION)
        tuning.attention = ("sdpa", CPU_GQA_ATTENTION)
    attention = attention_implementation(target)
    key = _cache_key(target, drafter, device, max_rows, blocks, few_rows_linear and on_cpu, attention)
    path = cache_dir() / f"{key}.json" if use_cache else None
    layouts = on_cpu and few_rows_linear
    cached = None if refresh else _read(path, max_rows if layouts else None, blocks, widest)
    tuning.cache_file, tuning.from_cache = path, cached is not None
    cached = cached or {}

    if layouts:
        tuning.target_layout = _lay_out(target, max_rows, cached.get("target_layout"))
        tuning.drafter_layout = _lay_out(drafter, max_rows, cached.get("drafter_layout"))
    # After the layouts: the costs are those of the forwards as they will run.
    cached_costs = cached.get("cycle_costs")  # checked by _read
    tuning.costs = CycleCosts.from_dict(cached_costs) if cached_costs else _measure_quietly(
        target, drafter, blocks, widest
    )
    tuning.batch_costs = {
        int(size): CycleCosts.from_dict(costs) for size, costs in cached.get("batch_costs", {}).items()
    }
    if choices and not cost_aware:
        tuning.block_choice = choose_block_size(drafter, tuning.costs, choices)
        set_block_size(drafter, tuning.block_choice.block_size)
    tuning.block_size = drafter.draft_block_size
    if path is not None and not tuning.from_cache:
        if tuning.costs.spread > NOISY_SPREAD:
            tuning.cache_file = None  # batch timings of this process stay uncached too
            tuning.notes.append(f"not cached: timed twice, spread above {100 * NOISY_SPREAD:.0f}% both times (a busy "
                                "machine?); used in this process only and measured again at the next attach")
        else:
            _write(path, tuning)
    return tuning


def _measure_quietly(target: PreTrainedModel, drafter: DCOCODrafter, blocks: list[int], widest: int) -> CycleCosts:
    """The cycle's costs; timed once more when the first timing was noisy (a busy spell may have passed), keeping
    the quieter of the two."""
    costs = measure_cycle_costs(target, drafter, blocks, max_rows=widest)
    if costs.spread > NOISY_SPREAD:
        again = measure_cycle_costs(target, drafter, blocks, max_rows=widest)
        costs = min(costs, again, key=lambda timed: timed.spread)
    return costs


def check_timed_blocks(blocks: Sequence[int]) -> None:
    """Refuse blocks longer than the tuning times (`MAX_TIMED_BLOCK`): their layouts and cycle costs would take
    minutes to time (two million rows for a block of a million), and the cache could not hold them."""
    largest = max(blocks)
    if largest > MAX_TIMED_BLOCK:
        raise ValueError(
            f"block_size={largest} is more than attach's tuning can time (blocks of up to {MAX_TIMED_BLOCK}). Draft "
            f"a smaller block, attach(target, block_size=N) with N <= {MAX_TIMED_BLOCK}, or attach without tuning: "
            "attach(target, tune=False)."
        )


def verify_width(drafter: DCOCODrafter, blocks: list[int]) -> int:
    """The widest verify forward to time: the largest block, or a draft tree of `tree_budget` nodes and its anchor."""
    return max(max(blocks), drafter.decoding.tree_budget + 1)


def time_batch(drafter: DCOCODrafter, batch: int) -> CycleCosts:
    """The cycle's costs at `batch` rows for the drafter's cost-aware schedule: timed at the power of two at or above
    `batch` the first time (a batched call's start; logged), then read from the tuning and its cache file."""
    tuning, model = drafter.tuning, drafter.cost_model
    size = 1 << (batch - 1).bit_length()
    costs = tuning.batch_costs.get(size)
    if costs is None:
        blocks = sorted(tuning.costs.draft)
        costs = measure_cycle_costs(drafter.target, drafter, blocks, max_rows=tuning.costs.max_rows, repeats=5,
                                    batch=size)
        tuning.batch_costs[size] = costs
        log(f"timed the cycle at batch {size}: plain step {1e3 * costs.plain:.1f} ms, verify of "
            f"{costs.max_rows} columns {costs.verify[-1] / costs.plain:.2f}x it (spread {100 * costs.spread:.0f}%)"
            + (f"; cached in {tuning.cache_file}" if tuning.cache_file is not None else ""))
        if tuning.cache_file is not None:
            _write(tuning.cache_file, tuning)
    model.batch_costs[size] = costs
    return costs


def draft_sizes(largest: int) -> list[int]:
    """Blocks the cost-aware schedule may draft when no tau per block size was measured: 2, 4, 8, ... and `largest`
    (timing every size of a 16-block drafter would lengthen attach for little)."""
    return sorted({*(2**i for i in range(1, largest.bit_length()) if 2**i <= largest), largest})


def untune(target: PreTrainedModel, drafter: DCOCODrafter | None, tuning: Tuning) -> None:
    """Undo `tune` on the target (and drafter): plain linear layers, the attention it had before."""
    if tuning.target_layout is not None:
        restore_linear(target)
    if drafter is not None and tuning.drafter_layout is not None:
        restore_linear(drafter)
    if tuning.attention is not None:
        for model in (target, drafter):
            if model is not None and attention_implementation(model) == tuning.attention[1]:
                model.set_attn_implementation(tuning.attention[0])


def unpack_for_capture(drafter: nn.Module, tuning: Tuning | None) -> None:
    """Before `compile_drafting`: a drafter laid out with MKL's packed GEMM gets plain linear layers back. A packed
    weight is an opaque tensor that inductor cannot lower, and the compiled graph fuses its own few-row products.
    Recorded in the drafter's `tuning` (its summary says so; `untune` has no drafter layout left to undo)."""
    if "packed" not in (few_rows_plan(drafter) or {}).values():
        return
    restore_linear(drafter)
    if tuning is not None and tuning.drafter_layout is not None:
        tuning.drafter_layout = None
        tuning.notes.append("drafter linear layers plain for compiled drafting")


def device_name(device: torch.device) -> str:
    """"CPU (AMD EPYC 7B13, 2 threads)" or "cuda:0 (NVIDIA H200)": timings are properties of this."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"CPU ({cpu_name()}, {torch.get_num_threads()} threads)"


def cpu_name() -> str:
    """The processor's model name: CPU timings (which linear layout wins, a cycle's cost) depend on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def _lay_out(model: nn.Module, max_rows: int, cached: dict[str, str] | None) -> dict[int, str]:
    if cached is not None:  # checked by _read
        return use_few_rows_linear(model, max_rows=max_rows, layout={int(rows): name for rows, name in cached.items()})
    return use_few_rows_linear(model, max_rows=max_rows)


def _cache_key(target, drafter, device, max_rows, blocks, layouts, attention) -> str:
    """A hash of everything the measurements depend on: machine, software, thread count, both models, what is
    measured. The drafter's block_size is left out (tuning sets it); its decoding choices (block_tau, the walk) are
    in."""
    drafter_config = drafter.config.to_dict()
    drafter_config.pop("block_size", None)
    identity = {
        "version": _CACHE_VERSION,
        "device": device_name(device),
        "torch": torch.__version__,
        "target": _model_identity(target),
        "drafter": {**drafter_config, "_dtype": str(drafter.dtype), "_decoding": asdict(drafter.decoding)},
        "max_rows": max_rows,
        "blocks": blocks,
        "layouts": layouts,
        "attention": attention,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_identity(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config.to_dict()
    for name in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        config.pop(name, None)
    return {"config": config, "dtype": str(model.dtype), "parameters": sum(p.numel() for p in model.parameters())}


def _read(path: Path | None, max_rows: int | None, blocks: list[int], widest: int) -> dict[str, Any] | None:
    """The cached measurements in `path`, or None (measure again) when there are none or they are not exactly what
    this tuning would measure: `max_rows` the few-rows plans must cover (None: no plans), `blocks` the drafted
    block sizes and `widest` the verify width the cycle costs must cover."""
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # a torn or foreign file: measure again and overwrite it
        problem = f"unreadable: {error}"
    else:
        problem = _cache_problem(data, max_rows, blocks, widest)
    if problem is None:
        return data
    logger.warning("ignoring the tuning cache %s (%s); measuring again", path, problem)
    return None


def _cache_problem(data: Any, max_rows: int | None, blocks: list[int], widest: int) -> str | None:
    """What is wrong with a cache file's contents, or None. Everything a later step reads is checked here, bounds
    included, so that a hand-edited or foreign file is measured again instead of crashing attach (or generate)."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if data.get("version") != _CACHE_VERSION:
        return f"version {data.get('version')!r}, expected {_CACHE_VERSION}"
    for name in ("target_layout", "drafter_layout"):
        problem = _plan_problem(data.get(name), max_rows)
        if problem is not None:
            return f"{name}: {problem}"
    problem = _costs_problem(data.get("cycle_costs"), blocks, widest)
    if problem is not None:
        return f"cycle_costs: {problem}"
    batch_costs = data.get("batch_costs", {})
    if not isinstance(batch_costs, dict):
        return f"batch_costs: expected an object {{batch: costs}}, got {type(batch_costs).__name__}"
    for size, costs in batch_costs.items():
        problem = _costs_problem(costs, blocks, widest)
        if problem is None and (not size.isdigit() or CycleCosts.from_dict(costs).batch != int(size)):
            problem = f"timed at another batch size than {size!r}"
        if problem is not None:
            return f"batch_costs[{size}]: {problem}"
    return None


def _plan_problem(plan: Any, max_rows: int | None) -> str | None:
    """A few-rows plan must name a layout available here for every row count 2..max_rows (the plan `tune` makes)."""
    if max_rows is None:
        return None  # not read
    if not isinstance(plan, dict):
        return f"expected an object {{rows: layout}}, got {type(plan).__name__}"
    expected = {str(rows) for rows in range(2, max_rows + 1)}
    if set(plan) != expected:
        return f"row counts {sorted(plan)[:8]}, expected 2..{max_rows}"
    unknown = {name for name in plan.values() if name not in available_layouts()}
    return f"layouts {sorted(map(str, unknown))} not among {list(available_layouts())}" if unknown else None


def _costs_problem(costs: Any, blocks: list[int], widest: int) -> str | None:
    """Cycle costs must have a finite positive time for a verify of 1..`widest` columns and a draft of each block."""
    try:
        parsed = CycleCosts.from_dict(costs)
    except (TypeError, ValueError) as error:
        return str(error)
    if parsed.max_rows != widest or sorted(parsed.draft) != blocks:
        return f"cover {parsed.max_rows} columns and blocks {sorted(parsed.draft)}, expected {widest} and {blocks}"
    return None


def _write(path: Path, tuning: Tuning) -> None:
    data = {
        "version": _CACHE_VERSION,
        "device": tuning.device,
        "target_layout": tuning.target_layout,
        "drafter_layout": tuning.drafter_layout,
        "cycle_costs": None if tuning.costs is None else tuning.costs.to_dict(),
        "batch_costs": {str(size): costs.to_dict() for size, costs in sorted(tuning.batch_costs.items())},
    }
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh name made with O_EXCL: a predictable one could be a symlink planted by another user.
        handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(json.dumps(data, indent=1) + "\n")
        os.replace(temporary, path)  # atomic: a concurrent reader sees the old file or the new one, never half
    except OSError as error:  # a read-only home must not break generation; it only costs the next start-up
        logger.warning("could not cache the tuning in %s (%s); the next process measures again", path, error)
        tuning.cache_file = None
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)

__all__ = ["Tuning", "cache_dir", "check_timed_blocks", "cpu_name", "device_name", "plan_text", "time_batch", "tune",
           "tuning_line", "unpack_for_capture", "untune", "verify_width"]
