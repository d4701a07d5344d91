"""Device helpers shared by drafting, the target tap, the block-size timing and the benchmarks (a leaf module)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for `device`'s queued work: `torch.cuda.synchronize` on a GPU, a no-op on CPU.

    Only timing needs it: each sync stalls a GPU's pipeline, so callers sync only when they were asked to time."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
