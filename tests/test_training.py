"""Training pieces: the packed block mask, anchor sampling, DCOCO labels, and the Trainer pipeline end to end."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, fit_drafter, make_target
from safetensors.torch import load_file, save_file
from transformers import TrainingArguments

from dcoco_hf import CorpusBigrams, DCOCODrafter
from dcoco_hf.training import (
    pack_blocks,
    sample_anchors,
    target_context,
    transition_labels,
)
from dcoco_hf.runtime.tap import decoder_layers
from dcoco_hf.training.data import cache_target_features, load_shards, read_shard, save_shard, shard_path
from dcoco_hf.training.losses import dcoco_loss, successor_loss
from dcoco_hf.training.objective import drafter_loss, successor_accuracy
from dcoco_hf.training.trainer import (
    DrafterCollator,
    DrafterTrainer,
    DrafterTrainingModel,
)


def test_block_mask_sees_context_before_anchor_and_own_block_only():
    ids = torch.arange(10)[None]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[2, 6]])
    blocks = pack_blocks(ids, ids + 1, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool), 4, 99)
    mask = blocks.attention_mask[0, 0]  # [8, 10 + 8]
    assert blocks.block_ids.tolist() == [[2, 99, 99, 99, 6, 99, 99, 99]]  # slot 0 embeds the anchor
    assert mask[:4, :10].tolist() == [[j < 2 for j in range(10)]] * 4
    assert mask[4:, :10].tolist() == [[j < 6 for j in range(10)]] * 4
    assert mask[:4, 10:].tolist() == [[True] * 4 + [False] * 4] * 4
    assert mask[4:, 10:].tolist() == [[False] * 4 + [True] * 4] * 4
    assert blocks.labels.tolist() == [[[3, 4, 5], [7, 8, 9]]]
    assert blocks.position_ids[0, 10:].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]


def test_labels_past_the_end_or_outside_the_response_are_masked():
    ids = torch.arange(8)[None]
    loss_mask = torch.tensor([[False, False, False, True, True, True, True, True]])
    blocks = pack_blocks(ids, ids + 1, loss_mask, torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 4, 99)
    assert blocks.label_mask.tolist() == [[[True, True, True], [True, True, False]]]


def test_labels_are_the_targets_greedy_tokens_while_the_text_follows_them():
    """On text the target did not write, a slot is labelled only while the text before it is the greedy path."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy_next = torch.tensor([[11, 12, 50, 14, 15, 16, 17, 18]])  # the target would write 50, not 13, after 12
    blocks = pack_blocks(ids, greedy_next, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[1, 3]]),
                         torch.tensor([[True, True]]), 4, 99)
    assert blocks.labels.tolist() == [[[12, 50, 14], [14, 15, 16]]]
    # Block 0: slot 2 (label 50) is still exact, slot 3 sits after the text left the path (13 != 50).
    assert blocks.label_mask.tolist() == [[[True, True, False], [True, True, True]]]


def test_anchors_lie_before_response_tokens():
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[:, 12:] = True
    loss_mask[2] = False
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(0))
    assert valid[:2].all() and not valid[2].any()
    assert ((anchors[:2] >= 11) & (anchors[:2] <= 18)).all()
    assert (anchors[:2].diff(dim=1) > 0).all()


def test_transition_labels_need_both_tokens_in_top_k():
    candidates = torch.tensor([[[5, 6], [7, 8], [9, 10]]])  # [1, S=3, K=2]
    argmax = torch.tensor([[6, 7, 11]])
    index, usable = transition_labels(candidates, argmax, torch.ones(1, 3, dtype=torch.bool))
    assert index[0, 0] == 1 * 2 + 0 and usable.tolist() == [[True, False]]


def test_successor_accuracy_compares_the_drafters_pick_with_the_correctors():
    scores = torch.zeros(1, 2, 3, 3)  # [R, P, K, K]; untrained corrector: the drafter's order, candidate 0 first
    scores[..., 0] = 1.0
    scores[0, 1, 2, 1] = 5.0  # pair 2: after candidate 2, the corrector prefers candidate 1
    pair_index = torch.tensor([[0 * 3 + 0, 2 * 3 + 1]])  # true pairs: (0 -> 0) and (2 -> 1)
    drafter, corrector = successor_accuracy(scores, pair_index, torch.ones(1, 2, dtype=torch.bool))
    assert drafter == 0.5 and corrector == 1.0
    drafter, corrector = successor_accuracy(scores, pair_index, torch.tensor([[True, False]]))
    assert drafter == 1.0 and corrector == 1.0


