"""The shipped drafter folder: Hub-ready, loadable with trust_remote_code, and its code in sync with the package.

A Hub folder carries its own copy of the network's code (`trust_remote_code`; the runtime is the installed package);
these tests fail as soon as the package code changes without the copy being refreshed
(`python scripts/sync_model_card.py`).
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import dcoco_hf
from dcoco_hf.assets import load_default_target
from dcoco_hf.cli.common import DEFAULT_DRAFTER_NAME
from dcoco_hf.runtime.cpu_linear import available_layouts, use_few_rows_linear

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "model_cards" / DEFAULT_DRAFTER_NAME
_SYNC = runpy.run_path(str(ROOT / "scripts" / "sync_model_card.py"))
_RESULTS = runpy.run_path(str(ROOT / "scripts" / "results_table.py"))
_TREES = runpy.run_path(str(ROOT / "docs" / "history" / "trees_bench.py"))
CODE_FILES = tuple(_SYNC["remote_code_files"]())
HEAD_CARDS = [ROOT / "model_cards" / "lilicorr-smollm2-135m", ROOT / "model_cards" / "dflash2-selector-smollm2-135m"]
# Each side-by-side bench JSON and the documents that show its table.
TABLES = {
    "docs/bench_lilicorr.json": ["docs/lilicorr.md", "model_cards/lilicorr-smollm2-135m/README.md"],
    "docs/bench_selector.json": ["docs/selector.md", "model_cards/dflash2-selector-smollm2-135m/README.md"],
}


def test_folder_is_complete_and_hub_ready():
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md", *CODE_FILES):
        assert (CARD / name).is_file(), name
    config = json.loads((CARD / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel"}  # a drafter cannot generate alone
    assert "RESULTS_TABLE" not in (CARD / "README.md").read_text()


# A card's own first lines, in a fresh process that never imports dcoco_hf: AutoModel builds the folder's network,
# which hands loading over to the installed package, so `.attach(target)` works. The target has the card's target's
# shapes (random weights and a narrow MLP: what matters is the class AutoModel returns and that speculation stays
# exact).
_CARD_FIRST_LINES = """
import json, sys, torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
folder, shape = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
target = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).eval()
drafter = AutoModel.from_pretrained(folder, trust_remote_code=True).attach(target, tune=False)
assert type(drafter).__module__ == "dcoco_hf.runtime.drafter", type(drafter)
assert type(drafter.corrector).__module__.startswith("dcoco_hf."), type(drafter.corrector)
ids = torch.randint(0, shape["vocab_size"], (1, 8))
with torch.no_grad():
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    fast = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           assistant_model=drafter)
assert torch.equal(plain, fast), (plain, fast)
print(drafter.config.corrector_type, drafter.generation_stats(fast).cycles)
"""
_SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64)
_GEMMA3 = dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=64, num_hidden_layers=18,
               num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
# Every drafter card, with the shape of the target it drafts for.
TARGET_SHAPES = {CARD.name: _SMOLLM2, **{card.name: _SMOLLM2 for card in HEAD_CARDS}, "dcoco-gemma3-270m": _GEMMA3}
FIRST_LINE_CARDS = [ROOT / "model_cards" / name for name in TARGET_SHAPES if (ROOT / "model_cards" / name).exists()]


def test_every_drafter_card_is_checked_by_its_first_lines():
    cards = {path.parent.name for path in (ROOT / "model_cards").glob("*/config.json")}
    assert cards == {card.name for card in FIRST_LINE_CARDS}, "add the card's target shape to TARGET_SHAPES"


@pytest.mark.parametrize("card", FIRST_LINE_CARDS, ids=lambda p: p.name)
def test_a_cards_first_line_attaches_without_importing_the_package(card):
    """`AutoModel.from_pretrained(folder, trust_remote_code=True).attach(target)` in a process that never imported
    dcoco_hf (the package is installed), on a target of the card's target's shape: every drafter card, head-only
    ones (LiLiCorr, DFlash2 selector) included."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _CARD_FIRST_LINES, str(card), json.dumps(TARGET_SHAPES[card.name])],
                            capture_output=True, text=True, cwd=card.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    corrector, cycles = result.stdout.split()[-2:]
    assert corrector == json.loads((card / "config.json").read_text()).get("corrector_type", "dcoco")
    assert int(cycles) > 0


