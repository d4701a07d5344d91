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

Verification: the target's token at every block position is chosen exactly like `generate()` chooses it (same logits
processors; argmax, or one multinomial sample from the processed distribution), and a draft is accepted while it
equals that token. For sampling this is the point-mass rule of DCOCO appendix G: exactly lossless for any drafter.

Static-friendliness: the output buffer is preallocated, every forward has a fixed block width (drafts are never cut
to the remaining budget; surplus tokens are simply not committed), and acceptance is computed with tensor ops. What
stays dynamic: the active batch size (finished rows leave), the cache length (grows by the longest accepted prefix
per cycle), the drafter context width (same), and one host sync per cycle (accepted counts and finished rows, read
together). The target mask is re-concatenated each cycle (cheap next to the forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from .candidate_generator import DCOCOStats, DraftContextCache

if TYPE_CHECKING:
    from .modeling_dcoco import DCOCODrafter

# Compact both caches once masked columns (left padding + holes) exceed this fraction of them: a gather of the whole
# cache, paid rarely, against attention over the wasted columns in every later forward.
COMPACT_WASTE = 0.5

# Processors whose output depends only on the logits row (not on the sequence so far or its length): the same at
# every position of a verified block, whichever row length it belongs to.
_ROW_LOCAL_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper,
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

    Args:
        target: the causal LM the drafter is attached to.
        input_ids: [B, L] left-padded prompts (pass `attention_mask` for padding).
        drafter: an attached `DCOCODrafter` (`drafter.attach(target)`).
        correct: False skips the corrector: plain DFlash argmax blocks with the same weights.
        selection: the corrector's walk ("greedy" | "viterbi" | "geometric"); default the drafter config's.
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
        generation_config, correct, selection, kwargs.get("cache"),
    )
    drafter._last_engine = _BatchedRun(stats, sequences)  # read by drafter.generation_stats()
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
    tap = drafter.tap
    tap.listen()
    try:
        return _loop(target, drafter, input_ids, attention_mask, logits_processor, config, correct, selection, tap)
    finally:
        tap.listening = False  # plain use of the target afterwards records nothing


