"""Train/inference parity: every block drafted at generation time equals the packed training forward at its anchor.

Both paths that call `DCOCODrafter.propose` (transformers' assisted generation and the batched loop) must hand the
drafter exactly what training showed it: the target states of every position before the anchor, the same positions
and the same block. A drift here (an off-by-one position, a lost context row) keeps outputs lossless but silently
costs acceptance, so no exactness test would catch it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import scrambled

from dcoco_hf import CorpusBigrams, speculative_generate
from dcoco_hf.training import pack_blocks, target_context


@pytest.mark.parametrize("inputs", ["", "context_bigrams", "corpus_bigrams"])
@pytest.mark.parametrize("path", ["assisted", "batched"])
def test_drafted_blocks_equal_the_training_forward(fitted, path, inputs, monkeypatch):
    target, fitted_drafter = fitted
    # A corrector that overrules the drafter, scoring the anchor -> slot 1 transitions too (and, with
    # context_bigrams, reading m(a, b), or with corpus_bigrams the counts of the target's answers to other prompts):
    # its scores must also be the training forward's, and the outputs stay the target's own. The training side sees
    # the whole output, so its m(a, b) must stop at each block's anchor.
    bigrams = inputs == "context_bigrams"
    corpus = None
    if inputs == "corpus_bigrams":
        others = torch.randint(0, target.config.vocab_size, (6, 4), generator=torch.Generator().manual_seed(3))
        answers = target.generate(others, attention_mask=torch.ones_like(others), max_new_tokens=30, do_sample=False)
        corpus = CorpusBigrams.count(((ids, torch.arange(ids.numel()) >= 4) for ids in answers), target.config.vocab_size)
    drafter = scrambled(fitted_drafter, seed=2, context_bigrams=bigrams, corpus=corpus)
    cfg = drafter.config
    cfg.correct_first_slot = True
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

    states, argmax = target_context(target, cfg.target_layer_ids, out)
    anchors = torch.tensor([[anchor for anchor, _, _ in drafted]])  # [1, m]
    everything = torch.ones_like(out, dtype=torch.bool)
    blocks = pack_blocks(out, argmax, everything, anchors, torch.ones_like(anchors, dtype=torch.bool),
                         cfg.block_size, cfg.mask_token_id)
    with torch.no_grad():
        hidden = drafter(drafter.embed(blocks.block_ids), states, blocks.position_ids, blocks.attention_mask)
        block_hidden = hidden.last_hidden_state.view(anchors.shape[1], cfg.block_size, -1)  # [m, block, H]
        logits, candidates = drafter.proposal_logits(block_hidden[:, 1:])[0].topk(cfg.top_k, dim=-1)  # [m, S, K]
        anchor_ids = blocks.block_ids.view(-1, cfg.block_size)[:, 0]  # [m]
        seen, first_seen = drafter.candidate_bigrams(anchor_ids[None], candidates[None], out, anchor_positions=anchors)
        # Drafting has no record to leave out of the counts (training's leave-one-out is its only difference).
        counts, first_counts = drafter.candidate_corpus_inputs(anchor_ids[None], candidates[None])
        first = drafter.first_slot_scores(block_hidden, anchor_ids, drafter.embed(candidates[:, 0]), logits,
                                          None if first_seen is None else first_seen[0],
                                          None if first_counts is None else first_counts[0])  # [m, K]
        pairs = drafter.corrector(block_hidden[:, 1:], drafter.embed(candidates), logits,
                                  None if seen is None else seen[0],
                                  None if counts is None else counts[0])  # [m, S - 1, K, K]
    if bigrams:  # the input really varies, and the full text would have said otherwise for some block
        assert 0 < int(seen.sum()) < seen.numel()
        everywhere = drafter.candidate_bigrams(anchor_ids[None], candidates[None], out)
        assert not (torch.equal(seen, everywhere[0]) and torch.equal(first_seen, everywhere[1]))
    if corpus is not None:  # some candidate pairs were counted, some not
        assert 0 < int((counts[..., 0] > 0).sum()) < counts[..., 0].numel()
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack([p.candidate_logits[0] for _, _, p in drafted]), logits, **close)
    torch.testing.assert_close(torch.stack([p.first_slot_scores[0] for _, _, p in drafted]), first, **close)
    torch.testing.assert_close(torch.stack([p.transition_scores[0] for _, _, p in drafted]), pairs, **close)