@pytest.mark.parametrize("card", FIRST_LINE_CARDS, ids=lambda p: p.name)
@pytest.mark.parametrize("name", CODE_FILES)
def test_shipped_code_matches_the_package(card, name):
    package = Path(dcoco_hf.__file__).parent / "network" / name
    assert (card / name).read_text() == package.read_text(), f"run scripts/sync_model_card.py {card} ({name} differs)"


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


def _shown(doc: Path, start: str, end: str) -> str:
    return doc.read_text().split(start, 1)[1].split(end, 1)[0].strip()


def test_results_tables_are_their_json_files():
    """The README's, the card's and docs/results.md's results tables are `scripts/results_table.py`'s rendering of
    the benchmark JSON files they link to (`--write`), not figures typed by hand; so is docs/trees.md's table
    (`docs/history/trees_bench.py --render`)."""
    rows = _RESULTS["api_rows"]() + _RESULTS["bench_rows"]()
    assert len(rows) >= 6, "docs/results/ lost its benchmark files"
    for doc, link in _RESULTS["DOCS"].items():
        assert _shown(doc, _RESULTS["START"], _RESULTS["END"]) == _RESULTS["table"](link), (
            f"{doc}: run python scripts/results_table.py --write")
    results = _RESULTS["RESULTS_DOC"]
    assert _shown(results, _RESULTS["START"], _RESULTS["END"]) == _RESULTS["api_table"]()
    for suite in _RESULTS["BATCH_SUITES"]:
        assert _RESULTS["batch_rows"](suite), f"docs/results/bench_batch_{suite}.json is missing"
        assert _shown(results, *_RESULTS["batch_marks"](suite)) == _RESULTS["batch_table"](suite), (
            f"{results}: run python scripts/results_table.py --write")
    for name, render in _RESULTS["SECTIONS"].items():
        assert _shown(results, *_RESULTS["section_marks"](name)) == render() != "", name
    proposal = _shown(_RESULTS["PROPOSAL_DOC"], *_RESULTS["section_marks"]("proposal"))
    assert proposal == _RESULTS["proposal_table"]() != "", "docs/proposal.md: python scripts/results_table.py --write"
    schedule = _shown(_RESULTS["PROPOSAL_DOC"], *_RESULTS["section_marks"]("schedule"))
    assert schedule == _RESULTS["schedule_table"]() != "", "docs/proposal.md: python scripts/results_table.py --write"
    if _RESULTS["GEMMA3_CARD"].parent.is_dir():  # a shipped Gemma 3 drafter publishes its runs in three places
        marks = _RESULTS["section_marks"]("gemma3 results")
        table = _RESULTS["gemma3_table"]
        assert _shown(_RESULTS["GEMMA3_CARD"], *marks) == table(link=False) != "", "its card"
        assert _shown(ROOT / "README.md", *marks) == table(link=True, full=False) != "", "README.md"
        assert _shown(results, *marks) == "\n".join(_RESULTS["_from_docs"](table(link=True).split("\n"))), results
        assert "corrector alone" in table() and "went" in table(), "the corrector-off bench and the time split"
    for name in _TREES["REPORTS"]:
        trees = _TREES["markdown_table"](json.loads((ROOT / "docs" / "history" / f"{name}.json").read_text()))
        assert _shown(ROOT / "docs" / "trees.md", *_TREES["table_marks"](name)) == trees, (
            f"run python docs/history/trees_bench.py --render docs/history/{name}.json --write docs/trees.md")


def test_every_published_speed_names_its_tuning_line():
    """A speedup depends on the host's plain step and verify cost: every results table's caption gives the tuning
    line of its run, so a reader can tell the prompts from the machine."""
    line = re.compile(r"plain step [0-9.]+ ms, verify of \d+ rows [0-9.]+x it")
    captions = [*_RESULTS["api_caption"](), *_RESULTS["bench_caption"]()]
    assert len(captions) == 3
    for suite in _RESULTS["BATCH_SUITES"]:
        caption = _RESULTS["batch_table"](suite).split("\n\n")[-2:]
        assert len(caption) == 2 and all(line.search(part) for part in caption), (suite, caption)
    for name in _TREES["REPORTS"]:
        trees = json.loads((ROOT / "docs" / "history" / f"{name}.json").read_text())
        captions.append(_TREES["markdown_table"](trees).split("\n")[0])
    captions += [_RESULTS["sampling_table"]().split("\n")[-1], _RESULTS["split_table"]().split("\n")[-1]]
    captions += _RESULTS["schedule_table"]().split("\n\n")[-1].split("\n")
    for caption in captions:
        assert line.search(caption), caption


