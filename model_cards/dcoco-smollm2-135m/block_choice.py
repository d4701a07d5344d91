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
    T(B)     one verify forward of B tokens plus one drafted and corrected block, timed on this machine, interleaved
             across block sizes on the same cached context,
and `choose_block_size` returns the B of largest tau(B) / T(B). The transformers loop around a cycle costs the same
for every B and is left out, which slightly favours shorter blocks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from .context_cache import DraftContextCache
from .device import device_sync
from .hf_compat import cache_kwargs

if TYPE_CHECKING:
    from .modeling_dcoco import DCOCODrafter


def check_block_size(drafter: DCOCODrafter, block_size: int) -> None:
    """Raise ValueError unless the drafter can draft blocks of `block_size`: at most the largest it was trained on
    (`config.max_block_size`, else `config.block_size`), since a longer block would ask for slots it never learned."""
    largest = drafter.config.largest_block_size
    if not 2 <= block_size <= largest:
        raise ValueError(
            f"block size {block_size}: must lie in [2, {largest}], the largest block this drafter was trained on "
            "(config.max_block_size, else config.block_size). A drafter predicts no slot beyond the blocks it was "
            "trained with; if it was trained on longer blocks (its model card says which), record the longest as "
            "max_block_size in its config.json"
        )


def set_block_size(drafter: DCOCODrafter, block_size: int) -> None:
    """Draft blocks of `block_size` (anchor + block_size - 1 slots); see `check_block_size`.

    Choosing a block never shrinks what the drafter can draft: the largest trained block is recorded as
    `max_block_size` before `block_size` changes, so a later call may go back up to it."""
    check_block_size(drafter, block_size)
    config = drafter.config
    config.max_block_size = config.largest_block_size
    config.block_size = block_size
    # transformers reads the draft length from the assistant's generation config.
    drafter.generation_config.num_assistant_tokens = block_size - 1


@contextmanager
def block_size_for_call(drafter: DCOCODrafter | None, block_size: int | None) -> Iterator[None]:
    """Draft blocks of `block_size` for the duration of one call (None: the drafter's own)."""
    if block_size is None or drafter is None:
        yield
        return
    saved = drafter.config.block_size, drafter.generation_config.num_assistant_tokens
    set_block_size(drafter, block_size)
    try:
        yield
    finally:
        drafter.config.block_size, drafter.generation_config.num_assistant_tokens = saved


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


@torch.no_grad()
def time_cycles(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    block_sizes: list[int],
    context_length: int = 256,
    new_rows: int = 2,
    repeats: int = 5,
) -> dict[int, float]:
    """Median seconds of one cycle at each block size: a verify forward of B tokens on a target cache of
    `context_length` tokens, plus `drafter.propose` of a block of B with `new_rows` fresh context rows (about tau)
    on a drafter cache of the same length. Sizes run interleaved, after one untimed round, so a noisy machine slows
    all of them alike. Token ids and context states are random: the cost of a forward does not depend on them."""
    device = next(target.parameters()).device
    sync = device_sync(device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, context_length + max(block_sizes)), generator=generator)
    ids = ids.to(device)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    states = torch.randn(1, context_length + new_rows, width, generator=generator).to(device, drafter.dtype)
    positions = torch.arange(context_length + new_rows + max(block_sizes), device=device)[None]

    target_cache = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context_length], **cache_kwargs(target_cache), use_cache=True, logits_to_keep=1)
    draft_cache = DraftContextCache()
    with block_size_for_call(drafter, min(block_sizes)):  # fills the drafter cache with the context rows
        block = positions[:, context_length : context_length + min(block_sizes)]
        drafter.propose(ids[0, -1:], states[:, :context_length], torch.cat([positions[:, :context_length], block], 1),
                        draft_cache, context_ids=ids[:, :context_length])

    def cycle(block_size: int) -> float:
        sync()
        start = time.perf_counter()
        target(input_ids=ids[:, context_length : context_length + block_size], **cache_kwargs(target_cache),
               use_cache=True)
        with block_size_for_call(drafter, block_size):
            cycle_positions = positions[:, context_length : context_length + new_rows + block_size]
            drafter.propose(
                ids[0, -1:], states[:, context_length:], cycle_positions, draft_cache, context_ids=ids[:, :context_length]
            )
        sync()
        seconds = time.perf_counter() - start
        target_cache.crop(-block_size)  # transformers 5 crops by the count removed
        draft_cache.truncate(context_length)
        return seconds

    timings: dict[int, list[float]] = {size: [] for size in block_sizes}
    for round_ in range(repeats + 1):
        for size in block_sizes:
            seconds = cycle(size)
            if round_:  # round 0 warms every size up
                timings[size].append(seconds)
    return {size: statistics.median(values) for size, values in timings.items()}


def choose_block_size(
    target: PreTrainedModel, drafter: DCOCODrafter, block_sizes: list[int] | None = None, repeats: int = 5
) -> BlockSizeChoice:
    """The block size of largest measured tau / timed cycle among `block_sizes` (default: every size in the
    drafter's `block_tau`). Apply it with `set_block_size(drafter, choice.block_size)`."""
    measured = candidate_block_sizes(drafter)
    sizes = sorted(set(block_sizes)) if block_sizes else measured
    missing = sorted(set(sizes) - set(measured))
    if missing:
        raise ValueError(f"block sizes {missing} have no measured tau in the drafter's block_tau (it has {measured})")
    tau = {size: drafter.decoding.block_tau[str(size)] for size in sizes}
    seconds = time_cycles(target, drafter, sizes, repeats=repeats)
    best = max(sizes, key=lambda size: tau[size] / seconds[size])
    return BlockSizeChoice(best, tau, seconds)
