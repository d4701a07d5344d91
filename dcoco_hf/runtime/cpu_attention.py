"""Cheaper masked multi-token attention on CPU for targets with grouped key/value heads (GQA).

A verify forward runs a few query rows against the whole cached context under a causal mask. Transformers' SDPA
path passes ``enable_gqa`` to torch only when there is no mask (CUDA's fast kernels refuse masked GQA), so with a
mask it first expands every layer's keys and values to all query heads (``repeat_kv``): a copy of the whole cache,
per layer, per verify forward. Torch's CPU kernel handles masked GQA directly, with the same arithmetic (outputs
bit-identical in our tests). On SmolLM2-135M (9 query / 3 key-value heads, 2-core Intel machine) a 3-token verify
forward cost 1.06-1.13x a 1-token step instead of 1.22-1.25x at 200 cached tokens, and 1.27x instead of 1.51x at 800
(`scripts/verify_cost.py`, which runs both side by side).

Importing `dcoco_hf` registers it with transformers as the attention implementation ``"sdpa_cpu_gqa"``:
``from_pretrained(..., attn_implementation="sdpa_cpu_gqa")`` or ``model.set_attn_implementation("sdpa_cpu_gqa")``
(the CLI's default on CPU). It differs from ``"sdpa"`` in that one case only (CPU, several query rows, grouped
heads, a mask); everything else, every 1-token decoding step included, goes through transformers' own
``sdpa_attention_forward``, so plain `generate()` is bit-for-bit the same, and on a GPU it is plain ``"sdpa"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)

CPU_GQA_ATTENTION = "sdpa_cpu_gqa"


def sdpa_cpu_gqa_forward(
    module: nn.Module,
    query: torch.Tensor,  # [B, heads, Q, D]
    key: torch.Tensor,  # [B, kv_heads, K, D]
    value: torch.Tensor,  # [B, kv_heads, K, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, K] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, except that masked multi-row GQA on CPU skips the key/value expansion."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    masked_rows = attention_mask is not None and query.shape[2] > 1
    # Position biases, soft-capping and sink logits stay with transformers (which handles or refuses them).
    plain_scores = all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux"))
    if not (grouped and masked_rows and plain_scores and query.device.type == "cpu"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, heads, Q, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CPU_GQA_ATTENTION, sdpa_cpu_gqa_forward)
AttentionMaskInterface.register(CPU_GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
