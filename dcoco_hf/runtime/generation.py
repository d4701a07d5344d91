"""Batched lossless speculative decoding: `speculative_generate(target, input_ids, drafter=drafter, ...)`.

transformers' assisted generation runs one sequence at a time; this loop serves a left-padded batch. Every cycle each
active row feeds [anchor, drafts] to the target: a chain of drafted slots, or a draft tree of the block's candidates
(`trees.py`, sized per cycle by the cost model with `tree_budget`); each row accepts its own number of drafts;
finished rows leave the active batch (their target cache, drafter cache and mask rows are index-selected away), so
they cost nothing more. The loop reads as `_loop`: `_start`, `_prefill`, then per cycle `_propose` and
`_verify_and_commit`, each a short function over two records (`_Call`, fixed for the call; `_Rows`, the active rows).

Ragged acceptance in one rectangular KV cache ("holes"): every cycle appends the block's columns to all rows, then
crops the columns that NO row accepted (the tail beyond the longest accepted path). A row that accepted fewer keeps
masked-out columns ("holes") where its rejected drafts were. Exactness holds because each query attends to exactly the
keys of its row's committed tokens (the 2D key mask zeroes holes and left padding; softmax gives them weight exactly
0), with the same RoPE positions as plain decoding (explicit position_ids = index in the unpadded sequence), so the
target computes the same function as in plain `generate()`, up to float summation order. A tree's nodes see only
their ancestors (a 4D mask from transformers' own `create_causal_mask`, in the attention implementation's format) at
positions anchor + depth; after verification its accepted path's columns are moved to the front of the block in the
cache (`target_cache.reorder_block`), so from there on it is a verified chain. Holes are packed out once they exceed
`COMPACT_WASTE` of the cache (`target_cache.compact`). Sliding-window layers get 4D masks whose window counts
committed tokens, not cache columns (`TargetMasks`): exact at any length.

Verification (`verification.py`): the target's token at each verified position is chosen exactly like `generate()`
chooses it, and a draft is accepted while it equals that token: exactly lossless for any drafter, greedy or sampling.

Static-friendliness: the output buffer is preallocated, every forward of a chain has a fixed block width (drafts are
never cut to the remaining budget; surplus tokens are simply not committed). The target cache is static on CUDA (or
with `cache_implementation="static"`; `target_cache.py`): its buffers are allocated once per call and every write,
reorder, crop, row removal and compaction stays in them. What stays dynamic: the active batch size, the cache length
the forward attends to, the drafter context width, and one host sync per cycle (accepted counts, finished rows and
the target's tokens, read together; a draft tree is built on the host, one more read of its scores; logits
processors that read the sequence add one call, and a sync, per distinct prefix length).

Each cycle is timed: what its wall time exceeds the costs timed at the batch's shape teaches the cost model
(`proposal.py`), so a batch prices its cycles like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from ..network.configuration_dcoco import check_tree_budget
from .cpu_attention import CPU_GQA_ATTENTION
from .engine import SpeculationEngine, keep_call_statistics, one_call, proposal_limits, require_prompt_tokens
from .proposal import COST_SCHEDULE, drafts_at
from .hf_compat import (
    attention_implementation,
    cache_kwargs,
    output_cache,
    plain_decoding,
    prepared_by_generate,
    special_token_tensors,
)
from .stats import DCOCOStats
from .tap import TargetTap
from .target_cache import (
    COMPACT_WASTE,
    TargetMasks,
    compact,
    layer_windows,
    reorder_block,
    static_cache_wanted,
    static_capacity,
)
from .trees import DraftTrees, path_order
from .tuning import time_batch
from .verification import (
    PREFIX_PROCESSORS,
    ROW_LOCAL_PROCESSORS,
    TextEnds,
    TokenPicker,
    column_picker,
    follow_path,
)

if TYPE_CHECKING:
    from .drafting import AttachedDrafter as DCOCODrafter


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
    tree_budget: int | None = None,
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
        tree_budget: the most nodes a cycle's draft tree may have (`trees.py`; 0: chains only); default the
            drafter's (`drafter.generation_config.tree_budget`). Under the cost-aware schedule each cycle verifies
            whichever is expected fastest: a plain step, the chain, or a tree of up to this many nodes; under
            "constant", the budget's tree every cycle. Trees follow the prefix-first walk's scores and need an
            attention implementation that takes arbitrary masks (eager, SDPA, flex); elsewhere cycles verify chains.
    """
    _check_positional(logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                      generation_config=generation_config)
    require_prompt_tokens(input_ids)
    prepared = (
        prepared_by_generate(generation_config) and logits_processor is not None and stopping_criteria is not None
    )
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
            tree_budget=tree_budget, logits_processor=logits_processor, stopping_criteria=stopping_criteria, **kwargs,
        )
        sequences = sequences.sequences if isinstance(sequences, ModelOutput) else sequences
        return SpeculativeOutput(sequences=sequences, stats=drafter.generation_stats(sequences))

    if drafter is None:
        raise TypeError(
            "target.generate(custom_generate=speculative_generate) needs `drafter=<attached DCOCODrafter>`."
        )
    budget = drafter.decoding.tree_budget if tree_budget is None else check_tree_budget(tree_budget)
    sequences, stats = _speculative_loop(
        target, drafter, input_ids, kwargs.get("attention_mask"), logits_processor, stopping_criteria,
        generation_config, _LoopOptions(correct, selection, budget), kwargs,
    )
    keep_call_statistics(drafter, _BatchedRun(stats, sequences))
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _check_positional(**arguments: Any) -> None:
    """A tensor in the slots after input_ids is an attention mask passed by position: the signature is the one
    transformers calls a custom_generate with, so the mask must come by keyword."""
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            raise TypeError(
                f"speculative_generate got a tensor as {name}: after input_ids it takes logits_processor, "
                "stopping_criteria and generation_config (transformers' custom_generate order). Pass the mask by "
                "keyword: speculative_generate(target, input_ids, attention_mask=mask, drafter=drafter, ...)."
            )


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Call:
    """What stays fixed through one call of the loop (every row, active or finished)."""

    target: PreTrainedModel
    drafter: DCOCODrafter
    tap: TargetTap
    engine: SpeculationEngine
    picker: TokenPicker
    masks: TargetMasks
    cache: Cache  # the target's
    out: torch.LongTensor  # [B, L + T + W] every row's tokens; a block is written past the end before its commit
    written: torch.LongTensor  # [B] new tokens committed so far (the first anchor included)
    prompt_valid: torch.BoolTensor  # [B, L] real prompt tokens (context bigrams skip padding)
    max_new: int
    eos: torch.Tensor | None  # [n_eos]
    pad: torch.Tensor  # []
    cap: int  # chain slots proposed per cycle, at most


