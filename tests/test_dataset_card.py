"""The shipped training data folders (model_cards/smollm2-135m-*-answers): complete as their cards describe them, and
disjoint from the evaluation suites."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from conftest import function_signatures

from dcoco_hf import assets
from dcoco_hf.training.data import load_shards, regenerate

CARDS = Path(__file__).resolve().parents[1] / "model_cards"
SHARD_SIZE = inspect.signature(regenerate).parameters["shard_size"].default


@pytest.fixture(
    scope="module",
    params=["smollm2-135m-self-answers", "smollm2-135m-code-answers", "smollm2-135m-exercise-answers",
            "smollm2-135m-exercise-answers-2"],
)
def folder(request) -> Path:
    return CARDS / request.param


def test_card_figures_are_the_data(folder):
    records = load_shards(folder)
    card = (folder / "README.md").read_text()
    prompts = json.loads((folder / "prompts.json").read_text())
    # A folder made with --shards N answers the first N shards of its prompts; the card says how many.
    assert len(records) == len(prompts) or len(records) % SHARD_SIZE == 0 < len(records) < len(prompts)
    answered = prompts[: len(records)]
    code = sum(p.startswith("Complete the following Python function") for p in answered)
    tokens = sum(len(r["input_ids"]) for r in records)
    answer_tokens = sum(int(r["loss_mask"].sum()) for r in records)
    assert f"| records | {len(records)}: {code} code prompts, {len(answered) - code} chat prompts |" in card
    if len(records) < len(prompts):
        assert f"the first {len(records)} of its {len(prompts)} prompts" in card
    assert f"| tokens | {tokens:,} in all, {answer_tokens:,} of them answer tokens (`loss_mask`) |" in card
    for record in records:  # one prompt, then one answer: the mask is a single tail
        mask = record["loss_mask"]
        assert mask.any() and not mask[: int(mask.nonzero()[0])].any() and mask[int(mask.nonzero()[0]):].all()


def test_no_prompt_comes_from_the_evaluation_suites(folder):
    prompts = json.loads((folder / "prompts.json").read_text())
    assert not function_signatures(prompts) & function_signatures(assets.suite_prompts("humaneval"))
    questions = {q.strip() for q in assets.suite_prompts("mtbench")}
    assert not questions & {p.strip() for p in prompts}


def test_shards_are_packed(folder):
    """Each shard holds one tensor per field that every record views (`save_shard`): a quarter smaller on disk."""
    for path in sorted(folder.glob("shard-*.pt")):
        records = torch.load(path)
        for name in records[0]:
            assert len({record[name].untyped_storage().data_ptr() for record in records}) == 1, (path.name, name)