def test_joint_pair_loss_is_the_predecessor_row_loss_plus_the_successor_loss():
    # -log p(a*, b*) = -log p(a*) - log p(b* | a*): the successor loss is the joint loss without the row term.
    scores = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))  # [R, P, K, K]
    pair_index = torch.tensor([[1, 6, 15], [4, 9, 2]])
    usable = torch.ones(2, 3, dtype=torch.bool)
    row_term = -(scores.logsumexp(-1).log_softmax(-1).gather(-1, (pair_index // 4)[..., None]).squeeze(-1))
    weights = torch.exp(-torch.arange(3.0) / 4.0).expand(2, 3)
    row_loss = (row_term * weights).sum() / weights.sum()
    joint, successor = dcoco_loss(scores, pair_index, usable), successor_loss(scores, pair_index, usable)
    torch.testing.assert_close(joint, row_loss + successor)
    # Only the true predecessor's row reaches the successor loss.
    other_rows = scores.clone()
    other_rows[0, 0, 0] += 3.0  # pair (0, 0) has predecessor 1
    assert successor_loss(other_rows, pair_index, usable) == successor_loss(scores, pair_index, usable)
    assert dcoco_loss(other_rows, pair_index, usable) != dcoco_loss(scores, pair_index, usable)


def test_unknown_pair_loss_is_refused():
    target = make_target("llama")
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    with pytest.raises(ValueError, match="pair_loss='pairwise' is unknown"):
        DrafterTrainingModel(drafter, target, stage=2, pair_loss="pairwise")


def _records(target, n=12, length=30):
    prompts = torch.randint(0, target.config.vocab_size, (n, 5), generator=torch.Generator().manual_seed(1))
    seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=length, do_sample=False)
    mask = torch.zeros_like(seqs, dtype=torch.bool)
    mask[:, 5:] = True
    return [{"input_ids": s.to(torch.int32), "loss_mask": m} for s, m in zip(seqs, mask)]


def _loss_on(records, drafter, target):
    """The drafter's objective on all `records` at once, every call with the same anchors (30 per record): a
    before / after measurement around training."""
    ids = torch.stack([r["input_ids"] for r in records]).long()
    mask = torch.stack([r["loss_mask"] for r in records])
    states, argmax = target_context(target, drafter.config.target_layer_ids, ids)

    def evaluate(**kwargs):
        with torch.no_grad():
            return drafter_loss(drafter, ids, mask, states, argmax, num_anchors=30, **kwargs)

    return evaluate


def _trainer(model, tmp_path, steps, **kw):
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=3e-3,
        logging_steps=1, save_steps=2, report_to=[], remove_unused_columns=False, use_cpu=True, **kw,
    )
    return DrafterTrainer(model=model, args=args, train_dataset=model._records, data_collator=DrafterCollator())


def test_trainer_stages_resume_and_export(tmp_path):
    target = make_target("qwen3")
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=6, top_k=4)
    records = _records(target)
    torch.save(records, tmp_path / "shard-00000.pt")
    features = cache_target_features(target, drafter.config.target_layer_ids, tmp_path, tmp_path / "features")
    cached = load_shards(features)
    width = 32 * len(drafter.config.target_layer_ids)
    assert cached[0]["context_states"].shape == (len(records[0]["input_ids"]), width)

    # stage 1, online target context: the corrector stays at zero, the backbone learns
    model = DrafterTrainingModel(drafter, target, stage=1, num_anchors=4)
    model._records = records
    fc_before = drafter.fc.weight.clone()
    _trainer(model, tmp_path / "s1", steps=4).train()
    assert not torch.equal(fc_before, drafter.fc.weight)
    assert drafter.corrector.delta_out.weight.abs().sum() == 0
    assert (tmp_path / "s1" / "checkpoint-4" / "model.safetensors").exists()

    # stage 2 from cached features: the corrector learns; a resumed run continues from the checkpoint
    model2 = DrafterTrainingModel(drafter, target, stage=2, num_anchors=4)
    model2._records = cached
    trainer = _trainer(model2, tmp_path / "s2", steps=2)
    trainer.train()
    assert drafter.corrector.delta_out.weight.abs().sum() > 0
    logged = [entry for entry in trainer.state.log_history if "successor_corrector_acc" in entry]
    assert logged and all(0 <= entry["successor_drafter_acc"] <= 1 for entry in logged)
    steps = [entry for entry in logged if "loss" in entry]  # the step lines, not the closing summary
    assert steps and all(entry["tokens_per_second"] > 0 for entry in steps)  # shown beside the bar's steps and ETA
    resumed = _trainer(model2, tmp_path / "s2", steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "s2" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    resumed.export_drafter(tmp_path / "final")
    reloaded = DCOCODrafter.from_pretrained(tmp_path / "final").attach(target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def test_cached_features_of_a_padded_batch_equal_each_record_alone(tmp_path):
    """Records of different lengths share right-padded forwards; every record's states and labels are its own."""
    target = make_target("llama")
    layers = [1, 2]
    generator = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).to(torch.int32),
                "loss_mask": torch.ones(n, dtype=torch.bool)} for n in (9, 4, 13, 7, 9)]
    torch.save(records, tmp_path / "shard-00000.pt")
    cached = load_shards(cache_target_features(target, layers, tmp_path, tmp_path / "features", batch_tokens=30))
    assert [len(r["input_ids"]) for r in cached] == [9, 4, 13, 7, 9]  # stored in the shard's own order
    for record in cached:
        states, argmax = target_context(target, layers, record["input_ids"].long()[None])
        assert record["context_states"].shape == states[0].shape
        torch.testing.assert_close(record["context_states"].float(), states[0].to(torch.bfloat16).float())
        assert torch.equal(record["target_argmax"].long(), argmax[0])


