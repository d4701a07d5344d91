"""Prompts at scale (`dcoco_hf.training.prompt_sources`): tens of thousands of distinct prompts from sources that
install with the package, deduplicated, none overlapping an evaluation suite the project reports on, with a dataset
card that says what was dropped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dcoco_hf.training.cards import dataset_card
from dcoco_hf.training.prompt_sources import (
    OVERLAP_WORDS,
    documentation_openings,
    library_code_openings,
    library_code_prompts,
    normalized,
    prepare_prompts,
    prose_openings,
    task_prompts,
)

REPO = Path(__file__).resolve().parents[1]


def test_task_prompts_are_distinct_varied_and_repeatable():
    prompts = task_prompts(5000, seed=3)
    assert len(prompts) == 5000 and len({normalized(p) for p in prompts}) == 5000
    assert task_prompts(5000, seed=3) == prompts and task_prompts(5000, seed=4) != prompts
    assert any("Answer in Hindi." in p for p in prompts)  # other languages
    assert any(re.search(r"\d+ km in \d+ hours", p) for p in prompts)  # reasoning with numbers
    assert any(p.startswith("Write a short poem") for p in prompts)  # writing


def test_prepare_prompts_drops_duplicates_and_anything_near_an_evaluation_prompt():
    evaluation = [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
        'def has_close_elements(numbers, threshold):\n    """Check if in given list of numbers, are any two numbers '
        'closer to each other than given threshold."""\n',
    ]
    sources = {
        "a": ["Explain tides.", "explain   TIDES.", "Please compose an engaging travel blog post about a recent trip "
              "to Hawaii, highlighting cultural experiences and sights."],
        "b": ["Complete the following Python function:\n```python\ndef has_close_elements(xs, t):\n    pass\n```",
              "Write a haiku about tea.", "Explain tides."],
    }
    kept, report = prepare_prompts(sources, evaluation)
    assert kept == ["Explain tides.", "Write a haiku about tea."]
    assert (report.duplicates, report.overlapping, report.named_like_evaluation) == (2, 1, 1)
    assert report.sources == {"a": 3, "b": 3} and report.kept == 2 and report.evaluation_prompts == 2
    card = dataset_card(report, "org/model", "dcoco-hf train --target org/model --out run")
    assert "dcoco-hf train --target org/model --out run" in card and "| a | 3 |" in card
    assert f"sharing a run of {OVERLAP_WORDS} words" in card and "2 prompts kept" in card
    meta = yaml.safe_load(card.split("---\n")[1])  # the Hub's metadata
    assert meta["license"] == "other" and "org/model's output: its licence and terms apply" in card
    assert meta["size_categories"] == ["n<1K"] and meta["task_categories"] == ["text-generation"]
    assert meta["pretty_name"] == "Training prompts and answers for a drafter of org/model"
    apache = yaml.safe_load(dataset_card(report, "org/model", "x", license="apache-2.0").split("---\n")[1])
    assert apache["license"] == "apache-2.0"


@pytest.mark.slow
def test_the_sources_give_tens_of_thousands_of_prompts_held_apart_from_every_reported_suite(capsys):
    """What `dcoco-hf train` draws on: documented functions of the standard library and the installed libraries,
    and task prompts; checked against HumanEval, MT-Bench and the held-out suites the results are reported on."""
    from dcoco_hf.assets import humaneval_prompts, load_prompts_file, mtbench_prompts

    code = library_code_prompts()
    assert len(code) > 5000 and not any(line.startswith("The Zen of") for line in capsys.readouterr().out.splitlines())
    evaluation = humaneval_prompts() + mtbench_prompts()
    for suite in sorted((REPO / "scripts" / "prompts").glob("*.jsonl")):
        evaluation += load_prompts_file(suite)
    kept, report = prepare_prompts({"code": code, "tasks": task_prompts(20000)}, evaluation)
    assert len(kept) >= 20000 and report.evaluation_prompts >= 80 + 164
    evaluation_names = {n for p in evaluation for n in re.findall(r"def (\w+)\(", p)}
    assert not any(set(re.findall(r"def (\w+)\(", p)) & evaluation_names for p in kept)
    assert not {normalized(p) for p in kept} & {normalized(p) for p in evaluation}


def test_prose_openings_are_distinct_varied_and_repeatable():
    """A base model's prose: essay, story, letter and how-to openings over the topics, and openings in five other
    languages; no template is left with an unfilled field."""
    openings = prose_openings(3000, seed=1)
    assert len(openings) == 3000 and len({normalized(p) for p in openings}) == 3000
    assert prose_openings(3000, seed=1) == openings and prose_openings(3000, seed=2) != openings
    assert not any("{" in p or "}" in p for p in openings)
    assert any(p.startswith("Dear Sam") for p in openings) and any(p.startswith("Chapter 1") for p in openings)
    assert any(p.startswith("Querida Ana") for p in openings) and any(p.startswith("Liebe Anna") for p in openings)


@pytest.mark.slow
def test_a_base_models_sources_are_code_and_prose_openings_held_apart_from_its_suites():
    """Without a chat template the target continues text: function openings (signature and docstring, no chat
    wrapper) and prose openings, none overlapping raw HumanEval or the held-out prose openings."""
    from dcoco_hf.assets import humaneval_code_prompts, load_prompts_file

    code, documentation = library_code_openings(), documentation_openings()
    assert len(code) > 5000 and all(p.startswith("def ") and p.endswith('"""\n') for p in code)
    assert len(documentation) > 500 and all(p[-1] in ".!?" for p in documentation)
    evaluation = humaneval_code_prompts() + load_prompts_file(REPO / "scripts" / "prompts" / "prose-openings.jsonl")
    kept, report = prepare_prompts({"code": code, "docs": documentation, "prose": prose_openings(10000)},
                                   evaluation)
    assert len(kept) >= 15000 and report.named_like_evaluation > 0  # some library functions share HumanEval's names
    assert not {normalized(p) for p in kept} & {normalized(p) for p in evaluation}
