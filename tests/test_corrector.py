"""The DCOCO corrector: size, zero-start behaviour, the batched transition scores and the three walks."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from conftest import scrambled
from torch.nn import functional as F

from dcoco_hf import (
    ContextBigrams,
    CorpusBigrams,
    DCOCOConfig,
    DCOCOCorrector,
    prefix_first_walk,
    select_candidates,
    viterbi_walk,
)
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.training import target_context

SELECTIONS = ("prefix_first", "viterbi", "geometric")


# ---------------------------------------------------------------------------------------------------- size


@pytest.mark.parametrize("hidden,expected", [(4096, 2_229_505), (2560, 1_443_073)])
def test_parameter_count_matches_paper(hidden, expected):
    corrector = DCOCOCorrector(hidden_size=hidden, rank=128, mlp_hidden=256)
    assert sum(p.numel() for p in corrector.parameters()) == expected


# ---------------------------------------------------------------------------------------------------- zero start


def _contexts(target, drafter, rows: int = 4, length: int = 30, seed: int = 0):
    """Committed sequences (the target's own greedy text after random prompts) and their tapped target states."""
    prompts = torch.randint(0, target.config.vocab_size, (rows, 6), generator=torch.Generator().manual_seed(seed))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=length - 6,
                                do_sample=False)
    states, _ = target_context(target, drafter.config.target_layer_ids, sequences)
    return sequences, states


def _propose(drafter, sequences, states, cut: int, **kwargs):
    """Draft after the first `cut` committed tokens of every row (anchor = token cut - 1, context = rows before)."""
    block = drafter.config.block_size
    positions = torch.arange(cut - 1 + block).expand(sequences.shape[0], -1)
    return drafter.propose(sequences[:, cut - 1], states[:, : cut - 1], positions, DraftContextCache(), **kwargs)


@pytest.mark.parametrize("first_slot", [False, True], ids=["paper", "correct_first_slot"])
@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_fresh_corrector_reproduces_dflash_argmax(fitted, first_slot):
    """A new corrector (zero output layer) on a fitted drafter proposes exactly the DFlash argmax, for every walk,
    also when it scores the anchor -> slot 1 transitions."""
    target, trained = fitted
    drafter = copy.deepcopy(trained).attach(target)
    cfg = drafter.config
    cfg.correct_first_slot = first_slot
    drafter.corrector = DCOCOCorrector(cfg.hidden_size, cfg.corrector_rank, cfg.corrector_hidden)
    assert not drafter.corrector.delta_out.weight.any() and not drafter.corrector.delta_out.bias.any()
    noisy = scrambled(drafter, seed=1)

    sequences, states = _contexts(target, drafter)
    changed = {selection: 0 for selection in SELECTIONS}
    first_changed = {selection: 0 for selection in SELECTIONS}  # proposals whose slot 1 is not the argmax
    noisy_tokens: dict[str, list[torch.Tensor]] = {}
    total = 0
    for cut in range(2, sequences.shape[1] - 1, 2):
        plain = _propose(drafter, sequences, states, cut, correct=False)
        assert plain.transition_scores is None and not plain.chosen.any()
        assert torch.equal(plain.tokens, plain.candidates[..., 0])
        total += plain.tokens.numel()
        for selection in SELECTIONS:
            corrected = _propose(drafter, sequences, states, cut, selection=selection, correct=True)
            assert corrected.transition_scores is not None
            assert torch.equal(corrected.candidates, plain.candidates)
            assert torch.equal(corrected.tokens, plain.tokens), (selection, cut)
            assert not corrected.chosen.any()
            # With Delta = 0 the scores are the successor's logits, so every walk picks each slot's argmax.
            scores, first = corrected.transition_scores, corrected.candidate_logits[:, 0]
            assert torch.equal(scores, corrected.candidate_logits[:, 1:, None, :].expand_as(scores))
            assert (corrected.first_slot_scores is not None) == first_slot
            if first_slot:
                assert torch.equal(corrected.first_slot_scores, first)
            for lam in (1.0, drafter.decoding.geometric_lambda, 0.05):
                assert not viterbi_walk(scores, first, decay=lam).any()
            # A corrector that does overrule the drafter: the comparison above can fail, and each selection is the
            # walk it names, applied to the scores of that very proposal.
            overruled = _propose(noisy, sequences, states, cut, selection=selection)
            first_scores = overruled.first_slot_scores if first_slot else overruled.candidate_logits[:, 0]
            lam = noisy.decoding.geometric_lambda
            walked = select_candidates(selection, overruled.transition_scores, first_scores, lam)
            first_changed[selection] += int(walked[:, 0].bool().sum())
            assert torch.equal(overruled.chosen, walked)
            assert torch.equal(overruled.tokens, overruled.candidates.gather(-1, walked[..., None]).squeeze(-1))
            changed[selection] += int((overruled.tokens != plain.tokens).sum())
            noisy_tokens.setdefault(selection, []).append(overruled.tokens)
    assert total >= 100
    assert all(count > 0.1 * total for count in changed.values()), (changed, total)
    # The paper's greedy walk never leaves the drafter's slot 1; scored from the anchor, it does.
    assert (first_changed["prefix_first"] > 0) == first_slot, first_changed
    greedy, viterbi = torch.cat(noisy_tokens["prefix_first"]), torch.cat(noisy_tokens["viterbi"])
    assert not torch.equal(greedy, viterbi)  # the walks differ, so the checks above tell them apart