def test_cached_features_of_changed_data_are_refused(tmp_path):
    target = make_target("llama")
    generator = torch.Generator().manual_seed(0)

    def shard(n: int) -> None:
        ids = torch.randint(0, VOCAB, (n,), generator=generator).to(torch.int32)
        save_shard([{"input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.bool)}], shard_path(tmp_path, 0))

    shard(6)
    cache_target_features(target, [1], tmp_path, tmp_path / "features")
    cache_target_features(target, [1], tmp_path, tmp_path / "features")  # unchanged data: reused as it is
    (tmp_path / "features" / "shard-00000.source-sha256").unlink()  # a cache from before fingerprints: checked once
    cache_target_features(target, [1], tmp_path, tmp_path / "features")
    assert (tmp_path / "features" / "shard-00000.source-sha256").exists()
    records = read_shard(shard_path(tmp_path, 0))
    shard_path(tmp_path, 0).unlink()
    torch.save(records, tmp_path / "shard-00000.pt")  # same records, other bytes (an older folder's format)
    cache_target_features(target, [1], tmp_path, tmp_path / "features")
    shard(7)  # the data folder regenerated under the same name
    with pytest.raises(ValueError, match="other records"):
        cache_target_features(target, [1], tmp_path, tmp_path / "features")


def test_a_saved_shard_loads_as_the_same_records_with_one_storage_per_field(tmp_path):
    generator = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator, dtype=torch.int32),
                "loss_mask": torch.rand(n, generator=generator) > 0.5} for n in (3, 9, 1, 5)]
    save_shard(records, shard_path(tmp_path, 0))
    loaded = read_shard(shard_path(tmp_path, 0))
    assert [r.keys() for r in loaded] == [r.keys() for r in records]
    for got, want in zip(loaded, records, strict=True):
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
    for name in records[0]:
        assert len({r[name].untyped_storage().data_ptr() for r in loaded}) == 1


