"""Cheaper few-row forwards on CPU: a linear layer picks, per machine and per row count, the fastest of three ways to
compute the same product.

Speculative decoding pays off only if verifying a block of B tokens costs about as much as one decoding step. On a
memory-bound CPU it should: a 135M fp32 target streams its ~540 MB of weights once per forward either way. But
torch's CPU GEMM (MKL sgemm) is slow for 2 to 16 rows, and which alternative wins depends on the processor:

* ``gemm``: plain ``F.linear``;
* ``transposed``: ``W @ x^T``, the same dot products with the weight as the streamed, unpacked operand. On an AMD
  2-core machine it brought a 4-token forward of SmolLM2-135M from 1.65x to 1.20x the cost of a 1-token step; on an
  Intel (Sapphire Rapids class) 2-core machine it made that forward slower (1.46x -> 1.75x);
* ``packed``: MKL's packed GEMM (``cblas_sgemm_pack`` through ``torch.ops.mkl``), which reorders the weight once
  into the layout its small-row kernels stream best. On that Intel machine the 4-token forward fell to 1.2-1.45x.

`use_few_rows_linear(model)` therefore measures the three on the model's own layers (`tune_few_rows_layout`: every
layer once per timing, so the weights stream from memory as in a real forward) and keeps the fastest per row count.
`scripts/verify_cost.py` measures whole forwards of each layout side by side on any machine.

One row (plain decoding), longer inputs (prefill, training, batched verification) and anything that needs autograd
through a packed weight keep `F.linear`, so plain `generate()` is bit-for-bit unchanged. Verify logits move by float
rounding only (about 1e-7 relative), the same kind of difference any batched verify forward already has.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LAYOUTS = ("gemm", "transposed", "packed")
DEFAULT_MAX_ROWS = 6
# MKL packs a weight for one row differently than for several; every pack built for 2 rows computed 2..64 rows
# identically to the pack built for that row count. `_check_pack` checks this for each layer and row count.
_PACK_ROWS = 2


def packed_available() -> bool:
    """Whether this torch build has MKL's packed GEMM (x86 builds with MKL; not ARM or other BLAS builds)."""
    mkl = getattr(torch.backends, "mkl", None)
    if mkl is None or not mkl.is_available():
        return False
    try:
        torch.ops.mkl._mkl_reorder_linear_weight  # noqa: B018 (raises when the op is not registered)
        torch.ops.mkl._mkl_linear  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def available_layouts() -> tuple[str, ...]:
    return LAYOUTS if packed_available() else LAYOUTS[:2]


