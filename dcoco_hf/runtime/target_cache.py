"""The batched loop's static target cache: every layer's keys/values in buffers allocated once per call.

A `DynamicCache` layer concatenates each forward's new columns onto its whole cache (a fresh allocation and a copy
of every cached key and value, per layer, per cycle). A `StaticTargetLayer` allocates [B, heads, capacity, D] at its
first write and from then on writes each forward's columns in place after the written ones. What the ragged loop
(`generation.py`) does to its cache maps onto the buffers without reallocating:

* crop (drop the block columns no row accepted): move the write position back; the next forward overwrites them;
* finished rows leaving (`batch_select_indices`): the kept rows are copied to the front rows of the buffers;
* compaction (every row's visible columns packed right): the packed columns are copied to the front columns.

Forwards read views of the live part (active rows, written columns), so attention sees exactly the keys and values
a dynamic cache holds, in the same order: the target computes the same function on either kind.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# Room for holes beyond the call's longest sequence, as a fraction of it: with more columns than that the loop packs
# the holes out before the next forward (`generation._TargetMasks.has_room`), so a call never outgrows its buffers.
STATIC_HEADROOM = 0.25


class StaticTargetLayer(CacheLayerMixin):
    """One target layer's keys and values in buffers [B, heads, capacity, D] allocated at the first write.

    `keys` / `values` are views of the live part, [rows, heads, length, D]. Assigning them (a row selection, a
    compaction) copies the new contents into the front of the buffers, so every cache operation of the loop stays in
    the same memory; `update` writes the new columns at [length, length + n).
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows = self.length = 0
        self._buffers: dict[str, torch.Tensor] = {}
        super().__init__()  # assigns keys/values None: nothing is allocated before the first write

    @property
    def keys(self) -> torch.Tensor | None:
        return self._live("keys")

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._store("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        return self._live("values")

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._store("values", value)

    def _live(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers.get(name)
        return None if buffer is None else buffer[: self.rows, :, : self.length]

    def _store(self, name: str, value: torch.Tensor | None) -> None:
        """Copy `value` [rows, heads, length, D] into the front of the buffer; it becomes the live part."""
        if value is None or name not in self._buffers:  # CacheLayerMixin's initial None, or a reset
            return
        rows, _, length, _ = value.shape
        self._check_room(length)
        self._buffers[name][:rows, :, :length].copy_(value)
        self.rows, self.length = rows, length

    def _check_room(self, length: int) -> None:
        if length > self.capacity:
            raise RuntimeError(
                f"The static target cache holds {self.capacity} columns; this write needs {length}. The batched loop "
                "packs its cache before it runs out; use cache_implementation='dynamic' if this happens."
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate both buffers for the first write's rows, heads, head size, dtype and device."""
        self.device = key_states.device
        for name, states in (("keys", key_states), ("values", value_states)):
            batch, heads, _, size = states.shape
            self._buffers[name] = states.new_zeros(batch, heads, self.capacity, size)  # [B, heads, capacity, D]
        self.rows, self.length = key_states.shape[0], 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns [rows, heads, n, D] after the written ones; return the live keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._check_room(end)
        self._buffers["keys"][: self.rows, :, start:end].copy_(key_states)
        self._buffers["values"][: self.rows, :, start:end].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(key length, key offset) of the next forward's mask: the written columns plus the new ones, as a dynamic
        layer's, so transformers builds the same masks for both kinds."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` columns (a negative count, as transformers 5.x crops): the next write
        overwrites them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of columns to remove.")
        self.length -= -tokens_to_remove

    def reset(self) -> None:
        self.length = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows `indices` [b], in that order, as the front rows of the buffers."""
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]  # gathered before either is written


def static_target_cache(capacity: int) -> Cache:
    """An empty cache of `StaticTargetLayer`s of `capacity` columns, one per layer that writes to it (added at its
    first write, as `DynamicCache` adds its layers), so models whose layers share or skip caches need no layer map."""
    return Cache(layer_class_to_replicate=functools.partial(StaticTargetLayer, capacity))


def static_capacity(longest: int, block: int) -> int:
    """Columns of a call's static buffers: its longest sequence (prompt + budget + one block), one more block, and
    `STATIC_HEADROOM` of it for holes. After packing, a cache holds at most `longest` columns (a finished row's
    anchor can sit a block past its budget), so the next verify forward of at most `block` columns always fits."""
    return longest + block + int(STATIC_HEADROOM * longest)


__all__ = ["STATIC_HEADROOM", "StaticTargetLayer", "static_capacity", "static_target_cache"]
