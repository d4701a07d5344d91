"""Which dtype a drafter runs in beside its target, and what quantization the target carries.

A drafter computes on the target's hidden states and ends in the target's own lm_head, so both must agree on one
floating dtype. Our own paths cast at those two seams, but transformers' ``speculation_type="dflash"`` path applies
the target's lm_head to the drafter's output as it comes, and a bfloat16 drafter beside a float32 target (or the
reverse) stops there with a dtype error. `align_drafter_dtype` therefore casts the drafter once, when it is
attached, to `target_compute_dtype(target)`; a small drafter costs little memory either way.

A bitsandbytes target needs nothing else: its 8-bit and 4-bit linears keep their own kernels (the CPU few-rows
layouts only take plain ``nn.Linear`` layers, `cpu_linear._linears`), the decoder layers whose hidden states the
drafter taps are the usual ones, and each quantized linear returns its product in the dtype of its input, so the
residual stream stays in the dtype of the embedding table.
"""

from __future__ import annotations

import torch
from torch import nn

_BNB_PACKAGE = "bitsandbytes"


def target_compute_dtype(target: nn.Module) -> torch.dtype:
    """The dtype of the target's hidden states and lm_head input, which its drafter must compute in.

    That is the dtype of the input embedding table: the decoder keeps its residual stream in it, and bitsandbytes'
    quantized linears cast their product back to their input's dtype whatever they compute in internally
    (`bnb_4bit_compute_dtype`, float16 for 8-bit). A target whose embedding table is itself quantized falls back to
    its first floating-point parameter.
    """
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return _floating_dtype(target, "target")


def align_drafter_dtype(drafter: nn.Module, target: nn.Module) -> str | None:
    """Cast `drafter` (in place) to `target_compute_dtype(target)`; returns a short log text when it cast, else None."""
    want = target_compute_dtype(target)
    have = _floating_dtype(drafter, "drafter")
    if have == want:
        return None
    drafter.to(dtype=want)
    return f"drafter cast from {_name(have)} to {_name(want)}, the dtype of the target's hidden states"


def describe_quantization(target: nn.Module) -> str | None:
    """A short description of the target's weight quantization, None for an unquantized target.

    "8-bit bitsandbytes (LLM.int8(), outlier threshold 6.0)", "4-bit nf4 bitsandbytes, compute float32", or
    "<method>-quantized" for other transformers quantizers.
    """
    config = getattr(getattr(target, "config", None), "quantization_config", None)
    if config is None:
        return None
    data = config if isinstance(config, dict) else config.to_dict()
    method = data.get("quant_method")
    method = str(getattr(method, "value", method))  # QuantizationMethod is an Enum; saved configs hold its value
    if method != _BNB_PACKAGE:
        return f"{method}-quantized"
    if data.get("load_in_8bit"):
        return f"8-bit bitsandbytes (LLM.int8(), outlier threshold {data.get('llm_int8_threshold')})"
    if data.get("load_in_4bit"):
        double = ", double quantization" if data.get("bnb_4bit_use_double_quant") else ""
        compute = str(data.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
        return f"4-bit {data.get('bnb_4bit_quant_type')} bitsandbytes, compute {compute}{double}"
    return f"{method}-quantized"


def quantized_linears(model: nn.Module) -> int:
    """How many of `model`'s linear layers are bitsandbytes' quantized ones (which keep their own kernels)."""
    return sum(type(m).__module__.startswith(_BNB_PACKAGE) for m in model.modules() if isinstance(m, nn.Linear))


def precision_notes(drafter: nn.Module, target: nn.Module) -> list[str]:
    """What `attach` does about dtypes and quantization, as log texts: the drafter's cast (if any) and the target's
    quantization with the number of quantized linears left to bitsandbytes' kernels (if quantized)."""
    notes = []
    cast = align_drafter_dtype(drafter, target)
    if cast is not None:
        notes.append(cast)
    quantization = describe_quantization(target)
    if quantization is not None:
        count = quantized_linears(target)
        kept = f": its {count} quantized linears keep their own kernels" if count else ""
        notes.append(f"target {quantization}{kept}")
    return notes


def _floating_dtype(model: nn.Module, role: str) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    raise ValueError(f"The {role} has no floating-point parameters to take a compute dtype from; load it unquantized.")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = [
    "align_drafter_dtype",
    "describe_quantization",
    "precision_notes",
    "quantized_linears",
    "target_compute_dtype",
]
