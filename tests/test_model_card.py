"""The shipped drafter folder: Hub-ready, loadable with trust_remote_code, and its code in sync with the package.

A Hub folder must carry its own copy of the modeling code (`trust_remote_code`); these tests fail as soon as the
package code changes without the copy being refreshed (`python scripts/sync_model_card.py`).
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import dcoco_hf
from dcoco_hf.assets import load_default_target
from dcoco_hf.cli import DEFAULT_DRAFTER_NAME
from dcoco_hf.cpu_linear import available_layouts, use_few_rows_linear

CARD = Path(__file__).resolve().parents[1] / "model_cards" / DEFAULT_DRAFTER_NAME
_SYNC = runpy.run_path(str(CARD.parents[1] / "scripts" / "sync_model_card.py"))
CODE_FILES = tuple(_SYNC["remote_code_files"]())


def test_folder_is_complete_and_hub_ready():
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md", *CODE_FILES):
        assert (CARD / name).is_file(), name
    config = json.loads((CARD / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert "RESULTS_TABLE" not in (CARD / "README.md").read_text()


@pytest.mark.parametrize("name", CODE_FILES)
def test_shipped_code_matches_the_package(name):
    package = Path(dcoco_hf.__file__).parent / name
    assert (CARD / name).read_text() == package.read_text(), f"run scripts/sync_model_card.py ({name} differs)"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, *(name for name in available_layouts() if name != "gemm")])
def test_shipped_drafter_is_lossless_on_the_default_target(layout):
    target, tokenizer = load_default_target()
    drafter = AutoModel.from_pretrained(CARD, trust_remote_code=True).attach(target)
    if layout is not None:  # the CLI's CPU default takes whichever of these is fastest on the machine
        use_few_rows_linear(target, layout=layout)
        use_few_rows_linear(drafter, max_rows=8, layout=layout)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        got = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    assert drafter.generation_stats(got).committed_tokens == 24


def test_card_results_table_matches_its_bench_json():
    """The headline numbers in the card are bench.json's, not typed by hand."""
    bench = json.loads((CARD / "bench.json").read_text())["suites"]
    card = (CARD / "README.md").read_text()
    rows = {("humaneval", "dcoco"): "| HumanEval | DCOCO (prefix-first walk) |", ("mtbench", "dcoco"): "| MT-Bench | DCOCO |",
            ("mtbench", "dflash"): "| MT-Bench | plain DFlash |"}
    for (suite, method), prefix in rows.items():
        summary = bench[suite][method]
        assert f"{prefix} {summary['tau']:.2f} | {summary['speedup']:.2f}x |" in card, (suite, method)


def test_recorded_block_tau_is_the_block_size_bench():
    """`block_tau` in config.json, which --block-size auto weighs against timed cycles, is what the card's block-size
    bench measured (scripts/record_block_tau.py), for every block the drafter was trained to draft."""
    config = json.loads((CARD / "config.json").read_text())
    bench = json.loads((CARD / "bench_block_sizes.json").read_text())
    measured = {
        name.split("@")[1]: round(summary["tau"], 4)
        for name, summary in bench["methods"].items()
        if name.startswith("dcoco@")
    }
    assert config["block_tau"] == measured
    assert sorted(map(int, measured)) == list(range(2, config["max_block_size"] + 1))


def test_card_states_the_check_on_prompts_no_choice_was_made_on():
    """The weights were picked partly on the first 20 prompts of each suite; the card's ratio on the next 20 is
    bench_prompts_21-40.json's, with every output equal to plain greedy."""
    report = json.loads((CARD / "bench_prompts_21-40.json").read_text())
    assert report["config"]["skip"] == 20 and report["config"]["suites"] == {"humaneval": 20, "mtbench": 20}
    card = (CARD / "README.md").read_text()
    for suite, name in (("humaneval", "HumanEval"), ("mtbench", "MT-Bench")):
        summaries = report["suites"][suite]
        assert summaries["dcoco@4"]["equal_to_vanilla"] == summaries["dflash@4"]["equal_to_vanilla"] == 1.0
        ratio = summaries["dcoco@4"]["tau"] / summaries["dflash@4"]["tau"]
        assert f"{name} {ratio:.3f}" in card, (suite, ratio)
