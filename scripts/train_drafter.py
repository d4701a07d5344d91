r"""Train one stage of a DCOCO drafter with transformers.Trainer, every option exposed (resumable; `accelerate launch`
works unchanged). `dcoco-hf train` runs whole drafters; this script is for what it does not: a new corrector head on
a trained drafter's frozen backbone (LiLiCorr, the DFlash2 selector), a corrector on a public DFlash folder, or a
stage with options of your own.

A LiLiCorr head on the shipped drafter, from the answers and cached target features of a `dcoco-hf train` run:
    python scripts/train_drafter.py --stage 2 --init model_cards/dcoco-smollm2-135m --corrector lilicorr \
        --corrector-only --data runs/smollm2-16k/data --features runs/smollm2-16k/features --output runs/lilicorr \
        --block-sizes 4 --max-steps 1200

With --features, each data folder's target context is cached once under <features>/<folder name> (a `dcoco-hf train`
run's own cache is found there).

From a recipe file (recipes/*.yaml: keys are this script's long options; flags given on the command line override it):
    python scripts/train_drafter.py --recipe recipes/smollm2/lilicorr.yaml --max-steps 10
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoModelForCausalLM

from dcoco_hf.assets import default_target_path
from dcoco_hf.cli.common import parse_with_recipe, recipe_argv
from dcoco_hf.network.correctors import CORRECTOR_TYPES
from dcoco_hf.training.losses import PAIR_LOSSES
from dcoco_hf.training.phases import SLOT_WEIGHTINGS
from dcoco_hf.training.stages import NEW_DRAFTER, StageOptions, train_stage

__all__ = ["build_parser", "main", "parse_args", "recipe_argv"]  # recipe_argv: what a recipe file stands for


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=None,
                   help="YAML file of this script's long options (e.g. `max-steps: 300`); "
                        "command-line flags override it")
    p.add_argument("--stage", type=int, choices=(1, 2), required=True)
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="answer folders (`dcoco-hf train ... --until answers` writes RUN/data); a folder listed "
                        "twice is read twice")
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
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="stage 1: propose from the N tokens the target writes most in the data (default: every token)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this many minutes (then save as usual); the learning-rate schedule "
                        "still follows --max-steps / --epochs")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; with --recipe FILE, the file's options come first, so flags given here override."""
    p = build_parser()
    args = parse_with_recipe(p, sys.argv[1:] if argv is None else argv)
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
    target = AutoModelForCausalLM.from_pretrained(args.target or default_target_path()).eval().requires_grad_(False)
    try:
        train_stage(StageOptions.from_namespace(args), target)
    except ValueError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
