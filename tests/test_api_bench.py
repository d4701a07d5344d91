"""scripts/api_bench.py's summary: where a method's time went."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

_API = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "api_bench.py"))


def test_time_split_names_every_second_once():
    """The target's prompt forward counts as prefill, not verify; the shares of all parts add up to the whole."""
    runs = [dict(seconds=2.0, prefill_seconds=0.2, drafter_seconds=0.3, corrector_seconds=0.1, target_seconds=1.2),
            dict(seconds=1.0, prefill_seconds=0.1, drafter_seconds=0.2, corrector_seconds=0.05, target_seconds=0.6)]
    split = _API["time_split"](runs)
    assert split["prefill"] == pytest.approx(0.3 / 3) and split["verify"] == pytest.approx(1.5 / 3)
    assert split["draft"] == pytest.approx(0.5 / 3) and split["corrector"] == pytest.approx(0.15 / 3)
    assert sum(split.values()) == pytest.approx(1.0) and split["other"] == pytest.approx(0.55 / 3)
