"""Retargeting a trained drafter + corrector to a different verifier that shares the tokenizer, with LoRA only.

A fine-tuned copy of the target keeps the vocabulary, hidden size and layer count, so the drafter still attaches, but
its hidden states and greedy continuations drift and acceptance (tau) drops. Instead of retraining, train LoRA
adapters on the drafter's linear layers with the usual stage-2 objective on data the NEW target regenerated, and ship
only the adapter (`adapter_model.safetensors`, loadable with `PeftModel.from_pretrained(drafter, folder)`).
Training is a stage-2 `DrafterTrainingModel` around the PEFT model, which leaves PEFT's trainable flags alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..runtime.stats import DCOCOStats

if TYPE_CHECKING:  # peft loads lazily: `import dcoco_hf.training` stays light
    from peft import LoraConfig

BACKBONE_LINEARS = ["fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# `delta_logits` is read through its `.weight` in DCOCOCorrector.forward, so a LoRA wrapper there would never apply.
CORRECTOR_LINEARS = ["cand_proj", "ctx_proj", "fuse_proj", "pair_proj", "delta_pair", "delta_prev", "delta_next",
                     "delta_out"]


def lora_config_for_drafter(r: int = 16, alpha: int = 32, include_corrector: bool = True) -> LoraConfig:
    """LoRA on the drafter backbone's linears (and the corrector's, except `delta_logits`)."""
    from peft import LoraConfig

    modules = BACKBONE_LINEARS + (CORRECTOR_LINEARS if include_corrector else [])
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules)


@torch.no_grad()
def measure_tau(target: nn.Module, drafter: nn.Module, prompts_ids: list[torch.LongTensor], max_new_tokens: int
                ) -> float:
    """Committed tokens per target forward of greedy `target.generate(..., assistant_model=drafter)` over prompts.

    prompts_ids: token id tensors [T] or [1, T]. `drafter` may be a DCOCODrafter or a PeftModel around one. Whole
    blocks are proposed every cycle (the constant schedule), so tau measures the drafter, not the machine's costs.
    """
    config = drafter.generation_config
    saved, config.num_assistant_tokens_schedule = config.num_assistant_tokens_schedule, "constant"
    try:
        return _measure_tau(target, drafter, prompts_ids, max_new_tokens)
    finally:
        config.num_assistant_tokens_schedule = saved


def _measure_tau(target: nn.Module, drafter: nn.Module, prompts_ids: list[torch.LongTensor], max_new_tokens: int
                 ) -> float:
    return held_out_stats(target, drafter, prompts_ids, max_new_tokens).tau


def held_out_stats(target: nn.Module, drafter: nn.Module, prompts_ids: list[torch.LongTensor], max_new_tokens: int
                   ) -> DCOCOStats:
    """The summed statistics (tau, per-slot chain acceptance) of greedy assisted generation over prompts, with the
    drafter's own schedule (`measure_tau` sets the constant one)."""
    total = DCOCOStats()
    for ids in prompts_ids:
        ids = ids.long().view(1, -1).to(target.device)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, assistant_model=drafter)
        total = total + drafter.generation_stats(out)
    return total


__all__ = ["BACKBONE_LINEARS", "CORRECTOR_LINEARS", "held_out_stats", "lora_config_for_drafter", "measure_tau"]