def test_train_script_refuses_architecture_flags_next_to_init():
    """With --init the architecture comes from that folder; a --layers beside it would be silently ignored."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_drafter.py"
    result = subprocess.run(
        [sys.executable, str(script), "--stage", "2", "--init", "runs/stage1/final", "--layers", "3", "--top-k", "8",
         "--data", "data", "--output", "out"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "--layers, --top-k: these shape a new drafter, but --init runs/stage1/final brings its own" in result.stderr


@pytest.mark.parametrize(
    "flags,message",
    [(["--stage", "1", "--corrector-only"], "use it with --stage 2 --init FOLDER"),
     (["--stage", "2", "--context-bigrams"],
      "--context-bigrams adds an input to the corrector of an existing drafter")],
    ids=["corrector-only", "context-bigrams"],
)
def test_train_script_corrector_flags_need_stage_2_and_init(flags, message):
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_drafter.py"
    result = subprocess.run(
        [sys.executable, str(script), *flags, "--data", "data", "--output", "out"], capture_output=True, text=True
    )
    assert result.returncode == 2 and message in result.stderr


def test_corrector_only_training_keeps_the_backbone(tmp_path):
    target = make_target("llama")
    drafter = fit_drafter(target, block_size=6, top_k=4, steps=60)  # a random one has no usable pair to learn from
    with pytest.raises(ValueError, match="needs stage=2"):
        DrafterTrainingModel(drafter, target, stage=1, corrector_only=True)
    model = DrafterTrainingModel(drafter, target, stage=2, num_anchors=4, corrector_only=True)
    model._records = _records(target)
    backbone = {k: v.clone() for k, v in drafter.state_dict().items() if not k.startswith("corrector.")}
    _trainer(model, tmp_path, steps=3).train()
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in backbone.items())
    assert drafter.corrector.delta_out.weight.abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_answers_match_generate_while_ended_rows_leave_the_batch(arch):
    """Each row's answer is what generate(do_sample=False) writes for it alone, up to and including its first EOS,
    though rows of other lengths end earlier and leave the batch (Gemma 3: prompts and answers cross the sliding
    window)."""
    from test_gemma3 import tiny_gemma3

    from dcoco_hf.runtime.prompts import left_pad
    from dcoco_hf.training.data import greedy_answers

    target = tiny_gemma3() if arch == "gemma3" else make_target("llama")
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 14, 9, 11)]
    alone = [target.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=12,
                             do_sample=False)[0, len(p):] for p in prompts]
    # EOS: a token some rows write early and others late or never, so rows leave at different steps.
    target.generation_config.eos_token_id = int(alone[1][4])
    ends = [torch.isin(a, torch.tensor([int(alone[1][4])])).nonzero() for a in alone]
    expected = [a[: int(e[0]) + 1] if e.numel() else a for a, e in zip(alone, ends)]
    assert len({len(e) for e in expected}) > 1
    ids, mask = left_pad(prompts, 0)
    answers = greedy_answers(target, ids, mask, max_new_tokens=12)
    assert [a.tolist() for a in answers] == [e.tolist() for e in expected]


def test_regenerate_says_when_the_generation_config_has_logit_rules_the_answers_leave_out(tmp_path, capsys):
    from test_cli import tiny_tokenizer

    from dcoco_hf.training.data import logit_rules, regenerate

    target, tokenizer = make_target("llama"), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    assert logit_rules(target) == []
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.no_repeat_ngram_size = 3
    assert logit_rules(target) == ["repetition_penalty", "no_repeat_ngram_size"]
    regenerate(target, tokenizer, ["w1 w2"], tmp_path, max_new_tokens=2)
    assert "sets repetition_penalty, no_repeat_ngram_size: the answers are the target's plain greedy argmax" in \
        capsys.readouterr().err


def test_regenerate_stops_after_max_shards_and_resumes_with_the_same_prompts(tmp_path):
    from test_cli import tiny_tokenizer

    from dcoco_hf.training.data import regenerate, shard_paths

    target, tokenizer = make_target("llama"), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(5)]
    common = dict(max_new_tokens=4, batch_size=2, shard_size=2)
    regenerate(target, tokenizer, prompts, tmp_path, max_shards=2, **common)
    assert [path.name for path in shard_paths(tmp_path)] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    first = load_shards(tmp_path)
    regenerate(target, tokenizer, prompts, tmp_path, **common)
    records = load_shards(tmp_path)
    assert len(first) == 4 and len(records) == 5
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, records))  # shards kept as they were
    assert all(int(record["loss_mask"].sum()) == 4 for record in records)  # 4 new tokens each, no EOS in the tiny model


def test_regenerate_answers_shortest_first_and_refuses_a_folder_of_other_prompts(tmp_path):
    """Prompts are answered in order of length, so a batch's rows pad to about the same length; `prompts.json`
    records that order, and a folder whose shards answered other prompts is refused rather than mixed."""
    from test_cli import tiny_tokenizer

    from dcoco_hf.training.data import regenerate

    target, tokenizer = make_target("llama"), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    prompts = ["w1 w2 w3 w4 w5 w6", "w7", "w8 w9 w10", "w11 w12", "w13 w14 w15 w16"]
    regenerate(target, tokenizer, prompts, tmp_path, max_new_tokens=2, batch_size=2, shard_size=2)
    answered = json.loads((tmp_path / "prompts.json").read_text())
    assert answered == sorted(prompts, key=lambda p: len(p.split()))
    lengths = [len(r["input_ids"]) - int(r["loss_mask"].sum()) for r in load_shards(tmp_path)]
    assert lengths == sorted(lengths)
    with pytest.raises(ValueError, match="holds answers to other prompts, or to these in another order"):
        regenerate(target, tokenizer, prompts + ["w20"], tmp_path, max_new_tokens=2, batch_size=2, shard_size=2)
    regenerate(target, tokenizer, list(reversed(prompts)), tmp_path, max_new_tokens=2, batch_size=2, shard_size=2)


def test_regenerate_leaves_out_prompts_whose_answers_cannot_fit_and_resumes_a_folder_written_without_the_cap(tmp_path):
    """A prompt longer than `max_prompt_tokens` is left out (listed in left_out.json): one such prompt would pad its
    whole batch to its length. A folder answered before the cap, whose written shards hold none of the long prompts,
    goes on; only the written shards' prompts must match."""
    from test_cli import tiny_tokenizer

    from dcoco_hf.runtime.prompts import prompt_input_ids
    from dcoco_hf.training.data import regenerate

    target, tokenizer = make_target("llama"), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    prompts = ["w1", "w2 w3", "w4 w5", "w6 w7 w8", " ".join(f"w{i}" for i in range(9, 40))]
    common = dict(max_new_tokens=2, batch_size=2, shard_size=2)
    regenerate(target, tokenizer, prompts, tmp_path, max_shards=1, **common)  # written without a cap
    longest = max(prompt_input_ids(tokenizer, p).shape[1] for p in prompts[:4])
    regenerate(target, tokenizer, prompts, tmp_path, max_prompt_tokens=longest, **common)
    assert json.loads((tmp_path / "left_out.json").read_text()) == prompts[4:]
    assert json.loads((tmp_path / "prompts.json").read_text()) == prompts[:4]
    assert len(load_shards(tmp_path)) == 4


