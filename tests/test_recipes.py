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


def test_recipes_exist_for_every_shipped_head():
    names = {path.stem for path in RECIPES if path.parent.name == "smollm2"}
    assert {"lilicorr", "lilicorr-evidence", "dflash2-selector", "corrector-on-dflash"} <= names, names
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
    recipe = REPO / "recipes" / "smollm2" / "lilicorr.yaml"
    base = script.parse_args(["--recipe", str(recipe)])
    assert (base.max_steps, base.lr, base.block_sizes, base.corrector) == (1200, 2e-3, [4], "lilicorr")
    assert [str(p) for p in base.data] == ["runs/smollm2-16k/data"]
    args = script.parse_args(["--max-steps", "7", "--recipe", str(recipe), "--data", "d1", "d1", "--block-sizes", "3",
                              "5"])
    assert (args.max_steps, args.block_sizes, [str(p) for p in args.data]) == (7, [3, 5], ["d1", "d1"])
    assert args.lr == 2e-3 and args.init == "model_cards/dcoco-smollm2-135m"  # what the command line leaves alone
    assert args.draft_block_size == 4  # the drafted block of the saved head, set without editing config files


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
