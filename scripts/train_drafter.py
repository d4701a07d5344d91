r"""Train a DCOCO drafter with transformers.Trainer (resumable; `accelerate launch` works unchanged).

Stage 1 (DFlash backbone, corrector frozen at zero), on regenerated and teacher-forced data together:
    python scripts/train_drafter.py --stage 1 --data data/smollm2 data/smollm2-text --features data/features \
        --output runs/stage1 --layers 2 --init-from-target --block-size 8 --epochs 1
Stage 2 (joint DFlash + DCOCO), from the stage-1 drafter:
    python scripts/train_drafter.py --stage 2 --init runs/stage1/final --data data/smollm2 data/smollm2-text \
        --features data/features --output runs/stage2 --epochs 0.5

With --features, each data folder's target context is cached once under <features>/<folder name>.

From a recipe file (recipes/*.yaml: keys are this script's long options; flags given on the command line override it):
    python scripts/train_drafter.py --recipe recipes/smollm2/stage2o.yaml --max-steps 10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dcoco_hf import CorpusBigrams, DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.block_choice import set_block_size
from dcoco_hf.network.configuration_dcoco import DCOCOConfig
from dcoco_hf.network.correctors import CORRECTOR_TYPES
from dcoco_hf.training.data import cache_target_features, load_shards
from dcoco_hf.training.losses import PAIR_LOSSES, SLOT_WEIGHTINGS
from dcoco_hf.training.trainer import (
    DrafterCollator,
    DrafterTrainer,
    DrafterTrainingModel,
)

NEW_DRAFTER = {"layers": 1, "block_size": 16, "target_layers_read": 5, "top_k": 16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=None,
                   help="YAML file of this script's long options (e.g. `max-steps: 300`); "
                        "command-line flags override it")
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
    p.add_argument("--draft-block-size", type=int, default=None,
                   help="with --init: draft (and, without --block-sizes, train) blocks of this size from now on, saved "
                        "as config block_size and generation_config num_assistant_tokens (at most the largest block "
                        "the --init drafter was trained on)")
    p.add_argument("--corrector-only", action="store_true",
                   help="stage 2: freeze the backbone and train only the corrector (needs --init)")
    p.add_argument("--evidence-only", action="store_true",
                   help="stage 2 with --init of a LiLiCorr drafter and --context-bigrams / --corpus-bigrams: train "
                        "only the head's pair evidence; the backbone and the head stay as they are, so the head's "
                        "public export is unchanged")
    p.add_argument("--correct-first-slot", action="store_true",
                   help="stage 2: train (and ship) the anchor -> slot 1 transitions too, so the walk may re-select "
                        "slot 1 (config `correct_first_slot`; adds no weights, so it goes with --init)")
    p.add_argument("--context-bigrams", action="store_true",
                   help="stage 2 with --init: the corrector also reads whether each candidate pair occurs in the "
                        "committed text (config `context_bigrams`; its new weights start at zero, so the scores "
                        "start as before; a LiLiCorr head reads it through its pair evidence)")
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
    p.add_argument("--corrector", choices=CORRECTOR_TYPES, default=None,
                   help="the corrector to train: 'dcoco' (transition MLP), 'lilicorr' (dcoco_hf/network/lilicorr.py) "
                        "or 'dflash2' (DFlash2's candidate selector, dcoco_hf/network/selector.py). With --init of a "
                        "drafter with another kind, its backbone is kept and a fresh head of this kind, proposing the "
                        "drafter's argmax until trained, is trained (default: the --init drafter's own, 'dcoco' for "
                        "a new drafter)")
    p.add_argument("--selector-rank", type=int, default=None,
                   help="with --corrector dflash2: width of the selector's token codes (config selector_rank, "
                        "default 16)")
    p.add_argument("--slot-weighting", choices=SLOT_WEIGHTINGS, default="decay",
                   help="weights of the DFlash slot loss: 'decay' (exp(-(k-1)/gamma), the DFlash recipe) or 'awl' "
                        "(DScout's acceptance-weighted loss: slot k weighs the detached probability that every earlier "
                        "slot is accepted)")
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
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this many minutes (then save as usual); the learning-rate schedule "
                        "still follows --max-steps / --epochs")
    return p


def recipe_argv(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The command-line tokens a recipe file stands for: `key: value` -> `--key value`, lists -> several values,
    `true` -> the bare flag (`false` leaves it off). Keys must be this script's long options."""
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        parser.error(f"--recipe {path}: cannot read it as YAML ({error})")
    if not isinstance(recipe, dict):
        parser.error(f"--recipe {path}: expected `option: value` lines, got a {type(recipe).__name__}")
    options = {a.option_strings[-1][2:]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(str(k) for k in recipe if str(k).replace("_", "-") not in options or k == "recipe")
    if unknown:
        parser.error(f"--recipe {path}: unknown option(s) {unknown}; keys are this script's long options without "
                     f"the dashes ({', '.join(sorted(o for o in options if o != 'recipe'))})")
    argv = []
    for key, value in recipe.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(options[flag[2:]], argparse._StoreTrueAction):
            if not isinstance(value, bool):
                parser.error(f"--recipe {path}: {key} is a switch; write `{key}: true` or `{key}: false`")
            argv += [flag] if value else []
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; with --recipe FILE, the file's options come first, so flags given here override."""
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)  # reads --recipe alone: the required options may be in the file
    pre.add_argument("--recipe", type=Path, default=None)
    recipe = pre.parse_known_args(argv)[0].recipe
    args = p.parse_args((recipe_argv(p, recipe) if recipe else []) + argv)
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
    if args.draft_block_size is not None and not args.init:
        p.error("--draft-block-size sets the drafted block of an existing drafter: use it with --init FOLDER "
                "(a new drafter takes --block-size)")
    dcoco_only = [flag for flag, on in (("--corrector-hidden", args.corrector_hidden is not None), (
                  "--correct-first-slot", args.correct_first_slot), ("--pair-loss", args.pair_loss != "joint")) if on]
    if args.corrector in ("lilicorr", "dflash2") and dcoco_only:
        p.error(f"{', '.join(dcoco_only)}: DCOCO corrector options; a {args.corrector} head takes none of them "
                "(drop them)")
    if args.selector_rank is not None and args.corrector != "dflash2":
        p.error("--selector-rank sizes a fresh DFlash2 selector: use it with --corrector dflash2")
    if args.evidence_only and not (args.stage == 2 and args.init and (args.context_bigrams or args.corpus_bigrams)):
        p.error("--evidence-only trains the pair evidence of an existing LiLiCorr head: use it with --stage 2 --init "
                "FOLDER and --context-bigrams and/or --corpus-bigrams")
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
        added.update(corrector_switch(args))
        drafter = DCOCODrafter.from_pretrained(args.init, **added).attach(target)
        drafter.config.correct_first_slot |= args.correct_first_slot
        if args.draft_block_size is not None:
            try:
                set_block_size(drafter, args.draft_block_size)
            except ValueError as error:
                raise SystemExit(f"--draft-block-size: {error}") from None
        if args.corrector_hidden is not None:
            drafter.corrector = drafter.corrector.widened(args.corrector_hidden)
            drafter.config.corrector_hidden = args.corrector_hidden
    elif args.stage == 2:
        raise SystemExit("--stage 2 starts from a stage-1 drafter: pass --init runs/stage1/final")
    else:
        drafter = DCOCODrafter.from_target(
            target, num_hidden_layers=args.layers, block_size=args.block_size, top_k=args.top_k,
            num_target_layers_read=args.target_layers_read, init_from_target=args.init_from_target,
            corrector_type=args.corrector or "dcoco",
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
        # Without an accelerator, say so: transformers otherwise leaves the processes of `accelerate launch
        # --num_processes N` on CPU unwrapped (no DDP), and each trains its own weights.
        use_cpu=not torch.accelerator.is_available(),
    )
    model = DrafterTrainingModel(
        drafter, target, stage=args.stage, num_anchors=args.num_anchors, corrector_only=args.corrector_only,
        block_sizes=args.block_sizes, pair_loss=args.pair_loss, slot_weighting=args.slot_weighting,
        evidence_only=args.evidence_only,
    )
    pad = target.generation_config.pad_token_id or 0
    trainer = DrafterTrainer(
        model=model, args=training_args, train_dataset=records,
        data_collator=DrafterCollator(pad_token_id=pad, max_length=args.max_length),
        callbacks=[TimeBudget(args.max_minutes)] if args.max_minutes else None,
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
                           "corpus_bigrams": cfg.corpus_bigrams, "corrector_type": cfg.corrector_type},
               "args": {k: str(v) for k, v in vars(args).items()}, "log": trainer.state.log_history[-5:],
               # one per process: equal when DDP kept them in step
               "rank_weight_digests": rank_weight_digests(drafter, args.output)}
    if trainer.is_world_process_zero():  # the process that exported the folder
        (args.output / "final" / "training_summary.json").write_text(json.dumps(summary, indent=2))


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