def test_exercise_prompt_keeps_signature_and_docstring_and_drops_the_body():
    from dcoco_hf.training.data import exercise_prompt

    reply = (
        "Here is an exercise:\n```python\ndef count_vowels(text: str) -> int:\n"
        '    """Count the vowels of a text.\n\n    >>> count_vowels("banana")\n    3\n    """\n'
        "    return sum(c in 'aeiou' for c in text)\n```\nThe function counts vowels."
    )
    name, prompt = exercise_prompt(reply)
    assert name == "count_vowels"
    assert prompt == (
        'Complete the following Python function:\n```python\ndef count_vowels(text: str) -> int:\n'
        '    """Count the vowels of a text.\n\n    >>> count_vowels("banana")\n    3\n    """\n```'
    )
    assert exercise_prompt("def f(x):\n    return x") is None  # no docstring: no task to complete
    # The first function with a docstring, and nothing of the code around it.
    two = 'def helper(x):\n    return x\n\ndef is_even(n):\n    """Return True if n is an even number."""\n    return 0'
    assert exercise_prompt(two)[1].split("\n")[2:] == ["def is_even(n):", '    """Return True if n is an even number.',
                                                         '    """', "```"]
    first = exercise_prompt('def a(x):\n    """The first task, with a docstring."""\n\ndef b(y):\n    """Another."""')
    assert first[0] == "a" and "def b" not in first[1]
    assert exercise_prompt('def f(x):\n    """Short."""\n') is None  # too short to state a task
    assert exercise_prompt("    def method(self):\n        '''A nested method, not a task of its own.'''") is None
    single = exercise_prompt("def area(r):\n    '''Return the area of a circle of radius r.'''\n    pass")
    assert single == ("area", 'Complete the following Python function:\n```python\ndef area(r):\n'
                              '    """Return the area of a circle of radius r.\n    """\n```')


def test_self_instruct_exercises_drop_humaneval_names_and_repeats(monkeypatch):
    """The HumanEval prompts come in `exclude` (the caller fetches them: training downloads nothing)."""
    from dcoco_hf.training import data

    replies = iter([
        'def is_prime(n):\n    """Return True if n is a prime number."""',  # a HumanEval function's name
        'def area(r):\n    """Return the area of a circle of radius r."""',
        'def area(r, pi=3.14):\n    """Return the area of a circle, another way."""',  # a repeated name
        "no function here",
        'def shout(text):\n    """Return the text in upper case, with an exclamation mark."""',
        'def one_too_many(x):\n    """A third exercise, past the requested count."""',
    ])
    asked = []

    def sampled(target, tokenizer, asks, max_new_tokens, temperature, batch_size):
        asked.extend(asks)
        return [next(replies) for _ in asks]

    monkeypatch.setattr(data, "_sampled_replies", sampled)
    humaneval = data.HUMANEVAL_TEMPLATE.format(prompt='def is_prime(n):\n    """Return true if n is prime."""\n')
    prompts = data.self_instruct_exercises(None, None, count=2, batch_size=2, exclude=[humaneval])
    assert [p.split("\n")[2] for p in prompts] == ["def area(r):", "def shout(text):"]
    assert len(asked) == 6 and all(any(topic in a for topic in data.EXERCISE_TOPICS) for a in asked)


