"""The corrector registry: one place maps `corrector_type` to a `Corrector` class, and nothing else reads the name."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dcoco_hf.network.corrector import Corrector, DCOCOCorrector
from dcoco_hf.network.correctors import CORRECTORS, corrector_class
from dcoco_hf.network.lilicorr import LiLiCorrCorrector
from dcoco_hf.network.selector import SelectorCorrector

ROOT = Path(__file__).resolve().parents[1]


def test_registry_names_the_three_correctors():
    assert CORRECTORS == {"dcoco": DCOCOCorrector, "lilicorr": LiLiCorrCorrector, "dflash2": SelectorCorrector}
    assert all(issubclass(cls, Corrector) for cls in CORRECTORS.values())
    assert corrector_class("lilicorr") is LiLiCorrCorrector and corrector_class("dflash2") is SelectorCorrector


def test_unknown_corrector_names_the_choices():
    with pytest.raises(
        ValueError, match=r"corrector_type='tree' is unknown; choose one of \('dcoco', 'lilicorr', 'dflash2'\)"
    ):
        corrector_class("tree")


def test_only_the_registry_compares_the_corrector_type():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = subprocess.run(
        # Tests may assert a loaded config's value; the code itself dispatches through the registry only.
        ["git", "grep", "-n", r"corrector_type ==\|corrector_type !=", "--", ".", ":!tests"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout
    assert found == "", f"compare through dcoco_hf/network/correctors.py instead:\n{found}"
