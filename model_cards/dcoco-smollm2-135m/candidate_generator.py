"""`DCOCOCandidateGenerator`: the speculation engine behind `target.generate(..., assistant_model=drafter)`.

One engine lives exactly as long as one target `generate()` call and holds all its state: the target hidden-state
capture, the drafter's context cache and the statistics. It reaches `generate()` through transformers' public
assisted-generation path (the drafter's `generate()` is called once per cycle, see `DCOCODrafter.generate`), so
neither transformers nor the target's class is patched.

Target hidden states come from forward hooks on the target's decoder layers (`TargetTap`): they are exactly the
states of the target's own verification forwards. A forward's rows become drafter context only where its token ids
agree with the committed sequence and lie strictly before the anchor, so rejected drafts, new prompts and multi-turn
continuations take care of themselves.

Lossless by construction: the target verifies every proposal. The proposal is deterministic, so its "draft
distribution" is a point mass, and we hand transformers ONE-HOT logits; its speculative sampling then accepts with
probability q_target(y) and resamples from q_target restricted to v != y, which is exact (DCOCO appendix G).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.generation.candidate_generator import CandidateGenerator

if TYPE_CHECKING:
    from .modeling_dcoco import DCOCODrafter, DraftProposal


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a Hugging Face causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ValueError(
        f"Cannot find the decoder layers of {type(model).__name__} (expected `model.get_decoder().layers`); "
        "DCOCO drafters need a standard Hugging Face decoder-only causal LM."
    )


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


@dataclass
class TargetForward:
    """Token ids, positions and tapped hidden states of one target forward (row 0..B-1)."""

    ids: torch.LongTensor  # [B, n]
    positions: torch.LongTensor  # [B, n] index of each token in its sequence
    states: torch.Tensor  # [B, n, n_layers * H]


def forward_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, int, int | torch.Tensor]:
    """(input_ids or None, input width, cache length) of a target forward, read in a forward pre-hook.

    The cache length is the index of the forward's first token in the sequence. A static cache returns it as a live
    device tensor that the forward then advances in place: callers copy it or convert it before the forward runs.
    """
    ids = kwargs.get("input_ids", args[0] if args else None)
    width = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return ids, width, cache.get_seq_length() if cache is not None else 0


class TargetTap:
    """Forward hooks that record the target's hidden states at `layer_ids` while an engine listens.

    The hooks stay registered while the drafter is attached but record nothing unless `listen()` was called, so
    plain use of the target costs one flag test per hooked module.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], max_pending: int = 4) -> None:
        self.layer_ids = list(layer_ids)
        self.max_pending = max_pending
        self.listening = False
        self.pending: list[TargetForward] = []
        self.forward_count = 0
        self.forward_starts: list[int] = []  # first position of each recorded forward
        self.seconds = 0.0
        self._current: dict[str, Any] | None = None
        layers = decoder_layers(target)
        self._handles = [
            target.register_forward_pre_hook(self._on_start, with_kwargs=True),
            target.register_forward_hook(self._on_end, with_kwargs=True),
        ] + [layers[i].register_forward_hook(partial(self._on_layer, i), with_kwargs=True) for i in self.layer_ids]
        self._sync = torch.cuda.synchronize if next(target.parameters()).device.type == "cuda" else (lambda: None)

    def listen(self) -> None:
        """Start recording for a new engine: forget what earlier engines left behind."""
        self.listening, self.pending, self.forward_count, self.seconds = True, [], 0, 0.0
        self.forward_starts = []

    def drain(self) -> list[TargetForward]:
        pending, self.pending = self.pending, []
        return pending

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.listening = False

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_start(self, module, args, kwargs) -> None:
        if not self.listening:
            return
        self._sync()
        # Rows are aligned by their index in the token sequence (= tokens already in the target's cache), not by
        # RoPE position, which skips padding holes.
        ids, _, start = forward_inputs(args, kwargs)
        self._current = {"ids": ids, "start": int(start), "states": {}, "t0": time.perf_counter()}

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_layer(self, layer_id: int, module, args, kwargs, output) -> None:
        current = self._current
        if current is None:
            return
        current["states"][layer_id] = (output[0] if isinstance(output, tuple) else output).detach()

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_end(self, module, args, kwargs, output) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        self._sync()
        self.seconds += time.perf_counter() - current["t0"]
        self.forward_count += 1
        ids, states = current["ids"], current["states"]
        self.forward_starts.append(current["start"])
        if ids is None or len(states) != len(self.layer_ids):
            return  # an inputs_embeds forward: no context for the drafter, still lossless
        positions = current["start"] + torch.arange(ids.shape[1], device=ids.device)
        self.pending.append(
            TargetForward(
                ids=ids,
                positions=positions.expand_as(ids),
                states=torch.cat([states[i] for i in self.layer_ids], dim=-1),
            )
        )
        del self.pending[: -self.max_pending]


