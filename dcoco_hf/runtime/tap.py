"""The target tap: forward hooks that record the hidden states of a few target layers (a leaf module).

DFlash's drafter reads the target's own hidden states at `target_layer_ids`. Hooks on the target's decoder layers
give exactly the states of the target's verification forwards, with nothing in transformers or the target's class
patched; the engine keeps only rows whose token ids agree with the committed sequence.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .device import device_sync
from .hf_compat import forward_cache


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
    cache = forward_cache(kwargs)
    return ids, width, cache.get_seq_length() if cache is not None else 0


class TargetTap:
    """Forward hooks that record the target's hidden states at `layer_ids` while an engine listens.

    The hooks stay registered while the drafter is attached but record nothing unless `listen()` was called, and
    only forwards run by the thread that called it, so plain use of the target (or another thread's) costs one flag
    test per hooked module and stores nothing.
    """

    # Forwards kept until the engine drains them at its next draft: a verify, up to 64 plain steps the cost-aware
    # schedule takes instead of drafting (`proposal.PROBE_EVERY`), and a final step; every one of them is context.
    def __init__(self, target: nn.Module, layer_ids: list[int], max_pending: int = 68) -> None:
        self.layer_ids = list(layer_ids)
        self.max_pending = max_pending
        self.listening = False
        self.timed = False
        self._owner: weakref.ReferenceType | None = None
        self.pending: list[TargetForward] = []
        self.forward_count = 0
        self.forward_starts: list[int] = []  # first position of each recorded forward
        self.seconds = 0.0
        self.prefill_seconds = 0.0  # of the forwards that start at position 0: the prompt's
        self._thread: int | None = None
        self._current: dict[str, Any] | None = None
        self._on_forward: weakref.WeakMethod | None = None
        layers = decoder_layers(target)
        self._handles = [
            target.register_forward_pre_hook(self._on_start, with_kwargs=True),
            target.register_forward_hook(self._on_end, with_kwargs=True),
        ] + [layers[i].register_forward_hook(partial(self._on_layer, i), with_kwargs=True) for i in self.layer_ids]
        self._device = next(target.parameters()).device
        self._sync = device_sync(self._device, timed=False)

    def listen(
        self, owner: object | None = None, timed: bool = False, on_forward: Callable[[int], None] | None = None
    ) -> None:
        """Start recording this thread's target forwards for `owner` (an engine): forget what earlier ones left.
        `timed`: wait for the device around each forward, so `seconds` is exact on a GPU too (it stalls it).
        `on_forward(width)`: a method of the owner called after each recorded forward with its width in tokens
        (held weakly, like the owner's lifetime: the tap never keeps an engine alive)."""
        self.timed, self._sync = timed, device_sync(self._device, timed)
        self._on_forward = weakref.WeakMethod(on_forward) if on_forward is not None else None
        self.listening, self.pending, self.forward_count, self.seconds, self.prefill_seconds = True, [], 0, 0.0, 0.0
        self.forward_starts, self._thread, self._current = [], threading.get_ident(), None
        # Weak: the target holds the tap through its hooks, and a strong owner (engine -> drafter) would keep every
        # drafter that ever served a call alive, its hooks with it (the finaliser that removes them never runs).
        self._owner = None if owner is None else weakref.ref(owner)

    @property
    def owner(self) -> object | None:
        """The engine now (or last) listening, while it lives."""
        return None if self._owner is None else self._owner()

    def stop(self, owner: object | None = None) -> None:
        """Stop recording (only if `owner` is still the listener: a newer call may have started listening since).
        Counters stay readable until the next `listen()`."""
        if owner is None or self.owner is owner:
            self.listening, self.pending, self._current, self._on_forward = False, [], None, None

    def _mine(self) -> bool:
        return self.listening and threading.get_ident() == self._thread

    def drain(self) -> list[TargetForward]:
        pending, self.pending = self.pending, []
        return pending

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.stop()

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_start(self, module, args, kwargs) -> None:
        if not self._mine():
            return
        self._sync()
        # Rows are aligned by their index in the token sequence (= tokens already in the target's cache), not by
        # RoPE position, which skips padding holes.
        ids, width, start = forward_inputs(args, kwargs)
        self._current = {"ids": ids, "width": width, "start": int(start), "states": {}, "t0": time.perf_counter()}

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_layer(self, layer_id: int, module, args, kwargs, output) -> None:
        current = self._current
        if current is None or not self._mine():
            return
        current["states"][layer_id] = (output[0] if isinstance(output, tuple) else output).detach()

    @torch.compiler.disable  # timing/sync side effects stay out of a compiled target graph
    def _on_end(self, module, args, kwargs, output) -> None:
        if not self._mine():
            return
        current, self._current = self._current, None
        if current is None:
            return
        self._sync()
        elapsed = time.perf_counter() - current["t0"]
        self.seconds += elapsed
        if current["start"] == 0:
            self.prefill_seconds += elapsed
        self.forward_count += 1
        ids, states = current["ids"], current["states"]
        self.forward_starts.append(current["start"])
        callback = self._on_forward() if self._on_forward is not None else None
        if callback is not None:
            callback(current["width"])
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
