"""Cheaper verify forwards on CPU: compute a linear layer as ``W @ x^T`` when its input has only a few rows.

Speculative decoding pays off only if verifying a block of B tokens costs about as much as one decoding step. On a
memory-bound CPU it should: a 135M fp32 target streams its ~540 MB of weights once per forward either way. But
torch's CPU GEMM (MKL sgemm) is slow for 2 to 6 rows: on the 2-core development machine a 4-token forward of
SmolLM2-135M cost 1.65x a 1-token step, most of it in `F.linear`. Computing the transposed product ``W @ x^T`` runs
the same dot products with the weight as the streamed, unpacked operand, at about the cost of the 1-row GEMV: the
4-token forward then cost 1.20x a step.
`scripts/verify_cost.py` measures both layouts side by side on any machine.

Only inputs of 2..max_rows rows on CPU take the transposed path. One row (plain decoding) and longer inputs
(prefill, training, batched verification) keep `F.linear`, so plain `generate()` is bit-for-bit unchanged. Verify
logits move by float rounding only (about 1e-7 relative, closer to the 1-row results than sgemm's own), the same
kind of difference any batched verify forward already has.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# SmolLM2-135M forward on the 2-core dev machine, x a 1-token step (GEMM vs W @ x^T): 4 rows 1.65x vs 1.20x,
# 5 rows 1.67x vs 1.40x, 6 rows 1.69x vs 1.52x, 8 rows 1.75x vs 1.88x.
DEFAULT_MAX_ROWS = 6


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` that takes the ``W @ x^T`` layout for 2..`few_rows_max` input rows on CPU.

    Made by swapping the class of an existing `nn.Linear` (`use_few_rows_linear`), so parameters, state-dict keys,
    hooks and PEFT wrappers are untouched.
    """

    few_rows_max: int = DEFAULT_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 < rows <= self.few_rows_max or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        # Row-major rows in, row-major rows out: a column-major x (an earlier layer's transposed product) would make
        # x^T contiguous, which sends sgemm down a path 3x slower than F.linear. The two copies are a few KB.
        rows_major = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
        out = (self.weight @ rows_major.T).T.contiguous()  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_few_rows_linear(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Switch every plain `nn.Linear` of `model` (in place) to `FewRowsLinear`; returns how many were switched.

    Subclasses of `nn.Linear` (quantised layers, for instance) keep their own forward; LoRA wrappers keep theirs
    and the plain `nn.Linear` layers inside them are switched. Undo with `restore_linear`.
    """
    if max_rows < 2:
        raise ValueError(f"max_rows={max_rows} disables the transposed path; use restore_linear(model) instead.")
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear or type(module) is FewRowsLinear:
            module.__class__ = FewRowsLinear
            module.few_rows_max = max_rows
            switched += 1
    return switched


def restore_linear(model: nn.Module) -> int:
    """Turn every `FewRowsLinear` of `model` back into a plain `nn.Linear`; returns how many were restored."""
    restored = 0
    for module in model.modules():
        if type(module) is FewRowsLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("few_rows_max", None)
            restored += 1
    return restored


def few_rows_max(model: nn.Module) -> int | None:
    """The row limit of `model`'s `FewRowsLinear` layers, or None when it has none (for run records)."""
    limits = {module.few_rows_max for module in model.modules() if type(module) is FewRowsLinear}
    return max(limits) if limits else None