def _loop(target, drafter, input_ids, attention_mask, logits_processor, config, correct, selection, tap):
    device, (batch, prompt_len) = input_ids.device, input_ids.shape
    slots = drafter.config.block_size - 1
    max_new = config.max_length - prompt_len
    eos = config._eos_token_tensor  # None or [n_eos]
    pad = config._pad_token_tensor if config._pad_token_tensor is not None else torch.tensor(0, device=device)
    pick = _token_picker(logits_processor, config.do_sample)
    stats = [DCOCOStats(drafter.config.block_size, drafter.config.top_k) for _ in range(batch)]

    # [B, L + T + S + 1] preallocated: every cycle writes its whole block (pad where not committed), no sync needed
    out = torch.cat([input_ids, pad.expand(batch, max_new + slots + 1)], dim=1)
    written = torch.zeros(batch, dtype=torch.long, device=device)  # [B] new tokens committed so far
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()  # [B, L] key mask
    prompt_valid = mask.bool()  # [B, L] real prompt tokens (the corrector's context bigrams skip padding)
    rows = torch.arange(batch, device=device)  # [b] original row of each active row
    cache = DynamicCache(config=target.config)
    dcache = DraftContextCache()

    # Prefill: the prompts, then the first token chosen by the target itself (it becomes the first anchor).
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, L] index in the unpadded sequence
    logits, states = _target_forward(target, tap, input_ids, mask, positions, cache, stats, rows, keep=1)
    anchor = pick(logits)[:, 0]  # [B]
    anchor_pos = mask.sum(1)  # [B] the anchor's index in the unpadded sequence
    done, new = _commit(out, written, prompt_len, anchor[:, None], torch.ones_like(anchor), max_new, eos, pad, rows)
    host = torch.stack([new, done.long()]).tolist()  # the one host sync of the prefill
    for row, count in zip(rows.tolist(), host[0]):
        stats[row].committed_tokens += count
    finished = host[1]
    ctx, ctx_mask, ctx_pos = states, mask, positions  # [B, N, nL*H], [B, N], [B, N] drafter context not yet cached
    dmask = mask[:, :0]  # [B, 0] key mask of the drafter cache
    offsets = torch.arange(slots + 1, device=device)  # [S + 1]

    while True:
        rows, keep = _drop_finished(rows, finished)
        if rows.numel() == 0:
            break
        if keep is not None:  # finished rows leave every per-row tensor and both caches
            cache.batch_select_indices(keep)
            dcache.select_rows(keep)
            anchor, anchor_pos, mask, dmask = anchor[keep], anchor_pos[keep], mask[keep], dmask[keep]
            ctx, ctx_mask, ctx_pos = ctx[keep], ctx_mask[keep], ctx_pos[keep]

        # Draft: one drafter forward per cycle for all active rows.
        block_pos = anchor_pos[:, None] + offsets  # [b, S + 1]
        draft_mask = torch.cat([dmask, ctx_mask, torch.ones_like(block_pos)], dim=1)  # [b, cached + N + S + 1]
        context_ids, context_valid = (
            _committed(out, prompt_valid, written, rows) if drafter.config.context_bigrams else (None, None)
        )
        proposal = drafter.propose(
            anchor, ctx, torch.cat([ctx_pos, block_pos], 1), dcache, draft_mask, selection=selection, correct=correct,
            context_ids=context_ids, context_valid=context_valid,
        )
        dmask = torch.cat([dmask, ctx_mask], dim=1)  # [b, cached + N]
        drafts = proposal.tokens  # [b, S]

        # Verify: [anchor, drafts] for every row at its true positions; holes and padding are masked keys.
        block = torch.cat([anchor[:, None], drafts], dim=1)  # [b, S + 1]
        mask = torch.cat([mask, torch.ones_like(block)], dim=1)  # [b, K + S + 1]
        logits, states = _target_forward(target, tap, block, mask, block_pos, cache, stats, rows)
        chosen, accepted = _verify(pick, logits, drafts)  # [b, S + 1], [b]
        done, new = _commit(out, written, prompt_len, chosen, accepted + 1, max_new, eos, pad, rows)
        anchor_pos = anchor_pos + accepted + 1  # [b] = committed tokens before the anchor = valid cache columns
        host_accepted, host_new, finished, valid_columns = torch.stack(
            [accepted, new, done.long(), anchor_pos]
        ).tolist()  # the cycle's one host sync
        _book(stats, rows, proposal, host_accepted, host_new, slots)

        # Keep the block columns some row accepted; the rest of the tail goes; shorter rows keep masked holes.
        valid = offsets <= accepted[:, None]  # [b, S + 1] anchor + accepted drafts are committed inputs
        width = max(host_accepted) + 1
        cache.crop(width - (slots + 1))
        mask = torch.cat([mask[:, : -(slots + 1)], valid[:, :width].long()], dim=1)  # [b, K + width]
        ctx, ctx_mask, ctx_pos = states[:, :width], valid[:, :width].long(), block_pos[:, :width]
        anchor = chosen.gather(1, accepted[:, None]).squeeze(1)  # [b] the bonus token
        if 1 - sum(valid_columns) / mask.numel() > COMPACT_WASTE:  # mostly holes: pack every row's keys right
            mask, dmask = _compact(cache, mask, dcache, dmask)

    return out[:, : prompt_len + int(written.max())], stats


def _compact(cache: DynamicCache, mask: torch.Tensor, dcache: DraftContextCache, dmask: torch.Tensor):
    """Pack every row's visible key/value columns to the right end, in order, in both caches: (mask, dmask).

    Exact: keys carry their RoPE rotation already and attention does not care where a key sits, only whether it is
    masked; new tokens keep their explicit positions.
    """
    index, mask = _pack_index(mask)
    for layer in cache.layers:
        layer.keys, layer.values = _take_columns(layer.keys, index), _take_columns(layer.values, index)
    index, dmask = _pack_index(dmask)
    dcache.keys = [_take_columns(k, index) for k in dcache.keys]
    dcache.values = [_take_columns(v, index) for v in dcache.values]
    return mask, dmask