@dataclass
class _Rows:
    """The active rows (b of them; finished rows leave) and what each carries from cycle to cycle."""

    ids: list[int]  # the original row of each active row, on the host: booking statistics needs no sync
    index: torch.LongTensor  # [b] the same on the device, to index per-call tensors
    anchor: torch.LongTensor  # [b] the last committed token
    anchor_pos: torch.LongTensor  # [b] its index in the unpadded sequence
    committed: list[int]  # committed tokens before each anchor, on the host: the visible columns of both caches
    mask: torch.Tensor  # [b, K] the target cache's key mask (holes and padding: 0)
    dmask: torch.Tensor  # [b, Kd] the drafter context cache's key mask
    context: torch.Tensor  # [b, N, n_layers * H] target states not yet in the drafter cache
    context_mask: torch.Tensor  # [b, N]
    context_pos: torch.LongTensor  # [b, N]

    def keep(self, kept: list[int], cache: Cache, dcache: Any) -> None:
        """Only the rows `kept` (indices among the active ones) stay: in every per-row tensor and both caches."""
        index = torch.tensor(kept, dtype=torch.long, device=self.anchor.device)  # a copy to the device, not a sync
        cache.batch_select_indices(index)
        dcache.select_rows(index)
        self.ids, self.committed = [self.ids[i] for i in kept], [self.committed[i] for i in kept]
        for name in ("index", "anchor", "anchor_pos", "mask", "dmask", "context", "context_mask", "context_pos"):
            setattr(self, name, getattr(self, name)[index])


