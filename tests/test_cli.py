"""Smoke tests of the `dcoco-hf` command line (generate, bench, --json, --plots, errors) on tiny random models.

The CLI runs in-process through `cli.main(argv)` (a subprocess would re-import torch each time); one test runs
`python -m dcoco_hf` for the entry point, and the slow test runs the installed `dcoco-hf` script on the real target.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import _FITTED, VOCAB, fit_drafter, make_target, scrambled
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from dcoco_hf import DCOCODrafter
from dcoco_hf.cli import bench as bench_module
from dcoco_hf.cli import common as cli_common
from dcoco_hf.cli import main as cli
from dcoco_hf.cli.bench import (
    METHODS,
    BenchSettings,
    MethodRunner,
    format_report,
    run_order,
)
from dcoco_hf.network.configuration_dcoco import DecodingChoices
from dcoco_hf.runtime.cpu_linear import LAYOUTS
from dcoco_hf.runtime.hf_compat import assisted_static_cache
from dcoco_hf.cli.plots import PLOT_FILES

SPECULATIVE = [m for m in METHODS if m != "vanilla"]
SUMMARY_KEYS = {
    "tau", "tokens_per_s", "speedup", "equal_to_vanilla", "accept_hist", "per_slot_accept", "chain_accept",
    "coverage_top1",
    "coverage_topk", "argmax_prefix_tau", "topk_ceiling_tau", "walk_ceiling_tau", "corrector_share", "new_tokens",
    "seconds", "prompts",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over the tiny target's vocabulary, with a ChatML-like chat template."""
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [f"w{i}" for i in range(VOCAB - 5)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def run_cli(*argv: str) -> SimpleNamespace:
    """Run `dcoco-hf argv...` in-process; returns exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return SimpleNamespace(code=code, out=out.getvalue(), err=err.getvalue())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> SimpleNamespace:
    """Saved folders of a tiny llama target (with tokenizer) and a drafter fitted to it, plus a prompts file."""
    root = tmp_path_factory.mktemp("tiny")
    if "llama" not in _FITTED:  # share the fitting (the slow part) with the other test modules of the session
        target = make_target("llama")
        _FITTED["llama"] = (target, fit_drafter(target))
    target, drafter = _FITTED["llama"]
    # Whole blocks every cycle, as with `fitted` (conftest), whichever module fitted it first: these tests read
    # per-slot statistics of the largest block and the constant schedule's block choice.
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    lines = [json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 40}" for j in range(5)), "id": i}) for i in range(3)]
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model_args = ["--target", root / "target", "--drafter", root / "drafter"]
    return SimpleNamespace(root=root, prompts=prompts, model_args=model_args)


@pytest.fixture(scope="module")
def bench_run(tiny) -> SimpleNamespace:
    """One greedy bench of every method, with --json and --plots, shared by the tests that inspect it."""
    json_path, plots = tiny.root / "bench.json", tiny.root / "plots"
    result = run_cli(
        "bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 2, "--max-new-tokens", 8, "--warmup", 0,
        "--json", json_path, "--plots", plots,
    )
    assert result.code == 0, result.err
    result.report = json.loads(json_path.read_text())
    result.plots = plots
    return result


def test_bench_json_schema(bench_run, tiny):
    report = bench_run.report
    assert set(report) >= {"methods", "suites", "config"}
    assert list(report["methods"]) == list(METHODS)
    assert list(report["suites"]) == ["prompts"]  # a --prompts file is a suite named after the file
    for summaries in (report["methods"], report["suites"]["prompts"]):
        for name, summary in summaries.items():
            assert SUMMARY_KEYS <= set(summary), name
            assert summary["prompts"] == 2  # --limit 2 of the 3 prompts in the file
            assert summary["new_tokens"] == 16
    config = report["config"]
    for key in ("command_line", "target", "drafter", "block_size", "device", "dtype", "torch", "transformers"):
        assert key in config, key
    assert config["block_size"] == config["config_block_size"] == 8
    assert config["device"] == "cpu" and config["dtype"] == "float32"
    assert config["command_line"][:2] == ["dcoco-hf", "bench"]
    assert len(report["runs"]) == 2 * len(METHODS)


def test_bench_greedy_is_exact_and_stats_are_sane(bench_run):
    methods = bench_run.report["methods"]
    vanilla = methods["vanilla"]
    assert vanilla["speedup"] == pytest.approx(1.0) and vanilla["tau"] == 1.0 and vanilla["accept_hist"] == {}
    for name in SPECULATIVE:
        summary = methods[name]
        assert summary["equal_to_vanilla"] == 1.0, name
        assert summary["tau"] >= 1.0 and summary["speedup"] > 0
    for name in ("dflash", "dcoco", "dcoco-paper", "dcoco-viterbi", "dcoco-geometric"):
        assert len(methods[name]["per_slot_accept"]) == 7  # block 8 = 7 drafted slots
        assert all(key.isdigit() for key in methods[name]["accept_hist"])
    for name in ("dflash", "dcoco", "dcoco-paper", "dcoco-viterbi", "dcoco-geometric"):  # our engine
        summary = methods[name]
        assert len(summary["coverage_top1"]) == len(summary["coverage_topk"]) == 7
        assert all(t1 <= tk for t1, tk in zip(summary["coverage_top1"], summary["coverage_topk"]) if t1 is not None)
        assert 1 <= summary["argmax_prefix_tau"] <= summary["walk_ceiling_tau"] <= summary["topk_ceiling_tau"] <= 8
        # dflash is the same engine with the corrector off: it runs no corrector at all
        assert summary["corrector_share"] == 0 if name == "dflash" else 0 < summary["corrector_share"] < 1
        # the cycles' share leaves each call's prefill out of the time: larger, by exactly that ratio
        decoding = summary["seconds"] - summary["prefill_seconds"]
        assert 0 < summary["prefill_seconds"] < summary["seconds"]
        assert summary["cycle_share"] == pytest.approx(summary["corrector_share"] * summary["seconds"] / decoding)
    for name in ("vanilla", "prompt_lookup", "dflash-hf"):
        assert methods[name]["coverage_top1"] is None and methods[name]["corrector_share"] is None


def test_bench_table_on_stdout(bench_run):
    assert "== suite prompts" in bench_run.out and "== overall" in bench_run.out
    for name in METHODS:
        assert name in bench_run.out
    dcoco = bench_run.report["methods"]["dcoco"]
    row = next(line.split() for line in bench_run.out.splitlines() if line.split()[:1] == ["dcoco"])
    # the corrector's share of the cycles, then of all time
    assert row[-2:] == [f"{100 * dcoco['cycle_share']:.1f}%", f"{100 * dcoco['corrector_share']:.1f}%"]


def test_bench_explains_greedy_mismatch_only_where_one_happened(bench_run):
    report = bench_run.report
    assert "outputs differ" not in format_report(report)  # every greedy output equal, nothing to explain
    report = copy.deepcopy(report)
    report["methods"]["dcoco"]["equal_to_vanilla"] = 0.2
    assert "please report this: in float32" in format_report(report)
    report["config"]["dtype"] = "bfloat16"
    note = format_report(report).rsplit("\n", 1)[-1]
    assert note.startswith("outputs differ from plain generate(): in bfloat16") and "--dtype float32" in note


def test_bench_plots(bench_run):
    for name in PLOT_FILES:
        path = bench_run.plots / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_forward_trace_agrees_with_dcoco_stats(tiny):
    """The method-neutral acceptance measurement (target forward trace) matches the DCOCO engine's own books."""
    target = AutoModelForCausalLM.from_pretrained(tiny.root / "target").eval()
    drafter = DCOCODrafter.from_pretrained(tiny.root / "drafter").eval().attach(target)
    runner = MethodRunner(target, drafter, BenchSettings(max_new_tokens=40))
    accepted = 0
    for seed in range(4):
        ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        record = runner.run("dcoco", "random", seed, ids)
        trace, stats = record.acceptance, record.dcoco
        assert trace.target_forwards == stats.target_forwards
        assert record.new_tokens == stats.committed_tokens
        assert trace.accepted == stats.accepted
        assert trace.slot_proposed == stats.slot_proposed and trace.slot_accepted == stats.slot_accepted
        assert trace.slot_reached == stats.slot_reached
        accepted += sum(trace.accepted)
    assert accepted > 0  # not vacuous: drafts were accepted


def test_dcoco_paper_method_keeps_slot_1_at_the_drafter_argmax(tiny, monkeypatch):
    """On a drafter with `correct_first_slot`, "dcoco" re-selects slot 1 and "dcoco-paper" (the paper's walk) never
    does; each call leaves the drafter's config as it was."""
    target = AutoModelForCausalLM.from_pretrained(tiny.root / "target").eval()
    drafter = scrambled(DCOCODrafter.from_pretrained(tiny.root / "drafter").eval().attach(target), seed=3)
    drafter.config.correct_first_slot = True
    first_slot_choices = []
    propose = drafter.propose

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        first_slot_choices.append(int(proposal.chosen[0, 0]))
        return proposal

    monkeypatch.setattr(drafter, "propose", recording)
    runner = MethodRunner(target, drafter, BenchSettings(max_new_tokens=40))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    picks = {}
    for method in ("dcoco-paper", "dcoco"):
        first_slot_choices.clear()
        record = runner.run(method, "random", 0, ids)
        picks[method] = list(first_slot_choices)
        assert record.output == runner.run("vanilla", "random", 0, ids).output
        assert drafter.config.correct_first_slot and drafter.generation_config.selection == "prefix_first"
    runner.close()
    assert picks["dcoco-paper"] and not any(picks["dcoco-paper"])
    assert any(picks["dcoco"]), picks


@pytest.mark.skipif(
    not assisted_static_cache(), reason="transformers < 5.24 refuses a static cache in assisted generation"
)
def test_bench_block_size_and_static_cache(tiny):
    result = run_cli(
        "bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 2, "--max-new-tokens", 12, "--warmup", 1,
        "--methods", "vanilla,prompt_lookup,dflash,dcoco", "--block-size", 4, "--cache", "static",
        "--json", tiny.root / "static.json",
    )
    assert result.code == 0, result.err
    report = json.loads((tiny.root / "static.json").read_text())
    assert report["config"]["block_size"] == 4 and report["config"]["config_block_size"] == 8
    assert report["config"]["cache"] == "static"
    # CPU default: forwards of 2 to 2 x block rows (the run's --block-size 4, not the config's 8), or to a draft tree
    # of the default budget and its anchor where that is wider, take the layout measured fastest on this machine
    plan = report["config"]["few_rows_linear"]
    widest = max(2 * 4, DecodingChoices().tree_budget + 1)
    assert set(plan) == {str(rows) for rows in range(2, widest + 1)} and set(plan.values()) <= set(LAYOUTS)
    for name in ("prompt_lookup", "dflash", "dcoco"):  # prompt lookup and DFlash overrun an exact-size static cache
        assert report["methods"][name]["equal_to_vanilla"] == 1.0, name
    for name in ("dflash", "dcoco"):
        assert len(report["methods"][name]["per_slot_accept"]) <= 3


def test_bench_compares_block_sizes_interleaved(tiny):
    result = run_cli(
        "bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 2, "--max-new-tokens", 12, "--warmup", 0,
        "--methods", "vanilla,dcoco@2,dcoco@5,dflash@3,dcoco", "--json", tiny.root / "blocks.json",
        "--plots", tiny.root / "block-plots",
    )
    assert result.code == 0, result.err
    report = json.loads((tiny.root / "blocks.json").read_text())
    methods = report["methods"]
    assert list(methods) == ["vanilla", "dcoco@2", "dcoco@5", "dflash@3", "dcoco"]
    drafted = {name: len(methods[name]["per_slot_accept"]) for name in methods if name != "vanilla"}
    assert drafted == {"dcoco@2": 1, "dcoco@5": 4, "dflash@3": 2, "dcoco": 7}  # block B drafts B - 1 slots
    assert len(methods["dcoco@5"]["coverage_top1"]) == 4
    assert all(methods[name]["equal_to_vanilla"] == 1.0 for name in drafted)
    assert report["config"]["block_size"] == 8  # every block size ran on the drafter of config.block_size 8
    assert "dcoco@5" in result.out


def test_bench_runs_speculative_generate_and_rounds(tiny):
    """`speculative` methods time `speculative_generate` beside `generate(assistant_model=)`; with --rounds N every
    method runs N times per prompt (each round in its own order) and its median run is the one reported."""
    calls = []
    real = bench_module.MethodRunner.run

    def counting(self, method, *args, **kwargs):
        calls.append(method)
        return real(self, method, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_module.MethodRunner, "run", counting)
        result = run_cli(
            "bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 2, "--max-new-tokens", 12, "--warmup", 0,
            "--rounds", 3, "--methods", "vanilla,speculative,speculative@3,dcoco", "--json", tiny.root / "rounds.json",
        )
    assert result.code == 0, result.err
    assert {method: calls.count(method) for method in set(calls)} == {
        "vanilla": 6, "speculative": 6, "speculative@3": 6, "dcoco": 6}
    report = json.loads((tiny.root / "rounds.json").read_text())
    assert [run["method"] for run in report["runs"]] == ["vanilla", "speculative", "speculative@3", "dcoco"] * 2
    methods = report["methods"]
    assert all(methods[name]["equal_to_vanilla"] == 1.0 for name in ("speculative", "speculative@3", "dcoco"))
    assert len(methods["speculative@3"]["per_slot_accept"]) == 2 and methods["speculative"]["tau"] > 1.0
    assert run_cli("bench", *tiny.model_args, "--rounds", 0).code != 0


def test_a_drafter_trained_on_longer_blocks_drafts_them_on_request(tiny):
    """A folder written before config.json held one block size (mixed-horizon training: block_size the default
    block, max_block_size the longest trained, generation_config.json's num_assistant_tokens the default's slots)
    loads with the longest as config.block_size and the default as the drafted block: the bench drafts any size up
    to the longest, and nothing longer."""
    folder = tiny.root / "mixed-drafter"
    DCOCODrafter.from_pretrained(tiny.root / "drafter").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"block_size": 3, "max_block_size": 6}))
    generation = json.loads((folder / "generation_config.json").read_text())
    # A small tree budget, so that the longest block, not a tree, sets the widest forward laid out
    (folder / "generation_config.json").write_text(
        json.dumps(generation | {"num_assistant_tokens": 2, "tree_budget": 4}))
    loaded = DCOCODrafter.from_pretrained(folder)
    assert (loaded.config.block_size, loaded.draft_block_size) == (6, 3)
    assert "max_block_size" not in loaded.config.to_dict()
    args = ["bench", "--target", tiny.root / "target", "--drafter", folder, "--prompts", tiny.prompts, "--limit", 1]
    result = run_cli(*args, "--max-new-tokens", 8, "--warmup", 0, "--methods", "vanilla,dcoco,dcoco@6",
                     "--json", tiny.root / "mixed.json")
    assert result.code == 0, result.err
    report = json.loads((tiny.root / "mixed.json").read_text())
    drafted = {name: len(report["methods"][name]["per_slot_accept"]) for name in ("dcoco", "dcoco@6")}
    assert drafted == {"dcoco": 2, "dcoco@6": 5} and report["config"]["config_block_size"] == 3
    assert set(report["config"]["few_rows_linear"]) == {str(rows) for rows in range(2, 13)}  # 2 x the longest block
    # The layout covers the blocks a run drafts, not every trained one: start-up time grows with each row count.
    short = run_cli(*args, "--max-new-tokens", 8, "--warmup", 0, "--methods", "vanilla,dcoco,dcoco@4",
                    "--json", tiny.root / "mixed-short.json")
    assert short.code == 0, short.err
    laid_out = json.loads((tiny.root / "mixed-short.json").read_text())["config"]["few_rows_linear"]
    assert set(laid_out) == {str(rows) for rows in range(2, 9)}
    refused = run_cli(*args, "--methods", "dcoco@7")
    assert refused.code == 2 and "must lie in [2, 6]" in refused.err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "dcoco@9"], "must lie in [2, 8], the block this drafter was trained on"),
        (["--methods", "vanilla@3"], "a block size suffix needs a drafter method"),
        (["--methods", "dcoco@1"], "a block of at least 2"),
        (["--methods", "dcoco@3", "--block-size", "4"], "use one or the other"),
    ],
)
def test_bad_block_sizes_in_methods_are_refused(tiny, extra, message):
    result = run_cli("bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 1, *extra)
    assert result.code == 2 and message in result.err, result.err


def test_bench_draft_vocabulary_and_full_vocab(tiny):
    """A drafter saved with a draft vocabulary benches with it (exactly), and --full-vocab drops it for the run."""
    folder = tiny.root / "drafter-vocab"
    DCOCODrafter.from_pretrained(tiny.root / "drafter").set_draft_vocabulary(list(range(0, VOCAB, 2))).save_pretrained(
        folder
    )
    for flag, size in (((), VOCAB // 2), (("--full-vocab", "--plain-linear"), None)):
        out = tiny.root / f"vocab-{size}.json"
        result = run_cli(
            "bench", "--target", tiny.root / "target", "--drafter", folder, "--prompts", tiny.prompts, "--limit", 1,
            "--max-new-tokens", 8, "--warmup", 0, "--methods", "vanilla,dcoco", *flag, "--json", out,
        )
        assert result.code == 0, result.err
        report = json.loads(out.read_text())
        assert report["config"]["draft_vocab_size"] == size
        assert (report["config"]["few_rows_linear"] is None) == (size is None)  # --plain-linear: no plan
        assert report["methods"]["dcoco"]["equal_to_vanilla"] == 1.0
        assert (f"draft vocab {size}" if size else "full vocab") in result.out


def test_bench_sampling_reports_no_equality(tiny):
    result = run_cli(
        "bench", *tiny.model_args, "--prompts", tiny.prompts, "--limit", 1, "--max-new-tokens", 6, "--warmup", 0,
        "--methods", "vanilla,dcoco", "--temperature", 0.7, "--json", tiny.root / "sample.json",
    )
    assert result.code == 0, result.err
    report = json.loads((tiny.root / "sample.json").read_text())
    assert report["config"]["temperature"] == 0.7
    assert all(summary["equal_to_vanilla"] is None for summary in report["methods"].values())
    assert "sampling T=0.7" in result.out


def test_generate_prints_tau_speedup_and_identity(tiny):
    result = run_cli("generate", "w1 w2 w3 w4", *tiny.model_args, "--max-new-tokens", 12, "--warmup", 0)
    assert result.code == 0, result.err
    assert "tau " in result.out
    assert "speedup " in result.out and "over plain generate" in result.out
    assert "outputs identical: yes" in result.out
    assert result.out.split("\n", 1)[0].startswith("w")  # the streamed answer comes first
    fixed = run_cli("generate", "w1 w2 w3 w4", *tiny.model_args, "--max-new-tokens", 12, "--warmup", 0,
                    "--block-size", 2)
    assert fixed.code == 0 and "(blocks of 2: " in fixed.out and "outputs identical: yes" in fixed.out, fixed.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--methods", "vanilla,medusa"], "unknown method(s) ['medusa']"),
        (["bench", "--suite", "gsm8k"], "unknown suite(s) ['gsm8k']"),
        (["bench", "--prompts", "no/such/file.jsonl"], "no such file"),
        (["bench", "--max-new-tokens", "1"], "at least 2 new tokens"),
        (["bench", "--suite", "mtbench", "--limit", "0"], "--limit 0"),
        (["bench", "--suite", "mtbench", "--skip", "-1"], "--skip -1"),
        (["generate", "hi", "--temperature", "-1"], "negative"),
        (["bench", "--target", "./missing-model"], "no such folder"),
    ],
)
def test_bad_arguments_fail_fast_with_clear_errors(argv, message):
    result = run_cli(*argv)
    assert result.code == 2
    assert message in result.err, result.err
    assert result.out == ""


def test_a_json_path_in_a_missing_folder_is_refused_before_the_run(tiny, tmp_path):
    """Refused at start-up, naming the folder: not found only after the whole run (the results then went to a
    temporary file), nor a file written where a folder was meant."""
    base = ["bench", "--target", tiny.root / "target", "--drafter", tiny.root / "drafter", "--prompts", tiny.prompts,
            "--limit", 1, "--max-new-tokens", 4, "--warmup", 0, "--methods", "vanilla,dcoco"]
    for path in (tmp_path / "missing" / "out.json", f"{tmp_path / 'results'}/"):
        result = run_cli(*base, "--json", path)
        assert result.code == 2 and result.out == "", result.err
        assert "does not exist" in result.err and str(Path(path).parent if str(path).endswith(".json") else
                                                      tmp_path / "results") in result.err, result.err
    assert not (tmp_path / "missing").exists() and not (tmp_path / "results").exists()


def test_bad_prompts_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n', encoding="utf-8")
    result = run_cli("bench", "--prompts", path)
    assert result.code == 2 and "line 2" in result.err


def test_skip_selects_the_next_prompts_of_each_suite(tmp_path):
    """--skip 1 --limit 1 is the second prompt, numbered as in its suite; a --skip past the suite's end is refused."""
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("one", "two", "three")), encoding="utf-8")
    args = cli.build_parser().parse_args(["bench", "--prompts", str(path), "--skip", "1", "--limit", "1"])
    assert [(item.index, item.text) for item in cli.collect_prompts(args)] == [(1, "two")]
    args = cli.build_parser().parse_args(["bench", "--prompts", str(path), "--skip", "1"])
    assert [item.text for item in cli.collect_prompts(args)] == ["two", "three"]
    refused = run_cli("bench", "--prompts", path, "--skip", "3")
    assert refused.code == 2 and "--skip 3 leaves no prompt of suite 'three', which has 3" in refused.err, refused.err


