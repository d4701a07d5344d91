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

from collections.abc import Callable

import torch
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


class TokenPicker:
    """Chooses the token generate() would choose at a position: its logits processors, then argmax or one sample
    from the processed distribution.

    Processors that read only the logits row (temperature, top_k, ...) run once over all positions. Those that read
    the sequence so far (`PREFIX_PROCESSORS`: repetition_penalty, min_new_tokens, ...) get at each position exactly
    the input_ids row plain generate() gives them there (left-padded prompt, committed tokens, the path's tokens up to
    that position), in a batch of generate()'s shape since some keep per-row state; rows of a ragged batch are at
    different lengths, so there is one call per distinct length (its other rows are processed and discarded).
    """

    def __init__(self, processors: LogitsProcessorList, do_sample: bool) -> None:
        self.processors, self.do_sample = processors, do_sample
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


# pick(column [b], step, path tokens so far [b, step]) -> the target's token at that block column [b]
ColumnPick = Callable[[torch.LongTensor, int, torch.LongTensor], torch.LongTensor]


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
    sequence choose a column when the path reaches it, with the path's tokens as its prefix."""
    batch = torch.arange(logits.shape[0], device=logits.device)
    if picker.row_local:
        every = picker.at(None, None, rows)(logits)  # [b, n + 1]
        return lambda column, step, path_tokens: every[batch, column]

    def pick(column: torch.LongTensor, step: int, path_tokens: torch.LongTensor) -> torch.LongTensor:
        history = out.clone()
        if step:
            places = start[:, None] + torch.arange(step, device=out.device)  # [b, step] inside out's spare room
            history[rows] = history[rows].scatter(1, places, path_tokens)
        return picker.at(history, start + step, rows)(logits[batch, column][:, None])[:, 0]

    return pick


def follow_path(
    tokens: torch.LongTensor, parents: torch.LongTensor, depth: int, pick: ColumnPick
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """The path the target's own tokens take through the verified block: from the anchor (column 0), the child
    whose token is the target's token at the current column, while there is one.

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
        wanted = pick(current, step, torch.stack(chosen, 1) if chosen else tokens[:, :0])  # [b]
        chosen.append(wanted)
        if step == depth:
            break
        match = (parents == current[:, None]) & (tokens == wanted[:, None])  # [b, n]: siblings differ, so one
        found = match.any(1) & alive
        current = torch.where(found, match.long().argmax(1) + 1, current)
        accepted += found.long()
        alive &= found
        path.append(current)
    return torch.stack(path, 1), accepted, torch.stack(chosen, 1)


__all__ = ["PREFIX_PROCESSORS", "ROW_LOCAL_PROCESSORS", "TokenPicker", "column_picker", "follow_path"]