@dataclass
class _Block:
    """What the target verifies this cycle after each row's anchor: a chain's drafts or a draft tree's nodes (none:
    a plain step)."""

    nodes: torch.LongTensor  # [b, n] tokens
    parents: torch.LongTensor  # [b, n] each node's parent as a block column (a chain's node i: column i)
    depths: torch.LongTensor  # [b, n]
    depth: int  # the deepest node's, on the host
    drafted: int | None  # the drafted block (anchor + slots); None: a plain step
    trees: DraftTrees | None = None

    @classmethod
    def chain(cls, drafts: torch.LongTensor, drafted: int | None) -> _Block:
        columns = torch.arange(drafts.shape[1], device=drafts.device).expand_as(drafts)
        return cls(drafts, columns, columns + 1, drafts.shape[1], drafted)

    @classmethod
    def tree(cls, trees: DraftTrees, drafted: int) -> _Block:
        return cls(trees.tokens, trees.parents, trees.depths, trees.depth, drafted, trees)


@torch.no_grad()
def _speculative_loop(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    config: GenerationConfig,
    options: _LoopOptions,
    model_kwargs: dict[str, Any],
) -> tuple[torch.LongTensor, list[DCOCOStats]]:
    _check_supported(target, drafter, logits_processor, stopping_criteria, config, output_cache(model_kwargs))
    _check_left_padded(attention_mask)
    tap, batch = drafter.tap, input_ids.shape[0]
    with one_call(drafter):  # refuses a second thread's call while this one runs
        cost_aware = drafter.proposal_schedule_name == COST_SCHEDULE
        if cost_aware and drafter.cost_model.needs_timing(batch):
            time_batch(drafter, batch)  # this batch size's costs, timed once per machine and cached
        if cost_aware and not drafts_at(drafter.cost_model, batch, proposal_limits(drafter.generation_config,
                                                                                     drafter.config.block_size - 1)[0]):
            return _plain_call(target, input_ids, logits_processor, stopping_criteria, config, model_kwargs)
        tap.listen(timed=drafter.time_phases)  # exact GPU phase times cost a sync per phase
        try:
            return _loop(target, drafter, input_ids, attention_mask, logits_processor, stopping_criteria, config,
                         options)
        finally:
            tap.stop()  # plain use of the target afterwards records nothing


def _plain_call(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> tuple[torch.LongTensor, list[DCOCOStats]]:
    """The call as plain steps only, through transformers' own decoding loop (`hf_compat.plain_decoding`): where the
    schedule expects no draft to beat a plain step at this batch size, even at the drafter's recorded tau, the call
    costs what plain batched generate() costs. Each row's statistics count its committed tokens as plain steps."""
    sequences = plain_decoding(target, input_ids, logits_processor, stopping_criteria, config, model_kwargs)
    stats = []
    for count in new_token_counts(sequences, input_ids.shape[1], _stops(config, stopping_criteria)[1]):
        row = DCOCOStats()
        row.observe_plain_steps(count, committed=count)
        row.target_forwards = count  # one forward per token: tau 1
        stats.append(row)
    return sequences, stats


def new_token_counts(sequences: torch.LongTensor, prompt_len: int, eos: torch.Tensor | None) -> list[int]:
    """Tokens each row generated, up to and including its first EOS (eos [n_eos] or None): after it, generate()
    pads, and the padding is no output."""
    new = sequences[:, prompt_len:]  # [B, T]
    ended = torch.isin(new, eos.to(new.device)) if eos is not None else torch.zeros_like(new, dtype=torch.bool)
    return torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1]).tolist()


