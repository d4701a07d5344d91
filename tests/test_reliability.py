"""Reliability (issue 32): sliding-window targets in the batched loop and the assisted path, block choices that never
shrink what a drafter can draft, bench output paths checked before any work (and results never lost), and one-line
errors instead of tracebacks for bad CLI input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from conftest import VOCAB, fit_drafter

from dcoco_hf import speculative_generate

PAD = 0
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)


# ------------------------------------------------------------------------------------------- sliding-window targets


def _sliding_target(kind: str, window: int) -> torch.nn.Module:
    """Mistral sets `sliding_window` without `layer_types` (every layer slides); Qwen3 names each layer's type."""
    torch.manual_seed(0)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=window))
    else:
        layer_types = ["full_attention", "sliding_attention"] * 2
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **TINY, use_sliding_window=True, sliding_window=window, max_window_layers=0, layer_types=layer_types))
    return model.eval().requires_grad_(False)


_SLIDING: dict[tuple[str, int], tuple] = {}


@pytest.fixture(scope="module", params=[("mistral", 5), ("mistral", 512), ("qwen3", 5)],
                ids=["mistral-window5", "mistral-window512", "qwen3-mixed-window5"])
def sliding(request):
    """(target, fitted drafter): windows far shorter than the generated text, and longer than all of it. It drafts
    every cycle (the constant schedule: its whole block, or in the batched loop its tree), so rejected drafts are
    rolled back in every call, whatever the costs timed on this machine say."""
    if request.param not in _SLIDING:
        target = _sliding_target(*request.param)
        _SLIDING[request.param] = (target, fit_drafter(target, block_size=4, steps=60))
    target, drafter = _SLIDING[request.param]
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return target, drafter.attach(target)


def _left_padded(seed: int, lengths: list[int]) -> tuple[torch.LongTensor, torch.LongTensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, ids.shape[1] - length :] = 1
    return ids, mask


@pytest.mark.parametrize("seed,lengths,max_new_tokens", [(0, [3, 9, 6, 1], 24), (1, [7, 2], 13)])
def test_sliding_window_batch_equals_plain_generate(sliding, seed, lengths, max_new_tokens):
    """Ragged left-padded batches (rows accepting different counts, holes in the cache) on sliding-window targets:
    token for token plain batched generate(), whether the window cuts the context or not."""
    target, drafter = sliding
    ids, mask = _left_padded(seed, lengths)
    common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, **common)
    assert got.sequences.tolist() == expected.tolist()
    assert sum(sum(s.accepted) for s in got.stats) > 0  # drafts were accepted: the verify path really ran


@pytest.mark.parametrize("block_size", [2, 4])
def test_sliding_window_assisted_path_equals_plain_generate(sliding, block_size):
    """`target.generate(assistant_model=drafter)` on sliding-window targets: transformers rolls the sliding cache
    back after rejected drafts; output equal to plain generate() past the window."""
    target, drafter = sliding
    drafter.config.block_size, drafter.generation_config.num_assistant_tokens = block_size, block_size - 1
    accepted = 0
    try:
        for seed in range(3):
            ids = torch.randint(1, VOCAB, (1, 4 + 3 * seed), generator=torch.Generator().manual_seed(seed))
            expected = target.generate(ids, max_new_tokens=30, do_sample=False)
            got = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
            assert got.tolist() == expected.tolist()
            accepted += sum(drafter.generation_stats(got).accepted)
        assert accepted > 0  # drafts were accepted, so rejected ones were rolled back too
    finally:
        drafter.config.block_size, drafter.generation_config.num_assistant_tokens = 4, 3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_with_cache_compaction(sliding, attn, monkeypatch):
    """Packing the holes out of the cache (here after every cycle) keeps sliding windows exact, with eager attention
    (additive float masks) as with sdpa (boolean masks)."""
    import dcoco_hf.runtime.generation as generation

    target, drafter = sliding
    monkeypatch.setattr(generation, "COMPACT_WASTE", -1.0)
    before = target.config._attn_implementation
    target.set_attn_implementation(attn)
    try:
        ids, mask = _left_padded(5, [2, 8, 5])
        common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
        expected = target.generate(ids, **common)
        assert speculative_generate(target, ids, drafter=drafter, **common).sequences.tolist() == expected.tolist()
    finally:
        target.set_attn_implementation(before)