# ---------------------------------------------------------------------------------------------------- scores


def _random_corrector(
    hidden: int, rank: int, mlp: int, context_bigrams: bool = False, corpus_bigrams: bool = False
) -> DCOCOCorrector:
    """A float64 corrector whose every parameter (delta_out and the LayerNorm affine included) is random."""
    corrector = DCOCOCorrector(hidden, rank, mlp, context_bigrams, corpus_bigrams).double()
    with torch.no_grad():
        for param in corrector.parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64))
    return corrector


def _naive_z(c: DCOCOCorrector, embed: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """z = LN_affine(W_fuse [LN(W_cand E[c]); LN(W_ctx h)]) for one candidate, straight from the paper."""
    cand = F.layer_norm(c.cand_proj.weight @ embed, (c.rank,))
    ctx = F.layer_norm(c.ctx_proj.weight @ h, (c.rank,))
    fused = c.fuse_proj.weight @ torch.cat([cand, ctx])
    return F.layer_norm(fused, (c.rank,), c.fuse_norm.weight, c.fuse_norm.bias, c.fuse_norm.eps)


def _naive_score(c, h_prev, h_next, z_prev, z_next, l_prev, l_next, seen=None, corpus=None) -> torch.Tensor:
    """S(a, b) = l_next + Delta([W_pair [h_prev; h_next]; z_prev; z_next; l_prev; l_next(; m)(; corpus)]) on one
    concatenated row (m: whether the pair occurs in the committed text, with `context_bigrams`; corpus: its two
    corpus inputs, with `corpus_bigrams`)."""
    weights = [c.delta_pair.weight, c.delta_prev.weight, c.delta_next.weight, c.delta_logits.weight]
    weights += [c.delta_seen.weight] if seen is not None else []
    weights += [c.delta_corpus.weight] if corpus is not None else []
    inputs = 3 * c.rank + 2 + (seen is not None) + 2 * (corpus is not None)
    first_w = torch.cat(weights, dim=1)
    assert first_w.shape == (c.delta_pair.out_features, inputs)
    s = c.pair_proj.weight @ torch.cat([h_prev, h_next])
    extra = ([seen.reshape(1)] if seen is not None else []) + ([corpus.reshape(2)] if corpus is not None else [])
    x = torch.cat([s, z_prev, z_next, l_prev.reshape(1), l_next.reshape(1)] + extra)
    assert x.shape == (inputs,)
    delta = c.delta_out.weight @ F.gelu(first_w @ x + c.delta_pair.bias) + c.delta_out.bias
    return l_next + delta.squeeze()


@pytest.mark.parametrize("bigrams,corpus", [(False, False), (True, False), (True, True)],
                         ids=["paper", "context_bigrams", "corpus_bigrams"])
def test_batched_scores_equal_naive_concatenation(bigrams, corpus):
    torch.manual_seed(0)
    hidden, rank, mlp, batch, slots, k = 12, 5, 7, 2, 4, 3
    c = _random_corrector(hidden, rank, mlp, bigrams, corpus)
    slot_hidden = torch.randn(batch, slots, hidden, dtype=torch.float64) * 3
    embeds = torch.randn(batch, slots, k, hidden, dtype=torch.float64) * 0.1
    logits = torch.randn(batch, slots, k, dtype=torch.float64) * 4
    seen = torch.rand(batch, slots - 1, k, k) < 0.5 if bigrams else None
    counts = torch.randn(batch, slots - 1, k, k, 2, dtype=torch.float64) if corpus else None
    batched = c(slot_hidden, embeds, logits, seen, counts)
    assert batched.shape == (batch, slots - 1, k, k)

    naive = torch.empty_like(batched)
    for b, p, a, n in itertools.product(range(batch), range(slots - 1), range(k), range(k)):
        naive[b, p, a, n] = _naive_score(
            c, slot_hidden[b, p], slot_hidden[b, p + 1], _naive_z(c, embeds[b, p, a], slot_hidden[b, p]),
            _naive_z(c, embeds[b, p + 1, n], slot_hidden[b, p + 1]), logits[b, p, a], logits[b, p + 1, n],
            None if seen is None else seen[b, p, a, n].double(), None if counts is None else counts[b, p, a, n],
        )
    assert (naive - logits[:, 1:, None, :]).abs().min() > 1e-6  # Delta really is non-zero everywhere
    torch.testing.assert_close(batched, naive, rtol=1e-10, atol=1e-10)


def test_first_slot_scores_equal_naive_concatenation():
    """S_0(anchor, b) is the pair formula with the anchor as a one-candidate predecessor whose logit input is 0."""
    torch.manual_seed(1)
    hidden, rank, mlp, batch, k = 12, 5, 7, 3, 4
    c = _random_corrector(hidden, rank, mlp)
    anchor_hidden, first_hidden = torch.randn(2, batch, hidden, dtype=torch.float64) * 3
    anchor_embed = torch.randn(batch, hidden, dtype=torch.float64) * 0.1
    embeds = torch.randn(batch, k, hidden, dtype=torch.float64) * 0.1
    logits = torch.randn(batch, k, dtype=torch.float64) * 4
    got = c.first_slot_scores(anchor_hidden, anchor_embed, first_hidden, embeds, logits)
    assert got.shape == (batch, k)

    naive = torch.empty_like(got)
    for b, n in itertools.product(range(batch), range(k)):
        naive[b, n] = _naive_score(
            c, anchor_hidden[b], first_hidden[b], _naive_z(c, anchor_embed[b], anchor_hidden[b]),
            _naive_z(c, embeds[b, n], first_hidden[b]), torch.zeros((), dtype=torch.float64), logits[b, n],
        )
    assert (naive - logits).abs().min() > 1e-6
    torch.testing.assert_close(got, naive, rtol=1e-10, atol=1e-10)


def test_context_bigrams_on_a_hand_worked_context():
    """m(a, b) per row, skipping padding, and (training) only up to each block's anchor."""
    context = torch.tensor([[5, 7, 5, 9, 0], [0, 1, 2, 7, 5]])  # row 0 right-padded, row 1 left-padded
    valid = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    first = torch.tensor([[5, 7, 9, 5, 9], [7, 0, 1, 5, 2]])
    second = torch.tensor([[7, 5, 5, 9, 0], [5, 1, 2, 7, 7]])
    seen = ContextBigrams(context, vocab_size=10, context_valid=valid).seen(first, second)
    assert seen.tolist() == [[True, True, False, True, False], [True, False, True, False, True]]
    # Rows do not see each other's pairs: (1, 2) is row 1's, (5, 7) row 0's.
    assert ContextBigrams(context, 10, valid).seen(torch.tensor([[1], [5]]), torch.tensor([[2], [7]])).tolist() == [
        [False], [False]
    ]
    # ends: a pair counts once its second token sits at or before the end (positions 1, 2, 3 in row 0).
    pairs = (torch.tensor([[5, 7, 5]]), torch.tensor([[7, 5, 9]]))
    ends = torch.tensor([[1, 1, 2]])
    assert ContextBigrams(context[:1], 10).seen(*pairs, ends=ends).tolist() == [[True, False, False]]
    assert ContextBigrams(context[:1], 10).seen(*pairs, ends=ends + 1).tolist() == [[True, True, True]]
    assert ContextBigrams(context[:1, :1], 10).seen(*pairs).tolist() == [[False, False, False]]  # one token: no pair
    # int32 ids (as stored in training records) with a real vocabulary size, whose pair hashes pass 2^31.
    big = torch.tensor([[49000, 48999, 7]], dtype=torch.int32)
    query = (torch.tensor([[49000, 48999, 7]], dtype=torch.int32), torch.tensor([[48999, 7, 49000]], dtype=torch.int32))
    assert ContextBigrams(big, vocab_size=49152).seen(*query).tolist() == [[True, True, False]]


def test_context_bigram_input_starts_at_zero():
    """A trained corrector given the m(a, b) input scores exactly as before until trained; m must match the config."""
    torch.manual_seed(3)
    hidden, rank, mlp, batch, slots, k = 12, 5, 7, 2, 4, 3
    c = _random_corrector(hidden, rank, mlp)
    with_input = DCOCOCorrector(hidden, rank, mlp, context_bigrams=True).double()
    assert with_input.load_state_dict(c.state_dict(), strict=False).missing_keys == ["delta_seen.weight"]
    slot_hidden = torch.randn(batch, slots, hidden, dtype=torch.float64) * 3
    embeds = torch.randn(batch, slots, k, hidden, dtype=torch.float64) * 0.1
    logits = torch.randn(batch, slots, k, dtype=torch.float64) * 4
    seen = torch.rand(batch, slots - 1, k, k) < 0.5
    torch.testing.assert_close(with_input(slot_hidden, embeds, logits, seen), c(slot_hidden, embeds, logits))
    with_input(slot_hidden, embeds, logits, seen).sum().backward()
    assert with_input.delta_seen.weight.grad.abs().sum() > 0  # trainable from the first step
    with torch.no_grad():
        with_input.delta_seen.weight.fill_(1.0)
    assert not torch.allclose(with_input(slot_hidden, embeds, logits, seen), c(slot_hidden, embeds, logits))
    with pytest.raises(ValueError, match="context_bigrams"):
        with_input(slot_hidden, embeds, logits)
    with pytest.raises(ValueError, match="context_bigrams"):
        c(slot_hidden, embeds, logits, seen)
    assert with_input.widened(9).delta_seen.weight.shape == (9, 1)


def test_corpus_bigrams_count_and_leave_one_out_on_hand_worked_texts():
    """c(a, b) and n(a) over the learned tokens only; in training each row's own pairs leave the counts."""
    texts = [
        # (5,7) (7,5) (5,9) (9,7) (7,5)
        (torch.tensor([5, 7, 5, 9, 7, 5]), torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool)),
        # (5,7); (3,5) unlearned
        (torch.tensor([3, 5, 7], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.bool)),
        (torch.tensor([4]), torch.tensor([True])),  # one token: no pair
    ]
    table = CorpusBigrams.count(texts, vocab_size=10)
    assert table.pair_keys.tolist() == [57, 59, 75, 97] and table.pair_counts.tolist() == [2, 1, 2, 1]
    assert table.first_counts[[5, 7, 9, 3]].tolist() == [3, 2, 1, 0]
    first, second = torch.tensor([[5, 7, 9, 3]]), torch.tensor([[7, 5, 7, 5]])
    log = torch.log1p(torch.tensor([2.0, 2.0, 1.0, 0.0]))
    expected = torch.stack([log, log - torch.log1p(torch.tensor([3.0, 2.0, 1.0, 0.0]))], -1)[None]
    torch.testing.assert_close(table.inputs(first, second), expected)
    # Leave-one-out against the first text: only the second text's (5, 7) is left.
    own = (texts[0][0][None], texts[0][1][None])
    left = torch.tensor([[[math.log(2), 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    torch.testing.assert_close(table.inputs(first, second, exclude=table.own_counts(*own)), left)
    # Rows leave out only their own text; broadcasting [B, K, 1] x [B, 1, K] as for slot pairs.
    rows = table.inputs(torch.tensor([5, 5]).view(2, 1, 1), torch.tensor([7, 9]).view(1, 1, 2).expand(2, 1, 2),
                        exclude=table.own_counts(torch.stack([texts[0][0], torch.zeros(6, dtype=torch.long)]),
                                                 torch.stack([texts[0][1], torch.zeros(6, dtype=torch.bool)])))
    assert rows.shape == (2, 1, 2, 2)
    assert rows[0, 0, :, 0].tolist() == pytest.approx([math.log(2), 0.0])  # (5,7): 2 - 1; (5,9): 1 - 1
    assert rows[1, 0, :, 0].tolist() == pytest.approx([math.log(3), math.log(2)])  # row 1 excludes nothing
    with pytest.raises(ValueError, match="No token pair"):
        CorpusBigrams.count(texts[2:], vocab_size=10)


def test_corpus_input_starts_at_zero():
    """A trained corrector given the corpus inputs scores exactly as before until trained; they must match it."""
    torch.manual_seed(4)
    hidden, rank, mlp, batch, slots, k = 12, 5, 7, 2, 4, 3
    c = _random_corrector(hidden, rank, mlp)
    with_input = copy.deepcopy(c)
    with_input.add_corpus_input()
    assert with_input.delta_corpus.weight.dtype == torch.float64 and with_input.delta_corpus.weight.abs().sum() == 0
    slot_hidden = torch.randn(batch, slots, hidden, dtype=torch.float64) * 3
    embeds = torch.randn(batch, slots, k, hidden, dtype=torch.float64) * 0.1
    logits = torch.randn(batch, slots, k, dtype=torch.float64) * 4
    counts = torch.rand(batch, slots - 1, k, k, 2, dtype=torch.float64) * 5
    torch.testing.assert_close(with_input(slot_hidden, embeds, logits, corpus=counts), c(slot_hidden, embeds, logits))
    with_input(slot_hidden, embeds, logits, corpus=counts).sum().backward()
    assert with_input.delta_corpus.weight.grad.abs().sum() > 0  # trainable from the first step
    with pytest.raises(ValueError, match="corpus_bigrams"):
        with_input(slot_hidden, embeds, logits)
    with pytest.raises(ValueError, match="corpus_bigrams"):
        c(slot_hidden, embeds, logits, corpus=counts)
    assert with_input.widened(9).delta_corpus.weight.shape == (9, 2)


def test_widened_corrector_scores_as_before_until_trained():
    """Widening Delta keeps every score (pairs and first slot); the new units then train like any other."""
    torch.manual_seed(2)
    hidden, rank, mlp, batch, slots, k = 12, 5, 7, 2, 4, 3
    c = _random_corrector(hidden, rank, mlp)
    wide = c.widened(11)
    assert wide.delta_out.in_features == 11 and wide.delta_pair.out_features == 11
    slot_hidden = torch.randn(batch, slots, hidden, dtype=torch.float64) * 3
    embeds = torch.randn(batch, slots, k, hidden, dtype=torch.float64) * 0.1
    logits = torch.randn(batch, slots, k, dtype=torch.float64) * 4
    torch.testing.assert_close(wide(slot_hidden, embeds, logits), c(slot_hidden, embeds, logits), rtol=0, atol=1e-12)
    first = (slot_hidden[:, 0], embeds[:, 0, 0], slot_hidden[:, 1], embeds[:, 1], logits[:, 1])
    torch.testing.assert_close(wide.first_slot_scores(*first), c.first_slot_scores(*first), rtol=0, atol=1e-12)
    wide(slot_hidden, embeds, logits).sum().backward()
    assert wide.delta_out.weight.grad[0, mlp:].abs().min() > 0  # the new units get gradient from the first step
    with torch.no_grad():
        wide.delta_out.weight[0, mlp:] = 1.0
    assert not torch.allclose(wide(slot_hidden, embeds, logits), c(slot_hidden, embeds, logits))
    with pytest.raises(ValueError, match="only adds units"):
        c.widened(mlp - 1)


# ---------------------------------------------------------------------------------------------------- walks


def _brute_force(scores: torch.Tensor, first: torch.Tensor, decay: float) -> list[list[int]]:
    batch, pairs, k, _ = scores.shape
    best = []
    for b in range(batch):
        def total(path):
            return float(first[b, path[0]]) + sum(decay**p * float(scores[b, p, path[p], path[p + 1]])
                                                  for p in range(pairs))
        best.append(list(max(itertools.product(range(k), repeat=pairs + 1), key=total)))
    return best


def _greedy_by_hand(scores: torch.Tensor) -> list[list[int]]:
    out = []
    for table in scores:
        path = [0]
        for p in range(table.shape[0]):
            path.append(int(table[p, path[-1]].argmax()))
        out.append(path)
    return out


def test_walks_on_hand_built_tables():
    # Slot 1 candidates have logits [2.0, 1.0]. Greedy keeps candidate 0 at slot 1, then takes the locally best
    # successor (0 -> 0, worth 5) and is stuck with a poor last transition (0 -> 1, worth 0.1): total 7.1.
    # The global path 0 -> 1 -> 0 gives up 1 point early and gains 10 later: total 2 + 4 + 10 = 16.
    first = torch.tensor([[2.0, 1.0]])
    scores = torch.tensor([[
        [[5.0, 4.0],    # S_0(a=0, .)
         [0.0, 0.0]],   # S_0(a=1, .)
        [[-1.0, 0.1],   # S_1(a=0, .)
         [10.0, 0.0]],  # S_1(a=1, .)
    ]])
    assert prefix_first_walk(scores).tolist() == [[0, 0, 1]]
    assert viterbi_walk(scores, first).tolist() == [[0, 1, 0]]
    # Geometric with a small lambda weighs the early transition (weight 1) over the late one (weight lambda):
    # 5 + 0.1 * lam vs 4 + 10 * lam, so it follows greedy for lam < 1/9.9 and the global path above it.
    assert viterbi_walk(scores, first, decay=0.05).tolist() == [[0, 0, 1]]
    assert viterbi_walk(scores, first, decay=0.2).tolist() == [[0, 1, 0]]
    assert select_candidates("prefix_first", scores, first, 0.75).tolist() == [[0, 0, 1]]
    assert select_candidates("viterbi", scores, first, 0.05).tolist() == [[0, 1, 0]]  # lambda is ignored
    assert select_candidates("geometric", scores, first, 0.05).tolist() == [[0, 0, 1]]
    assert select_candidates("geometric", scores, first, 0.75).tolist() == [[0, 1, 0]]

    # Viterbi may even change slot 1 (greedy never does): candidate 1 there opens a transition worth 20.
    first2 = torch.tensor([[1.0, 0.5]])
    scores2 = torch.tensor([[
        [[1.0, 0.0],
         [20.0, 0.0]],
        [[3.0, 0.0],
         [0.0, 2.0]],
    ]])
    assert prefix_first_walk(scores2).tolist() == [[0, 0, 0]]
    assert viterbi_walk(scores2, first2).tolist() == [[1, 0, 0]]
    # A small lambda does not protect slot 1: the first transition always has weight 1 in the geometric walk.
    assert viterbi_walk(scores2, first2, decay=0.05).tolist() == [[1, 0, 0]]

    # Scored from the anchor (correct_first_slot), the greedy walk starts where those scores say, then goes on
    # from that choice; the drafter's own sorted logits start it at candidate 0, as without them.
    assert prefix_first_walk(scores2, torch.tensor([[0.0, 1.0]])).tolist() == [[1, 0, 0]]
    assert prefix_first_walk(scores2, first2).tolist() == [[0, 0, 0]]
    assert select_candidates("greedy", scores2, torch.tensor([[0.0, 1.0]]), 0.75).tolist() == [[1, 0, 0]]
    # Blocks of 2 have no slot pair: only the anchor -> slot 1 scores choose.
    assert prefix_first_walk(torch.zeros(1, 0, 2, 2), torch.tensor([[0.0, 1.0]])).tolist() == [[1]]

    # Both tables in one batch: rows are walked independently.
    batch_scores, batch_first = torch.cat([scores, scores2]), torch.cat([first, first2])
    assert prefix_first_walk(batch_scores).tolist() == [[0, 0, 1], [0, 0, 0]]
    assert viterbi_walk(batch_scores, batch_first).tolist() == [[0, 1, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="unknown"):
        select_candidates("beam", scores, first, 0.75)


def test_walks_equal_brute_force_on_random_tables():
    generator = torch.Generator().manual_seed(0)
    for pairs, k in [(1, 3), (3, 4), (5, 3), (2, 5)]:
        scores = torch.randn(6, pairs, k, k, generator=generator) * 3
        first = torch.randn(6, k, generator=generator).sort(dim=-1, descending=True).values
        assert prefix_first_walk(scores).tolist() == _greedy_by_hand(scores)
        for decay in (1.0, 0.75, 0.3):
            assert viterbi_walk(scores, first, decay=decay).tolist() == _brute_force(scores, first, decay), decay


def test_bad_corpus_tables_are_refused(fitted):
    target, trained = fitted
    drafter = copy.deepcopy(trained).attach(target)
    vocab = drafter.config.vocab_size
    other = CorpusBigrams.count([(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.bool))], vocab_size=vocab + 1)
    with pytest.raises(ValueError, match=f"vocabulary of {vocab + 1}"):
        drafter.set_corpus_bigrams(other)
    with pytest.raises(ValueError, match="corpus_bigrams=0 must be the number of pairs counted"):
        DCOCOConfig(vocab_size=vocab, target_layer_ids=[0], corpus_bigrams=0)


def test_the_legacy_walk_name_greedy_still_loads_as_prefix_first():
    """Checkpoints before 0.2 wrote selection "greedy" (which also names greedy decoding); they load unchanged
    (tests/test_save_load.py loads a whole folder of that age)."""
    from dcoco_hf import DCOCOConfig
    from dcoco_hf.network.configuration_dcoco import DecodingChoices

    config = DCOCOConfig(target_layer_ids=[1])
    assert DecodingChoices.read({"selection": "greedy"}, config).selection == "prefix_first"
    scores = torch.tensor([[[[0.0, 2.0], [1.0, 0.0]]]])
    first = torch.tensor([[1.0, 0.0]])
    assert select_candidates("greedy", scores, first, 0.75).tolist() == select_candidates(
        "prefix_first", scores, first, 0.75).tolist()
    with pytest.raises(ValueError, match="unknown"):
        DecodingChoices.read({"selection": "beam"}, config)