def _pack_index(mask: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
    """Key mask [b, K] -> (source column of each packed column [b, W], packed mask [b, W]), W = most visible keys."""
    width = int(mask.sum(1).max())
    index = torch.argsort(mask, dim=1, stable=True)[:, mask.shape[1] - width :]  # masked first, then visible, in order
    return index, mask.gather(1, index)


def _take_columns(states: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """states [b, heads, K, D], index [b, W] -> [b, heads, W, D]."""
    return states.gather(2, index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))


def _target_forward(target, tap, ids, mask, positions, cache, stats, rows, keep: int = 0):
    """One target forward with hidden-state capture: (logits [b, n or keep, V] fp32, states [b, n, nL*H])."""
    tap.drain()
    seconds = tap.seconds
    logits = target(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=keep
    ).logits
    forwards = tap.drain()
    if not forwards:
        raise RuntimeError(
            "The drafter's tap recorded no target forward: the drafter is attached to a different model. Call "
            "`drafter.attach(target)` with the model you generate with."
        )
    for row in rows.tolist():  # the batch's forward time: every active row waited for all of it
        stats[row].target_forwards += 1
        stats[row].target_seconds += tap.seconds - seconds
    return logits.float(), forwards[-1].states


def _verify(pick, logits: torch.Tensor, drafts: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The target's own token at every block position [b, S + 1], and how many leading drafts equal them [b].

    Lossless for greedy and sampling alike: an accepted draft IS the token the target chose (argmax or sample) given
    exactly the committed prefix, and the first mismatch commits the target's own token there (the bonus)."""
    chosen = pick(logits)
    return chosen, (drafts == chosen[:, :-1]).long().cumprod(1).sum(1)


def _token_picker(processors: LogitsProcessorList, do_sample: bool):
    """logits [b, n, V] -> the tokens generate() would choose at each of the n positions [b, n]."""

    def pick(logits: torch.Tensor) -> torch.LongTensor:
        b, n, vocab = logits.shape
        flat = logits.reshape(b * n, vocab)
        # Row-local processors ignore input_ids (checked in _check_supported); they still want a [rows, len] tensor.
        scores = processors(flat.new_zeros(b * n, 1, dtype=torch.long), flat)
        if do_sample:
            return torch.multinomial(scores.softmax(-1), num_samples=1).view(b, n)
        return scores.argmax(-1).view(b, n)

    return pick


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


def _drop_finished(rows: torch.LongTensor, finished: list[int]) -> tuple[torch.LongTensor, torch.LongTensor | None]:
    """(rows still active, their index among the current rows, or None when every row stays)."""
    if not any(finished):
        return rows, None
    keep = torch.tensor([i for i, f in enumerate(finished) if not f], dtype=torch.long, device=rows.device)
    return rows[keep], keep


def _book(stats, rows, proposal, accepted, new, slots) -> None:
    """Per-row cycle statistics (drafter time is the batch's: every row waited for all of it)."""
    for row, count, committed in zip(rows.tolist(), accepted, new):
        row_stats = stats[row]
        row_stats.cycles += 1
        row_stats.committed_tokens += committed
        row_stats.accepted.append(count)
        row_stats.drafter_seconds += proposal.backbone_seconds
        row_stats.corrector_seconds += proposal.corrector_seconds
        for slot in range(slots):
            row_stats.slot_proposed[slot] += 1
            row_stats.slot_accepted[slot] += slot < count


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
    unsupported = [type(p).__name__ for p in logits_processor if not isinstance(p, _ROW_LOCAL_PROCESSORS)]
    if unsupported:
        raise ValueError(
            f"Logits processors {unsupported} depend on the sequence so far (or its length), which differs per row "
            "in a ragged speculative batch; speculative_generate supports temperature, top_k, top_p, min_p, typical, "
            "epsilon and eta. Drop those settings (e.g. repetition_penalty, min_new_tokens) or use plain generate()."
        )
    other = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if other:
        raise ValueError(f"Stopping criteria {other} are not supported by speculative_generate; use max_new_tokens "
                         "and eos_token_id.")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("speculative_generate starts from an empty cache; do not pass a filled `cache`.")
    text = target.config.get_text_config()
    if set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        raise ValueError(
            "speculative_generate keeps masked holes in the KV cache, which sliding-window or recurrent layers "
            "cannot represent; use a full-attention target or target.generate(assistant_model=drafter) per prompt."
        )

__all__ = ["SpeculativeOutput", "speculative_generate"]