def test_self_instruct_exercises_skip_names_of_an_excluded_folder(monkeypatch):
    from dcoco_hf.training import data

    replies = iter(['def area(r):\n    """Return the area of a circle, asked again."""',
                    'def shout(text):\n    """Return the text in upper case, with an exclamation mark."""'])
    monkeypatch.setattr(data, "_sampled_replies", lambda *args: [next(replies) for _ in args[2]])
    earlier = data.HUMANEVAL_TEMPLATE.format(prompt='def area(r):\n    """The area of a circle of radius r."""\n')
    prompts = data.self_instruct_exercises(None, None, count=2, batch_size=2, max_asks=2, exclude=[earlier])
    assert [p.split("\n")[2] for p in prompts] == ["def shout(text):"]


def test_self_instruct_exercises_stop_when_the_target_runs_out_of_new_functions(monkeypatch):
    """A target that keeps writing the functions it already wrote is asked no further once four batches in a row
    each found a new one for fewer than a quarter of their asks."""
    from dcoco_hf.training import data

    fresh = iter(range(1000))

    def sampled(target, tokenizer, asks, *args):
        new = next(fresh)  # one new function per batch of 8 asks (12.5%), the rest repeats
        return [f'def f{new}(x):\n    """A new exercise number {new}."""'] + \
            ['def f0(x):\n    """An exercise the target wrote before."""'] * (len(asks) - 1)

    monkeypatch.setattr(data, "_sampled_replies", sampled)
    prompts = data.self_instruct_exercises(None, None, count=100, batch_size=8, exclude=[])
    assert len(prompts) == 4  # batches 1-4 found one each: saturated, long before 3 x 100 asks


def test_first_slot_training_teaches_the_corrector_to_re_select_slot_1(tmp_path):
    """Blocks of 2 have no slot pair, so with `correct_first_slot` the anchor -> slot 1 loss is the corrector's only
    signal: it starts at the drafter's pick (zero output layer) and learns to beat it on the records it sees."""
    target = make_target("llama")
    drafter = fit_drafter(target, block_size=2, top_k=4, steps=40)
    records = _records(target)
    evaluate = _loss_on(records, drafter, target)

    def first_slot_accuracy():
        return evaluate().first_slot_accuracy

    assert first_slot_accuracy() is None  # the paper's corrector does not touch slot 1
    drafter.config.correct_first_slot = True
    drafter_before, corrector_before = first_slot_accuracy()
    assert drafter_before == corrector_before < 0.9
    model = DrafterTrainingModel(drafter, target, stage=2, num_anchors=8, corrector_only=True)
    model._records = records
    trainer = _trainer(model, tmp_path, steps=30)
    trainer.train()
    assert any("first_slot_corrector_acc" in entry for entry in trainer.state.log_history)
    drafter_after, corrector_after = first_slot_accuracy()
    assert drafter_after == drafter_before  # corrector-only: the backbone and its top-1 are unchanged
    assert corrector_after > drafter_after + 0.05, (drafter_after, corrector_after)


def test_mixed_horizons_train_each_block_size_in_turn_and_leave_the_drafting_size(tmp_path):
    """DScout's mixed horizons: training forwards take the listed block sizes in turn; evaluation forwards and the
    drafting size (config.block_size) stay as they were."""
    target = make_target("qwen3")
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    with pytest.raises(ValueError, match="every size must be >= 2"):
        DrafterTrainingModel(drafter, target, stage=2, block_sizes=[3, 1])
    assert DrafterTrainingModel(drafter, target, stage=2).block_sizes == (4,)
    model = DrafterTrainingModel(drafter, target, stage=2, num_anchors=4, block_sizes=[3, 5])
    batch = DrafterCollator()(_records(target, n=4))
    sizes = [model(**batch)["block_size"] for _ in range(3)]
    model.eval()
    with torch.no_grad():
        evaluated = [model(**batch) for _ in range(2)]
    assert sizes == [3, 5, 3] and [out["block_size"] for out in evaluated] == [5, 5]
    assert evaluated[0]["slot_accuracy"].shape == (4,)  # 4 mask slots: the forward really used blocks of 5
    assert drafter.config.block_size == 5  # the longest trained block: the drafter may draft up to it
    longer = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=8, top_k=4)
    DrafterTrainingModel(longer, target, stage=2, block_sizes=[3, 5])  # trained on blocks of 8 before: kept
    assert longer.config.block_size == 8

    model.train()
    model._records = _records(target)
    trainer = _trainer(model, tmp_path, steps=2)
    trainer.train()
    assert [entry["block_size"] for entry in trainer.state.log_history if "loss" in entry] == [5, 3]  # forwards 4, 5


