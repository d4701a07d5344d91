"""Batched lossless speculative decoding: `speculative_generate(target, input_ids, drafter=drafter, ...)`.

transformers' assisted generation runs one sequence at a time; this loop serves a left-padded batch. Every cycle each
active row feeds [anchor, S drafts] to the target; each row accepts its own number of drafts; finished rows leave the
active batch (their target cache, drafter cache and mask rows are index-selected away), so they cost nothing more.

Ragged acceptance in one rectangular KV cache ("holes"): every cycle appends 1 + S columns to all rows, then crops
the columns that NO row accepted (the tail beyond the longest accepted prefix). A row that accepted fewer keeps
masked-out columns ("holes") where its rejected drafts were. Exactness holds because each query attends to exactly the
keys of its row's committed tokens (the 2D key mask zeroes holes and left padding; softmax gives them weight exactly
0), with the same RoPE positions as plain decoding (explicit position_ids = index in the unpadded sequence), so the
target computes the same function as in plain `generate()`, up to float summation order. Why holes rather than
compacting every cycle: compaction reads and writes the whole cache, holes cost only attention over the gap between
the fastest and the slower rows. Once masked columns exceed `COMPACT_WASTE` (half) of the cache, both caches are
packed (every row's visible columns gathered to the right, in order; keys already carry their rotation, so this is
exact too), which bounds the waste. The drafter's context cache works the same way with its own key mask.
Sliding-window layers (Mistral's `sliding_window`, `layer_types` with "sliding_attention") get 4D masks whose window
counts committed tokens, not cache columns, and cache every column like full layers (`_TargetMasks`): exact at any
length, at the memory of a full-attention cache for those layers.

Verification: the target's token at every block position is chosen exactly like `generate()` chooses it (same logits
processors, those that read the sequence so far given each position's own prefix; argmax, or one multinomial sample
from the processed distribution), and a draft is accepted while it equals that token. For sampling this is the
point-mass rule of DCOCO appendix G: exactly lossless for any drafter.

Static-friendliness: the output buffer is preallocated, every forward has a fixed block width (drafts are never cut
to the remaining budget; surplus tokens are simply not committed), and acceptance is computed with tensor ops. The
target cache is static on CUDA (or with `cache_implementation="static"`; `target_cache.py`): its buffers are
allocated once per call and every write, crop, row removal and compaction stays in them; the dynamic cache
(`cache_implementation="dynamic"`, the default elsewhere) re-concatenates every layer each cycle. Both hold the same
columns, so the target computes the same function on either. What stays dynamic: the active batch size (finished
rows leave), the cache length the forward attends to (grows by the longest accepted prefix per cycle), the drafter
context width (same), and one host sync per cycle (accepted counts and finished rows, read together; logits
processors that read the sequence add one call, and a sync, per distinct prefix length). The target mask is
re-concatenated each cycle (cheap next to the forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.masking_utils import create_causal_mask
from transformers.utils import ModelOutput

from .context_cache import DraftContextCache
from .engine import SpeculationEngine
from .hf_compat import cache_kwargs, output_cache
from .stats import DCOCOStats
from .target_cache import static_capacity, static_target_cache

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter

# Compact both caches once masked columns (left padding + holes) exceed this fraction of them: a gather of the whole
# cache, paid rarely, against attention over the wasted columns in every later forward.
COMPACT_WASTE = 0.5

# Processors whose output depends only on the logits row (not on the sequence so far or its length): the same at
# every position of a verified block, whichever row length it belongs to.
_ROW_LOCAL_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, SuppressTokensLogitsProcessor, InfNanRemoveLogitsProcessor,
    LogitNormalization,
)
# Processors that read the sequence so far, each batch row on its own (some keep per-row state, e.g. the prompt's
# padding length, or pass the row index to a user function): exact when called on the whole batch with each row's
# own prefix, which `_TokenPicker` does.
_PREFIX_PROCESSORS = (
    RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor, ForcedEOSTokenLogitsProcessor, ExponentialDecayLengthPenalty,
    PrefixConstrainedLogitsProcessor,
)


@dataclass
class SpeculativeOutput(ModelOutput):
    """sequences: [B, L + T] exactly as `generate()` returns them; stats: one `DCOCOStats` per row."""

    sequences: torch.LongTensor | None = None
    stats: list[DCOCOStats] | None = None


class _BatchedRun:
    """What `drafter.generation_stats()` reads after a `target.generate(custom_generate=speculative_generate)` call:
    the per-row statistics list (the single-sequence engine has `close(sequences)` + `stats` too)."""

    def __init__(self, stats: list[DCOCOStats], sequences: torch.LongTensor) -> None:
        self.stats, self._shape = stats, tuple(sequences.shape)

    def close(self, sequences: torch.LongTensor) -> None:
        if tuple(sequences.shape) != self._shape:
            raise RuntimeError(
                f"These sequences {tuple(sequences.shape)} did not come from the last generate() call that consulted "
                f"this drafter (a batched call of shape {self._shape}; a call with fewer than 2 new tokens never "
                "drafts). Statistics exist only for calls that used the drafter."
            )


# ----------------------------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------------------------


def speculative_generate(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    *,
    drafter: "DCOCODrafter | None" = None,
    correct: bool = True,
    selection: str | None = None,
    **kwargs: Any,
) -> SpeculativeOutput | torch.LongTensor | GenerateDecoderOnlyOutput:
    """Lossless batched speculative decoding with a DCOCO (or, with `correct=False`, plain DFlash) drafter.

    Two ways in, one loop:

    * `speculative_generate(target, input_ids, attention_mask=mask, drafter=drafter, max_new_tokens=64,
      do_sample=False, temperature=1.0, top_k=None, top_p=None, eos_token_id=None, ...)` returns a
      `SpeculativeOutput(sequences, stats)` with one `DCOCOStats` per row. Any `generate()` keyword works.
    * `target.generate(**inputs, custom_generate=speculative_generate, drafter=drafter, ...)` returns what
      `generate()` returns (a tensor, or `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True`);
      `drafter.generation_stats()` then gives the per-row `DCOCOStats` list.

    Both go through `generate()`'s own preparation (generation config, pad/EOS tokens, max length, logits processors
    in generate()'s order), so results match plain `target.generate()` on the same batch: token for token under
    greedy decoding, in distribution under sampling. The signature follows how transformers 5.x calls a callable
    `custom_generate`: `(model, input_ids, logits_processor=, stopping_criteria=, generation_config=, <its own
    keywords>, **model_kwargs)`; hence the drafter is a keyword and generation settings travel in `**kwargs`.
    `cache_implementation="static"` or `"dynamic"` (a keyword or in the generation config) picks the target's cache;
    unset, it is static on CUDA and dynamic elsewhere; both give the same outputs.

    Args:
        target: the causal LM the drafter is attached to.
        input_ids: [B, L] left-padded prompts (pass `attention_mask` for padding).
        drafter: an attached `DCOCODrafter` (`drafter.attach(target)`).
        correct: False skips the corrector: plain DFlash argmax blocks with the same weights.
        selection: the corrector's walk ("prefix_first" | "viterbi" | "geometric"); default the drafter's
            (`drafter.generation_config.selection`).
    """
    prepared = generation_config is not None and logits_processor is not None and stopping_criteria is not None
    if not prepared:  # a direct call: let generate() prepare everything, then come back here with it prepared
        if isinstance(input_ids, torch.nn.Module) or drafter is None:
            raise TypeError(
                "speculative_generate(target, input_ids, drafter=drafter, ...): pass the drafter by keyword "
                "(this is the order transformers uses for a callable custom_generate)."
            )
        if generation_config is not None:
            kwargs["generation_config"] = generation_config
        sequences = target.generate(
            input_ids, custom_generate=speculative_generate, drafter=drafter, correct=correct, selection=selection,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria, **kwargs,
        )
        sequences = sequences.sequences if isinstance(sequences, ModelOutput) else sequences
        return SpeculativeOutput(sequences=sequences, stats=drafter.generation_stats(sequences))

    if drafter is None:
        raise TypeError(
            "target.generate(custom_generate=speculative_generate) needs `drafter=<attached DCOCODrafter>`."
        )
    sequences, stats = _speculative_loop(
        target, drafter, input_ids, kwargs.get("attention_mask"), logits_processor, stopping_criteria,
        generation_config, correct, selection, output_cache(kwargs),
    )
    drafter.keep_call_statistics(_BatchedRun(stats, sequences))
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def _speculative_loop(
    target, drafter, input_ids, attention_mask, logits_processor, stopping_criteria, config, correct, selection, cache
) -> tuple[torch.LongTensor, list[DCOCOStats]]:
    _check_supported(target, drafter, logits_processor, stopping_criteria, config, cache)
    _check_left_padded(attention_mask)
    tap = drafter.tap
    with drafter.one_call():  # refuses a second thread's call while this one runs
        tap.listen(timed=drafter.time_phases)  # exact GPU phase times cost a sync per phase
        try:
            return _loop(target, drafter, input_ids, attention_mask, logits_processor, config, correct, selection, tap)
        finally:
            tap.stop()  # plain use of the target afterwards records nothing


def _loop(target, drafter, input_ids, attention_mask, logits_processor, config, correct, selection, tap):
    device, (batch, prompt_len) = input_ids.device, input_ids.shape
    slots = drafter.config.block_size - 1
    max_new = config.max_length - prompt_len
    eos = config._eos_token_tensor  # None or [n_eos]
    pad = config._pad_token_tensor if config._pad_token_tensor is not None else torch.tensor(0, device=device)
    picker = _TokenPicker(logits_processor, config.do_sample)
    # The drafter's context holds the target's columns less the newest, then a captured draft's padded rows.
    context_length = static_capacity(prompt_len + max_new + slots, slots + 1) + drafter.config.block_size
    engine = SpeculationEngine(drafter, batch, correct=correct, selection=selection, context_length=context_length)
    stats = engine.stats
    cap = engine.cap  # drafts proposed per cycle

    # [B, L + T + S + 1] preallocated: every cycle writes its whole block (pad where not committed), no sync needed
    out = torch.cat([input_ids, pad.expand(batch, max_new + slots + 1)], dim=1)
    written = torch.zeros(batch, dtype=torch.long, device=device)  # [B] new tokens committed so far
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()  # [B, L] key mask
    prompt_valid = mask.bool()  # [B, L] real prompt tokens (the corrector's context bigrams skip padding)
    rows = torch.arange(batch, device=device)  # [b] original row of each active row, to index per-call tensors
    row_ids = list(range(batch))  # the same on the host: booking statistics per row needs no sync
    masks = _TargetMasks(target, prompt_len + max_new + slots, slots + 1, _static_cache(config, device))
    cache = masks.new_cache()
    dcache = engine.cache

    # Prefill: the prompts, then the first token chosen by the target itself (it becomes the first anchor).
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, L] index in the unpadded sequence
    logits, states = _target_forward(
        target, tap, input_ids, masks(mask, cache), positions, cache, stats, row_ids, keep=1
    )
    for row in row_ids:
        stats[row].prefill_seconds = stats[row].target_seconds  # the prompts' forward, every row's
    anchor = picker.at(input_ids, torch.full((batch,), prompt_len, device=device), rows)(logits)[:, 0]  # [B]
    anchor_pos = mask.sum(1)  # [B] the anchor's index in the unpadded sequence
    done, new = _commit(out, written, prompt_len, anchor[:, None], torch.ones_like(anchor), max_new, eos, pad, rows)
    host = torch.stack([new, done.long(), anchor_pos, anchor]).tolist()  # the one host sync of the prefill
    engine.prefilled(row_ids, [[token] if count else [] for count, token in zip(host[0], host[3])])
    # committed [b]: each active row's committed tokens before its anchor, on the host; they are also the visible
    # columns of the target cache's key mask and of the drafter's context (cached rows + new rows).
    finished, committed = host[1], host[2]
    ctx, ctx_mask, ctx_pos = states, mask, positions  # [B, N, nL*H], [B, N], [B, N] drafter context not yet cached
    dmask = mask[:, :0]  # [B, 0] key mask of the drafter cache
    offsets = torch.arange(slots + 1, device=device)  # [S + 1]

    while True:
        kept = _still_active(finished)
        if kept is not None:  # finished rows leave every per-row tensor and both caches
            if not kept:
                break
            row_ids, committed = [row_ids[i] for i in kept], [committed[i] for i in kept]
            keep = torch.tensor(kept, dtype=torch.long, device=device)  # a copy to the device, not a sync
            rows = rows[keep]
            cache.batch_select_indices(keep)
            dcache.select_rows(keep)
            anchor, anchor_pos, mask, dmask = anchor[keep], anchor_pos[keep], mask[keep], dmask[keep]
            ctx, ctx_mask, ctx_pos = ctx[keep], ctx_mask[keep], ctx_pos[keep]

        if engine.plain_left:  # a plain step for every row: no draft, the anchor alone
            proposal, drafts = None, anchor[:, None][:, :0]  # [b, 0]
        else:  # one drafter forward per cycle for all active rows
            drafted = engine.draft_block(row_ids, cap)  # anchor + slots
            # The host knows whether some key is masked (padding, holes): with none, the drafter's attention takes
            # its unmasked path; else it gets the full mask, which it uses without first reading it for a masked key
            # (a sync, as for a key mask).
            if min(committed) == dmask.shape[1] + ctx_mask.shape[1]:
                draft_mask = None
            else:
                draft_mask = torch.cat([dmask, ctx_mask, ctx_mask.new_ones(len(row_ids), drafted)], dim=1)
                draft_mask = draft_mask[:, None, None, :].expand(-1, 1, drafted, -1)  # [b, 1, drafted, ...]
            context_ids, context_valid = (
                _committed(out, prompt_valid, written, rows) if drafter.config.context_bigrams else (None, None)
            )
            proposal, k = engine.draft(
                anchor, anchor_pos, ctx, ctx_pos, row_ids, cap, draft_mask, context_ids=context_ids,
                context_valid=context_valid,
            )
            dmask = torch.cat([dmask, ctx_mask], dim=1)  # [b, cached + N]
            drafts = proposal.tokens[:, :k]  # [b, k]
        k = drafts.shape[1]

        # Verify: [anchor, drafts] for every row at its true positions; holes and padding are masked keys.
        block = torch.cat([anchor[:, None], drafts], dim=1)  # [b, k + 1]
        block_pos = anchor_pos[:, None] + offsets[: k + 1]  # [b, k + 1]
        mask = torch.cat([mask, torch.ones_like(block)], dim=1)  # [b, K + k + 1]
        logits, states = _target_forward(target, tap, block, masks(mask, cache), block_pos, cache, stats, row_ids)
        history = (None, None) if picker.row_local else _with_drafts(out, written, rows, prompt_len, drafts)
        chosen, accepted = _verify(picker.at(*history, rows), logits, drafts)  # [b, k + 1], [b]
        done, new = _commit(out, written, prompt_len, chosen, accepted + 1, max_new, eos, pad, rows)
        anchor_pos = anchor_pos + accepted + 1  # [b] = committed tokens before the anchor = valid cache columns
        # The cycle's one host sync: how many drafts each row accepted decides how far the caches and masks grow
        # (their shapes, hence the next forward's), and finished rows leave the batch; both are read together.
        # The target's tokens travel in the same read: the engine learns from the committed text.
        host = torch.cat([torch.stack([accepted, new, done.long(), anchor_pos], dim=1), chosen], dim=1).tolist()
        host_accepted, host_new, finished, anchor_committed = ([row[i] for row in host] for i in range(4))
        engine.verified(row_ids, k, host_accepted, [row[4 : 4 + n] for row, n in zip(host, host_new)])

        # Keep the block columns some row accepted; the rest of the tail goes; shorter rows keep masked holes.
        valid = offsets[: k + 1] <= accepted[:, None]  # [b, k + 1] anchor + accepted drafts are committed inputs
        width = max(host_accepted) + 1
        cache.crop(width - (k + 1))
        mask = torch.cat([mask[:, : -(k + 1)], valid[:, :width].long()], dim=1)  # [b, K + width]
        fresh = states[:, :width], valid[:, :width].long(), block_pos[:, :width]
        if proposal is None:  # no draft read the context since: it waits for the next one
            ctx, ctx_mask, ctx_pos = (torch.cat(pair, dim=1) for pair in zip((ctx, ctx_mask, ctx_pos), fresh))
        else:
            ctx, ctx_mask, ctx_pos = fresh
        anchor = chosen.gather(1, accepted[:, None]).squeeze(1)  # [b] the bonus token
        # Mostly holes, or a static cache without room for the next block: pack every row's keys right.
        room = masks.has_room(mask.shape[1]) and dcache.has_room(mask.shape[1])
        if 1 - sum(anchor_committed) / mask.numel() > COMPACT_WASTE or not room:
            # The drafter cache holds the context up to the old anchors (the new rows are cached next cycle).
            mask, dmask = _compact(cache, mask, max(anchor_committed), dcache, dmask, max(committed))
        committed = anchor_committed

    engine.finish()
    # The statistics count every committed token: the longest row without a sync.
    return out[:, : prompt_len + max(row.committed_tokens for row in stats)], stats


def _compact(
    cache: Cache, mask: torch.Tensor, width: int, dcache: DraftContextCache, dmask: torch.Tensor, dwidth: int
):
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
    dcache.keys, dcache.values = [_take_columns(k, index) for k in dcache.keys], [_take_columns(v, index) for v in dcache.values]
    return mask, dmask


def _pack_index(mask: torch.Tensor, width: int) -> tuple[torch.LongTensor, torch.Tensor]:
    """Key mask [b, K] -> (source column of each packed column [b, W], packed mask [b, W]), W = `width`, the most
    visible keys of a row."""
    index = torch.argsort(mask, dim=1, stable=True)[:, mask.shape[1] - width :]  # masked first, then visible, in order
    return index, mask.gather(1, index)


def _take_columns(states: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """states [b, heads, K, D], index [b, W] -> [b, heads, W, D]."""
    return states.gather(2, index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))


class _TargetMasks:
    """What each target forward gets as `attention_mask`, and the cache it fills.

    Full-attention layers read the 2D key mask as is: holes and left padding are masked keys. Sliding-window layers
    cannot: transformers measures their window in cache columns, and holes and padding put columns farther apart
    than tokens, so their queries would lose keys plain decoding attends to. With sliding layers, every layer caches
    every column (plain croppable layers; a sliding cache layer drops old columns, which rolling back rejected drafts
    needs), and each forward gets 4D masks built by transformers' own `create_causal_mask` (so in the format of the
    attention implementation) with the window counted in committed tokens: a key is visible to a query when it is
    one of the `window` last tokens up to and including the query's, exactly the keys plain decoding attends to.

    The cache is dynamic or static (`target_cache.py`: buffers allocated once for the call, every layer full, like
    the dynamic one with sliding layers); both hold the same columns, so the masks are the same for both.
    """

    def __init__(self, target: PreTrainedModel, longest: int, block: int, static: bool) -> None:
        """longest: the call's longest sequence (prompt + budget + one block); block: the widest verify forward."""
        self.block = block
        self.capacity = static_capacity(longest, block) if static else None
        self.config = target.config
        self.dtype = target.dtype
        text = self.config.get_text_config(decoder=True)
        windows = _layer_windows(text)
        self.sliding = any(window is not None for window in windows.values())
        # A window at least as long as the longest sequence of this call (prompt + budget + a block) hides no key:
        # such layers get the plain causal mask, which needs no per-element mask function.
        self.windows = {kind: None if window is None or window >= longest else window
                        for kind, window in windows.items()}
        self.by_type = getattr(text, "layer_types", None) is not None  # the model reads {layer type: mask}

    def new_cache(self) -> Cache:
        if self.capacity is not None:
            return static_target_cache(self.capacity)
        return DynamicCache() if self.sliding else DynamicCache(config=self.config)

    def has_room(self, columns: int) -> bool:
        """Whether a cache of `columns` columns takes the next verify forward as it is (a static cache packs its
        holes out first when it would not; a dynamic one grows)."""
        return self.capacity is None or columns + self.block <= self.capacity

    def __call__(self, mask: torch.Tensor, cache: Cache) -> torch.Tensor | dict[str, torch.Tensor]:
        """mask: [b, K + n] key mask of the cache plus the n new tokens -> the forward's `attention_mask`."""
        if not self.sliding:
            return mask
        positions = mask.cumsum(1) - 1  # [b, K + n] each visible column's index in its unpadded sequence
        # Shape, dtype and device of the queries are all create_causal_mask reads from the embeddings.
        queries = torch.empty(mask.shape[0], mask.shape[1] - cache.get_seq_length(), 0, dtype=self.dtype,
                              device=mask.device)
        built = {
            window: create_causal_mask(
                config=self.config, inputs_embeds=queries, attention_mask=mask, **cache_kwargs(cache),
                and_mask_function=None if window is None else _window_function(positions, window),
                allow_is_causal_skip=False,  # a None mask would let the model build its column-counted one
            )
            for window in set(self.windows.values())
        }
        if self.by_type:
            return {kind: built[window] for kind, window in self.windows.items()}
        return next(iter(built.values()))  # without layer_types every layer is of the one type


