"""Refresh the code files of a drafter folder from the package (a Hub folder carries its own copy of the code).

    python scripts/sync_model_card.py [model_cards/dcoco-smollm2-135m ...]

The files copied are modeling_dcoco.py and every package module it imports, directly or not: remote code must be
self-contained, and transformers refuses a folder that lacks a module one of its files imports.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import dcoco_hf

PACKAGE = Path(dcoco_hf.__file__).parent
_RELATIVE_IMPORT = re.compile(r"^\s*from \.(\w+) import", re.MULTILINE)


def remote_code_files(entry: str = "modeling_dcoco.py") -> list[str]:
    """`entry` and the package modules it reaches through relative imports, sorted."""
    found, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        todo += [f"{module}.py" for module in _RELATIVE_IMPORT.findall((PACKAGE / name).read_text())]
    return sorted(found)


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cards", type=Path, nargs="*", default=[root / "model_cards" / "dcoco-smollm2-135m"])
    for card in parser.parse_args().cards:
        if not (card / "config.json").exists():
            parser.error(f"{card}: no config.json there; pass a drafter folder (save_pretrained output)")
        for name in remote_code_files():
            shutil.copyfile(PACKAGE / name, card / name)
            print(f"copied {name} -> {card}")


if __name__ == "__main__":
    main()
