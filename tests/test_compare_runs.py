"""`scripts/compare_runs.py`: runs of `dcoco-hf train` compared at the checkpoint steps they share, each named by
the drafter options where it differs from the reference."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "compare_runs.py")


def compare(monkeypatch, *argv: object) -> None:
    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, argv)])
    runpy.run_path(SCRIPT, run_name="__main__")


def fake_run(folder: Path, options: dict, taus: dict[int, float]) -> Path:
    folder.mkdir()
    (folder / "train_state.json").write_text(json.dumps({"target": "t", "command": ["dcoco-hf", "train"],
                                                         "options": options}))
    lines = [{"stage": 1, "step": step, "tau": tau, "chain_accept": [0.5], "time": 0} for step, tau in taus.items()]
    lines.append({"stage": 2, "step": 250, "tau": 9.0, "chain_accept": [0.9], "time": 0})
    (folder / "progress.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_runs_are_compared_at_shared_steps_by_their_differing_options(tmp_path, monkeypatch, capsys):
    base = {"layers": 3, "steps": 3000, "out": "a", "data_from": None, "lr": 6e-4}
    reference = fake_run(tmp_path / "a", base, {250: 1.5, 500: 1.7, 750: 1.8})
    other = fake_run(tmp_path / "b", {**base, "layers": 2, "steps": 500, "out": "b", "data_from": "a"},
                     {250: 1.4, 500: 1.6})
    out = tmp_path / "choices.json"
    compare(monkeypatch, reference, other, "--json", out)
    report = json.loads(out.read_text())
    assert report["steps"] == [250, 500]
    assert [run["differs"] for run in report["runs"]] == [{}, {"layers": 2}]  # paths and step budgets are no choice
    assert [line["tau"] for line in report["runs"][1]["progress"]] == [1.4, 1.6]  # stage 1 only
    assert "layers=2" in capsys.readouterr().out


def test_a_folder_that_is_no_run_is_refused_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--out folder of a `dcoco-hf train` run"):
        compare(monkeypatch, tmp_path)