# `cache_implementation` values that name a static cache: transformers' own, and the older names it still maps to it.
_STATIC_NAMES = ("static", "sliding_window", "hybrid", "hybrid_chunked")


def _static_cache(config: GenerationConfig, device: torch.device) -> bool:
    """Whether the call's target cache is static (`target_cache.py`), from `cache_implementation`: "static" or
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


def _window_function(positions: torch.Tensor, window: int):
    """A mask function (transformers' index convention: q and kv are cache columns) keeping the keys less than
    `window` committed tokens before the query."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

    return inner


def _layer_windows(text_config) -> dict[str, int | None]:
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


def _target_forward(target, tap, ids, mask, positions, cache, stats, row_ids: list[int], keep: int = 0):
    """One target forward with hidden-state capture: (logits [b, n or keep, V] fp32, states [b, n, nL*H]);
    row_ids: the original row of each active row, whose statistics it books."""
    tap.drain()
    seconds = tap.seconds
    logits = target(
        input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True,
        logits_to_keep=keep,
    ).logits
    forwards = tap.drain()
    if not forwards:
        raise RuntimeError(
            "The drafter's tap recorded no target forward: the drafter is attached to a different model. Call "
            "`drafter.attach(target)` with the model you generate with."
        )
    for row in row_ids:  # the batch's forward time: every active row waited for all of it
        stats[row].target_forwards += 1
        stats[row].target_seconds += tap.seconds - seconds
    return logits.float(), forwards[-1].states


def _verify(pick, logits: torch.Tensor, drafts: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The target's own token at every block position [b, S + 1], and how many leading drafts equal them [b].

    Lossless for greedy and sampling alike: an accepted draft IS the token the target chose (argmax or sample) given
    exactly the committed prefix, and the first mismatch commits the target's own token there (the bonus)."""
    chosen = pick(logits)
    return chosen, (drafts == chosen[:, :-1]).long().cumprod(1).sum(1)


class _TokenPicker:
    """Chooses the token generate() would choose at every position of a block: its logits processors, then argmax or
    one sample from the processed distribution.

    Processors that read only the logits row (temperature, top_k, ...) run once over all positions. Those that read
    the sequence so far (`_PREFIX_PROCESSORS`: repetition_penalty, min_new_tokens, ...) get at position i of row r
    exactly the input_ids row plain generate() gives them there (left-padded prompt, committed tokens, the block's
    first i inputs), in a batch of generate()'s shape since some keep per-row state; rows of a ragged batch are at
    different lengths, so there is one call per distinct length (its other rows are processed and discarded).
    """

    def __init__(self, processors: LogitsProcessorList, do_sample: bool) -> None:
        self.processors, self.do_sample = processors, do_sample
        self.row_local = all(isinstance(p, _ROW_LOCAL_PROCESSORS) for p in processors)

    def at(self, tokens: torch.LongTensor | None, start: torch.LongTensor | None, rows: torch.LongTensor):
        """pick(logits [b, n, V]) -> tokens [b, n] for the active `rows` [b], where position i of active row j has
        the prefix tokens[rows[j], : start[j] + i] (tokens [B, W] for every row of the call; tokens and start may be
        None when every processor is row-local)."""
        return lambda logits: self._choose(self._scores(logits, tokens, start, rows))

    def _scores(self, logits: torch.Tensor, tokens, start, rows) -> torch.Tensor:
        b, n, vocab = logits.shape
        if self.row_local:  # row-local processors ignore input_ids; they still want a [rows, len] tensor
            flat = logits.reshape(b * n, vocab)
            return self.processors(flat.new_zeros(b * n, 1, dtype=torch.long), flat).view(b, n, vocab)
        lengths = start[:, None] + torch.arange(n, device=logits.device)  # [b, n] prefix length at each position
        scores = torch.empty_like(logits)
        for length in lengths.unique().tolist():
            active, position = (lengths == length).nonzero(as_tuple=True)  # at most one position per row
            batch_scores = logits.new_zeros(tokens.shape[0], vocab)  # rows not at this length: discarded
            batch_scores[rows[active]] = logits[active, position]
            processed = self.processors(tokens[:, :length], batch_scores)
            scores[active, position] = processed[rows[active]]
        return scores

    def _choose(self, scores: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            b, n, vocab = scores.shape
            return torch.multinomial(scores.reshape(b * n, vocab).softmax(-1), num_samples=1).view(b, n)
        return scores.argmax(-1)


def _with_drafts(out, written, rows, prompt_len, drafts) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Every row's committed tokens, the active rows' drafts after them [B, W], and the active rows' committed
    lengths [b]: block position i of active row j has the prefix of length start[j] + i."""
    start = prompt_len + written[rows]  # [b]
    columns = start[:, None] + torch.arange(drafts.shape[1], device=drafts.device)  # [b, S], inside out's spare room
    tokens = out.clone()
    tokens[rows] = tokens[rows].scatter(1, columns, drafts)
    return tokens, start


def _commit(out, written, prompt_len, tokens, counts, max_new, eos, pad, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit up to counts[i] of tokens[i] (cut at the budget and after an EOS) into out, without a host sync.

    The whole block is written at each row's end, pad where nothing is committed, so the next cycle overwrites what
    this one did not commit and a finished row ends in pad exactly like generate() output.
    Returns (finished [b], tokens committed [b]).
    """
    index = torch.arange(tokens.shape[1], device=tokens.device)  # [n]
    room = (max_new - written[rows])[:, None]  # [b, 1]
    keep = (index < counts[:, None]) & (index < room)  # [b, n]
    hit_eos = torch.zeros_like(counts, dtype=torch.bool)  # [b]
    if eos is not None:
        is_eos = torch.isin(tokens, eos) & keep  # [b, n]
        keep &= (is_eos.long().cumsum(1) - is_eos.long()) == 0  # nothing after the first EOS
        hit_eos = is_eos.any(1)
    columns = prompt_len + written[rows][:, None] + index  # [b, n]
    out.index_put_((rows[:, None].expand_as(columns), columns), torch.where(keep, tokens, pad))
    new = keep.sum(1)
    written[rows] += new
    return hit_eos | (written[rows] >= max_new), new


def _committed(out, prompt_valid, written, rows) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Each active row's committed tokens: out[rows] [b, W] and where they are real (prompt, not padding; then the
    written tokens, anchor included) [b, W]."""
    prompt_len = prompt_valid.shape[1]
    new_columns = torch.arange(out.shape[1] - prompt_len, device=out.device)  # [W - L]
    valid = torch.cat([prompt_valid[rows], new_columns < written[rows][:, None]], dim=1)
    return out[rows], valid


def _still_active(finished: list[int]) -> list[int] | None:
    """The index among the current rows of each row still active, or None when every row stays."""
    if not any(finished):
        return None
    return [i for i, f in enumerate(finished) if not f]


def _check_supported(target, drafter, logits_processor, stopping_criteria, config, cache) -> None:
    if drafter.target is not target:
        raise ValueError(
            "The drafter is attached to a different model than the one generating. Call `drafter.attach(target)`."
        )
    if config.num_beams != 1:
        raise ValueError(
            f"num_beams={config.num_beams}: speculative_generate does greedy decoding or sampling, not beam search."
        )
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(config, flag, False):
            raise ValueError(f"{flag}=True is not supported by speculative_generate; leave it False.")
    supported = _ROW_LOCAL_PROCESSORS + _PREFIX_PROCESSORS
    unsupported = [type(p).__name__ for p in logits_processor if not isinstance(p, supported)]
    if unsupported:
        raise ValueError(
            f"Logits processors {unsupported} are not supported by speculative_generate: it applies, exactly, only "
            "processors known to treat each row on its own (generate()'s own sampling, penalty, n-gram, bad-words, "
            "sequence-bias, prefix-constraint and length settings). Generate one prompt at a time with "
            "target.generate(assistant_model=drafter), or use plain generate()."
        )
    other = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if other:
        raise ValueError(f"Stopping criteria {other} are not supported by speculative_generate; use max_new_tokens "
                         "and eos_token_id.")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("speculative_generate starts from an empty cache; do not pass a filled `cache`.")
    _layer_windows(target.config.get_text_config(decoder=True))  # raises for layers the loop cannot mask


def _check_left_padded(attention_mask: torch.Tensor | None) -> None:
    """The loop appends every row's new tokens after its last column: padding anywhere but on the left would end up
    inside the sequence, where plain generate() has it too but attends past it differently (a different result)."""
    if attention_mask is None:
        return
    rows = (attention_mask.long().diff(dim=1) < 0).any(1).nonzero().flatten().tolist()  # a 1 followed by a 0
    if rows:
        raise ValueError(
            f"speculative_generate needs left-padded prompts, but rows {rows[:8]} of attention_mask have padding after "
            "a real token (right padding?). Pad on the left: tokenizer.padding_side = 'left' before tokenizing."
        )


__all__ = ["SpeculativeOutput", "speculative_generate"]