def test_successor_pair_loss_trains_the_walks_decision(tmp_path):
    """With `pair_loss="successor"` the corrector learns only the true predecessor's row, and that is enough to pick
    the true successor more often than the drafter's argmax on the records it sees."""
    target, drafter = _backbone_with_untrained_corrector()  # fit_drafter trains the corrector jointly
    records = _records(target)
    evaluate = _loss_on(records, drafter, target)

    def accuracy():
        return evaluate(pair_loss="successor").successor_accuracy

    drafter_before, corrector_before = accuracy()
    assert drafter_before == corrector_before < 0.9  # zero output layer: the drafter's own pick
    model = DrafterTrainingModel(drafter, target, stage=2, num_anchors=8, corrector_only=True, pair_loss="successor")
    model._records = records
    _trainer(model, tmp_path, steps=30).train()
    drafter_after, corrector_after = accuracy()
    assert drafter_after == drafter_before and corrector_after > corrector_before


def _backbone_with_untrained_corrector():
    """A fitted tiny drafter whose corrector output is zero again, so that corrector training has something to gain."""
    target = make_target("llama")
    drafter = fit_drafter(target, block_size=4, top_k=4, steps=40)
    with torch.no_grad():
        drafter.corrector.delta_out.weight.zero_()
        drafter.corrector.delta_out.bias.zero_()
    return target, drafter


def test_context_bigrams_join_a_trained_corrector_at_zero_and_then_train(tmp_path):
    """`from_pretrained(folder, context_bigrams=True)` (what `train_drafter.py --context-bigrams` does) adds the
    m(a, b) input with zero weights, so the corrector's picks are unchanged; corrector-only training then uses it."""
    target, drafter = _backbone_with_untrained_corrector()
    drafter.save_pretrained(tmp_path / "drafter")
    records = _records(target)
    before = _loss_on(records, drafter, target)().successor_accuracy
    widened = DCOCODrafter.from_pretrained(tmp_path / "drafter", context_bigrams=True).attach(target)
    assert widened.config.context_bigrams and widened.corrector.delta_seen.weight.abs().sum() == 0
    evaluate = _loss_on(records, widened, target)
    assert evaluate().successor_accuracy == before
    model = DrafterTrainingModel(widened, target, stage=2, num_anchors=8, corrector_only=True)
    model._records = records
    _trainer(model, tmp_path / "run", steps=30).train()
    assert widened.corrector.delta_seen.weight.abs().sum() > 0
    assert evaluate().successor_accuracy[1] > before[1]


def test_corpus_bigrams_join_a_trained_corrector_at_zero_train_and_round_trip(tmp_path):
    """`set_corpus_bigrams(CorpusBigrams.count(...))` (what `train_drafter.py --corpus-bigrams` does) adds the corpus
    inputs with zero weights, so the corrector's picks are unchanged; corrector-only training then uses them, and the
    counts travel with the weights (a checkpoint that lost them is an error, not a silent table of zeros)."""
    target, drafter = _backbone_with_untrained_corrector()
    records = _records(target)
    before = _loss_on(records, drafter, target)().successor_accuracy
    table = CorpusBigrams.count(((r["input_ids"], r["loss_mask"]) for r in records), target.config.vocab_size)
    drafter.set_corpus_bigrams(table)
    assert drafter.config.corpus_bigrams == table.num_pairs > 0
    assert drafter.corrector.delta_corpus.weight.abs().sum() == 0
    evaluate = _loss_on(records, drafter, target)
    assert evaluate().successor_accuracy == before
    model = DrafterTrainingModel(drafter, target, stage=2, num_anchors=8, corrector_only=True)
    model._records = records
    _trainer(model, tmp_path / "run", steps=30).train()
    assert drafter.corrector.delta_corpus.weight.abs().sum() > 0
    assert evaluate().successor_accuracy[1] > before[1]

    drafter.save_pretrained(tmp_path / "saved")
    loaded = DCOCODrafter.from_pretrained(tmp_path / "saved").attach(target)
    for name in ("pair_keys", "pair_counts", "first_counts"):
        assert torch.equal(getattr(loaded.corpus_bigrams, name), getattr(table, name))
    torch.testing.assert_close(loaded.corrector.delta_corpus.weight, drafter.corrector.delta_corpus.weight)
    weights = load_file(tmp_path / "saved" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("corpus_bigrams.")},
              tmp_path / "saved" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 3 drafter weight"):
        DCOCODrafter.from_pretrained(tmp_path / "saved")


class _Planted:
    """Any class a pickle may name: unpickling it runs code of the pickle's choosing (here, harmlessly, a flag)."""

    ran = False

    def __reduce__(self):
        return (_Planted._run, ())

    @staticmethod
    def _run():
        _Planted.ran = True
        return {}