@dataclass(frozen=True)
class _LoopOptions:
    """speculative_generate's own keywords."""

    correct: bool
    selection: str | None
    tree_budget: int


def _loop(
    target: PreTrainedModel,
    drafter: DCOCODrafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    config: GenerationConfig,
    options: _LoopOptions,
) -> tuple[torch.LongTensor, list[DCOCOStats]]:
    call, rows = _start(target, drafter, input_ids, attention_mask, logits_processor, stopping_criteria, config,
                        options)
    finished = _prefill(call, rows, input_ids)
    while True:
        kept = _still_active(finished)
        if kept is not None:  # finished rows leave every per-row tensor and both caches
            if not kept:
                break
            rows.keep(kept, call.cache, call.engine.cache)
        started, active = time.perf_counter(), list(rows.ids)
        block = _propose(call, rows)
        finished, verified = _verify_and_commit(call, rows, block)
        call.engine.verified(active, *verified, seconds=time.perf_counter() - started)
    call.engine.finish()
    stats = call.engine.stats
    # The statistics count every committed token: the longest row without a sync.
    return call.out[:, : input_ids.shape[1] + max(row.committed_tokens for row in stats)], stats


def _start(
    target, drafter, input_ids, attention_mask, logits_processor, stopping_criteria, config, options
) -> tuple[_Call, _Rows]:
    """The call's fixed parts, its engine and caches, and the rows before the prompts' forward."""
    device, (batch, prompt_len) = input_ids.device, input_ids.shape
    slots = drafter.config.block_size - 1
    budget = options.tree_budget if trees_supported(target) else 0
    widest = max(slots, budget) + 1  # the widest verify forward: an anchor and a chain, or a tree
    max_length, eos = _stops(config, stopping_criteria)  # eos: None or [n_eos]
    max_new = max_length - prompt_len
    pad = special_token_tensors(config)[1]  # None or []
    pad = pad if pad is not None else torch.tensor(0, device=device)
    # The drafter's context holds the target's columns less the newest, then a captured draft's padded rows.
    context_length = static_capacity(prompt_len + max_new + slots, widest) + drafter.config.block_size
    engine = SpeculationEngine(drafter, batch, correct=options.correct, selection=options.selection,
                               context_length=context_length, tree_budget=budget)
    masks = TargetMasks(target, prompt_len + max_new + slots, widest, static_cache_wanted(config, device))
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()  # [B, L] key mask
    call = _Call(
        target, drafter, drafter.tap, engine, TokenPicker(logits_processor, config.do_sample), masks,
        masks.new_cache(),
        torch.cat([input_ids, pad.expand(batch, max_new + widest)], dim=1),  # every cycle writes a whole block
        torch.zeros(batch, dtype=torch.long, device=device), mask.bool(), max_new, eos, pad,
        engine.cap,
    )
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, L] index in the unpadded sequence
    rows = _Rows(list(range(batch)), torch.arange(batch, device=device), input_ids[:, -1], mask.sum(1), [0] * batch,
                 mask, mask[:, :0], input_ids.new_zeros(0), mask, positions)
    return call, rows


