"""The phases of a `dcoco-hf train` run and their share of a `--hours` budget: what the command line needs to
describe a run before it loads the training machinery (`pipeline.py`, which imports `transformers.Trainer`)."""

from __future__ import annotations

PHASES = ("prompts", "answers", "features", "stage1", "stage2", "final")
# --hours: the share of the wall-clock budget each long phase may use, from when it (re)starts (features a shard at
# a time: what is left is cached when stage 1 starts).
TIME_SHARES = {"answers": 0.45, "features": 0.1, "stage1": 0.3, "stage2": 0.15}
# The slot loss's weightings (`losses.awl_slot_weights`): DFlash's exp(-(k-1)/gamma) decay, DScout's AWL.
SLOT_WEIGHTINGS = ("decay", "awl")

__all__ = ["PHASES", "SLOT_WEIGHTINGS", "TIME_SHARES"]
