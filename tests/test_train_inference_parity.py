"""Train/inference parity: every block drafted at generation time is scored exactly as the training objective scores
it at the same anchor.

Both sides take candidates with `DCOCODrafter.slot_candidates` and score them with `DCOCODrafter.score_candidates`;
this test records what the real `drafter_loss` hands to and gets from `score_candidates`, and compares it with the
proposals of both paths that call `DCOCODrafter.propose` (transformers' assisted generation and the batched loop).
They must see exactly what training showed the drafter: the target states of every position before the anchor, the
same positions and the same block, the same candidates and the same corrector inputs. A drift here (an off-by-one
position, a lost context row, a caller that computes candidates or scores its own way) keeps outputs lossless but
silently costs acceptance, so no exactness test would catch it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import scrambled
from test_lilicorr import lilicorr_copy, randomise

from dcoco_hf import CorpusBigrams, speculative_generate
from dcoco_hf.training import drafter_loss, objective, pack_blocks, target_context


@pytest.mark.parametrize("inputs", ["", "context_bigrams", "corpus_bigrams", "lilicorr", "lilicorr_evidence"])
@pytest.mark.parametrize("path", ["assisted", "batched"])
def test_drafted_blocks_equal_the_training_forward(fitted, path, inputs, monkeypatch):
    target, fitted_drafter = fitted
    # A corrector that overrules the drafter, scoring the anchor -> slot 1 transitions too (and, with
    # context_bigrams, reading m(a, b), or with corpus_bigrams the counts of the target's answers to other prompts;
    # or a random LiLiCorr head, alone or with pair evidence reading both): its scores must also be the training
    # forward's, and the outputs stay the target's own. The training side sees the whole output, so its m(a, b) must
    # stop at each block's anchor.
    bigrams = inputs in ("context_bigrams", "lilicorr_evidence")
    answers = corpus = None
    if inputs in ("corpus_bigrams", "lilicorr_evidence"):
        others = torch.randint(0, target.config.vocab_size, (6, 4), generator=torch.Generator().manual_seed(3))
        answers = target.generate(others, attention_mask=torch.ones_like(others), max_new_tokens=30, do_sample=False)
        corpus = CorpusBigrams.count(_answer_texts(answers), target.config.vocab_size)
    if inputs.startswith("lilicorr"):
        drafter = lilicorr_copy(fitted_drafter, target, context_bigrams=bigrams)
        if corpus is not None:
            drafter.set_corpus_bigrams(corpus)
        randomise(drafter.corrector)
    else:
        drafter = scrambled(fitted_drafter, seed=2, context_bigrams=bigrams, corpus=corpus)
    cfg = drafter.config
    cfg.correct_first_slot = True
    # Training packs whole blocks of cfg.block_size: draft those every cycle (the cost-aware schedule may draft less).
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafted = []  # (anchor position, context rows the drafter holds, proposal) per cycle
    propose = drafter.propose

    def recording(anchor_ids, context_hidden_states, position_ids, cache, *args, **kwargs):
        seen = cache.get_seq_length() + context_hidden_states.shape[1]
        proposal = propose(anchor_ids, context_hidden_states, position_ids, cache, *args, **kwargs)
        drafted.append((int(position_ids[0, -cfg.block_size]), seen, proposal))
        return proposal

    monkeypatch.setattr(drafter, "propose", recording)
    # Seed 8: a prompt whose continuation does not loop on one token (tiny random targets often do), so m(a, b)
    # differs between the text up to an anchor and the whole output.
    ids = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(8))
    common = dict(max_new_tokens=40, do_sample=False)
    plain = target.generate(ids, **common)
    if path == "assisted":
        out = target.generate(ids, assistant_model=drafter, **common)
        # transformers asks for the first draft before its prefill: that block is drafted from the anchor alone.
        assert drafted[0][:2] == (ids.shape[1] - 1, 0)
        drafted = drafted[1:]
    else:
        out = speculative_generate(target, ids, drafter=drafter, **common).sequences
    assert torch.equal(out, plain)
    assert len(drafted) >= 3
    assert [seen for _, seen, _ in drafted] == [anchor for anchor, _, _ in drafted]  # all rows before the anchor
    assert any(proposal.chosen[0, 0] != 0 for _, _, proposal in drafted)  # slot 1 was re-selected

    # The training step at exactly the drafted anchors, on the output (every token learned), recording what it
    # scores. Training leaves each record's own pairs out of the corpus counts: a corpus that also counted this
    # record then reads, with it left out, exactly the counts drafting read.
    anchors = torch.tensor([[anchor for anchor, _, _ in drafted]])  # [1, m]
    everything = torch.ones_like(out, dtype=torch.bool)
    if corpus is not None:  # drafting read some counted candidate pairs, and some uncounted ones
        candidates = torch.stack([p.candidates[0] for _, _, p in drafted])  # [m, S, K]
        counts = drafter.candidate_corpus_inputs(out[:, anchors[0]], candidates[None])  # [1, m, P, K, K, 2]
        assert 0 < int((counts[..., 0] > 0).sum()) < counts[..., 0].numel()
        texts = [*_answer_texts(answers), (out[0], everything[0])]
        drafter.set_corpus_bigrams(CorpusBigrams.count(texts, cfg.vocab_size))
    monkeypatch.setattr(objective, "sample_anchors", lambda *_: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    scored = []  # (arguments, result) of each score_candidates call
    score = drafter.score_candidates
    signature = inspect.signature(score)

    def scoring(*args, **kwargs):
        result = score(*args, **kwargs)
        scored.append((signature.bind(*args, **kwargs).arguments, result))
        return result

    monkeypatch.setattr(drafter, "score_candidates", scoring)
    states, argmax = target_context(target, cfg.target_layer_ids, out)
    with torch.no_grad():
        drafter_loss(drafter, out, everything, states, argmax, num_anchors=anchors.shape[1])
    (arguments, (first, pairs)), = scored  # training scores through the one function drafting uses
    blocks = pack_blocks(out, argmax, everything, anchors, torch.ones_like(anchors, dtype=torch.bool),
                         cfg.block_size, cfg.mask_token_id)
    labelled = blocks.label_mask[0]  # [m, S] slots whose true token training knows (the rest are placeholders)
    assert labelled[:, 0].all()  # on the target's own output every block's slot 1 is labelled
    rows = arguments["rows"][0]  # [m] training passes every block, and which ones to score
    candidates, logits = arguments["candidates"][0][rows], arguments["candidate_logits"][0][rows]  # [R, S, K]
    labelled = labelled[rows]  # [R, S]
    assert 0 < int(rows.sum())
    proposals = [p for _, _, p in drafted]
    drafted_candidates = torch.stack([p.candidates[0] for p in proposals])[rows]  # [R, S, K]
    close = dict(atol=1e-4, rtol=1e-4)
    assert torch.equal(candidates[labelled], drafted_candidates[labelled])
    drafted_logits = torch.stack([p.candidate_logits[0] for p in proposals])[rows]  # [R, S, K]
    torch.testing.assert_close(logits[labelled], drafted_logits[labelled], **close)
    torch.testing.assert_close(first, torch.stack([p.first_slot_scores[0] for p in proposals])[rows], **close)
    # A DCOCO pair's score reads its own two slots only: compare the pairs whose both slots training labels.
    both = labelled[:, :-1] & labelled[:, 1:]  # [R, S - 1]
    drafted_pairs = torch.stack([p.transition_scores[0] for p in proposals])[rows]  # [R, S - 1, K, K]
    torch.testing.assert_close(pairs[both], drafted_pairs[both], **close)
    if bigrams:  # the input really varies, and the full text would have said otherwise for some block
        anchor_ids = blocks.block_ids.view(-1, cfg.block_size)[:, 0]  # [m]
        grid = arguments["candidates"]  # [1, m, S, K]
        seen = drafter.candidate_bigrams(anchor_ids[None], grid, out, anchor_positions=anchors)  # [1, m, P, K, K]
        assert 0 < int(seen.sum()) < seen.numel()
        everywhere = drafter.candidate_bigrams(anchor_ids[None], grid, out)
        assert not torch.equal(seen, everywhere)


def _answer_texts(answers: torch.LongTensor) -> list[tuple[torch.LongTensor, torch.BoolTensor]]:
    """(ids, learned) of each answer to 4-token prompts, as training records count into `CorpusBigrams`."""
    return [(ids, torch.arange(ids.numel()) >= 4) for ids in answers]
