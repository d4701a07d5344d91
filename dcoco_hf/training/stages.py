"""One training stage of a drafter on `transformers.Trainer`: the one code path behind `scripts/train_drafter.py` and
`dcoco-hf train`.

A stage builds (stage 1) or loads (`init`) the drafter, reads its data folders (optionally through cached target
features), trains with `DrafterTrainer` and exports a Hub-ready folder to `<output>/final`. Rerun with the same
`output` and it resumes from the last checkpoint there; under `accelerate launch` every process runs it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ..network.configuration_dcoco import DCOCOConfig
from ..runtime.block_choice import set_block_size
from ..network.corrector import CorpusBigrams
from ..runtime.drafter import DCOCODrafter
from ..runtime.logs import log
from .data import cache_target_features, draft_vocabulary, load_shards
from .trainer import DrafterCollator, DrafterTrainer, DrafterTrainingModel

NEW_DRAFTER = {"layers": 1, "block_size": 16, "target_layers_read": 5, "top_k": 16}


@dataclass
class StageOptions:
    """Everything one stage needs; the field names are `scripts/train_drafter.py`'s long options (dashes as
    underscores), so a recipe file means the same thing to the script and to `dcoco-hf train`."""

    stage: int
    data: Sequence[Path]
    output: Path
    features: Path | None = None
    init: str | None = None
    layers: int | None = None
    block_size: int | None = None
    target_layers_read: int | None = None
    top_k: int | None = None
    init_from_target: bool = False
    draft_block_size: int | None = None
    corrector_only: bool = False
    evidence_only: bool = False
    correct_first_slot: bool = False
    context_bigrams: bool = False
    corpus_bigrams: bool = False
    corrector_hidden: int | None = None
    pair_loss: str = "joint"
    corrector: str | None = None
    selector_rank: int | None = None
    slot_weighting: str = "decay"
    block_sizes: Sequence[int] | None = None
    epochs: float = 1.0
    max_steps: int = -1
    lr: float = 6e-4
    batch_size: int = 4
    grad_accum: int = 1
    num_anchors: int = 16
    max_length: int = 640
    bf16: bool = False
    save_steps: int = 100
    seed: int = 0
    max_minutes: float | None = None
    draft_vocab: int | None = None  # stage 1: propose from the N tokens the target writes most in the data

    @classmethod
    def from_namespace(cls, namespace: Any) -> StageOptions:
        """The options an argparse namespace (or any object with these attributes) holds; other attributes are
        ignored."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)})


def train_stage(options: StageOptions, target: PreTrainedModel, pad_token_id: int | None = None,
                callbacks: Sequence[TrainerCallback] = ()) -> Path:
    """Train one stage into `options.output` (resuming from its last checkpoint) and export `<output>/final`.

    `pad_token_id` right-pads batches (masked out, so any id is correct; default: the target's generation config
    pad, else 0); `callbacks` join the Trainer's (e.g. held-out measurements at each checkpoint). Raises ValueError
    for options that do not fit the drafter or the data. Returns the final folder.
    """
    drafter = build_drafter(options, target)
    loaded = read_data(options, target, drafter)
    records = [record for folder in options.data for record in loaded[Path(folder)]]
    if options.draft_vocab and not options.init:  # a later stage keeps the vocabulary its drafter was saved with
        set_draft_vocabulary_from(drafter, records, options.draft_vocab, target)
    if options.corpus_bigrams:  # counted once per folder: the counts are the corpus's, not the reading schedule's
        drafter.set_corpus_bigrams(CorpusBigrams.count(
            ((r["input_ids"], r["loss_mask"]) for folder_records in loaded.values() for r in folder_records),
            target.config.vocab_size,
        ))
    model = DrafterTrainingModel(
        drafter, target, stage=options.stage, num_anchors=options.num_anchors,
        corrector_only=options.corrector_only, block_sizes=options.block_sizes, pair_loss=options.pair_loss,
        slot_weighting=options.slot_weighting, evidence_only=options.evidence_only,
    )
    pad = pad_token_id if pad_token_id is not None else target.generation_config.pad_token_id or 0
    output = Path(options.output)
    trainer = DrafterTrainer(
        model=model, args=training_arguments(options), train_dataset=records,
        data_collator=DrafterCollator(pad_token_id=pad, max_length=options.max_length),
        callbacks=[*callbacks, *([TimeBudget(options.max_minutes)] if options.max_minutes else [])],
    )
    start = time.time()
    last = get_last_checkpoint(str(output)) if output.exists() else None
    if last is not None:
        log(f"stage {options.stage}: resuming from {last}")
    trainer.train(resume_from_checkpoint=last)
    final = output / "final"
    trainer.export_drafter(final)
    summary = stage_summary(options, drafter, model, trainer, len(records), time.time() - start)
    if trainer.is_world_process_zero():  # the process that exported the folder
        (final / "training_summary.json").write_text(json.dumps(summary, indent=2))
    return final