def test_results_runs_kept_every_output_identical():
    api = json.loads((ROOT / "docs" / "results" / "api_bench.json").read_text())
    assert set(api["suites"]) == {"humaneval", "mtbench", "mixed-heldout", "hard-to-draft"}
    for name, suite in api["suites"].items():
        for method in api["methods"][1:]:
            assert suite["totals"][method]["identical"] == suite["prompts"] == len(suite["records"]) > 0, name
    benches = ["bench_dflash_vs_dcoco.json"]
    if _RESULTS["GEMMA3_CARD"].parent.is_dir():
        gemma = json.loads((ROOT / "docs" / "results" / _RESULTS["GEMMA3_API_RUN"]).read_text())
        for name, suite in gemma["suites"].items():
            assert suite["totals"]["assisted"]["identical"] == suite["prompts"] == len(suite["records"]) > 0, name
        benches += [file for _, file in _RESULTS["GEMMA3_BENCHES"]]
    for file in benches:
        for suite in json.loads((ROOT / "docs" / "results" / file).read_text())["suites"].values():
            assert suite["dflash"]["equal_to_vanilla"] == suite["dcoco"]["equal_to_vanilla"] == 1.0, file
    for file in sorted((ROOT / "docs" / "results").glob("bench_batch_*.json")):
        for size, methods in json.loads(file.read_text())["results"].items():
            assert all(entry["equal_to_vanilla"] for entry in methods.values()), (file.name, size)
    for file in _RESULTS["SCHEDULE_RUNS"]:
        for method, summary in json.loads((ROOT / "docs" / "results" / file).read_text())["methods"].items():
            assert summary["equal_to_vanilla"] == 1.0, (file, method)
    for report in _TREES["REPORTS"]:
        for name, methods in json.loads((ROOT / "docs" / "history" / f"{report}.json").read_text())["suites"].items():
            assert all(r["identical"] == r["prompts"] > 0 for r in methods.values()), (report, name)


def test_recorded_block_tau_is_the_block_size_bench():
    """`block_tau` in generation_config.json, which --block-size auto weighs against timed cycles, is what the card's
    block-size bench measured (scripts/record_block_tau.py), for every block the drafter was trained to draft."""
    config = json.loads((CARD / "config.json").read_text())
    generation = json.loads((CARD / "generation_config.json").read_text())
    bench = json.loads((CARD / "bench_block_sizes.json").read_text())
    measured = {
        name.split("@")[1]: round(summary["tau"], 4)
        for name, summary in bench["methods"].items()
        if name.startswith("dcoco@")
    }
    assert generation["block_tau"] == measured and "block_tau" not in config
    assert sorted(map(int, measured)) == list(range(2, config["block_size"] + 1))