def test_unmaskable_layers_are_refused_clearly():
    """Layer types the batched loop cannot mask exactly (chunked attention: no target the drafter attaches to has
    them today) are named in a one-line error with the alternative, before any work."""
    from types import SimpleNamespace

    from dcoco_hf.runtime.target_cache import layer_windows as _layer_windows

    config = SimpleNamespace(layer_types=["full_attention", "chunked_attention"], sliding_window=None)
    with pytest.raises(ValueError, match=r"not \['chunked_attention'\].*assistant_model=drafter"):
        _layer_windows(config)
    assert _layer_windows(SimpleNamespace(sliding_window=7)) == {"sliding_attention": 7}  # Mistral: no layer_types
    assert _layer_windows(SimpleNamespace(sliding_window=None)) == {"full_attention": None}


# ------------------------------------------------------------------------------------------------ block choice


def test_choosing_a_smaller_block_never_shrinks_the_drafter():
    """A drafter trained on blocks of 8: drafting blocks of 4 (by hand, for one call, or as the CLI's automatic
    choice does) must leave blocks of 8 available afterwards."""
    from conftest import make_target

    from dcoco_hf import DCOCODrafter, set_block_size
    from dcoco_hf.cli.bench import block_size_for_call

    target = make_target("llama")
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=8, top_k=4)
    set_block_size(drafter, 4)
    set_block_size(drafter, 8)  # failed: "must lie in [2, 4]"
    assert (drafter.draft_block_size, drafter.generation_config.num_assistant_tokens) == (8, 7)
    set_block_size(drafter, 2)
    with block_size_for_call(drafter, 6):  # a bench's dcoco@6 after the automatic choice picked 2
        assert drafter.draft_block_size == 6
    assert drafter.draft_block_size == 2 and drafter.config.block_size == 8


# ------------------------------------------------------------------------------------------------ command line


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Saved tiny target (with tokenizer) and random drafter, a prompts file, and broken variants of them."""
    import json
    import shutil

    from conftest import make_target
    from test_cli import tiny_tokenizer

    from dcoco_hf import DCOCODrafter

    root = tmp_path_factory.mktemp("reliability")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4).save_pretrained(root / "drafter")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "w1 w2 w3"}) + "\n", encoding="utf-8")
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "notes.txt").write_text("a folder, but no model in it")
    shutil.copytree(root / "drafter", root / "edited_drafter")  # config.json edited after saving: weights differ
    config = json.loads((root / "edited_drafter" / "config.json").read_text())
    (root / "edited_drafter" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    return root


def _cli(*argv):
    from test_cli import run_cli

    return run_cli(*argv)


def _one_line_error(result, command: str, *needles: str) -> str:
    """The run ended with exactly one error line (no traceback) naming every needle; returns that line."""
    assert "Traceback" not in result.err
    errors = [line for line in result.err.splitlines() if line.startswith(f"dcoco-hf {command}: error: ")]
    assert len(errors) == 1, result.err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a command gets as far as loading models (its checks must come first)."""
    from dcoco_hf.cli import main as cli
    from dcoco_hf.cli import common as cli_common
    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_models", refuse)  # bench's
    monkeypatch.setattr(cli_common, "load_models", refuse)  # bench-batch's


def _bench_args(folders, *extra):
    return ["bench", "--target", folders / "target", "--methods", "vanilla", "--prompts", folders / "prompts.jsonl",
            "--max-new-tokens", 4, "--warmup", 0, *extra]


def _batch_args(folders, *extra):
    return ["bench-batch", "--target", folders / "target", "--random-drafter", "--batch-size", 1, "--prompts",
            folders / "prompts.jsonl", "--max-new-tokens", 4, "--warmup", 0, *extra]


@pytest.mark.parametrize("case", ["bench-json-is-dir", "bench-json-under-file", "bench-plots-is-file",
                                  "batch-json-is-dir", "batch-json-under-file"])
def test_output_paths_are_checked_before_any_work(folders, no_loading, case):
    """--json / --plots that could never be written fail at once, not after the whole run."""
    command, option, problem = case.split("-", 2)
    command = "bench" if command == "bench" else "bench-batch"
    build = _bench_args if command == "bench" else _batch_args
    path = {"is-dir": folders / "not_a_model", "under-file": folders / "not_a_model" / "notes.txt" / "out.json",
            "is-file": folders / "not_a_model" / "notes.txt"}[problem]
    result = _cli(*build(folders, f"--{option}", path))
    assert result.code == 2
    _one_line_error(result, command, f"--{option}", str(path))


