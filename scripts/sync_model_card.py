"""Refresh the code files of the shipped drafter folder from the package (a Hub folder carries its own copy).

    python scripts/sync_model_card.py [model_cards/dcoco-smollm2-135m]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import dcoco_hf

CODE_FILES = ("configuration_dcoco.py", "modeling_dcoco.py", "corrector.py", "candidate_generator.py")


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("card", type=Path, nargs="?", default=root / "model_cards" / "dcoco-smollm2-135m")
    card = parser.parse_args().card
    if not (card / "config.json").exists():
        parser.error(f"{card}: no config.json there; pass a drafter folder (save_pretrained output)")
    for name in CODE_FILES:
        shutil.copyfile(Path(dcoco_hf.__file__).parent / name, card / name)
        print(f"copied {name} -> {card}")


if __name__ == "__main__":
    main()