def test_auto_block_size(tiny, tmp_path):
    """--block-size auto times cycles and records the choice; without a recorded block_tau it says how to get one,
    while the default then keeps the config's block."""
    base = ["bench", "--target", tiny.root / "target", "--prompts", tiny.prompts, "--limit", 1,
            "--max-new-tokens", 8, "--warmup", 0, "--methods", "vanilla,dcoco"]
    refused = run_cli(*base, "--drafter", tiny.root / "drafter", "--block-size", "auto")
    assert refused.code == 2 and "records no block_tau" in refused.err, refused.err
    plain = run_cli(*base, "--drafter", tiny.root / "drafter", "--json", tmp_path / "plain.json")
    assert plain.code == 0, plain.err
    assert json.loads((tmp_path / "plain.json").read_text())["config"]["block_size_choice"] is None

    folder = tmp_path / "measured-drafter"
    DCOCODrafter.from_pretrained(tiny.root / "drafter").save_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    measured = {"block_tau": {"2": 1.6, "3": 1.9, "4": 2.0}}  # as scripts/record_block_tau.py records it
    (folder / "generation_config.json").write_text(json.dumps(generation | measured))
    result = run_cli(*base, "--drafter", folder, "--json", tmp_path / "auto.json")
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "auto.json").read_text())["config"]
    assert sorted(report["block_size_choice"]) == ["2", "3", "4"]  # the block sizes with a recorded tau
    assert report["block_size"] in (2, 3, 4) and f"block size {report['block_size']} chosen" in result.err
    assert report["methods"] == ["vanilla", "dcoco"]
    assert json.loads((tmp_path / "auto.json").read_text())["methods"]["dcoco"]["equal_to_vanilla"] == 1.0


