"""Refresh the code files of a drafter folder from the package (a Hub folder carries its own copy of the network).

    python scripts/sync_model_card.py [model_cards/dcoco-smollm2-135m ...]

The files are the network's: modeling_dcoco.py and every package module it imports (`network_code_files`), which the
folder's auto_map names; transformers refuses a folder that lacks a module one of its files imports. Other .py files
in the folder (code the network no longer imports) are removed. The runtime is the installed dcoco-hf package.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dcoco_hf.runtime.drafter import network_code_files, save_network_code


def remote_code_files() -> list[str]:
    """The file names a drafter folder carries, sorted."""
    return [path.name for path in network_code_files()]


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cards", type=Path, nargs="*", default=[root / "model_cards" / "dcoco-smollm2-135m"])
    for card in parser.parse_args().cards:
        if not (card / "config.json").exists():
            parser.error(f"{card}: no config.json there; pass a drafter folder (save_pretrained output)")
        for stale in sorted(set(card.glob("*.py")) - {card / name for name in remote_code_files()}):
            stale.unlink()
            print(f"removed {stale}")
        for name in save_network_code(card):
            print(f"copied {name} -> {card}")


if __name__ == "__main__":
    main()