@dataclass
class DCOCOStats:
    """Per-call statistics: tau = committed tokens per target forward (accepted drafts + the target's own token)."""

    block_size: int
    top_k: int
    cycles: int = 0
    committed_tokens: int = 0
    target_forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    corrector_seconds: float = 0.0
    target_seconds: float = 0.0
    # per drafted slot (1..S): cycles whose slot was proposed / accepted / whose committed token was top-1 / top-K
    slot_proposed: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    slot_top1: list[int] = field(default_factory=list)
    slot_topk: list[int] = field(default_factory=list)
    slot_seen: list[int] = field(default_factory=list)
    # per drafted slot s: cycles whose committed tokens at slots 1..s were all top-1 / all inside the top-K / top-1
    # at slot 1 and inside the top-K after it (the most the paper's prefix-first walk can reach)
    prefix_top1: list[int] = field(default_factory=list)
    prefix_topk: list[int] = field(default_factory=list)
    prefix_walk: list[int] = field(default_factory=list)

    _SLOT_FIELDS = ("slot_proposed", "slot_accepted", "slot_top1", "slot_topk", "slot_seen", "prefix_top1",
                    "prefix_topk", "prefix_walk")

    def __post_init__(self) -> None:
        slots = self.block_size - 1
        for name in self._SLOT_FIELDS:
            if not getattr(self, name):
                setattr(self, name, [0] * slots)

    @property
    def tau(self) -> float:
        return self.committed_tokens / max(self.target_forwards, 1)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)

    def accept_hist(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted).items()))

    def prefix_tau(self, runs: str) -> float | None:
        """Tokens per verify these cycles would commit if each kept its longest run of right slots, counting a slot
        right when the committed token was
        - "top1": the drafter's top-1 (what argmax drafting of the same blocks earns);
        - "topk": anywhere in its top-K (the ceiling of every walk over these candidates, a perfect corrector's);
        - "walk": the top-1 at slot 1 and anywhere in the top-K after it (the ceiling of the paper's prefix-first
          walk, which only re-selects successors).
        """
        prefixes = {"top1": self.prefix_top1, "topk": self.prefix_topk, "walk": self.prefix_walk}
        if runs not in prefixes:
            raise ValueError(f"runs={runs!r} is unknown; choose one of {sorted(prefixes)}.")
        prefix = prefixes[runs]
        if not self.slot_seen or not self.slot_seen[0]:
            return None
        return 1 + sum(n / d for n, d in zip(prefix, self.slot_seen) if d)

    def as_dict(self) -> dict[str, Any]:
        def ratio(num: list[int], den: list[int]) -> list[float | None]:
            return [n / d if d else None for n, d in zip(num, den)]

        return {
            "cycles": self.cycles,
            "committed_tokens": self.committed_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "mean_accepted": self.mean_accepted,
            "accept_hist": self.accept_hist(),
            "per_slot_accept": ratio(self.slot_accepted, self.slot_proposed),
            "coverage_top1": ratio(self.slot_top1, self.slot_seen),
            "coverage_topk": ratio(self.slot_topk, self.slot_seen),
            "argmax_prefix_tau": self.prefix_tau("top1"),
            "topk_ceiling_tau": self.prefix_tau("topk"),
            "walk_ceiling_tau": self.prefix_tau("walk"),
            "drafter_seconds": self.drafter_seconds,
            "corrector_seconds": self.corrector_seconds,
            "target_seconds": self.target_seconds,
        }

    def merge(self, other: "DCOCOStats") -> "DCOCOStats":
        """Sum of two runs' statistics (for benchmark totals)."""
        merged = DCOCOStats(self.block_size, self.top_k)
        for name in ("cycles", "committed_tokens", "target_forwards", "drafter_seconds", "corrector_seconds",
                     "target_seconds"):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.accepted = self.accepted + other.accepted
        for name in self._SLOT_FIELDS:
            setattr(merged, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        return merged


class DCOCOCandidateGenerator(CandidateGenerator):
    """Drafts corrected DFlash blocks for one `generate()` call of the drafter's attached target.

    Args:
        drafter: an attached `DCOCODrafter`.
        generation_config: the target's generation config (unused beyond validation; kept for the transformers API).
        selection: walk override ("greedy" | "viterbi" | "geometric"); default the drafter's config.
        correct: False proposes plain DFlash argmax blocks (same weights, corrector off).
    """

    def __init__(
        self,
        drafter: "DCOCODrafter",
        generation_config: Any | None = None,
        selection: str | None = None,
        correct: bool = True,
    ) -> None:
        self.drafter = drafter
        self.target = drafter.target  # raises the clear "not attached" error
        self.tap = drafter.tap
        self.selection = selection
        self.correct = correct
        self.cache = DraftContextCache()
        self.context_end = 0  # every committed position below this is in the drafter cache (or was never seen)
        self.stats = DCOCOStats(drafter.config.block_size, drafter.config.top_k)
        self._pending_cycle: tuple[int, int, int, DraftProposal] | None = None  # (len, drafted, forwards, proposal)
        self._closed_sequence: torch.LongTensor | None = None
        self._last_committed: torch.LongTensor | None = None
        self._slot_candidates: list[tuple[int, torch.Tensor]] = []  # (committed length, [S, K]) per cycle
        self.tap.listen()

    def get_candidates(
        self, input_ids: torch.LongTensor, max_new_tokens: int | None = None, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """input_ids [1, L] (committed) -> (candidate ids [1, L + k], one-hot candidate logits [1, k, V])."""
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"transformers' assisted generation runs one sequence at a time (got batch {input_ids.shape[0]}); "
                "use dcoco_hf.speculative_generate(target, drafter, input_ids, attention_mask=...) for batches."
            )
        committed = input_ids[0]
        self._finish_cycle(committed)
        context, positions = self._new_context(committed)
        length = committed.shape[0]
        block_positions = torch.arange(length - 1, length - 1 + self.drafter.config.block_size, device=input_ids.device)
        position_ids = torch.cat([positions, block_positions])[None]
        proposal = self.drafter.propose(
            committed[-1:], context[None], position_ids, self.cache, selection=self.selection, correct=self.correct,
            context_ids=committed[None],
        )
        limit = self.drafter.config.block_size - 1 if max_new_tokens is None else max_new_tokens
        tokens = proposal.tokens[:, :limit]
        self.stats.drafter_seconds += proposal.backbone_seconds
        self.stats.corrector_seconds += proposal.corrector_seconds
        self._pending_cycle = (length, tokens.shape[1], self.tap.forward_count, proposal)
        self._last_committed = committed
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=1), one_hot_logits(tokens, self.vocab_size)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """DCOCO blocks have a fixed length: nothing to adapt."""

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().weight.shape[0]

    def close(self, sequences: torch.LongTensor) -> None:
        """Account for the last cycle, which transformers ends without calling the drafter again.

        Raises if `sequences` did not come from this engine's generate() call (for instance a later call with too
        few new tokens to draft never consulted the drafter): statistics are never silently attributed to it.
        """
        if self._closed_sequence is not None:  # closed already: only the very same sequences may ask again
            if not torch.equal(sequences[0].to(self._closed_sequence.device), self._closed_sequence):
                raise RuntimeError(_OTHER_CALL)
            return
        self._check_same_call(sequences[0])
        self._finish_cycle(sequences[0])
        self._book_coverage(sequences[0])
        self._closed_sequence = sequences[0].clone()
        self.stats.target_forwards = self.tap.forward_count
        self.stats.target_seconds = self.tap.seconds
        self.tap.listening = False  # the call is over: plain use of the target records nothing more

    # ------------------------------------------------------------------ internals

    def _new_context(self, committed: torch.LongTensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """Rows of the target forwards since the last draft that are committed, before the anchor and not yet in
        the drafter cache: ([n, n_layers * H], [n])."""
        anchor_position = committed.shape[0] - 1
        rows, positions = [], []
        for forward in self.tap.drain():
            ids, pos = forward.ids[0].to(committed.device), forward.positions[0].to(committed.device)
            inside = pos < anchor_position
            agrees = inside & (committed[pos.clamp(max=anchor_position)] == ids)
            agreeing = int(agrees.long().cumprod(0).sum())  # a state is valid only if every earlier token agrees
            fresh = (pos[:agreeing] >= self.context_end).nonzero()
            if agreeing == 0 or fresh.numel() == 0:
                continue
            first = int(fresh[0])
            rows.append(forward.states[0, first:agreeing])
            positions.append(pos[first:agreeing])
            self.context_end = int(pos[agreeing - 1]) + 1
        width = len(self.drafter.config.target_layer_ids) * self.drafter.config.hidden_size
        if not rows:
            device = committed.device
            return torch.zeros(0, width, device=device, dtype=self.drafter.dtype), committed.new_zeros(0)
        return torch.cat(rows), torch.cat(positions)

    def _finish_cycle(self, committed: torch.LongTensor) -> None:
        """Book the previous cycle now that its committed tokens are known."""
        if self._pending_cycle is None:
            return
        length, drafted, forwards_before, proposal = self._pending_cycle
        self._pending_cycle = None
        if self.tap.forward_count == forwards_before:
            raise RuntimeError(
                "The drafter's target ran no forward since the last draft: generate() was called on a different "
                "model than the one this drafter is attached to. Call `drafter.attach(model)` for the model you "
                "generate with."
            )
        new = committed.shape[0] - length
        # Every target forward commits one token of its own. Only the first one after the draft verified it; more
        # follow only at the end of a call, when transformers has stopped drafting (no room left for a draft).
        accepted = max(0, min(new - (self.tap.forward_count - forwards_before), drafted))
        stats = self.stats
        stats.cycles += 1
        stats.committed_tokens += new
        stats.accepted.append(accepted)
        for slot in range(drafted):
            stats.slot_proposed[slot] += 1
            stats.slot_accepted[slot] += slot < accepted
        self._slot_candidates.append((length, proposal.candidates[0]))

    def _check_same_call(self, sequence: torch.LongTensor) -> None:
        length, _, forwards_before, _ = self._pending_cycle or (0, 0, self.tap.forward_count, None)
        last = self._last_committed
        later_starts = self.tap.forward_starts[forwards_before:]
        if forwards_before == 0:
            # The call's first draft precedes its prefill, which verifies it and starts where the prompt cache ends.
            later_starts = later_starts[1:]
        same = (
            last is not None
            and sequence.shape[0] >= last.shape[0]
            and torch.equal(sequence[: last.shape[0]].to(last.device), last)
            and len(later_starts) <= 2
            and all(start >= last.shape[0] - 1 for start in later_starts)
        )
        if not same:
            raise RuntimeError(_OTHER_CALL)

    def _book_coverage(self, sequence: torch.LongTensor) -> None:
        """Per slot: was the token finally committed at that position the drafter's top-1, or inside its top-K?"""
        stats = self.stats
        for length, candidates in self._slot_candidates:  # candidates [S, K]
            truth = sequence[length : length + candidates.shape[0]].to(candidates.device)
            hits = candidates[: truth.shape[0]] == truth[:, None]  # [s, K]
            top1_run = hits[:, 0].long().cumprod(0)  # [s] 1 while every slot so far was top-1
            topk_run = hits.any(-1).long().cumprod(0)  # [s] 1 while every slot so far was inside the top-K
            walk_run = topk_run * hits[0, 0].long()  # [s] the same, with slot 1 the drafter's top-1
            for slot in range(truth.shape[0]):
                stats.slot_seen[slot] += 1
                stats.slot_top1[slot] += bool(hits[slot, 0])
                stats.slot_topk[slot] += bool(hits[slot].any())
                stats.prefix_top1[slot] += int(top1_run[slot])
                stats.prefix_topk[slot] += int(topk_run[slot])
                stats.prefix_walk[slot] += int(walk_run[slot])
        self._slot_candidates = []


_OTHER_CALL = (
    "These sequences did not come from the last generate() call that consulted this drafter (a call with fewer than 2 "
    "new tokens never drafts). Statistics exist only for calls that used the drafter."
)


def one_hot_logits(tokens: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
    """Logits of a point-mass proposal: 0 at the proposed token, -inf elsewhere. [B, k] -> [B, k, V]."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)
