"""The batched loop's target cache: its masks (holes, sliding windows, draft trees), its compaction, and the static
kind, every layer's keys/values in buffers allocated once per call.

A `DynamicCache` layer concatenates each forward's new columns onto its whole cache (a fresh allocation and a copy
of every cached key and value, per layer, per cycle). A `StaticTargetLayer` allocates [B, heads, capacity, D] at its
first write and from then on writes each forward's columns in place after the written ones. What the ragged loop
(`generation.py`) does to its cache maps onto the buffers without reallocating:

* crop (drop the block columns no row accepted): move the write position back; the next forward overwrites them;
* finished rows leaving (`batch_select_indices`): the kept rows are copied to the front rows of the buffers;
* compaction (every row's visible columns packed right): the packed columns are copied to the front columns.

Forwards read views of the live part (active rows, written columns), so attention sees exactly the keys and values
a dynamic cache holds, in the same order: the target computes the same function on either kind.

Ragged acceptance leaves masked columns ("holes") where a row's rejected drafts were; once masked columns exceed
`COMPACT_WASTE` of the cache, `compact` packs every row's visible columns (the drafter's context cache too). A
verified draft tree is reordered in place first (`reorder_block`), so the rest treats it as a verified chain.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import create_causal_mask

from .cpu_attention import CPU_GQA_ATTENTION
from .hf_compat import attention_implementation, cache_kwargs

# Compact both caches once masked columns (left padding + holes) exceed this fraction of them: a gather of the whole
# cache, paid rarely, against attention over the wasted columns in every later forward.
COMPACT_WASTE = 0.5

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


class TargetMasks:
    """What each target forward gets as `attention_mask`, and the cache it fills.

    Full-attention layers read the 2D key mask as is: holes and left padding are masked keys. Sliding-window layers
    cannot: transformers measures their window in cache columns, and holes and padding put columns farther apart
    than tokens, so their queries would lose keys plain decoding attends to. With sliding layers, every layer caches
    every column (plain croppable layers; a sliding cache layer drops old columns, which rolling back rejected drafts
    needs), and each forward gets 4D masks built by transformers' own `create_causal_mask` (so in the format of the
    attention implementation) with the window counted in committed tokens: a key is visible to a query when it is
    one of the `window` last tokens up to and including the query's, exactly the keys plain decoding attends to.

    A draft tree's forward (`trees.py`) gets a 4D mask too, each node seeing only its ancestors among the block's
    columns: without sliding layers built here at once (the key mask, with the tree's ancestry over the block's
    columns: boolean for SDPA, additive for eager, as transformers' builder makes them, which takes a prepared 4D mask
    as it is), else through `create_causal_mask` with the window counted at the nodes' depths as well; transformers'
    per-element mask function costs milliseconds a cycle on a CPU, the direct build a few small tensor ops.

    The cache is dynamic or static (`StaticTargetLayer`: buffers allocated once for the call, every layer full, like
    the dynamic one with sliding layers); both hold the same columns, so the masks are the same for both.
    """

    def __init__(self, target: PreTrainedModel, longest: int, block: int, static: bool) -> None:
        """longest: the call's longest sequence (prompt + budget + one block); block: the widest verify forward."""
        self.block = block
        self.capacity = static_capacity(longest, block) if static else None
        self.config = target.config
        self.dtype = target.dtype
        text = self.config.get_text_config(decoder=True)
        windows = layer_windows(text)
        self.sliding = any(window is not None for window in windows.values())
        # A window at least as long as the longest sequence of this call (prompt + budget + a block) hides no key:
        # such layers get the plain causal mask, which needs no per-element mask function.
        self.windows = {kind: None if window is None or window >= longest else window
                        for kind, window in windows.items()}
        self.by_type = getattr(text, "layer_types", None) is not None  # the model reads {layer type: mask}
        self.additive = attention_implementation(target) == "eager"  # eager adds its mask; SDPA takes booleans too
        self.direct = not self.sliding and attention_implementation(target) in ("eager", "sdpa", CPU_GQA_ATTENTION)

    def _tree_mask(self, mask: torch.Tensor, visible: torch.BoolTensor, start: int) -> torch.Tensor:
        """The 4D mask of a tree's forward without sliding layers: key mask [b, K + n], block visibility [b, n, n]
        -> [b, 1, n, K + n], boolean (True: attend) or additive (0 / the dtype's minimum) for eager attention."""
        seen = mask.bool()[:, None, None, :].repeat(1, 1, visible.shape[1], 1)  # [b, 1, n, K + n]
        seen[..., start:] &= visible[:, None]
        if not self.additive:
            return seen
        additive = torch.zeros(seen.shape, dtype=self.dtype, device=seen.device)
        return additive.masked_fill_(~seen, torch.finfo(self.dtype).min)

    def new_cache(self) -> Cache:
        if self.capacity is not None:
            return static_target_cache(self.capacity)
        return DynamicCache() if self.sliding else DynamicCache(config=self.config)

    def has_room(self, columns: int) -> bool:
        """Whether a cache of `columns` columns takes the next verify forward as it is (a static cache packs its
        holes out first when it would not; a dynamic one grows)."""
        return self.capacity is None or columns + self.block <= self.capacity

    def __call__(
        self, mask: torch.Tensor, cache: Cache, tree: tuple[torch.BoolTensor, torch.LongTensor] | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """mask: [b, K + n] key mask of the cache plus the n new tokens -> the forward's `attention_mask`. tree: a
        draft tree's (which block columns each block column sees [b, n, n], the block's positions [b, n])."""
        if not self.sliding and tree is None:
            return mask
        start = cache.get_seq_length()
        if self.direct:
            return self._tree_mask(mask, tree[0], start)
        positions = mask.cumsum(1) - 1  # [b, K + n] each visible column's index in its unpadded sequence
        if tree is not None:  # siblings share a position: the block's are its nodes' depths after the anchor's
            positions = torch.cat([positions[:, :start], tree[1]], dim=1)
        # Shape, dtype and device of the queries are all create_causal_mask reads from the embeddings.
        queries = torch.empty(mask.shape[0], mask.shape[1] - start, 0, dtype=self.dtype, device=mask.device)
        built = {
            window: create_causal_mask(
                config=self.config, inputs_embeds=queries, attention_mask=mask, **cache_kwargs(cache),
                and_mask_function=_block_function(window, positions, tree, start),
                allow_is_causal_skip=False,  # a None mask would let the model build its column-counted one
            )
            for window in set(self.windows.values())
        }
        if self.by_type:
            return {kind: built[window] for kind, window in self.windows.items()}
        return next(iter(built.values()))  # without layer_types every layer is of the one type


# `cache_implementation` values that name a static cache: transformers' own, and the older names it still maps to it.
_STATIC_NAMES = ("static", "sliding_window", "hybrid", "hybrid_chunked")


def static_cache_wanted(config: GenerationConfig, device: torch.device) -> bool:
    """Whether the call's target cache is static (`StaticTargetLayer`), from `cache_implementation`: "static" or
    "dynamic"; unset, static on CUDA, where it saves re-concatenating every layer's cache each cycle, and dynamic
    elsewhere. Raises for the other kinds."""
    kind = config.cache_implementation
    if kind is None:
        return device.type == "cuda"
    if kind in _STATIC_NAMES or kind == "dynamic":
        return kind != "dynamic"
    raise ValueError(
        f"cache_implementation={kind!r} is not supported by speculative_generate: it keeps the target's keys and "
        "values on the device in full precision, with holes it masks and packs itself. Pass "
        'cache_implementation="static" or "dynamic", or leave it unset (static on CUDA, dynamic elsewhere).'
    )


def _block_function(
    window: int | None, positions: torch.Tensor, tree: tuple[torch.BoolTensor, torch.LongTensor] | None, start: int
):
    """The mask function (transformers' index convention: q and kv are cache columns) ANDed to the causal and
    padding mask: keys less than `window` tokens before the query (positions [b, K + n] per column), and within a
    tree's block (columns from `start` on) the query's ancestors only; None when neither applies."""
    visible = tree[0] if tree is not None else None

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        keep = torch.ones_like(kv_idx, dtype=torch.bool) if window is None else (
            positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window)
        if visible is not None:
            inside = kv_idx >= start
            keep = keep & (~inside | visible[batch_idx, q_idx - start, (kv_idx - start).clamp(min=0)])
        return keep

    return None if window is None and tree is None else inner


def layer_windows(text_config) -> dict[str, int | None]:
    """{attention layer type: its sliding window, None for full attention}; configs without `layer_types` (Mistral)
    slide in every layer when they set `sliding_window`. Raises for layers the loop cannot mask exactly."""
    window = getattr(text_config, "sliding_window", None)
    chunked = getattr(text_config, "attention_chunk_size", None) is not None
    default = "sliding_attention" if window is not None else "chunked_attention" if chunked else "full_attention"
    kinds = set(getattr(text_config, "layer_types", None) or [default])
    unsupported = sorted(kinds - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(
            f"speculative_generate supports full and sliding-window attention layers, not {unsupported}: chunked or "
            "recurrent layers cannot keep the masked holes of a ragged batch. Use target.generate(assistant_model="
            "drafter) one prompt at a time, or plain generate()."
        )
    if "sliding_attention" in kinds and window is None:
        raise ValueError("The target config has sliding_attention layers but no sliding_window; set its window.")
    return {kind: window if kind == "sliding_attention" else None for kind in kinds}


def compact(
    cache: Cache, mask: torch.Tensor, width: int, dcache: Any, dmask: torch.Tensor, dwidth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack every row's visible key/value columns to the right end, in order, in both caches: (mask, dmask).

    width / dwidth: the most visible columns of a row in mask / dmask (known on the host, so packing needs no sync).
    Exact: keys carry their RoPE rotation already and attention does not care where a key sits, only whether it is
    masked; new tokens keep their explicit positions. A static cache's layers copy the packed columns into the front
    of their buffers when assigned (`StaticTargetLayer`).
    """
    index, mask = _pack_index(mask, width)
    for layer in cache.layers:
        layer.keys, layer.values = _take_columns(layer.keys, index), _take_columns(layer.values, index)
    index, dmask = _pack_index(dmask, dwidth)
    # Both read before either is assigned: a static context cache's length follows what was assigned.
    keys, values = [_take_columns(k, index) for k in dcache.keys], [_take_columns(v, index) for v in dcache.values]
    dcache.keys, dcache.values = keys, values
    return mask, dmask


def reorder_block(cache: Cache, order: torch.LongTensor) -> None:
    """Reorder the last forward's columns of every layer in place: block column j of row i takes its column
    order[i, j] (order [b, n], the block's width; `trees.path_order` puts a verified tree's accepted path first, so
    the cache then holds it where a chain's accepted prefix would be). Keys carry their rotation already."""
    width = order.shape[1]
    for layer in cache.layers:
        for states in (layer.keys, layer.values):
            block = states[:, :, -width:]  # a view: written in place, in a dynamic layer and a static one alike
            block.copy_(_take_columns(block, order))


def _pack_index(mask: torch.Tensor, width: int) -> tuple[torch.LongTensor, torch.Tensor]:
    """Key mask [b, K] -> (source column of each packed column [b, W], packed mask [b, W]), W = `width`, the most
    visible keys of a row."""
    index = torch.argsort(mask, dim=1, stable=True)[:, mask.shape[1] - width :]  # masked first, then visible, in order
    return index, mask.gather(1, index)


def _take_columns(states: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """states [b, heads, K, D], index [b, W] -> [b, heads, W, D]."""
    return states.gather(2, index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))


__all__ = ["COMPACT_WASTE", "STATIC_HEADROOM", "StaticTargetLayer", "TargetMasks", "compact", "layer_windows",
           "reorder_block", "static_cache_wanted", "static_capacity", "static_target_cache"]
