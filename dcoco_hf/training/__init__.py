"""Training the DCOCO drafter: data regeneration, the packed DFlash objective, the joint DCOCO stage, Trainer glue."""

from .losses import (
    dcoco_loss,
    dflash_loss,
    pack_blocks,
    sample_anchors,
    transition_labels,
)
from .objective import DrafterLoss, drafter_loss, fit_on_own_answers, target_context
from .retarget import lora_config_for_drafter, measure_tau

__all__ = [
    "DrafterLoss",
    "dcoco_loss",
    "dflash_loss",
    "drafter_loss",
    "fit_on_own_answers",
    "lora_config_for_drafter",
    "measure_tau",
    "pack_blocks",
    "sample_anchors",
    "target_context",
    "transition_labels",
]
