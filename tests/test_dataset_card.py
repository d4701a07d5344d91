"""The shipped training data folder (model_cards/smollm2-135m-self-answers): complete, as its card describes it, and
disjoint from the evaluation suites."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dcoco_hf import assets
from dcoco_hf.training.data import load_shards

FOLDER = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-self-answers"


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_shards(FOLDER)


def test_card_figures_are_the_data(records):
    card = (FOLDER / "README.md").read_text()
    prompts = json.loads((FOLDER / "prompts.json").read_text())
    code = sum(p.startswith("Complete the following Python function") for p in prompts)
    tokens = sum(len(r["input_ids"]) for r in records)
    answer_tokens = sum(int(r["loss_mask"].sum()) for r in records)
    assert len(records) == len(prompts)
    assert f"| records | {len(records)}: {code} code prompts, {len(prompts) - code} chat prompts |" in card
    assert f"| tokens | {tokens:,} in all, {answer_tokens:,} of them answer tokens (`loss_mask`) |" in card
    for record in records:  # one prompt, then one answer: the mask is a single tail
        mask = record["loss_mask"]
        assert mask.any() and not mask[: int(mask.nonzero()[0])].any() and mask[int(mask.nonzero()[0]):].all()


def test_no_prompt_comes_from_the_evaluation_suites():
    prompts = json.loads((FOLDER / "prompts.json").read_text())
    signature = re.compile(r"def \w+\(.*")  # some names recur (`add`), whole signatures must not
    held_out = {m.group(0) for p in assets.suite_prompts("humaneval") for m in signature.finditer(p)}
    assert not {m.group(0) for p in prompts for m in signature.finditer(p)} & held_out
    questions = {q.strip() for q in assets.suite_prompts("mtbench")}
    assert not questions & {p.strip() for p in prompts}