def test_shards_load_tensors_only(tmp_path):
    # torch.load without weights_only unpickles arbitrary objects; a planted shard must be refused, unexecuted.
    torch.save([{"input_ids": torch.arange(4)}], tmp_path / "shard-00000.pt")
    assert torch.equal(load_shards(tmp_path)[0]["input_ids"], torch.arange(4))
    torch.save([_Planted()], tmp_path / "shard-00001.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_shards(tmp_path)
    assert not _Planted.ran


def test_shards_are_safetensors_and_older_pt_shards_still_read(tmp_path):
    """Records are written in a format that runs no code when loaded; a folder from before keeps its .pt shards,
    read with weights_only=True, beside new ones, in index order."""
    from safetensors import safe_open

    from dcoco_hf.training.data import shard_done, shard_paths

    records = [{"input_ids": torch.arange(n), "loss_mask": torch.arange(n) % 2 == 0,
                "context_states": torch.randn(n, 3).to(torch.bfloat16), "target_argmax": torch.arange(n).int()}
               for n in (4, 1, 6)]
    save_shard(records, shard_path(tmp_path, 1))
    with safe_open(str(shard_path(tmp_path, 1)), "pt") as file:
        assert set(file.keys()) == {f"{name}{suffix}" for name in records[0] for suffix in ("", ".lengths")}
    torch.save(records[:1], tmp_path / "shard-00000.pt")  # an older folder's first shard
    assert [p.name for p in shard_paths(tmp_path)] == ["shard-00000.pt", "shard-00001.safetensors"]
    assert shard_done(tmp_path, 0) and shard_done(tmp_path, 1) and not shard_done(tmp_path, 2)
    loaded = load_shards(tmp_path)
    assert len(loaded) == 4
    for got, expected in zip(loaded, records[:1] + records):
        assert all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in expected)
    assert read_shard(shard_path(tmp_path, 1))[2]["context_states"].shape == (6, 3)


def test_a_reply_journal_keeps_what_a_killed_prompt_phase_wrote(tmp_path):
    path = tmp_path / "questions.jsonl"
    calls = []

    def sample(tag):
        calls.append(tag)
        return [f"reply {tag} {torch.rand(1).item():.6f}"]

    from dcoco_hf.training import data

    first = data.ReplyJournal(path).replies(0, seed=3, sample=lambda: sample("a"))
    with path.open("a") as file:
        file.write('{"batch": 1, "repl')  # a kill mid-line
    again = data.ReplyJournal(path)
    assert again.replies(0, seed=3, sample=lambda: sample("b")) == first  # kept, not sampled again
    second = again.replies(1, seed=3, sample=lambda: sample("c"))
    assert calls == ["a", "c"]
    assert data.ReplyJournal(path).done == {0: first, 1: second}
    # each batch samples under its own seed, so a resumed run writes what an uninterrupted one would
    assert data.ReplyJournal(None).replies(1, seed=3, sample=lambda: sample("c")) == second


def test_features_of_the_targets_greedy_answers_skip_the_layers_above_the_deepest_read(tmp_path):
    """The answers `dcoco-hf train` caches are the target's own greedy text: their next tokens are its argmax, so the
    forward stops after the deepest layer read (no layer above it, no LM head) and gives the same states and labels."""
    target = make_target("llama")
    layers = [0, 2]  # of 4: layer 3 and the LM head need not run
    generator = torch.Generator().manual_seed(1)
    records = []
    for prompt_len, new in ((5, 9), (3, 4), (7, 12)):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)
        mask = torch.zeros(out.shape[1], dtype=torch.bool)
        mask[prompt_len:] = True
        records.append({"input_ids": out[0].to(torch.int32), "loss_mask": mask})
    torch.save(records, tmp_path / "shard-00000.pt")
    ran = []
    hooks = [decoder_layers(target)[3].register_forward_hook(lambda *args: ran.append("layer 3")),
             target.lm_head.register_forward_hook(lambda *args: ran.append("lm_head"))]
    cached = load_shards(cache_target_features(target, layers, tmp_path, tmp_path / "features", batch_tokens=64,
                                               greedy_text=True))
    for hook in hooks:
        hook.remove()
    assert ran == []
    for record in cached:
        states, argmax = target_context(target, layers, record["input_ids"].long()[None])
        torch.testing.assert_close(record["context_states"].float(), states[0].to(torch.bfloat16).float())
        # every label a block reads (from the prompt's last position, whose next token is the answer's first, to the
        # last but one) is the full forward's argmax
        read = slice(int(record["loss_mask"].nonzero()[0]) - 1, -1)
        assert torch.equal(record["target_argmax"][read].long(), argmax[0, read])