def build_drafter(options: StageOptions, target: PreTrainedModel) -> DCOCODrafter:
    """The drafter a stage starts from: `options.init` (with the requested head and block changes) or a new one
    sized for `target` (stage 1 only)."""
    if options.init:
        added = {"context_bigrams": True} if options.context_bigrams else {}  # its zero-started weights are missing
        added.update(corrector_switch(options))
        drafter = DCOCODrafter.from_pretrained(options.init, **added).attach(target, tune=False)  # trains, not decodes
        drafter.config.correct_first_slot |= options.correct_first_slot
        if options.draft_block_size is not None:
            try:
                set_block_size(drafter, options.draft_block_size)
            except ValueError as error:
                raise ValueError(f"--draft-block-size: {error}") from None
        if options.corrector_hidden is not None:
            drafter.corrector = drafter.corrector.widened(options.corrector_hidden)
            drafter.config.corrector_hidden = options.corrector_hidden
        return drafter
    if options.stage == 2:
        raise ValueError("--stage 2 starts from a stage-1 drafter: pass --init runs/stage1/final")
    shape = {name: default if getattr(options, name) is None else getattr(options, name)
             for name, default in NEW_DRAFTER.items()}
    return DCOCODrafter.from_target(
        target, num_hidden_layers=shape["layers"], block_size=shape["block_size"], top_k=shape["top_k"],
        num_target_layers_read=shape["target_layers_read"], init_from_target=options.init_from_target,
        corrector_type=options.corrector or "dcoco",
    )


def set_draft_vocabulary_from(drafter: DCOCODrafter, records: list[dict], size: int, target: PreTrainedModel) -> None:
    """Make `drafter` propose from the `size` tokens the target wrote most often in `records` (and its EOS ids):
    over a vocabulary of hundreds of thousands, the drafter's LM head would cost most of a draft and of a training
    step, while the target writes a few tens of thousands. Outputs cannot change: the target verifies every token."""
    eos = target.generation_config.eos_token_id
    always = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids, coverage = draft_vocabulary(records, target.config.vocab_size, size, always=always)
    drafter.set_draft_vocabulary(ids)
    log(f"draft vocabulary: the {ids.numel()} tokens the target writes most, {100 * coverage:.1f}% of the answer "
        "tokens in the data")


def read_data(options: StageOptions, target: PreTrainedModel, drafter: DCOCODrafter) -> dict[Path, list[dict]]:
    """Each data folder's records, read once per folder (the caller reads a folder named n times in `data` n times
    per epoch); with `features`, through the target features cached under `<features>/<folder name>`."""
    loaded = {}
    for folder in dict.fromkeys(Path(f) for f in options.data):
        source = folder
        if options.features is not None:
            source = cache_target_features(
                target, drafter.config.target_layer_ids, folder, Path(options.features) / folder.name
            )
        loaded[folder] = load_shards(source)
        last = loaded[folder][-1]
        if "context_states" in last and last["context_states"].shape[-1] != drafter.fc.in_features:
            raise ValueError(f"{source} holds features of other target layers; use a fresh --features folder")
    return loaded


def training_arguments(options: StageOptions) -> TrainingArguments:
    """The Trainer settings of a stage (cosine schedule, 4% warm-up, clipped gradients, two checkpoints kept)."""
    return TrainingArguments(
        output_dir=str(options.output), per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum, learning_rate=options.lr, lr_scheduler_type="cosine",
        warmup_steps=0.04, max_grad_norm=1.0, num_train_epochs=options.epochs, max_steps=options.max_steps,
        weight_decay=0.0, logging_steps=10, save_steps=options.save_steps, save_total_limit=2, bf16=options.bf16,
        report_to=[], remove_unused_columns=False, dataloader_num_workers=0, seed=options.seed,
        disable_tqdm=False,
        # Without an accelerator, say so: transformers otherwise leaves the processes of `accelerate launch
        # --num_processes N` on CPU unwrapped (no DDP), and each trains its own weights.
        use_cpu=not torch.accelerator.is_available(),
    )