def test_missing_default_drafter_says_pass_drafter(tiny, monkeypatch):
    monkeypatch.setattr(cli_common, "DEFAULT_DRAFTER_NAME", "no-such-drafter")
    result = run_cli("bench", "--target", tiny.root / "target", "--prompts", tiny.prompts, "--methods", "dcoco")
    assert result.code == 1
    assert "default drafter is missing" in result.err and "--drafter" in result.err


def test_too_long_block_size_is_refused(tiny):
    result = run_cli("bench", *tiny.model_args, "--prompts", tiny.prompts, "--methods", "dcoco", "--block-size", 9)
    assert result.code == 2 and "must lie in [2, 8], the block this drafter was trained on" in result.err


def test_missing_matplotlib_names_the_extra(tiny, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "matplotlib" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = run_cli("bench", "--prompts", tiny.prompts, "--plots", tiny.root / "never")
    assert result.code == 1 and "pip install dcoco-hf[plots]" in result.err
    assert not (tiny.root / "never").exists()


def test_methods_run_in_an_order_shuffled_per_prompt():
    """Repeatable; over many prompts every method runs first, and right after every other method, so no method
    always follows the same one (as a rotation would have it)."""
    orders = [run_order(METHODS, turn) for turn in range(200)]
    assert orders == [run_order(METHODS, turn) for turn in range(200)]
    assert all(sorted(order) == sorted(METHODS) for order in orders)
    assert {order[0] for order in orders} == set(METHODS)
    followers = {(a, b) for order in orders for a, b in zip(order, order[1:])}
    assert followers == {(a, b) for a in METHODS for b in METHODS if a != b}


def test_python_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "dcoco_hf", "bench", "--methods", "nope"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "unknown method(s) ['nope']" in result.stderr and "vanilla,prompt_lookup,dflash" in result.stderr


@pytest.mark.slow
def test_bench_real_default_target(tmp_path):
    """`dcoco-hf bench` end to end through the installed console script, on SmolLM2 and both prompt suites."""
    from dcoco_hf.assets import default_target_path

    target_dir = default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    DCOCODrafter.from_target(target).save_pretrained(tmp_path / "drafter")  # untrained: the shipped one may not exist
    del target
    script = Path(sys.executable).with_name("dcoco-hf")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dcoco_hf"]
    out = tmp_path / "real.json"
    result = subprocess.run(
        command + [
            "bench", "--suite", "humaneval,mtbench", "--limit", "1", "--max-new-tokens", "16",
            "--methods", "vanilla,dflash,dcoco", "--drafter", str(tmp_path / "drafter"), "--json", str(out),
            # One thread: on a busy 2-core machine two OpenMP threads run this model several times slower.
            "--threads", "1", "--warmup", "0",
        ],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["suites"]) == ["humaneval", "mtbench"]
    assert report["config"]["target"] == str(target_dir) and report["config"]["block_size"] == 16
    for suite in report["suites"].values():
        assert list(suite) == ["vanilla", "dflash", "dcoco"]
        assert all(summary["prompts"] == 1 for summary in suite.values())
    for name in ("dflash", "dcoco"):
        assert report["methods"][name]["equal_to_vanilla"] == 1.0, name
    assert "== suite humaneval" in result.stdout and "== suite mtbench" in result.stdout


def test_speedup_is_a_ratio_of_tokens_per_second():
    """Under sampling the methods write answers of different lengths: a method that stops earlier must not look
    faster. 100 tokens in 10 s (vanilla) against 50 tokens in 4 s is 1.25x, not the 2.5x a ratio of times says."""
    from dcoco_hf import DCOCOStats
    from dcoco_hf.cli.bench import RunRecord, summarise

    def record(method: str, tokens: int, seconds: float) -> RunRecord:
        return RunRecord("suite", 0, method, 8, tokens, seconds, DCOCOStats(target_forwards=tokens))

    summaries = summarise([record("vanilla", 100, 10.0), record("dcoco", 50, 4.0)], ["vanilla", "dcoco"])
    assert summaries["vanilla"]["speedup"] == pytest.approx(1.0)
    assert summaries["dcoco"]["tokens_per_s"] == pytest.approx(12.5)
    assert summaries["dcoco"]["speedup"] == pytest.approx(1.25)


def test_export_refuses_a_non_empty_folder_and_the_source_folder(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    refused = run_cli("export", "--drafter", tiny.root / "drafter", out)
    assert refused.code == 2 and "is not empty" in refused.err and "--overwrite" in refused.err
    assert (out / "config.json").read_text() == "{}"
    assert run_cli("export", "--drafter", tiny.root / "drafter", out, "--overwrite").code == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    source = tiny.root / "drafter"
    before = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    same = run_cli("export", "--drafter", source, source, "--overwrite")
    assert same.code == 2 and "the drafter's own folder" in same.err
    assert {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()} == before
    (tmp_path / "file").write_text("")
    as_file = run_cli("export", "--drafter", source, tmp_path / "file")
    assert as_file.code == 2 and "is a file" in as_file.err and "Traceback" not in as_file.err


def test_export_draft_vocab_with_a_target(tiny, tmp_path):
    drafter = DCOCODrafter.from_pretrained(tiny.root / "drafter").set_draft_vocabulary(list(range(0, VOCAB, 2)))
    drafter.save_pretrained(tmp_path / "vocab-drafter")
    result = run_cli("export", "--drafter", tmp_path / "vocab-drafter", "--target", tiny.root / "target",
                     "--draft-vocab", tmp_path / "out")
    assert result.code == 0, result.err
    assert "tuned for" not in result.err  # the export needs the target's lm_head rows, not a tuning
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_vocab_size"] == VOCAB // 2


def test_a_nan_temperature_is_refused_in_one_line(tiny):
    result = run_cli("generate", *tiny.model_args, "w1 w2", "--temperature", "nan")
    assert result.code == 2 and "--temperature nan" in result.err and "Traceback" not in result.err


def test_ctrl_c_during_bench_reports_the_finished_prompts(tiny, monkeypatch):
    run, calls = MethodRunner.run, []

    def interrupted_on_the_second_prompt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # warmup 0, two methods per prompt: the second prompt's second run is interrupted
            raise KeyboardInterrupt
        return run(self, *args, **kwargs)

    monkeypatch.setattr(MethodRunner, "run", interrupted_on_the_second_prompt)
    json_path = tiny.root / "interrupted.json"
    result = run_cli("bench", *tiny.model_args, "--prompts", tiny.prompts, "--methods", "vanilla,dcoco",
                     "--max-new-tokens", 6, "--warmup", 0, "--json", json_path)
    assert result.code == 130 and "Traceback" not in result.err and "1 of 3 prompt(s)" in result.err
    report = json.loads(json_path.read_text())
    assert report["config"]["interrupted_after_prompts"] == 1 and len(report["runs"]) == 2
    assert "dcoco" in result.out


def test_the_summary_names_the_blocks_each_call_drafted():
    from dcoco_hf.cli.main import blocks_drafted
    from dcoco_hf.runtime.stats import DCOCOStats

    stats = DCOCOStats()
    assert blocks_drafted(stats, 8) == "blocks of 8"  # nothing drafted: the configured block
    stats.drafted_blocks = [0, 0, 3, 0, 0, 0, 9, 0, 1]
    assert blocks_drafted(stats, 8) == "blocks of 2-8 per cycle, mostly 6"
    stats.drafted_blocks = [0, 0, 0, 0, 5]
    assert blocks_drafted(stats, 8) == "blocks of 4"
    assert blocks_drafted(None, 3) == "blocks of 3"
