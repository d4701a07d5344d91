"""Every example in examples/ runs end to end (on tiny random-weight models) and shows what its docstring promises."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
from test_cli import tiny  # noqa: F401 (the saved tiny target and drafter folders, a module fixture)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folders(tiny) -> list[str]:  # noqa: F811 (pytest injects the imported fixture by name)
    """--target / --drafter arguments: a saved tiny llama target (with tokenizer) and a drafter fitted to it."""
    return [str(arg) for arg in tiny.model_args]


def test_every_example_is_tested():
    tested = {"quickstart", "sampling", "batched", "train_drafter"}
    assert {path.stem for path in EXAMPLES.glob("*.py")} == tested


def test_quickstart(folders, capsys):
    result = load_example("quickstart").main([*folders, "--prompt", "w1 w2 w3", "--max-new-tokens", "24"])
    assert result["identical"] and result["new_tokens"] == 24
    assert "identical to plain greedy generate(): True" in capsys.readouterr().out


def test_sampling(folders):
    example = load_example("sampling")
    samples = 200
    result = example.main([*folders, "--prompt", "w4 w5", "--samples", str(samples)])
    # The check has power: a sampler that ignored the target's distribution (here: always its greedy token) is far
    # from plain sampling, while speculative sampling stays within the noise of two plain runs (fixed seeds).
    greedy = Counter({result["greedy_token"]: samples})
    assert example.total_variation(result["plain"], greedy) > 0.5
    assert result["gap"] < 2 * result["noise"] + 0.05


def test_batched(folders):
    result = load_example("batched").main([*folders, "--max-new-tokens", "16"])
    assert result["identical"] and len(result["tau"]) == 3


def test_train_drafter(folders, tmp_path):
    result = load_example("train_drafter").main([
        folders[0], folders[1], "--output", str(tmp_path / "run"), "--answers", "16", "--held-out", "2",
        "--steps", "40", "--max-new-tokens", "24",
    ])
    assert (result["folder"] / "model.safetensors").is_file() and (result["folder"] / "modeling_dcoco.py").is_file()
    assert (result["folder"] / "README.md").is_file()  # the run's model card
    assert result["tau_after"] > result["tau_before"]  # training taught the drafter something the target accepts


def test_script_and_example_docstrings_keep_their_command_lines():
    """Their docstrings are their --help text; a shell line break (a backslash at the end of a line) in a non-raw
    docstring joins two command lines into one with a run of blanks in the middle."""
    import ast

    root = EXAMPLES.parent
    for path in sorted([*root.glob("scripts/*.py"), *EXAMPLES.glob("*.py")]):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        glued = [line for line in doc.splitlines() if re.search(r"\S {3,}--", line)]
        assert not glued, f"{path.name}: {glued}"
