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

    def truncate(self, length: int) -> None:
        self.keys = [k[..., :length, :] for k in self.keys]
        self.values = [v[..., :length, :] for v in self.values]

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows `rows` (batched generation drops finished sequences)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
