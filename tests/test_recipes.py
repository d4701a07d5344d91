"""recipes/*.yaml: every file parses into valid `scripts/train_drafter.py` arguments (no training), command-line
flags override a recipe, and a bad recipe is a one-line error naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# recipes/train/ holds `dcoco-hf train` recipes (tests/test_train_command.py); the rest are stage recipes
RECIPES = sorted(path for path in (REPO / "recipes").rglob("*.yaml") if path.parent.name != "train")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_drafter", REPO / "scripts" / "train_drafter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipes_exist_for_every_stage_of_the_shipped_chain():
    names = {path.stem for path in RECIPES if path.parent.name == "smollm2"}
    stages = {"stage1"} | {f"stage2{s}" for s in "abcdefghilmno"}
    assert stages | {"corrector-on-dflash"} <= names, stages - names
    assert (REPO / "recipes" / "qwen3-8b" / "corrector-on-dflash.yaml").exists()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_recipe_parses_into_valid_arguments(script, recipe):
    args = script.parse_args(["--recipe", str(recipe)])
    assert args.stage in (1, 2) and args.data and args.output
    assert (args.init is None) == (args.stage == 1)
    for token in script.recipe_argv(script.build_parser(), recipe):  # every key is one of the script's options
        assert not token.startswith("--") or token[2:] in {
            a.option_strings[-1][2:] for a in script.build_parser()._actions
        }


def test_command_line_flags_override_the_recipe(script):
    recipe = REPO / "recipes" / "smollm2" / "stage2o.yaml"
    base = script.parse_args(["--recipe", str(recipe)])
    assert (base.max_steps, base.lr, base.block_sizes, base.corpus_bigrams) == (300, 1e-3, [4], True)
    assert [p.name for p in base.data].count("smollm2-self-answers") == 4  # a folder listed n times is read n times
    args = script.parse_args(["--max-steps", "7", "--recipe", str(recipe), "--data", "d1", "--block-sizes", "3", "5"])
    assert (args.max_steps, args.block_sizes, [str(p) for p in args.data]) == (7, [3, 5], ["d1"])
    assert args.lr == 1e-3 and args.init == "runs/stage2n/final"  # what the command line leaves alone


def test_stage_2c_recipe_sets_the_drafted_block_without_editing_config_files(script):
    args = script.parse_args(["--recipe", str(REPO / "recipes" / "smollm2" / "stage2c.yaml")])
    assert args.draft_block_size == 4 and args.init == "runs/ship"


@pytest.mark.parametrize(
    "text,message",
    [("stage: 2\nmax_stepz: 3\n", "unknown option(s) ['max_stepz']"),
     ("stage: 2\ncorrector-only: yes please\n", "corrector-only is a switch"),
     ("- stage\n", "expected `option: value` lines"),
     ("stage: [2\n", "cannot read it as YAML")],
    ids=["unknown-key", "switch-value", "not-a-mapping", "bad-yaml"],
)
def test_bad_recipes_are_clear_errors(script, tmp_path, capsys, text, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--recipe", str(recipe), "--data", "d", "--output", "o"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_draft_block_size_needs_init(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--stage", "1", "--data", "d", "--output", "o", "--draft-block-size", "4"])
    assert "--draft-block-size sets the drafted block of an existing drafter" in capsys.readouterr().err


def test_sampled_data_folders_rebuild_exactly_from_their_record_list(tmp_path, monkeypatch):
    """scripts/sample_records.py: a new sample leaves out the records an earlier one took, and --from-list rebuilds a
    folder record for record (the LiLiCorr recipe's data is rebuilt this way)."""
    import json
    import runpy
    import sys

    import torch

    from dcoco_hf.training.data import load_shards

    source = tmp_path / "answers"
    source.mkdir()
    records = [{"input_ids": torch.tensor([i, i + 1]), "loss_mask": torch.tensor([0, 1])} for i in range(10)]
    torch.save(records[:6], source / "shard-00000.pt")
    torch.save(records[6:], source / "shard-00001.pt")
    script = str(REPO / "scripts" / "sample_records.py")

    def run(*argv: str) -> None:
        monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
        runpy.run_path(script, run_name="__main__")

    run("--source", source, "--output", tmp_path / "a", "--count", 4)
    run("--source", source, "--output", tmp_path / "b", "--count", 6, "--exclude", tmp_path / "a")
    first, second = (load_shards(tmp_path / name) for name in "ab")
    taken = [int(r["input_ids"][0]) for r in first + second]
    assert sorted(taken) == list(range(10))  # disjoint, and together every record
    listed = {str(tmp_path / "again"): {"source": str(source), "indices": sorted(taken[4:])}}
    (tmp_path / "list.json").write_text(json.dumps(listed))
    run("--from-list", tmp_path / "list.json")
    again = load_shards(tmp_path / "again")
    assert [r["input_ids"].tolist() for r in again] == [r["input_ids"].tolist() for r in second]
    with pytest.raises(SystemExit, match="only 0 records are left"):
        run("--source", source, "--output", tmp_path / "c", "--count", 1, "--exclude", tmp_path / "a", tmp_path / "b")
