"""The drafter's context cache: keys/values of the committed target positions, per drafter layer (a leaf module).

DFlash's drafter attends to the fused target states of every committed position; they are projected once, when the
position is committed, and kept here, while each drafted block's own keys/values are dropped after its draft.
"""

from __future__ import annotations

from typing import Any

import torch


class DraftContextCache:
    """Keys/values of the drafter's context rows (committed target positions), per layer.

    Duck-types the one `Cache.update` call the attention makes, so the same layers also run inside transformers'
    own DFlash generator with its `DFlashCache`. Rows are only ever appended for committed positions; the block's
    keys/values are dropped again with `truncate` after each draft.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any) -> tuple[torch.Tensor, ...]:
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if self.keys else 0

    def has_room(self, columns: int) -> bool:
        """Always: it grows with every write."""
        return True

    def truncate(self, length: int) -> None:
        self.keys = [k[..., :length, :] for k in self.keys]
        self.values = [v[..., :length, :] for v in self.values]

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows `rows` (batched generation drops finished sequences)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


class StaticDraftContextCache:
    """The drafter's context keys/values in buffers [B, kv_heads, capacity, D] per layer, for captured drafting
    (`DCOCODrafter.compile_drafting`): every draft of a block shape then reads tensors of one shape at one address.

    A draft writes its new context rows and its block at the positions `place` chose (`update`, an `index_copy_`, so
    the write offset is a tensor and not part of the graph) and attends over the whole buffer, unwritten columns
    masked (`place` builds that mask). `truncate` keeps the committed rows, as with `DraftContextCache`; what the
    block wrote beyond them is overwritten by the next draft. The buffers are allocated at the first `place` and
    reallocated, twice as long, when a draft would not fit (a new address: one more graph per block shape).

    `keys` / `values` are the live part [B, kv_heads, length, D], as `DraftContextCache` holds them; assigning them
    (the batched loop's compaction) copies into the front of the buffers.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, block_size: int
    ) -> None:
        self.shape = (num_kv_heads, head_dim)
        self.num_layers, self.capacity, self.dtype, self.block_size = num_layers, capacity, dtype, block_size
        self.length = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.write_at: torch.LongTensor | None = None  # [N + Q] buffer columns of the next forward's rows

    # -------------------------------------------------------------------------------------- the forward's side

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any) -> tuple[torch.Tensor, ...]:
        """Write key/value [B, kv_heads, N + Q, D] at `write_at`; return the whole buffers
        [B, kv_heads, capacity, D]."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys.index_copy_(2, self.write_at, key.to(keys.dtype))
        values.index_copy_(2, self.write_at, value.to(values.dtype))
        return keys, values

    # -------------------------------------------------------------------------------------- the host's side

    def place(
        self, batch: int, new_rows: int, padded_rows: int, block: int, visible: torch.BoolTensor, device: torch.device
    ) -> torch.Tensor:
        """Lay out the next forward: `new_rows` context rows, then `padded_rows - new_rows` padding rows, then the
        `block`, written from column `length` on. visible [B, Q, length + new_rows + block] which of the unpadded
        keys each block row sees (the engines' mask) -> the additive mask [B, 1, Q, capacity] over the buffers."""
        needed = self.length + padded_rows + block
        if not self._keys or needed > self.capacity or self._keys[0].shape[0] != batch:
            grown = self.capacity if needed <= self.capacity else max(needed, 2 * self.capacity)
            self._allocate(batch, grown, device)
        self.write_at = torch.arange(self.length, needed, device=device)  # [padded_rows + block]
        seen = torch.zeros(batch, block, self.capacity, dtype=torch.bool, device=device)  # [B, Q, capacity]
        context_end, block_start = self.length + new_rows, self.length + padded_rows
        seen[..., :context_end] = visible[..., :context_end]
        seen[..., block_start:needed] = visible[..., context_end:]
        additive = torch.zeros(seen.shape, dtype=self.dtype, device=device).masked_fill_(
            ~seen, torch.finfo(self.dtype).min
        )
        return additive[:, None]  # [B, 1, Q, capacity]

    def _allocate(self, batch: int, capacity: int, device: torch.device) -> None:
        """Fresh buffers of `capacity` columns holding the live part (a batch change keeps none: `select_rows`
        copies the kept rows first)."""
        live_k, live_v = (self.keys, self.values) if self._keys and self._keys[0].shape[0] == batch else ([], [])
        shape = (batch, *self.shape[:1], capacity, self.shape[1])
        self._keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        self._values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        for buffer in self._keys + self._values:
            # CUDA graphs may write inputs in place only at addresses they were recorded with.
            torch._dynamo.mark_static_address(buffer)
        self.capacity = capacity
        if live_k:
            self.keys, self.values = live_k, live_v

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[:, :, : self.length] for k in self._keys]

    @keys.setter
    def keys(self, live: list[torch.Tensor]) -> None:
        self._store(self._keys, live)

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self.length] for v in self._values]

    @values.setter
    def values(self, live: list[torch.Tensor]) -> None:
        self._store(self._values, live)

    def _store(self, buffers: list[torch.Tensor], live: list[torch.Tensor]) -> None:
        """Copy live [B, heads, L, D] per layer into the front columns (assign keys and values together)."""
        for buffer, part in zip(buffers, live):
            part = part.clone()  # it may be a view of the buffer itself
            buffer[:, :, : part.shape[2]].copy_(part)
        self.length = live[0].shape[2] if live else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def has_room(self, columns: int) -> bool:
        """Whether a cache of `columns` columns takes the next draft without reallocating: a captured draft writes
        `block_size` context rows and a block of at most `block_size` (the batched loop packs holes out first)."""
        return columns + 2 * self.block_size <= self.capacity

    def truncate(self, length: int) -> None:
        self.length = length

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows `rows` (new buffers of the smaller batch: the graphs are per batch size anyway)."""
        if not self._keys:
            return
        live_k, live_v = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        self._keys = []
        self._allocate(len(rows), self.capacity, live_k[0].device)
        self.keys, self.values = live_k, live_v
