"""`transformers.Trainer` glue for drafter training: a wrapper module, a collator and a Trainer subclass.

The wrapper registers only the drafter as a submodule, so checkpoints, DDP, FSDP and DeepSpeed see exactly the
trainable weights; the frozen target rides along unregistered and follows the drafter's device. `accelerate launch`
therefore needs no code change. Target context (hidden states + argmax labels) comes from cached feature shards when
the dataset provides them, else it is computed online with the same hooks inference uses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from .losses import pair_loss_fn
from .objective import drafter_loss, target_context
from .phases import SLOT_WEIGHTINGS


class DrafterTrainingModel(nn.Module):
    """The drafter (trainable) next to its frozen target. `stage` 1 = DFlash only, 2 = DFlash + DCOCO.

    `corrector_only` (stage 2) freezes the backbone and trains the corrector alone: a cheap extra stage for a drafter
    whose backbone is done, since no gradient then flows through the drafter's layers. `evidence_only` (stage 2, a
    LiLiCorr head with pair evidence) trains that evidence alone (`lilicorr.PairEvidence`), so the head's own scores,
    and its public export, stay exactly as they were.

    `block_sizes` trains mixed horizons (DScout: every update draws its block size with equal frequency, and one
    checkpoint then serves each of those sizes about as well as a drafter trained on it alone). Training forwards
    take the sizes in turn. Worth it because the best drafting size depends on the machine (tau / cycle time), while
    a slot attends to every later mask slot of its block, so a drafter trained on one size drafts others less well.
    Default: the drafter's `config.block_size` alone. A longer size becomes its `config.block_size` (the longest it
    drafts), except for a head sized for its block (LiLiCorr), which is refused.

    `pair_loss` (stage 2): "joint", the paper's cross-entropy over each pair's K^2 transitions, or "successor", over
    the true predecessor's K successors only (the one decision the prefix-first walk makes).

    `slot_weighting`: how the DFlash slot loss weighs slots, "decay" (exp(-(k-1)/gamma)) or "awl" (DScout's
    acceptance-weighted loss). A drafter with `corrector_type="lilicorr"` trains its LiLiCorr head in stage 2.
    """

    def __init__(self, drafter: nn.Module, target: nn.Module, stage: int = 1, num_anchors: int = 16,
                 gamma: float | None = None, rho: float = 4.0, corrector_only: bool = False,
                 block_sizes: Sequence[int] | None = None, pair_loss: str = "joint",
                 slot_weighting: str = "decay", evidence_only: bool = False) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"stage={stage}: use 1 (DFlash) or 2 (joint DFlash + DCOCO).")
        self.block_sizes = tuple(block_sizes or (drafter.config.block_size,))
        if min(self.block_sizes) < 2:
            raise ValueError(f"block_sizes={list(self.block_sizes)}: a block is the anchor plus at least one mask "
                             "slot, so every size must be >= 2.")
        longest = max(self.block_sizes)
        if longest > drafter.config.block_size:  # saved with the drafter: it may then draft up to it
            if drafter.corrector.sized_by_block:
                raise ValueError(
                    f"block_sizes={list(self.block_sizes)}: this {drafter.config.corrector_type} head is sized for "
                    f"blocks up to {drafter.config.block_size}; build the drafter with block_size={longest}."
                )
            drafter.config.block_size = longest
        self._training_forwards = 0  # picks the block size of the next training forward
        if corrector_only and (stage != 2 or hasattr(drafter, "peft_config")):
            raise ValueError("corrector_only trains the corrector on the DCOCO loss: it needs stage=2 and a plain "
                             "(non-PEFT) drafter.")
        self.drafter = drafter
        self.__dict__["target"] = target.eval().requires_grad_(False)  # unregistered: never saved, never wrapped
        pair_loss_fn(pair_loss)  # refuse an unknown name now rather than at the first training step
        self.stage, self.num_anchors, self.gamma, self.rho = stage, num_anchors, gamma, rho
        self.pair_loss = pair_loss
        if slot_weighting not in SLOT_WEIGHTINGS:
            raise ValueError(f"slot_weighting={slot_weighting!r} is unknown; choose one of {SLOT_WEIGHTINGS}.")
        self.slot_weighting = slot_weighting
        if corrector_only:
            drafter.requires_grad_(False)  # the corrector is switched back on just below
        # Stage 1 leaves the zero-output corrector untouched; stage 2 trains it jointly with the backbone. A PEFT
        # drafter already trains exactly its adapters, so its flags stay as PEFT set them.
        if not hasattr(drafter, "peft_config"):
            drafter.corrector.requires_grad_(stage == 2)
        if evidence_only:
            evidence = getattr(drafter.corrector, "evidence", None)
            if stage != 2 or evidence is None or hasattr(drafter, "peft_config"):
                raise ValueError("evidence_only trains a LiLiCorr head's pair evidence: it needs stage=2, a plain "
                                 "(non-PEFT) drafter and a head that reads context or corpus bigrams.")
            drafter.requires_grad_(False)
            evidence.requires_grad_(True)

    def forward(self, input_ids, loss_mask, attention_mask=None, context_states=None, target_argmax=None, **_):
        if self.target.device != input_ids.device:
            self.target.to(input_ids.device)
        if context_states is None:
            context_states, target_argmax = target_context(
                self.target, self.drafter.config.target_layer_ids, input_ids, attention_mask
            )
        block_size = self.block_sizes[self._training_forwards % len(self.block_sizes)]
        if self.training:
            self._training_forwards += 1
        out = drafter_loss(
            self.drafter, input_ids, loss_mask, context_states.to(self.drafter.dtype),
            target_argmax, self.num_anchors, self.gamma, self.rho, dcoco=self.stage == 2, block_size=block_size,
            pair_loss=self.pair_loss, slot_weighting=self.slot_weighting,
        )
        return {
            "loss": out.loss, "dflash": out.dflash, "dcoco": out.dcoco, "slot_accuracy": out.slot_accuracy,
            "successor_accuracy": out.successor_accuracy, "first_slot_accuracy": out.first_slot_accuracy,
            "block_size": block_size,
        }


@dataclass
class DrafterCollator:
    """Right-pads records {"input_ids", "loss_mask"[, "context_states", "target_argmax"]} to the batch's length."""

    pad_token_id: int = 0
    max_length: int = 1024

    def __call__(self, records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = min(self.max_length, max(len(r["input_ids"]) for r in records))
        batch: dict[str, torch.Tensor] = {
            "input_ids": torch.full((len(records), length), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros((len(records), length), dtype=torch.bool),
            "attention_mask": torch.zeros((len(records), length), dtype=torch.long),
        }
        cached = "context_states" in records[0]
        if cached:
            width = records[0]["context_states"].shape[-1]
            batch["context_states"] = torch.zeros(
                (len(records), length, width), dtype=records[0]["context_states"].dtype
            )
            batch["target_argmax"] = torch.zeros((len(records), length), dtype=torch.long)
        for i, record in enumerate(records):
            n = min(length, len(record["input_ids"]))
            batch["input_ids"][i, :n] = record["input_ids"][:n]
            batch["loss_mask"][i, :n] = record["loss_mask"][:n]
            batch["attention_mask"][i, :n] = 1
            if cached:
                batch["context_states"][i, :n] = record["context_states"][:n]
                batch["target_argmax"][i, :n] = record["target_argmax"][:n]
        return batch


class DrafterTrainer(Trainer):
    """Trainer whose loss is the drafter objective; logs the DFlash/DCOCO parts and the tokens read per second;
    exports a loadable drafter folder."""

    _tokens = 0  # record tokens this process read since the last log
    _since: float | None = None  # when that count started

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self._since = self._since or time.perf_counter()
            self._tokens += int(inputs["attention_mask"].sum())
        outputs = model(**inputs)
        if self.state.global_step % max(self.args.logging_steps, 1) == 0 and model.training:
            parts = {"dflash_loss": float(outputs["dflash"])}
            if outputs["dcoco"] is not None:
                parts["dcoco_loss"] = float(outputs["dcoco"])
            accuracy = outputs["slot_accuracy"]
            parts["slot1_acc"], parts["slot_mean_acc"] = float(accuracy[0]), float(accuracy.mean())
            parts["block_size"] = outputs["block_size"]
            if outputs["successor_accuracy"] is not None:  # the corrector's repairs: compare the two
                parts["successor_drafter_acc"], parts["successor_corrector_acc"] = map(
                    float, outputs["successor_accuracy"]
                )
            if outputs["first_slot_accuracy"] is not None:  # correct_first_slot: the same comparison at slot 1
                parts["first_slot_drafter_acc"], parts["first_slot_corrector_acc"] = map(
                    float, outputs["first_slot_accuracy"]
                )
            self._parts = parts
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        logs.update(getattr(self, "_parts", {}))
        if "loss" in logs and self._since is not None:
            logs["tokens_per_second"] = round(self._tokens / max(time.perf_counter() - self._since, 1e-9), 1)
            self._tokens, self._since = 0, time.perf_counter()
        super().log(logs, *args, **kwargs)

    def export_drafter(self, folder: str | Path) -> None:
        """Write the trained drafter as a Hub-ready folder (config with auto_map, safetensors, code files)."""
        drafter = self.accelerator.unwrap_model(self.model).drafter
        if self.is_world_process_zero():
            drafter.save_pretrained(folder)
