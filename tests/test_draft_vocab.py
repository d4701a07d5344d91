"""Frequency-ranked draft vocabulary: proposals come only from it, outputs stay exact, and it saves and loads."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PROMPT_LEN, scrambled
from test_corrector import _contexts, _propose

from dcoco_hf import DCOCOConfig, DCOCODrafter
from dcoco_hf.training import drafter_loss, pack_blocks, sample_anchors, target_context
from dcoco_hf.training.data import draft_vocabulary
from dcoco_hf.training.losses import default_gamma, dflash_loss


def _greedy_records(target, rows: int = 16, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    prompts = torch.randint(0, target.config.vocab_size, (rows, PROMPT_LEN),
                            generator=torch.Generator().manual_seed(seed))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=30, do_sample=False)
    mask = torch.zeros_like(sequences, dtype=torch.bool)
    mask[:, PROMPT_LEN:] = True
    return [{"input_ids": s, "loss_mask": m} for s, m in zip(sequences, mask)]


def test_draft_vocabulary_ranks_learned_tokens_and_keeps_always():
    records = [
        {"input_ids": torch.tensor([9, 9, 9, 1, 1, 2, 3]), "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 1]).bool()},
        {"input_ids": torch.tensor([4, 1, 2, 5]), "loss_mask": torch.tensor([0, 1, 1, 1]).bool()},
    ]
    # learned tokens: 1 x3, 2 x2, 3 x1, 5 x1 (the unlearned 9s and 4 do not count)
    ids, coverage = draft_vocabulary(records, vocab_size=12, size=3, always=[11])
    assert ids.tolist() == [1, 2, 11]
    assert coverage == pytest.approx(5 / 7)
    ids, coverage = draft_vocabulary(records, vocab_size=12, size=2, always=[1])  # `always` is not counted twice
    assert ids.tolist() == [1, 2] and coverage == pytest.approx(5 / 7)
    with pytest.raises(ValueError, match="no learned tokens"):
        draft_vocabulary([{"input_ids": torch.tensor([1]), "loss_mask": torch.tensor([False])}], 12, 2)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_proposals_are_the_top_k_inside_the_draft_vocabulary(fitted):
    """Same logits as the whole-vocabulary drafter, restricted to the draft vocabulary, best first."""
    target, trained = fitted
    vocab, k = trained.config.vocab_size, trained.config.top_k
    subset = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 2]
    sequences, states = _contexts(target, trained)

    everything = copy.deepcopy(trained).attach(target)
    everything.config.top_k = vocab  # the whole ranking, to filter by hand
    full = _propose(everything, sequences, states, cut=12, correct=False)
    restricted = copy.deepcopy(trained).attach(target).set_draft_vocabulary(subset)
    got = _propose(restricted, sequences, states, cut=12, correct=False)

    inside = torch.isin(full.candidates, subset)  # [B, S, V]
    order = inside.float().argsort(dim=-1, descending=True, stable=True)[..., :k]  # first K inside, ranking kept
    assert torch.equal(got.candidates, full.candidates.gather(-1, order))
    torch.testing.assert_close(got.candidate_logits, full.candidate_logits.gather(-1, order))
    assert torch.isin(got.tokens, subset).all()


@pytest.mark.parametrize("variant", ["fitted", "scrambled"])
def test_greedy_stays_exact_with_a_draft_vocabulary(fitted, variant):
    target, trained = fitted
    drafter = scrambled(trained, seed=2) if variant == "scrambled" else copy.deepcopy(trained).attach(target)
    ids, coverage = draft_vocabulary(_greedy_records(target), target.config.vocab_size, size=24)
    drafter.set_draft_vocabulary(ids)
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, target.config.vocab_size, (1, PROMPT_LEN),
                               generator=torch.Generator().manual_seed(seed))
        expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
        got = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        accepted += sum(drafter.generation_stats(got).accepted)
    assert coverage > 0.5 and accepted > 0  # drafts from the restricted vocabulary were really accepted


def test_draft_vocabulary_saves_loads_and_can_be_removed(tmp_path, fitted):
    target, trained = fitted
    drafter = copy.deepcopy(trained).attach(target).set_draft_vocabulary([7, 3, 5, 1, 0, 9])
    drafter.save_pretrained(tmp_path / "with")
    loaded = DCOCODrafter.from_pretrained(tmp_path / "with")
    assert loaded.config.draft_vocab_size == 6
    assert loaded.draft_token_ids.tolist() == [0, 1, 3, 5, 7, 9]
    loaded.set_draft_vocabulary(None).save_pretrained(tmp_path / "without")
    again = DCOCODrafter.from_pretrained(tmp_path / "without")
    assert again.config.draft_vocab_size is None and again.draft_token_ids is None


def test_bad_draft_vocabularies_are_refused(fitted):
    target, trained = fitted
    drafter = copy.deepcopy(trained).attach(target)
    vocab, k = drafter.config.vocab_size, drafter.config.top_k
    with pytest.raises(ValueError, match="fewer than top_k"):
        drafter.set_draft_vocabulary(list(range(k - 1)))
    with pytest.raises(ValueError, match=r"must lie in \[0, "):
        drafter.set_draft_vocabulary(list(range(k - 1)) + [vocab])
    with pytest.raises(ValueError, match="twice"):
        drafter.set_draft_vocabulary([0, 0, *range(1, k)])
    with pytest.raises(ValueError, match="draft_vocab_size=2 must lie in"):
        DCOCOConfig(vocab_size=vocab, top_k=4, target_layer_ids=[0], draft_vocab_size=2)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_training_ranks_only_the_draft_vocabulary(fitted):
    """With a draft vocabulary the DFlash loss is the slot cross-entropy over those tokens alone (the ranking
    `propose` uses), labels outside it are dropped, and stage 2's candidates are that ranking's top-K token ids."""
    target, trained = fitted
    records = _greedy_records(target)
    ids, mask = torch.stack([r["input_ids"] for r in records]), torch.stack([r["loss_mask"] for r in records])
    cfg = trained.config
    states, argmax = target_context(target, cfg.target_layer_ids, ids)
    common_label = int(argmax[mask].mode().values)
    subset = torch.tensor([t for t in range(cfg.vocab_size) if t != common_label and t % 3])  # drops real labels
    drafter = copy.deepcopy(trained).attach(target).set_draft_vocabulary(subset)
    got = drafter_loss(drafter, ids, mask, states, argmax, num_anchors=8, generator=torch.Generator().manual_seed(0))

    # The same anchors and blocks by hand, scored by the whole lm_head, then restricted to the subset.
    anchors, valid = sample_anchors(mask, 8, torch.Generator().manual_seed(0))
    blocks = pack_blocks(ids, argmax, mask, anchors, valid, cfg.block_size, cfg.mask_token_id)
    hidden = drafter(drafter.embed(blocks.block_ids), states, blocks.position_ids, blocks.attention_mask)
    slot_hidden = hidden.last_hidden_state.view(*anchors.shape, cfg.block_size, -1)[:, :, 1:]
    proposable = torch.isin(blocks.labels, subset)
    assert (blocks.label_mask & ~proposable).any()  # the test really drops labels
    labelled = blocks.label_mask & proposable
    logits = drafter.slot_logits(slot_hidden[labelled])[:, subset]  # [L, |subset|], columns in subset order
    columns = torch.searchsorted(subset, blocks.labels[labelled])
    expected = dflash_loss(logits, columns, labelled.nonzero()[:, -1], cfg.block_size, default_gamma(cfg.block_size))
    torch.testing.assert_close(got.dflash, expected.detach(), rtol=1e-5, atol=1e-6)
    assert got.dcoco is not None and torch.isfinite(got.dcoco)


def test_the_compare_script_measures_coverage_and_draft_cost_per_size(tmp_path):
    """scripts/draft_vocab.py --compare: per size, the share of the answers' tokens it holds (the whole vocabulary
    holds all) and the timed draft cost in plain steps, written as JSON with its command line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import make_target
    from test_cli import tiny_tokenizer

    from dcoco_hf.training.data import regenerate

    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    tokenizer = tiny_tokenizer()
    regenerate(target, tokenizer, [f"w{i} w{i + 1}" for i in range(8)], tmp_path / "data", max_new_tokens=8)
    script = Path(__file__).resolve().parents[1] / "scripts" / "draft_vocab.py"
    result = subprocess.run(
        [sys.executable, str(script), "--compare", "16", "0", "--target", str(tmp_path / "target"), "--data",
         str(tmp_path / "data"), "--json", str(tmp_path / "sizes.json")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "sizes.json").read_text())
    small, whole = report["sizes"]
    assert small["size"] == 16 and 0 < small["coverage"] <= 1 and whole == {**whole, "coverage": 1.0}
    assert 0 < small["held_out_coverage"] <= 1 and whole["held_out_coverage"] == 1.0
    assert whole["size"] == target.config.vocab_size and all(v > 0 for v in small["draft"].values())
    assert "--compare 16 0" in report["command"]
