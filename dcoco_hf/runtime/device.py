"""Device helpers shared by drafting, the target tap, the block-size timing and the benchmarks (a leaf module)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def device_sync(device: torch.device, timed: bool = True) -> Callable[[], None]:
    """A function that waits for `device`'s queued work when `timed`: `torch.cuda.synchronize` on a GPU, a no-op on
    CPU (whose clock already sees finished work) and whenever timing was not asked for.

    Only timing needs it: each sync stalls a GPU's pipeline, so the hot path syncs only when asked to time."""
    if timed and device.type == "cuda":
        return torch.cuda.synchronize
    return _no_sync


def _no_sync() -> None:
    return None
