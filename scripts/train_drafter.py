r"""Train a DCOCO drafter with transformers.Trainer (resumable; `accelerate launch` works unchanged).

Stage 1 (DFlash backbone, corrector frozen at zero), on regenerated and teacher-forced data together:
    python scripts/train_drafter.py --stage 1 --data data/smollm2 data/smollm2-text --features data/features \
        --output runs/stage1 --layers 2 --init-from-target --block-size 8 --epochs 1
Stage 2 (joint DFlash + DCOCO), from the stage-1 drafter:
    python scripts/train_drafter.py --stage 2 --init runs/stage1/final --data data/smollm2 data/smollm2-text \
        --features data/features --output runs/stage2 --epochs 0.5

With --features, each data folder's target context is cached once under <features>/<folder name>.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dcoco_hf import CorpusBigrams, DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.training.data import cache_target_features, load_shards
from dcoco_hf.training.losses import PAIR_LOSSES
from dcoco_hf.training.trainer import DrafterCollator, DrafterTrainer, DrafterTrainingModel


NEW_DRAFTER = {"layers": 1, "block_size": 16, "target_layers_read": 5, "top_k": 16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=(1, 2), required=True)
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="folders written by scripts/regenerate_data.py or scripts/text_data.py")
    p.add_argument("--features", type=Path, default=None,
                   help="cache each folder's target features under FEATURES/<folder name> (built if missing)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--init", default=None, help="drafter folder to start from (required for stage 2)")
    # Architecture of a new drafter (defaults in NEW_DRAFTER); with --init it comes from that folder instead.
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 1)")
    p.add_argument("--block-size", type=int, default=None, help="anchor + mask slots (default 16)")
    p.add_argument("--target-layers-read", type=int, default=None, help="target layers fused (default 5)")
    p.add_argument("--top-k", type=int, default=None, help="corrector candidates per slot (default 16)")
    p.add_argument("--init-from-target", action="store_true", help="warm-start layers from the target's last ones")
    p.add_argument("--corrector-only", action="store_true",
                   help="stage 2: freeze the backbone and train only the corrector (needs --init)")
    p.add_argument("--correct-first-slot", action="store_true",
                   help="stage 2: train (and ship) the anchor -> slot 1 transitions too, so the walk may re-select "
                        "slot 1 (config `correct_first_slot`; adds no weights, so it goes with --init)")
    p.add_argument("--context-bigrams", action="store_true",
                   help="stage 2 with --init: the corrector also reads whether each candidate pair occurs in the "
                        "committed text (config `context_bigrams`; its new weights start at zero, so the scores "
                        "start as before)")
    p.add_argument("--corpus-bigrams", action="store_true",
                   help="stage 2 with --init: the corrector also reads how often each candidate pair was written in "
                        "the --data answers (counted once per folder, stored with the weights; config "
                        "`corpus_bigrams`; its new weights start at zero)")
    p.add_argument("--corrector-hidden", type=int, default=None,
                   help="stage 2 with --init: widen the corrector's transition MLP to this many hidden units; the "
                        "widened corrector scores exactly as before until trained (config `corrector_hidden`)")
    p.add_argument("--pair-loss", choices=sorted(PAIR_LOSSES), default="joint",
                   help="stage 2: 'joint' is the paper's cross-entropy over each slot pair's K^2 transitions; "
                        "'successor' keeps only the part the prefix-first walk uses, the true predecessor's K "
                        "successors")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None,
                   help="train on these block sizes in turn (DScout's mixed horizons), so one checkpoint drafts each "
                        "of them well; drafting still uses config block_size (default: train on that size alone)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs; fp16 overflows in fc)")
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    given = [name for name in NEW_DRAFTER if getattr(args, name) is not None] + (
        ["init_from_target"] if args.init_from_target else []
    )
    if args.init and given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        p.error(f"{flags}: these shape a new drafter, but --init {args.init} brings its own architecture; drop them")
    if args.corrector_only and (args.stage != 2 or not args.init):
        p.error("--corrector-only trains the corrector of an existing drafter: use it with --stage 2 --init FOLDER")
    if args.corrector_hidden is not None and (args.stage != 2 or not args.init):
        p.error("--corrector-hidden widens the corrector of an existing drafter: use it with --stage 2 --init FOLDER")
    if args.pair_loss != "joint" and args.stage != 2:
        p.error("--pair-loss chooses the corrector's loss, which stage 1 does not train: use it with --stage 2")
    if args.context_bigrams and (args.stage != 2 or not args.init):
        p.error("--context-bigrams adds an input to the corrector of an existing drafter: use it with --stage 2 --init")
    if args.corpus_bigrams and (args.stage != 2 or not args.init):
        p.error("--corpus-bigrams adds an input to the corrector of an existing drafter: use it with --stage 2 --init")
    if args.correct_first_slot and args.stage != 2:
        p.error("--correct-first-slot trains corrector scores, which stage 1 leaves at zero: use it with --stage 2")
    for name, default in NEW_DRAFTER.items():
        if not args.init and getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    args = parse_args()
    target_path = args.target or default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_path).eval().requires_grad_(False)
    if args.init:
        added = {"context_bigrams": True} if args.context_bigrams else {}  # its zero-started weights are missing
        drafter = DCOCODrafter.from_pretrained(args.init, **added).attach(target)
        drafter.config.correct_first_slot |= args.correct_first_slot
        if args.corrector_hidden is not None:
            drafter.corrector = drafter.corrector.widened(args.corrector_hidden)
            drafter.config.corrector_hidden = args.corrector_hidden
    elif args.stage == 2:
        raise SystemExit("--stage 2 starts from a stage-1 drafter: pass --init runs/stage1/final")
    else:
        drafter = DCOCODrafter.from_target(
            target, num_hidden_layers=args.layers, block_size=args.block_size, top_k=args.top_k,
            num_target_layers_read=args.target_layers_read, init_from_target=args.init_from_target,
        )
    loaded = {}  # each folder once; a folder named n times in --data is read n times per epoch
    for folder in dict.fromkeys(args.data):
        source = folder
        if args.features is not None:
            source = cache_target_features(target, drafter.config.target_layer_ids, folder, args.features / folder.name)
        loaded[folder] = load_shards(source)
        last = loaded[folder][-1]
        if "context_states" in last and last["context_states"].shape[-1] != drafter.fc.in_features:
            raise SystemExit(f"{source} holds features of other target layers; use a fresh --features folder")
    records = [record for folder in args.data for record in loaded[folder]]
    if args.corpus_bigrams:  # counted once per folder: the counts are the corpus's, not the reading schedule's
        drafter.set_corpus_bigrams(CorpusBigrams.count(
            ((r["input_ids"], r["loss_mask"]) for folder_records in loaded.values() for r in folder_records),
            target.config.vocab_size,
        ))

    training_args = TrainingArguments(
        output_dir=str(args.output), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=0.04, max_grad_norm=1.0, num_train_epochs=args.epochs, max_steps=args.max_steps,
        weight_decay=0.0, logging_steps=10, save_steps=args.save_steps, save_total_limit=2, bf16=args.bf16,
        report_to=[], remove_unused_columns=False, dataloader_num_workers=0, seed=args.seed,
        disable_tqdm=False,
    )
    model = DrafterTrainingModel(
        drafter, target, stage=args.stage, num_anchors=args.num_anchors, corrector_only=args.corrector_only,
        block_sizes=args.block_sizes, pair_loss=args.pair_loss,
    )
    pad = target.generation_config.pad_token_id or 0
    trainer = DrafterTrainer(
        model=model, args=training_args, train_dataset=records,
        data_collator=DrafterCollator(pad_token_id=pad, max_length=args.max_length),
    )
    start = time.time()
    last = get_last_checkpoint(str(args.output)) if args.output.exists() else None
    trainer.train(resume_from_checkpoint=last)
    trainer.export_drafter(args.output / "final")
    cfg = drafter.config  # with --init, the architecture comes from that folder, not from the arguments
    summary = {"stage": args.stage, "wall_seconds": time.time() - start, "records": len(records),
               "training_block_sizes": list(model.block_sizes),
               "drafter": {"block_size": cfg.block_size, "num_hidden_layers": cfg.num_hidden_layers,
                           "top_k": cfg.top_k, "target_layer_ids": cfg.target_layer_ids,
                           "correct_first_slot": cfg.correct_first_slot, "context_bigrams": cfg.context_bigrams,
                           "corpus_bigrams": cfg.corpus_bigrams},
               "args": {k: str(v) for k, v in vars(args).items()}, "log": trainer.state.log_history[-5:]}
    (args.output / "final" / "training_summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
