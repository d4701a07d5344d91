"""The draft block size of highest throughput on the machine at hand: DScout's G = tau / T.

DScout ("Factorization-Guided Training and Inference for Diffusion-Drafted Speculative Decoding") argues that the
block size is an inference choice, per target and hardware: a longer block raises tau, the tokens committed per
target forward, but also T, the time of one cycle (one drafted block and one verify forward of it). On a GPU a verify
forward of 8 tokens costs about what one of 3 does; on a CPU it does not, and by how much depends on the CPU: with
our SmolLM2 drafter the fastest were blocks of 2 and 4, within a few percent of each other, on an AMD EPYC host
and blocks of 3 on an Intel Sapphire Rapids one.

So both factors are measured, each where it is a property of what it measures:
    tau(B)   tokens committed per target forward at blocks of B: a property of the drafter and the text, measured
             once on held-out prompts and recorded in the drafter's generation config (`block_tau`, in
             generation_config.json). It is measured at every B
             rather than predicted from the slot acceptance of the longest block: a block's mask slots attend to
             each other, so the slots of a shorter block predict somewhat differently.
    T(B)     one verify forward of B tokens plus one drafted and corrected block, from the cycle costs timed on
             this machine (`measure_cycle_costs`: every part interleaved with the others, repeated, medians
             priced as the cheapest forward covering them (`cheapest_cover`), so one slow spell does not decide),
and `choose_block_size` returns the B of largest tau(B) / T(B). This fixed block is the constant schedule's; the
default, cost-aware schedule (`proposal.py`) drafts the same block (`CostModel.machine_block`, with the loop's own
learned cost per cycle added) and sizes each cycle's proposal from the same costs. The constant schedule leaves the
loop around a cycle out (it costs the same for every B), which slightly favours shorter blocks.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from .context_cache import DraftContextCache
from .device import device_sync
from .costs import CycleCosts, best_block
from .hf_compat import cache_kwargs

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter


def check_block_size(drafter: DCOCODrafter, block_size: int) -> None:
    """Raise ValueError unless the drafter can draft blocks of `block_size`: at most the block it was trained on
    (`config.block_size`), since a longer block would ask for slots it never learned."""
    largest = drafter.config.block_size
    if not 2 <= block_size <= largest:
        raise ValueError(
            f"block size {block_size}: must lie in [2, {largest}], the block this drafter was trained on "
            "(config.block_size). A drafter predicts no slot beyond the blocks it was trained with; if it was "
            "trained on longer blocks (its model card says which), record the longest as block_size in its "
            "config.json"
        )


def set_block_size(drafter: DCOCODrafter, block_size: int) -> None:
    """Draft blocks of `block_size` (anchor + block_size - 1 slots) where no schedule plans the block per cycle, and
    propose at most block_size - 1 tokens per cycle; see `check_block_size`.

    It is a decoding choice: transformers reads the draft length from the assistant's generation config
    (`num_assistant_tokens`), and `drafter.draft_block_size` follows it. The architecture's `config.block_size`
    stays, so a later call may go back up to it."""
    check_block_size(drafter, block_size)
    drafter.generation_config.num_assistant_tokens = block_size - 1


@contextmanager
def block_size_for_call(drafter: DCOCODrafter | None, block_size: int | None) -> Iterator[None]:
    """Draft blocks of `block_size` for the duration of one call (None: the drafter's own)."""
    if block_size is None or drafter is None:
        yield
        return
    saved = drafter.generation_config.num_assistant_tokens
    set_block_size(drafter, block_size)
    try:
        yield
    finally:
        drafter.generation_config.num_assistant_tokens = saved


@dataclass(frozen=True)
class BlockSizeChoice:
    """The chosen block size, and for every candidate size its recorded tau, timed cycle and tau / cycle."""

    block_size: int
    tau: dict[int, float]
    cycle_seconds: dict[int, float]

    def throughput(self, block_size: int) -> float:
        """Tokens per second of cycle time (G)."""
        return self.tau[block_size] / self.cycle_seconds[block_size]

    def summary(self) -> str:
        """One line per candidate size, the chosen one marked."""
        return "\n".join(
            f"{'*' if size == self.block_size else ' '} block {size}: tau {self.tau[size]:.2f} (recorded), cycle "
            f"{1e3 * self.cycle_seconds[size]:.1f} ms, tau/cycle {self.throughput(size):.1f} tokens/s"
            for size in sorted(self.tau)
        )


def candidate_block_sizes(drafter: DCOCODrafter) -> list[int]:
    """The block sizes with a measured tau (`drafter.decoding.block_tau`)."""
    block_tau = drafter.decoding.block_tau
    if block_tau is None:
        raise ValueError(
            "this drafter records no block_tau, so there is no tau to weigh cycle times against: measure it with a "
            "bench over block sizes (dcoco@2,...,dcoco@8) and record it (scripts/record_block_tau.py), or draft a "
            "fixed block size."
        )
    return sorted(int(size) for size in block_tau)


def verify_widths(widest: int) -> list[int]:
    """The verify widths (columns per row) to time up to `widest`: each up to 8, then a few, interpolated between
    (`CycleCosts.fit`): a draft tree's widths would otherwise double the timing."""
    return sorted({*range(1, min(widest, 8) + 1), *(w for w in (10, 12, 16, 24, 32, 48, 64) if w < widest), widest})


@torch.no_grad()
def measure_cycle_costs(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    block_sizes: list[int],
    max_rows: int,
    context_length: int = 256,
    new_rows: int = 2,
    repeats: int = 7,
    batch: int = 1,
) -> CycleCosts:
    """Time the parts of a cycle on this device at `batch` rows (`CycleCosts`): a target forward of 1..`max_rows`
    columns per row on a cached context of `context_length` tokens (1 column: a plain step; `verify_widths`), and
    `drafter.propose` of a block of each of `block_sizes` with `new_rows` fresh context rows (about tau) on a drafter
    cache of the same length.

    A noisy machine slows whatever runs during a slow spell, so every size runs once per round, in an order rotated
    from round to round, after one untimed round; the fit takes medians over `repeats` rounds and makes them
    monotone in the size (`CycleCosts.fit`). Token ids and context states are random: the cost of a forward does not
    depend on them."""
    device = next(target.parameters()).device
    sync = device_sync(device)
    longest = max(max_rows, max(block_sizes))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (batch, context_length + longest), generator=generator)
    ids = ids.to(device)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    states = torch.randn(batch, context_length + new_rows, width, generator=generator).to(device, drafter.dtype)
    positions = torch.arange(context_length + new_rows + longest, device=device)[None]

    context_cache = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context_length], **cache_kwargs(context_cache), use_cache=True, logits_to_keep=1)
    draft_cache = DraftContextCache()
    with block_size_for_call(drafter, min(block_sizes)):  # fills the drafter cache with the context rows
        block = positions[:, context_length : context_length + min(block_sizes)]
        drafter.propose(ids[:, context_length - 1], states[:, :context_length],
                        torch.cat([positions[:, :context_length], block], 1), draft_cache,
                        context_ids=ids[:, :context_length])

    def verify(columns: int) -> float:
        # A copy of the context's cache per forward: cropping it back would not undo a sliding-window layer's
        # shift on every transformers release.
        target_cache = copy.deepcopy(context_cache)
        sync()
        start = time.perf_counter()
        target(input_ids=ids[:, context_length : context_length + columns], **cache_kwargs(target_cache),
               use_cache=True, logits_to_keep=columns)
        sync()
        return time.perf_counter() - start

    def draft(block_size: int) -> float:
        sync()
        start = time.perf_counter()
        with block_size_for_call(drafter, block_size):
            cycle_positions = positions[:, context_length : context_length + new_rows + block_size]
            drafter.propose(ids[:, -1], states[:, context_length:], cycle_positions, draft_cache,
                            context_ids=ids[:, :context_length])
        sync()
        seconds = time.perf_counter() - start
        draft_cache.truncate(context_length)
        return seconds

    widths = verify_widths(max_rows)
    parts = [("verify", columns) for columns in widths] + [("draft", size) for size in block_sizes]
    timings: dict[tuple[str, int], list[float]] = {part: [] for part in parts}
    for round_ in range(repeats + 1):
        shift = round_ % len(parts)
        for kind, size in parts[shift:] + parts[:shift]:
            seconds = verify(size) if kind == "verify" else draft(size)
            if round_:  # round 0 warms every size up
                timings[kind, size].append(seconds)
    return CycleCosts.fit(
        {columns: timings["verify", columns] for columns in widths},
        {size: timings["draft", size] for size in block_sizes},
        batch=batch,
    )


def choose_block_size(
    drafter: DCOCODrafter, costs: CycleCosts, block_sizes: list[int] | None = None
) -> BlockSizeChoice:
    """The block size of largest recorded tau / modelled cycle (draft + verify of B rows) among `block_sizes`
    (default: every size in the drafter's `block_tau`), for the constant schedule. Apply it with
    `set_block_size(drafter, choice.block_size)`."""
    measured = candidate_block_sizes(drafter)
    sizes = sorted(set(block_sizes)) if block_sizes else measured
    missing = sorted(set(sizes) - set(measured))
    if missing:
        raise ValueError(f"block sizes {missing} have no measured tau in the drafter's block_tau (it has {measured})")
    tau = {size: drafter.decoding.block_tau[str(size)] for size in sizes}
    seconds = {size: costs.cycle(size - 1, size) for size in sizes}
    return BlockSizeChoice(best_block(tau, seconds), tau, seconds)
