"""Refresh the code files of the shipped drafter folder from the package (a Hub folder carries its own copy).

    python scripts/sync_model_card.py [model_cards/dcoco-smollm2-135m]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import dcoco_hf

CODE_FILES = ("configuration_dcoco.py", "modeling_dcoco.py", "corrector.py", "candidate_generator.py")


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    card = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "model_cards" / "dcoco-smollm2-135m"
    for name in CODE_FILES:
        shutil.copyfile(Path(dcoco_hf.__file__).parent / name, card / name)
        print(f"copied {name} -> {card}")


if __name__ == "__main__":
    main()