def _prefill(call: _Call, rows: _Rows, input_ids: torch.LongTensor) -> list[int]:
    """The prompts' forward, then the first token chosen by the target itself (it becomes the first anchor).
    Returns which rows finished already."""
    stats, prompt_len = call.engine.stats, input_ids.shape[1]
    logits, states = _target_forward(
        call, input_ids, call.masks(rows.mask, call.cache), rows.context_pos, rows.ids, keep=1
    )
    for row in rows.ids:
        stats[row].prefill_seconds = stats[row].target_seconds  # the prompts' forward, every row's
    start = torch.full((len(rows.ids),), prompt_len, device=input_ids.device)
    anchor = call.picker.at(input_ids, start, rows.index)(logits)[:, 0]  # [B]
    done, new = _commit(call, anchor[:, None], torch.ones_like(anchor), rows.index)
    host = torch.stack([new, done.long(), rows.anchor_pos, anchor]).tolist()  # the one host sync of the prefill
    call.engine.prefilled(rows.ids, [[token] if count else [] for count, token in zip(host[0], host[3])])
    rows.anchor, rows.committed, rows.context = anchor, host[2], states
    return host[1]


def _propose(call: _Call, rows: _Rows) -> _Block:
    """One drafter forward for all active rows, and what the target verifies of it; or a plain step."""
    engine = call.engine
    drafted = engine.next_cycle(rows.ids)  # anchor + slots
    if drafted is None:  # a plain step for every row: no draft, the anchor alone
        return _Block.chain(rows.anchor[:, None][:, :0], None)
    # The host knows whether some key is masked (padding, holes): with none, the drafter's attention takes its
    # unmasked path; else it gets the full mask, which it uses without first reading it for a masked key (a sync, as
    # for a key mask).
    if min(rows.committed) == rows.dmask.shape[1] + rows.context_mask.shape[1]:
        draft_mask = None
    else:
        draft_mask = torch.cat([rows.dmask, rows.context_mask, rows.context_mask.new_ones(len(rows.ids), drafted)], 1)
        draft_mask = draft_mask[:, None, None, :].expand(-1, 1, drafted, -1)  # [b, 1, drafted, ...]
    context_ids, context_valid = (
        _committed(call, rows.index) if call.drafter.config.context_bigrams else (None, None)
    )
    proposal, k, trees = engine.draft(
        rows.anchor, rows.anchor_pos, rows.context, rows.context_pos, rows.ids, call.cap, draft_mask,
        context_ids=context_ids, context_valid=context_valid,
    )
    rows.dmask = torch.cat([rows.dmask, rows.context_mask], dim=1)  # [b, cached + N]: the drafter cached them
    if trees is not None and not trees.is_chain:
        return _Block.tree(trees, proposal.tokens.shape[1] + 1)
    drafts = trees.tokens if trees is not None else proposal.tokens[:, :k]  # a one-path tree is a chain
    block = _Block.chain(drafts, proposal.tokens.shape[1] + 1)
    block.trees = trees
    return block


