"""Verification in the batched loop: the target's own token at each verified position, and the path it takes
through the proposal (a chain, or a draft tree: `trees.py`).

The target's token at every position is chosen exactly like `generate()` chooses it (same logits processors, those
that read the sequence so far given each position's own prefix; argmax, or one multinomial sample from the processed
distribution), and a draft is accepted while it equals that token: for sampling this is the point-mass rule of DCOCO
appendix G, exactly lossless for any deterministic draft. Through a tree the path starts at the anchor and moves to
the child holding the target's token at the current node while there is one (`follow_path`); a chain is the tree in
which every node's parent is the node before it, so both run the same walk.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
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

# Processors whose output depends only on the logits row (not on the sequence so far or its length): the same at
# every position of a verified block, whichever row length it belongs to.
ROW_LOCAL_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, SuppressTokensLogitsProcessor, InfNanRemoveLogitsProcessor,
    LogitNormalization,
)
# Processors that read the sequence so far, each batch row on its own (some keep per-row state, e.g. the prompt's
# padding length, or pass the row index to a user function): exact when called on the whole batch with each row's
# own prefix, which `TokenPicker` does.
PREFIX_PROCESSORS = (
    RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor, ForcedEOSTokenLogitsProcessor, ExponentialDecayLengthPenalty,
    PrefixConstrainedLogitsProcessor,
)


class RowsConstraint(LogitsProcessor):
    """`prefix_allowed_tokens_fn` (transformers' `PrefixConstrainedLogitsProcessor`) asked about `batch_rows` only
    (the other rows' scores pass unchanged, to be discarded): the user's function gets each row's batch id as plain
    generate() computes it (row // rows per prompt), so a row-aware function (a trie per prompt) answers as there.

    Where every allowed token of a row already scores -inf, transformers' processor falls back to the allowed tokens
    at 0 when all rows of that prompt are so; this one decides per row, since the rows of one prompt may stand at
    different lengths here. The two differ only for several return sequences per prompt whose allowed tokens another
    processor has all set to -inf."""

    def __init__(self, allowed: Callable[[int, torch.Tensor], list[int]], rows_per_prompt: int) -> None:
        self.allowed, self.rows_per_prompt = allowed, rows_per_prompt

    @classmethod
    def of(cls, processor: PrefixConstrainedLogitsProcessor) -> RowsConstraint:
        return cls(processor._prefix_allowed_tokens_fn, processor._num_beams)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, batch_rows: torch.LongTensor) -> torch.Tensor:
        mask = torch.zeros_like(scores)  # [B, V]
        for row in batch_rows.tolist():
            batch_id = row // self.rows_per_prompt
            allowed = self.allowed(batch_id, input_ids[row])
            if len(allowed) == 0:
                raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}: the "
                                 "constraint is unsatisfiable. Check your prefix_allowed_tokens_fn.")
            mask[row] = -math.inf
            mask[row, allowed] = 0
        constrained = scores + mask
        return torch.where(constrained.amax(-1, keepdim=True).isneginf(), mask, constrained)


class TokenPicker:
    """Chooses the token generate() would choose at a position: its logits processors, then argmax or one sample
    from the processed distribution.

    Processors that read only the logits row (temperature, top_k, ...) run once over all positions. Those that read
    the sequence so far (`PREFIX_PROCESSORS`: repetition_penalty, min_new_tokens, ...) get at each position exactly
    the input_ids row plain generate() gives them there (left-padded prompt, committed tokens, the path's tokens up to
    that position), in a batch of generate()'s shape since some keep per-row state (repetition_penalty: each row's
    padding). Rows of a ragged batch are at different lengths, so there is one call per distinct length; its other
    rows are processed and discarded, except by a user's `prefix_allowed_tokens_fn`, which is asked about the rows at
    that length only, so it sees only prefixes plain generate() shows it (`RowsConstraint`).
    """

    def __init__(self, processors: LogitsProcessorList, do_sample: bool) -> None:
        self.processors = LogitsProcessorList(
            RowsConstraint.of(p) if isinstance(p, PrefixConstrainedLogitsProcessor) else p for p in processors
        )
        self.do_sample = do_sample
        self.row_local = all(isinstance(p, ROW_LOCAL_PROCESSORS) for p in processors)

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
            at_length = rows[active]  # [a] their rows in the call's batch
            batch_scores = logits.new_zeros(tokens.shape[0], vocab)  # rows not at this length: discarded
            batch_scores[at_length] = logits[active, position]
            processed = self.processors(tokens[:, :length], batch_scores, batch_rows=at_length)
            scores[active, position] = processed[at_length]
        return scores

    def _choose(self, scores: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            b, n, vocab = scores.shape
            return torch.multinomial(scores.reshape(b * n, vocab).softmax(-1), num_samples=1).view(b, n)
        return scores.argmax(-1)


# pick(column [b], step, path tokens so far [b, step], rows still on the path [b]) -> the target's token at that
# block column [b] (rows off the path get a token that is never read)
ColumnPick = Callable[[torch.LongTensor, int, torch.LongTensor, torch.BoolTensor], torch.LongTensor]
# ends(token picked [b], step) -> [b]: the row's text ends with that token (an EOS, or its last budgeted position)
TextEnds = Callable[[torch.LongTensor, int], torch.BoolTensor]


def column_picker(
    picker: TokenPicker,
    logits: torch.Tensor,
    out: torch.LongTensor,
    start: torch.LongTensor,
    rows: torch.LongTensor,
) -> ColumnPick:
    """The target's token at any block column, given the path's tokens before it. logits [b, n + 1, V] of the
    verified block; out [B, W] every row's committed tokens, start [b] the active rows' committed lengths (the anchor
    included), rows [b] their index in `out`.

    Row-local processors choose every column at once (one sample per column under sampling: the path reads the
    sample of each column it reaches, independent of how it got there, so it stays exact); processors that read the
    sequence choose a column when the path reaches it, with the path's tokens as its prefix, for the rows still on
    their path only: they see exactly the prefixes plain generate() shows them."""
    batch = torch.arange(logits.shape[0], device=logits.device)
    if picker.row_local:
        every = picker.at(None, None, rows)(logits)  # [b, n + 1]
        return lambda column, step, path_tokens, alive: every[batch, column]

    def pick(column: torch.LongTensor, step: int, path_tokens: torch.LongTensor, alive: torch.BoolTensor):
        history = out.clone()
        if step:
            places = start[:, None] + torch.arange(step, device=out.device)  # [b, step] inside out's spare room
            history[rows] = history[rows].scatter(1, places, path_tokens)
        live = alive.nonzero().squeeze(1)  # a host read; processors that read the sequence sync per length anyway
        wanted = torch.zeros_like(column)
        wanted[live] = picker.at(history, start[live] + step, rows[live])(logits[live, column[live]][:, None])[:, 0]
        return wanted

    return pick


def follow_path(
    tokens: torch.LongTensor, parents: torch.LongTensor, depth: int, pick: ColumnPick, ends: TextEnds
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """The path the target's own tokens take through the verified block: from the anchor (column 0), the child
    whose token is the target's token at the current column, while there is one and the row's text goes on (no
    draft after an EOS or past the budget is accepted, and no token is picked there).

    tokens / parents [b, n]: each node's token and its parent's block column (node i is column i + 1; a chain's
    node i has parent i); depth: the deepest node's depth. Returns (the path's columns [b, depth + 1], anchor first,
    padded with its last; accepted nodes [b]; the target's token at each path column [b, depth + 1], of which the
    first accepted + 1 are committed: the accepted nodes' tokens, then the target's own)."""
    batch = tokens.shape[0]
    current = torch.zeros(batch, dtype=torch.long, device=tokens.device)  # [b] the column reached
    alive = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    accepted = torch.zeros_like(current)
    path, chosen = [current], []
    for step in range(depth + 1):
        wanted = pick(current, step, torch.stack(chosen, 1) if chosen else tokens[:, :0], alive)  # [b]
        chosen.append(wanted)
        if step == depth:
            break
        match = (parents == current[:, None]) & (tokens == wanted[:, None])  # [b, n]: siblings differ, so one
        found = match.any(1) & alive
        current = torch.where(found, match.long().argmax(1) + 1, current)
        accepted += found.long()
        alive &= found & ~ends(wanted, step)  # a node holding the text's last token is accepted; nothing after it
        path.append(current)
    return torch.stack(path, 1), accepted, torch.stack(chosen, 1)


__all__ = ["PREFIX_PROCESSORS", "ROW_LOCAL_PROCESSORS", "TokenPicker", "column_picker", "follow_path"]