def corrector_switch(args: argparse.Namespace) -> dict:
    """`from_pretrained` overrides that give the --init drafter a fresh head of kind --corrector (none if it has that
    kind).

    A new LiLiCorr head is sized for the largest block it will train on, reads pair evidence only when asked
    (--context-bigrams, --corpus-bigrams), does not score DCOCO's way (correct_first_slot off: it always scores slot
    1 by its start scores), and starts with no measured block_tau (the DCOCO corrector's taus do not describe it)."""
    if args.corrector is None or args.corrector == DCOCOConfig.from_pretrained(args.init).corrector_type:
        return {}
    if args.corrector == "dcoco":
        return {"corrector_type": "dcoco"}
    if args.corrector == "dflash2":  # its codebooks follow the drafter's draft vocabulary; it reads no pair facts
        rank = {} if args.selector_rank is None else {"selector_rank": args.selector_rank}
        return {"corrector_type": "dflash2", "context_bigrams": False, "corpus_bigrams": None,
                "correct_first_slot": False, "block_tau": None, **rank}
    block = max(args.block_sizes or [args.draft_block_size or 0]) or None  # None: the drafter's block_size
    return {"corrector_type": "lilicorr", "block_size": block, "context_bigrams": args.context_bigrams,
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


if __name__ == "__main__":
    main()