def _verify_and_commit(call: _Call, rows: _Rows, block: _Block) -> tuple[list[int], tuple]:
    """Verify [anchor, block] for every row at its true positions in one target forward, commit what each row's
    path accepted, and move every row on by it. Returns which rows finished, and what the engine is told of the
    cycle (`SpeculationEngine.verified`'s arguments after the rows)."""
    n = block.nodes.shape[1]
    tokens = torch.cat([rows.anchor[:, None], block.nodes], dim=1)  # [b, n + 1]
    depths = torch.cat([torch.zeros_like(rows.anchor_pos[:, None]), block.depths], dim=1)  # [b, n + 1]
    positions = rows.anchor_pos[:, None] + depths  # [b, n + 1]: siblings share a position
    rows.mask = torch.cat([rows.mask, torch.ones_like(tokens)], dim=1)  # [b, K + n + 1]
    tree_cycle = block.trees is not None  # a tree (or a one-path tree: a chain) teaches the fit node by node
    branching = tree_cycle and not block.trees.is_chain
    tree = (block.trees.visible(), positions) if branching else None
    attention = call.masks(rows.mask, call.cache, tree)
    logits, states = _target_forward(call, tokens, attention, positions, rows.ids)
    start = call.prompt_valid.shape[1] + call.written[rows.index]  # [b] committed tokens, the anchor included
    pick = column_picker(call.picker, logits, call.out, start, rows.index)
    path, accepted, chosen = follow_path(block.nodes, block.parents, block.depth, pick, _text_ends(call, start))
    # path, chosen [b, d + 1]; accepted [b]
    if branching:  # the accepted path's columns first: from here on the block is a chain with that prefix accepted
        order = path_order(path, n + 1)
        reorder_block(call.cache, order)
        states = states.gather(1, order[..., None].expand_as(states))
        positions = positions.gather(1, order)
    done, new = _commit(call, chosen, accepted + 1, rows.index)
    anchor_pos = rows.anchor_pos + accepted + 1  # [b] = committed tokens before the anchor = valid cache columns
    # The cycle's one host sync: how many drafts each row accepted decides how far the caches and masks grow (their
    # shapes, hence the next forward's), and finished rows leave the batch; both are read together. The target's
    # tokens travel in the same read (the engine learns from the committed text), and a tree's path.
    parts = [torch.stack([accepted, new, done.long(), anchor_pos], dim=1), chosen] + ([path] if tree_cycle else [])
    host = torch.cat(parts, dim=1).tolist()
    host_accepted, host_new, finished, anchor_committed = ([row[i] for row in host] for i in range(4))
    depth = chosen.shape[1]
    committed = [row[4 : 4 + count] for row, count in zip(host, host_new)]
    path_tokens = [row[4 : 4 + depth] for row in host] if tree_cycle else None
    host_path = [row[4 + depth :] for row in host] if tree_cycle else None

    # Keep the block columns some row accepted; the rest of the tail goes; shorter rows keep masked holes.
    offsets = torch.arange(n + 1, device=tokens.device)
    valid = offsets <= accepted[:, None]  # [b, n + 1] the anchor and the accepted path are committed inputs
    width = max(host_accepted) + 1
    call.cache.crop(width - (n + 1))
    rows.mask = torch.cat([rows.mask[:, : -(n + 1)], valid[:, :width].long()], dim=1)  # [b, K + width]
    fresh = states[:, :width], valid[:, :width].long(), positions[:, :width]
    if block.drafted is None:  # no draft read the context since: it waits for the next one
        rows.context, rows.context_mask, rows.context_pos = (
            torch.cat(pair, dim=1) for pair in zip((rows.context, rows.context_mask, rows.context_pos), fresh)
        )
    else:
        rows.context, rows.context_mask, rows.context_pos = fresh
    rows.anchor = chosen.gather(1, accepted[:, None]).squeeze(1)  # [b] the target's own token
    rows.anchor_pos = anchor_pos
    # Mostly holes, or a static cache without room for the next block: pack every row's keys right.
    dcache = call.engine.cache
    room = call.masks.has_room(rows.mask.shape[1]) and dcache.has_room(rows.mask.shape[1])
    if 1 - sum(anchor_committed) / rows.mask.numel() > COMPACT_WASTE or not room:
        # The drafter cache holds the context up to the old anchors (the new rows are cached next cycle).
        rows.mask, rows.dmask = compact(call.cache, rows.mask, max(anchor_committed), dcache, rows.dmask,
                                        max(rows.committed))
    rows.committed = anchor_committed
    return finished, (n, host_accepted, committed, host_path, path_tokens)