def test_readme_and_card_are_product_docs():
    """Short enough to read in five minutes, history kept in docs/, and the README's layout table names every file
    of the package."""
    readme, card = (ROOT / "README.md").read_text(), (CARD / "README.md").read_text()
    assert len(readme.splitlines()) <= 220 and len(card.splitlines()) <= 220
    assert not list(CARD.glob("training_summary_stage*.json")) and not (CARD / "HISTORY.md").exists()
    package = Path(dcoco_hf.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        name = path.relative_to(package).as_posix()
        shown = name if "/" not in name else name.split("/")[0] + "/"
        assert f"`dcoco_hf/{shown}" in readme or f"`{path.name}`" in readme or f", `{path.name}" in readme, name


@pytest.mark.parametrize("source", sorted(TABLES))
def test_side_by_side_tables_are_their_json_files(source):
    """The side-by-side tables (LiLiCorr's in docs/lilicorr.md and its card, the DFlash2 selector's in docs/selector.md
    and its card) are `scripts/bench_lilicorr.py --render`'s rendering of the JSON file they name, and every output of
    that run equals plain greedy."""
    bench = runpy.run_path(str(ROOT / "scripts" / "bench_lilicorr.py"))
    report = json.loads((ROOT / source).read_text())
    start, end = bench["table_markers"](source)
    for doc in (ROOT / name for name in TABLES[source]):
        shown = doc.read_text().split(start, 1)[1].split(end, 1)[0].strip()
        assert shown == bench["markdown_table"](report, source), \
            f"run bench_lilicorr.py --render {source} --write {doc}"
    for segments in report["segments"].values():
        for methods in segments.values():
            assert all(m["equal_to_vanilla"] == 1.0 for m in methods.values() if m["prompts"])


@pytest.mark.slow
@pytest.mark.parametrize("card", [CARD, *HEAD_CARDS], ids=lambda p: p.name)
def test_the_folders_own_code_drafts_what_the_package_drafts(card):
    """The network class a shipped folder's code builds (what a Hub user without the package gets), given the
    shipped weights and the real target's states, picks the same candidates, transition scores and drafts as the
    package's `DCOCODrafter.propose`."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from dcoco_hf import DCOCODrafter, DraftContextCache, select_candidates
    from dcoco_hf.training import target_context

    target, tokenizer = load_default_target()
    drafter = DCOCODrafter.from_pretrained(card).attach(target, tune=False).eval()
    network_class = get_class_from_dynamic_module("modeling_dcoco.DCOCODraftModel", str(card))
    assert network_class.__module__.startswith("transformers_modules")
    network = network_class(network_class.config_class.from_pretrained(card)).eval()
    network.load_state_dict(drafter.state_dict())  # a head-only folder's backbone comes from its base drafter
    network.bind_target(target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    block, decoding = drafter.draft_block_size, drafter.decoding
    with torch.no_grad():
        sequences = target.generate(ids, max_new_tokens=24, do_sample=False)
        states, _ = target_context(target, drafter.config.target_layer_ids, sequences)
        for cut in range(ids.shape[1] + 2, sequences.shape[1], 5):
            anchor, context, committed = sequences[:, cut - 1], states[:, : cut - 1], sequences[:, :cut]
            positions = torch.arange(cut - 1 + block)[None]
            reference = drafter.propose(
                anchor, context, positions, DraftContextCache(), context_ids=committed, block_size=block
            )

            mask = torch.full((1, block - 1), drafter.config.mask_token_id)
            out = network(network.embed(torch.cat([anchor[:, None], mask], 1)), context, positions)
            hidden = out.last_hidden_state
            logits, columns = network.proposal_logits(hidden[:, 1:])
            candidates, candidate_logits, log_probs = network.slot_candidates(logits, columns)
            reads_anchor = network.corrector.reads_anchor_state
            first, scores = network.score_candidates(
                hidden, anchor, candidates, candidate_logits, log_probs, context_ids=committed,
                anchor=network.anchor_rows(out.context_states, positions) if reads_anchor else None,
            )
            first = first if first is not None else candidate_logits[:, 0]
            chosen = select_candidates(decoding.selection, scores.float(), first.float(), decoding.geometric_lambda)
            assert torch.equal(candidates, reference.candidates)
            torch.testing.assert_close(scores, reference.transition_scores, rtol=1e-4, atol=1e-4)
            assert torch.equal(candidates.gather(-1, chosen[..., None]).squeeze(-1), reference.tokens)
    assert cut > ids.shape[1] + 10  # several drafts compared


@pytest.mark.slow
def test_shipped_selector_is_lossless_on_the_default_target():
    """The DFlash2 selector folder, loaded by AutoModel with its own code and the package imported, drafts for the
    real target, and greedy output is plain greedy output."""
    target, tokenizer = load_default_target()
    drafter = AutoModel.from_pretrained(HEAD_CARDS[1], trust_remote_code=True).attach(target)
    assert type(drafter).__name__ == "DCOCODrafter" and drafter.config.corrector_type == "dflash2"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        expected = target.generate(ids, max_new_tokens=32, do_sample=False)
        got = target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    stats = drafter.generation_stats(got)
    assert stats.corrector_seconds > 0 and stats.committed_tokens == 32