def _packed_fits(layers: list[nn.Linear]) -> bool:
    """Whether MKL's packed GEMM can serve these layers: fp32 weights (it is sgemm), whose packed copies fit in free
    memory. Packs took up to twice a weight's bytes (small matrices more, large ones about 1.1-1.3x); a big model on
    a small machine must not swap or die for them."""
    if any(layer.weight.dtype != torch.float32 for layer in layers):
        return False
    need = sum(2 * layer.weight.numel() * layer.weight.element_size() for layer in layers)
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: no reliable figure, trust the caller
        return True
    return need < 0.8 * available


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` that computes 2..len(few_rows_plan)-1 input rows on CPU with the layout its plan names.

    Made by swapping the class of an existing `nn.Linear` (`use_few_rows_linear`), so parameters, state-dict keys,
    hooks and PEFT wrappers are untouched. `few_rows_plan[rows]` is the layout for that many rows.
    """

    few_rows_plan: tuple[str, ...] = ()
    few_rows_dtype: torch.dtype = torch.float32  # the weight dtype the plan was made (and timed) for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        layout = self.few_rows_plan[rows] if 1 < rows < len(self.few_rows_plan) else "gemm"
        # A model cast or moved after its plan was made (`target.half()`, `.to("cuda")`) computes with F.linear: the
        # packed GEMM is fp32-only, and the plan's timings belong to the old dtype and device.
        if layout == "gemm" or x.device.type != "cpu" or self.weight.dtype != self.few_rows_dtype:
            return F.linear(x, self.weight, self.bias)
        # Row-major rows in, row-major rows out: a column-major x (an earlier layer's transposed product) would make
        # x^T contiguous, which sends sgemm down a path 3x slower than F.linear. The copies are a few KB.
        flat = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
        if layout == "packed" and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            out = torch.ops.mkl._mkl_linear(flat, self._packed_weight(rows), self.weight, self.bias, rows)
        else:  # "transposed", and packed layers asked for gradients (the packed op has no backward)
            out = (self.weight @ flat.T).T.contiguous()  # [rows, out]
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _packed_weight(self, rows: int) -> torch.Tensor:
        """MKL's packed copy of the weight, checked for `rows` rows; rebuilt when the weight changes
        (load_state_dict, an optimizer step)."""
        weight = self.weight.detach()
        key = (weight.data_ptr(), 0 if weight.is_inference() else self.weight._version)
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            cached = (key, torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS), set())
            self.__dict__["_packed"] = cached
        if rows not in cached[2]:
            _check_pack(cached[1], weight, self.bias, rows)
            cached[2].add(rows)
        return cached[1]

    def __getstate__(self) -> dict[str, Any]:
        # MKL's packed copy is an opaque tensor that neither copies nor pickles; the copy's `_packed_weight` packs
        # (and checks) its own weight on first use, so deep copies and pickles of a laid-out model work.
        state = super().__getstate__()
        state.pop("_packed", None)
        return state


def _check_pack(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
    """One product of a random probe through the packed weight against F.linear: a pack whose format did not fit
    this row count would give garbage, never a near miss."""
    probe = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows), dtype=weight.dtype)
    bias = None if bias is None else bias.detach()
    got = torch.ops.mkl._mkl_linear(probe, packed, weight, bias, rows)
    expected = probe @ weight.T + (0 if bias is None else bias)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        raise RuntimeError(
            f"MKL's packed GEMM gave wrong results for {rows} rows on a {tuple(weight.shape)} weight with this torch "
            "build; use use_few_rows_linear(model, layout='transposed') or layout='gemm' instead."
        )


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The layers a few-rows layout may take over: exactly `nn.Linear` (or already `FewRowsLinear`) holding a plain
    floating-point weight.

    Subclasses keep their own forward: bitsandbytes' Linear8bitLt and Linear4bit (int8 / packed 4-bit weights and
    their own kernels), LoRA wrappers (the plain layers inside them count). So do plain `nn.Linear` layers whose
    weight is a quantized tensor subclass (torchao) or not floating point, which none of the layouts can compute.
    """
    return [
        m
        for m in model.modules()
        if type(m) in (nn.Linear, FewRowsLinear)
        and type(m.weight) in (nn.Parameter, torch.Tensor)
        and m.weight.is_floating_point()
    ]


def use_few_rows_linear(
    model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS, layout: str | Mapping[int, str] = "auto"
) -> dict[int, str]:
    """Switch every plain `nn.Linear` of `model` (in place) to `FewRowsLinear`; returns the plan {rows: layout}.

    layout: "auto" (time the layouts on this machine with `tune_few_rows_layout`, a few seconds for a 135M model;
    the packed GEMM only where its copies of the weights fit in free memory), one of `LAYOUTS` for every row count
    2..max_rows, or an explicit {rows: layout}. Packed copies are made (and checked) here, once. Undo with
    `restore_linear`.
    """
    if max_rows < 2:
        raise ValueError(f"max_rows={max_rows} disables the few-rows path; use restore_linear(model) instead.")
    if isinstance(layout, str) and layout == "auto":
        tuned = tune_few_rows_layout(model, _rows_to_time(max_rows))
        # Between timed counts, a row count takes the layout of the nearest timed count below it.
        plan = {rows: tuned[max(t for t in tuned if t <= rows)] for rows in range(2, max_rows + 1)}
    elif isinstance(layout, str):
        plan = {rows: layout for rows in range(2, max_rows + 1)}
    else:
        plan = dict(layout)
    if set(plan.values()) - set(available_layouts()) or min(plan, default=2) < 2:
        raise ValueError(
            f"Few-rows plan {plan} is not valid here: layouts must be among {available_layouts()} ('packed' needs an "
            "MKL build of torch), for row counts of 2 or more."
        )
    layers = _linears(model)
    if "packed" in plan.values() and not _packed_fits(layers):
        raise ValueError(
            "MKL's packed GEMM needs fp32 weights whose packed copies (up to twice their size) fit in free memory, "
            "and this model's do not; use use_few_rows_linear(model, layout='transposed') or layout='auto', which "
            "then skips the packed GEMM."
        )
    _set_plan(layers, plan)
    packed_rows = [rows for rows, name in plan.items() if name == "packed"]
    for layer in layers:
        if not packed_rows:
            layer.__dict__.pop("_packed", None)  # MKL's packed copy of the weight: as large as the weight or more
        elif layer.weight.device.type == "cpu":
            # Pack and check now, so that neither the first verify forward nor a timing pays for it.
            with torch.no_grad():
                for rows in packed_rows:
                    layer._packed_weight(rows)
    return plan


def _rows_to_time(max_rows: int) -> list[int]:
    """Every count up to 8 (single-sequence blocks), then about two per octave (batched verifies): 2..64 in 13."""
    counts = set(range(2, min(max_rows, 8) + 1)) | {max_rows}
    edge = 8
    while edge < max_rows:
        counts |= {edge + edge // 2, 2 * edge}
        edge *= 2
    return sorted(c for c in counts if c <= max_rows)


def _set_plan(layers: list[nn.Linear], plan: Mapping[int, str]) -> None:
    table = ["gemm"] * (max(plan, default=1) + 1)
    for rows, name in plan.items():
        table[rows] = name
    for layer in layers:
        layer.__class__ = FewRowsLinear
        layer.few_rows_plan = tuple(table)
        layer.few_rows_dtype = layer.weight.dtype


@torch.no_grad()
def tune_few_rows_layout(model: nn.Module, rows: Iterable[int], repeats: int = 4) -> dict[int, str]:
    """The fastest layout for each row count, timed on `model`'s own linear layers on this machine.

    One timing runs every layer of the model once, in module order, on a random input of that many rows: the same
    weights stream through the caches as in a real forward, without the rest of the model. Each layout is warmed up
    first (packing happens there), then the layouts are interleaved and the best of `repeats` kept, so a noisy
    machine biases none of them. Best of 2 let disturbed spells pick MKL's packed GEMM for 2-3 rows on a 2-core
    Intel machine in 2 of 13 tunings of one day, ~10% slower per verify there than torch's GEMM; best of 4 costs
    ~2 s more for SmolLM2-135M. The model's layers are left as they were.
    """
    layers = [m for m in _linears(model) if m.weight.device.type == "cpu"]
    rows = list(rows)
    if not layers:
        return {r: "gemm" for r in rows}
    layouts = [name for name in available_layouts() if name != "packed" or _packed_fits(layers)]
    before = [(layer, layer.__class__, layer.__dict__.get("few_rows_plan"), layer.__dict__.get("few_rows_dtype"))
              for layer in layers]
    dtype = layers[0].weight.dtype
    inputs = {r: {n: torch.randn(r, n, dtype=dtype) for n in {m.in_features for m in layers}} for r in rows}
    best: dict[tuple[int, str], float] = {}
    for attempt in range(repeats + 1):
        for name in layouts:
            _set_plan(layers, {r: name for r in rows})
            for r in rows:
                start = time.perf_counter()
                for layer in layers:
                    layer(inputs[r][layer.in_features])
                if attempt:  # the first round only warms up (and packs)
                    best[r, name] = min(best.get((r, name), float("inf")), time.perf_counter() - start)
    for layer, cls, plan, dtype in before:
        layer.__class__ = cls
        for name in ("_packed", "few_rows_plan", "few_rows_dtype"):
            layer.__dict__.pop(name, None)
        if plan is not None:
            layer.few_rows_plan, layer.few_rows_dtype = plan, dtype
    return {r: min(layouts, key=lambda name: best[r, name]) for r in rows}


def restore_linear(model: nn.Module) -> int:
    """Turn every `FewRowsLinear` of `model` back into a plain `nn.Linear`; returns how many were restored."""
    restored = 0
    for module in model.modules():
        if type(module) is FewRowsLinear:
            module.__class__ = nn.Linear
            for name in ("few_rows_plan", "few_rows_dtype", "_packed"):  # _packed: MKL's packed copy of the weight
                module.__dict__.pop(name, None)
            restored += 1
    return restored


def few_rows_plan(model: nn.Module) -> dict[int, str] | None:
    """The {rows: layout} plan of `model`'s `FewRowsLinear` layers, or None when it has none (for run records)."""
    for module in model.modules():
        if type(module) is FewRowsLinear:
            return {rows: name for rows, name in enumerate(module.few_rows_plan) if rows > 1}
    return None