def stage_summary(options: StageOptions, drafter: DCOCODrafter, model: DrafterTrainingModel, trainer: DrafterTrainer,
                  records: int, seconds: float) -> dict[str, Any]:
    """What `training_summary.json` records: the drafter's shape (with `init`, that folder's, not the options'),
    the options, the last log lines and every process's weight digest."""
    cfg = drafter.config
    return {"stage": options.stage, "wall_seconds": seconds, "records": records,
            "training_block_sizes": list(model.block_sizes),
            "drafter": {"block_size": cfg.block_size, "num_hidden_layers": cfg.num_hidden_layers,
                        "top_k": cfg.top_k, "target_layer_ids": cfg.target_layer_ids,
                        "correct_first_slot": cfg.correct_first_slot, "context_bigrams": cfg.context_bigrams,
                        "corpus_bigrams": cfg.corpus_bigrams, "corrector_type": cfg.corrector_type},
            "args": {k: str(v) for k, v in asdict(options).items()}, "log": trainer.state.log_history[-5:],
            # one per process: equal when DDP kept them in step
            "rank_weight_digests": rank_weight_digests(drafter, Path(options.output))}


def rank_weight_digests(drafter: DCOCODrafter, folder: Path) -> list[str]:
    """SHA-256 of the drafter's weights in every process (all of them take part), rank order.

    The digests travel as files in `folder` behind one barrier, not through `all_gather_object`: gloo's worker
    thread can free that call's Python-made tensors last, which needs the GIL, and at exit that aborts the process
    ("terminate called without an active exception") or deadlocks the process group's teardown."""
    digest = hashlib.sha256()
    for name, tensor in sorted(drafter.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [digest.hexdigest()]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    (folder / f"weights-rank{rank}.sha256").write_text(digest.hexdigest())
    torch.distributed.barrier()
    return [(folder / f"weights-rank{r}.sha256").read_text() for r in range(world)]


def corrector_switch(options: StageOptions) -> dict[str, Any]:
    """`from_pretrained` overrides that give the `init` drafter a fresh head of kind `corrector` (none if it has that
    kind).

    A new LiLiCorr head is sized for the largest block it will train on, reads pair evidence only when asked
    (context_bigrams, corpus_bigrams), does not score DCOCO's way (correct_first_slot off: it always scores slot
    1 by its start scores), and starts with no measured block_tau (the DCOCO corrector's taus do not describe it)."""
    if options.corrector is None or options.corrector == DCOCOConfig.from_pretrained(options.init).corrector_type:
        return {}
    if options.corrector == "dcoco":
        return {"corrector_type": "dcoco"}
    if options.corrector == "dflash2":  # its codebooks follow the drafter's draft vocabulary; it reads no pair facts
        rank = {} if options.selector_rank is None else {"selector_rank": options.selector_rank}
        return {"corrector_type": "dflash2", "context_bigrams": False, "corpus_bigrams": None,
                "correct_first_slot": False, "block_tau": None, **rank}
    block = max(options.block_sizes or [options.draft_block_size or 0]) or None  # None: the drafter's block_size
    return {"corrector_type": "lilicorr", "block_size": block, "context_bigrams": options.context_bigrams,
            "corpus_bigrams": None, "correct_first_slot": False, "block_tau": None}


class TimeBudget(TrainerCallback):
    """Stops training once `minutes` have passed since the first step (the Trainer then saves as usual)."""

    def __init__(self, minutes: float) -> None:
        self.seconds, self.start = minutes * 60, None

    def on_step_end(self, args, state, control, **kwargs):
        self.start = self.start or time.time()
        if time.time() - self.start >= self.seconds:
            control.should_training_stop = True
        return control


__all__ = ["NEW_DRAFTER", "StageOptions", "TimeBudget", "build_drafter", "corrector_switch", "train_stage"]
