"""`dcoco-hf export`: the command line over `dcoco_hf.serving.export` (the formats and their writers live there).

    dcoco-hf export --format dflash [DRAFTER] OUT [--block-size B] [--draft-vocab --target T]
    dcoco-hf export --format vllm [DRAFTER] OUT [--block-size B]
    dcoco-hf export --format dflash2 [DRAFTER] OUT [--block-size B]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..serving.export import (
    CORRECTOR_NAMES,
    DTYPES,
    FORMATS,
    check_export_folder,
    export_dflash,
    export_dflash2,
    export_vllm,
)
from .common import CLIError, check_model_path, default_drafter_path, load_drafter, load_target


def add_export_parser(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `dcoco-hf export` on the CLI's subcommands."""
    export = commands.add_parser(
        "export", parents=[common],
        help="write the drafter for a serving engine (dflash: the backbone in the z-lab format vLLM and SGLang serve; "
        "vllm: backbone and corrector, for vLLM with the dcoco-hf plugin; dflash2: backbone and DFlash2 candidate "
        "selector in the public DFlash2 format)",
        description="Writes the drafter as config.json, model.safetensors and README.md. --format dflash: its DFlash "
        "backbone in the public z-lab format; the DCOCO corrector is dropped (vLLM and SGLang serve plain DFlash). "
        "--format vllm: backbone and corrector (DCOCO or DFlash2 selector), served by vLLM's dflash method through "
        "this package's plugin "
        "(pip install \"dcoco-hf[vllm]\"; docs/serving.md). --format dflash2: a drafter with a DFlash2 candidate "
        "selector (corrector_type dflash2) in the public DFlash2 format, served by vLLM's V2 model runner "
        "(docs/selector.md).",
    )
    export.add_argument("paths", nargs="+", metavar="[DRAFTER] OUT",
                        help="the drafter folder (optional: else --drafter, else the shipped one), "
                        "then the output folder")
    export.add_argument("--format", choices=FORMATS, default="dflash", help="export format (default dflash)")
    export.add_argument("--block-size", type=int, default=None,
                        help="block size the engines draft (default: the drafter's config block_size)")
    export.add_argument("--draft-vocab", action="store_true",
                        help="dflash: write the drafter's draft vocabulary (d2t + its lm_head rows; loads the target) "
                        "instead of the full vocabulary (vllm always keeps it, as token ids)")
    export.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output folder (never into the drafter's own folder or its "
                        "base drafter)")
    export.add_argument("--export-dtype", choices=sorted(DTYPES), default=None,
                        help="weight dtype of the export (default: the drafter's)")
    export.set_defaults(handler=cmd_export)


def export_paths(args: argparse.Namespace) -> tuple[str, str]:
    """(drafter, output folder) from `[DRAFTER] OUT` and --drafter; refuses two drafters or extra paths."""
    if len(args.paths) > 2:
        raise CLIError(f"export takes [DRAFTER] OUT, got {len(args.paths)} paths: {args.paths}.")
    if len(args.paths) == 2 and args.drafter:
        raise CLIError("Two drafters given (--drafter and the DRAFTER argument); pass one.")
    source = args.paths[0] if len(args.paths) == 2 else args.drafter or str(default_drafter_path())
    return source, args.paths[-1]


def cmd_export(args: argparse.Namespace) -> int:
    source, out_dir = export_paths(args)
    if args.format != "dflash" and args.draft_vocab:
        raise CLIError(f"--draft-vocab belongs to --format dflash: the {args.format} format keeps its own vocabulary.")
    check_model_path("DRAFTER", source)
    if args.draft_vocab:
        check_model_path("--target", args.target)
    drafter = load_drafter(source, torch.device("cpu"), None, "sdpa")  # None: the dtype the checkpoint was saved in
    dtype = DTYPES.get(args.export_dtype)
    try:
        check_export_folder(Path(out_dir), source, args.overwrite)  # before loading a target for nothing
        target = None  # held here: the drafter keeps only a weak reference to its target
        if args.draft_vocab:  # the export carries the target lm_head's draft rows; no tuning needed for that
            target = load_target(args.target, torch.device("cpu"), torch.float32, "sdpa")[0]
            drafter.attach(target, tune=False)
        if args.format == "dflash2":
            out = export_dflash2(drafter, out_dir, block_size=args.block_size, dtype=dtype, source=source,
                                 overwrite=args.overwrite)
        elif args.format == "vllm":
            out = export_vllm(drafter, out_dir, block_size=args.block_size, dtype=dtype, source=source,
                              overwrite=args.overwrite)
        else:
            out = export_dflash(drafter, out_dir, block_size=args.block_size, draft_vocab=args.draft_vocab,
                                dtype=dtype, source=source, overwrite=args.overwrite)
    except ValueError as error:
        raise CLIError(str(error)) from None
    except OSError as error:  # a read-only output folder, a full disk: nothing half-written is left (write_folder)
        raise CLIError(str(error), exit_code=1) from None
    what = {"vllm": f"the drafter (backbone and {CORRECTOR_NAMES.get(drafter.config.corrector_type, 'corrector')}, "
                    "for vLLM with the dcoco-hf plugin)",
            "dflash2": "the DFlash2 drafter (backbone and candidate selector, public DFlash2 format)"}.get(
                args.format, "the DFlash backbone")
    dropped = "" if args.format != "dflash" else "corrector dropped; "
    print(f"wrote {what} of {source} to {out} ({dropped}see {out / 'README.md'})")
    return 0


__all__ = ["add_export_parser", "cmd_export"]