def _target_forward(
    call: _Call, ids: torch.LongTensor, mask: Any, positions: torch.LongTensor, row_ids: list[int], keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward with hidden-state capture: (logits [b, n or keep, V] fp32, states [b, n, nL*H]);
    row_ids: the original row of each active row, whose statistics it books."""
    tap, stats = call.tap, call.engine.stats
    tap.drain()
    seconds = tap.seconds
    logits = call.target(
        input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(call.cache), use_cache=True,
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


def _text_ends(call: _Call, start: torch.LongTensor) -> TextEnds:
    """Where each row's text ends within a verified block (start [b]: its committed tokens, the anchor included):
    at an EOS, or at its last budgeted position, as `_commit` cuts it."""
    limit = call.prompt_valid.shape[1] + call.max_new

    def ends(wanted: torch.LongTensor, step: int) -> torch.BoolTensor:
        last = start + step + 1 >= limit
        return last if call.eos is None else last | torch.isin(wanted, call.eos)

    return ends


def _commit(
    call: _Call, tokens: torch.LongTensor, counts: torch.LongTensor, rows: torch.LongTensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit up to counts[i] of tokens[i] (cut at the budget and after an EOS) into out, without a host sync.

    The whole block is written at each row's end, pad where nothing is committed, so the next cycle overwrites what
    this one did not commit and a finished row ends in pad exactly like generate() output.
    Returns (finished [b], tokens committed [b]).
    """
    written, prompt_len = call.written, call.prompt_valid.shape[1]
    index = torch.arange(tokens.shape[1], device=tokens.device)  # [n]
    room = (call.max_new - written[rows])[:, None]  # [b, 1]
    keep = (index < counts[:, None]) & (index < room)  # [b, n]
    hit_eos = torch.zeros_like(counts, dtype=torch.bool)  # [b]
    if call.eos is not None:
        is_eos = torch.isin(tokens, call.eos) & keep  # [b, n]
        keep &= (is_eos.long().cumsum(1) - is_eos.long()) == 0  # nothing after the first EOS
        hit_eos = is_eos.any(1)
    columns = prompt_len + written[rows][:, None] + index  # [b, n]
    call.out.index_put_((rows[:, None].expand_as(columns), columns), torch.where(keep, tokens, call.pad))
    new = keep.sum(1)
    written[rows] += new
    return hit_eos | (written[rows] >= call.max_new), new


def _committed(call: _Call, rows: torch.LongTensor) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Each active row's committed tokens: out[rows] [b, W] and where they are real (prompt, not padding; then the
    written tokens, anchor included) [b, W]."""
    out, prompt_valid = call.out, call.prompt_valid
    prompt_len = prompt_valid.shape[1]
    new_columns = torch.arange(out.shape[1] - prompt_len, device=out.device)  # [W - L]
    valid = torch.cat([prompt_valid[rows], new_columns < call.written[rows][:, None]], dim=1)
    return out[rows], valid


def _still_active(finished: list[int]) -> list[int] | None:
    """The index among the current rows of each row still active, or None when every row stays."""
    if not any(finished):
        return None
    return [i for i, f in enumerate(finished) if not f]


def trees_supported(target: PreTrainedModel) -> bool:
    """Whether the target's attention takes a draft tree's arbitrary mask: eager, SDPA (and this package's CPU
    variant) and flex attention do; FlashAttention kernels take causal masks only, so there cycles verify chains."""
    return attention_implementation(target) in ("eager", "sdpa", CPU_GQA_ATTENTION, "flex_attention")


def _stops(config: GenerationConfig, criteria: StoppingCriteriaList) -> tuple[int, torch.Tensor | None]:
    """Where rows stop, as plain generate() stops them: at the max_length of the MaxLengthCriteria in the criteria
    generate() prepared (a caller's own replaces generate()'s), and at every EOS id of the config and of any
    EosTokenCriteria."""
    eos = special_token_tensors(config)[0]
    extra = [c.eos_token_id.to(eos.device if eos is not None else c.eos_token_id.device).flatten()
             for c in criteria if isinstance(c, EosTokenCriteria)]
    if extra:
        eos = torch.cat(([] if eos is None else [eos.flatten()]) + extra).unique()
    lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
    return min(lengths) if lengths else config.max_length, eos


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
    supported = ROW_LOCAL_PROCESSORS + PREFIX_PROCESSORS
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
    layer_windows(target.config.get_text_config(decoder=True))  # raises for layers the loop cannot mask


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