@pytest.mark.parametrize("command", ["bench", "bench-batch"])
@pytest.mark.parametrize("lost", ["json", "plots"])
def test_finished_results_are_never_lost(folders, tmp_path, monkeypatch, command, lost):
    """The output folder turns into a file while the bench runs: the finished results go to a file in the temp
    folder, and the one error line says where."""
    import json
    import shutil
    import tempfile

    from dcoco_hf.cli import batch_bench
    from dcoco_hf.cli import main as cli
    if command == "bench-batch" and lost == "plots":
        pytest.skip("bench-batch writes no plots")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    module, name = (cli, "run_bench") if command == "bench" else (batch_bench, "run_batch_bench")
    run = getattr(module, name)

    def run_then_break_the_folder(*args, **kwargs):
        report = run(*args, **kwargs)
        shutil.rmtree(out_dir)
        out_dir.write_text("the output folder became a file during the run")
        return report

    monkeypatch.setattr(module, name, run_then_break_the_folder)
    build = _bench_args if command == "bench" else _batch_args
    option = ["--json", out_dir / "report.json"] if lost == "json" else ["--plots", out_dir / "plots"]
    result = _cli(*build(folders, *option))
    assert result.code == 1
    line = _one_line_error(result, command, str(tmp_path / "tmp"))
    saved = [path for path in (tmp_path / "tmp").iterdir() if path.suffix == ".json"]
    assert len(saved) == 1 and str(saved[0]) in line
    report = json.loads(saved[0].read_text())
    assert ("methods" if command == "bench" else "results") in report


@pytest.mark.parametrize("case", ["empty-folder", "drafter-folder"])
def test_target_folder_that_is_not_a_model(folders, case):
    """--target naming a folder without a causal LM in it: one error line, no traceback."""
    path = folders / ("not_a_model" if case == "empty-folder" else "drafter")
    result = _cli("bench", "--target", path, "--methods", "vanilla", "--prompts", folders / "prompts.jsonl",
                  "--max-new-tokens", 4, "--warmup", 0)
    assert result.code in (1, 2)
    _one_line_error(result, "bench", "--target", str(path))


def test_drafter_config_that_no_longer_matches_its_weights(folders):
    result = _cli("bench", "--target", folders / "target", "--drafter", folders / "edited_drafter", "--methods",
                  "dcoco", "--prompts", folders / "prompts.jsonl", "--max-new-tokens", 4, "--warmup", 0)
    assert result.code == 2
    _one_line_error(result, "bench", str(folders / "edited_drafter"), "config.json", "weights")


@pytest.mark.parametrize("option,value", [("--threads", 0), ("--temperature", -1), ("--warmup", -2),
                                          ("--max-new-tokens", 1)])
@pytest.mark.parametrize("command", ["bench", "bench-batch"])
def test_bad_numbers_fail_before_loading_in_both_benches(folders, no_loading, command, option, value):
    """One check of the shared options for both benches: a one-line error naming the option, before any loading."""
    build = _bench_args if command == "bench" else _batch_args
    argv = [str(a) for a in build(folders)]
    if option in argv:  # replace the harmless default the helper passes
        argv[argv.index(option) + 1] = str(value)
    else:
        argv += [option, str(value)]
    result = _cli(*argv)
    assert result.code == 2
    _one_line_error(result, command, option)


@pytest.mark.parametrize(
    "file,field,value",
    [("config.json", "block_size", "abc"), ("config.json", "block_size", 2.5),
     ("config.json", "target_layer_ids", "1,2"), ("config.json", "top_k", "16"),
     ("generation_config.json", "block_tau", "fast"), ("generation_config.json", "geometric_lambda", "x")],
)
@pytest.mark.parametrize("command", ["export", "generate"])
def test_a_drafter_field_of_the_wrong_type_is_one_line_naming_it(folders, tmp_path, command, file, field, value):
    edited = tmp_path / "drafter"
    shutil.copytree(folders / "drafter", edited)
    path = edited / file
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, field: value}))
    if command == "export":
        result = _cli("export", "--drafter", edited, tmp_path / "out")
    else:
        result = _cli("generate", "--target", folders / "target", "--drafter", edited, "w1 w2", "--max-new-tokens", 4)
    assert result.code == 2
    _one_line_error(result, command, f"{field}=")
