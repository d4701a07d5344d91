"""The cost of one speculation cycle's parts on one device: `CycleCosts` (a leaf module).

A cycle is a draft of a block of B (anchor + B - 1 slots) and a target forward verifying n columns per row. On a GPU
the verify of 8 columns costs about what one of 2 does; on a CPU each column costs, by an amount that depends on the
CPU's GEMM tiles (DScout: the block is a per-machine choice, from tau and these costs). `block_choice
.measure_cycle_costs` times the parts when a drafter is attached; this module holds the fit and its cache format.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The longest block whose cycle costs are timed and cached, and the most verify columns they hold: `tune` refuses
# larger blocks rather than timing them for minutes.
MAX_TIMED_BLOCK = 64
MAX_TIMED_ROWS = 2 * MAX_TIMED_BLOCK


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [mean for mean, weight in blocks for _ in range(int(weight))]


def cheapest_cover(seconds: Sequence[float]) -> list[float]:
    """Verify seconds per width (`seconds[n - 1]`: n columns) as the plan should price them: n >= 2 columns cost the
    cheapest forward of at least n; a plain step (`seconds[0]`) costs what it was timed at.

    A wider forward can cost less than a narrower one: CPU GEMM kernels work in SIMD-wide tiles, and on an AVX-512
    machine 16 columns of SmolLM2-135M took 1.46x a plain step where 12 took 1.65x and 17 1.9x
    (`scripts/verify_cost.py`). Pricing 12 columns at 16's cost is then right for the plan: at that price it
    proposes the wider option (more tokens for the same forward), which does cost that. Pooling the dip into its
    neighbours instead (a least-squares monotone fit) priced every width from 10 to 16 at about 12's cost, and
    the 16-column tree out.

    A verify forward may also cost less than a plain step: a plain step keeps plain decoding's own 1-row
    `F.linear`, the few-rows layouts compute 2 and more rows (`cpu_linear`), and on a 2-core AMD EPYC 2 columns of
    SmolLM2-135M took 0.62x a plain step, 3-4 columns 0.79x and 5 columns 0.92x (docs/results/schedule_*.json).
    Flooring verify widths at a plain step priced 2-5 columns alike, which hid the step from 4 to 5 columns (whole
    blocks of 5 ran 6-14% slower than blocks of 4 there) and made plain steps look no dearer than a one-token draft."""
    covers, cheapest = [], math.inf
    for wider in reversed(seconds[1:]):
        cheapest = min(cheapest, wider)
        covers.append(cheapest)
    return [seconds[0], *reversed(covers)]


@dataclass
class CycleCosts:
    """Seconds of the parts of one speculation cycle on one device, for one target and drafter, at one batch size.

    verify[n - 1]: a target forward of n columns for each of `batch` rows on a cached context (n = 1 is a plain
    decoding step of the batch); draft[B]: drafting and correcting a block of B for each row; verify widths of 2 and
    more and the drafts non-decreasing (`cheapest_cover` of the verify medians, a monotone fit of the draft medians;
    widths timed sparsely are interpolated). spread: the timings' median relative interquartile range (how noisy the
    machine was while timing).
    """

    verify: list[float]
    draft: dict[int, float]
    spread: float = 0.0
    batch: int = 1

    @classmethod
    def fit(
        cls, verify: Mapping[int, Sequence[float]], draft: Mapping[int, Sequence[float]], batch: int = 1
    ) -> CycleCosts:
        """From repeated timings per size ({columns: [seconds]}, {block: [seconds]}): medians; verify widths between
        two timed ones are interpolated linearly (1 and the widest must be timed), then each priced as the cheapest
        forward covering it (`cheapest_cover`); draft medians made monotone."""
        widths = sorted(verify)
        if not widths or widths[0] != 1:
            raise ValueError(f"verify timings must start at 1 column (a plain step), got {widths}")
        blocks = sorted(draft)
        spreads = [_relative_iqr(samples) for samples in [*verify.values(), *draft.values()]]
        medians = [statistics.median(verify[n]) for n in widths]
        return cls(
            verify=cheapest_cover([_interpolate(widths, medians, n) for n in range(1, widths[-1] + 1)]),
            draft=dict(zip(blocks, isotonic([statistics.median(draft[b]) for b in blocks]))),
            spread=statistics.median(spreads) if spreads else 0.0,
            batch=batch,
        )

    @property
    def plain(self) -> float:
        return self.verify[0]

    @property
    def max_rows(self) -> int:
        """The widest verify forward timed (columns per row)."""
        return len(self.verify)

    def verify_seconds(self, columns: int) -> float:
        """A verify forward of `columns` per row: timed, or beyond the widest timed the last step's slope
        continued (a tree wider than any block)."""
        if columns <= self.max_rows:
            return self.verify[columns - 1]
        slope = self.verify[-1] - self.verify[-2] if self.max_rows > 1 else self.verify[-1]
        return self.verify[-1] + slope * (columns - self.max_rows)

    def cycle(self, k: int, block: int) -> float:
        """Seconds of a cycle proposing k tokens of a drafted block of `block` (k = 0: a plain step, no draft)."""
        if k == 0:
            return self.plain
        return self.draft_seconds(block) + self.verify_seconds(k + 1)

    def draft_seconds(self, block: int) -> float:
        timed = [b for b in self.draft if b >= block] or [max(self.draft)]
        return self.draft[min(timed)]

    def between(self, other: CycleCosts, batch: int) -> CycleCosts:
        """The costs at a batch size between this one's and `other`'s, each part interpolated linearly in the
        batch size (a forward's work grows with its rows; rows finishing shrink a call's batch)."""
        low, high = (self, other) if self.batch <= other.batch else (other, self)
        share = 0.0 if high.batch == low.batch else (batch - low.batch) / (high.batch - low.batch)
        width = min(low.max_rows, high.max_rows)
        blocks = sorted(set(low.draft) & set(high.draft))
        return CycleCosts(
            verify=[a + share * (b - a) for a, b in zip(low.verify[:width], high.verify[:width])],
            draft={block: low.draft[block] + share * (high.draft[block] - low.draft[block]) for block in blocks},
            spread=max(low.spread, high.spread),
            batch=batch,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"verify": self.verify, "draft": {str(b): s for b, s in self.draft.items()}, "spread": self.spread,
                "batch": self.batch}

    @classmethod
    def from_dict(cls, data: Any) -> CycleCosts:
        """Read what `to_dict` wrote; a ValueError for anything else (a cache file of another shape)."""
        if not isinstance(data, Mapping):
            raise ValueError("cycle costs must be a mapping")
        verify, draft, spread = data.get("verify"), data.get("draft"), data.get("spread", 0.0)
        batch = data.get("batch", 1)
        if not isinstance(verify, list) or not verify or not isinstance(draft, Mapping) or not draft:
            raise ValueError("cycle costs need a non-empty 'verify' list and 'draft' mapping")
        if not all(str(b).isdigit() for b in draft):
            raise ValueError("cycle costs need block sizes as 'draft' keys")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 4096:
            raise ValueError(f"a batch size of {batch!r}")
        verify = [_positive_seconds(v) for v in verify]
        draft = {int(b): _positive_seconds(s) for b, s in draft.items()}
        spread = _spread(spread)
        if (verify[1:] != isotonic(verify[1:]) or not all(2 <= b <= MAX_TIMED_BLOCK for b in draft)
                or len(verify) > MAX_TIMED_ROWS):
            raise ValueError(
                f"cycle costs out of range (verify widths of 2 and more must be non-decreasing, blocks in [2, "
                f"{MAX_TIMED_BLOCK}])"
            )
        return cls(verify, draft, spread, batch)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """ys at x, linear between the neighbouring xs (ascending, x within their range)."""
    right = next(i for i, known in enumerate(xs) if known >= x)
    if xs[right] == x or right == 0:
        return ys[right]
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _spread(value: Any) -> float:
    spread = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(spread) and spread >= 0.0):
        raise ValueError(f"a spread of {value!r}")
    return spread


def _positive_seconds(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"a cost of {value!r} seconds")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0.0 < seconds < 3600.0):
        raise ValueError(f"a cost of {value!r} seconds")
    return seconds


def _relative_iqr(samples: Sequence[float]) -> float:
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / max(statistics.median(samples), 1e-12)



def best_block(tau: Mapping[int, float], seconds: Mapping[int, float]) -> int:
    """DScout's block: of the blocks with a tau, the one of most tokens per second, tau(B) / T(B); the smaller on a
    tie."""
    return max(sorted(tau), key=lambda block: tau[block] / seconds[block])


__all__ = ["CycleCosts", "best_block", "MAX_TIMED_BLOCK", "MAX_TIMED_ROWS", "cheapest_cover", "isotonic"]
