"""`DCOCOStats`, the one statistics type: hand-counted cycles, candidate coverage, merging, and who fills it."""

from __future__ import annotations

import pytest
import torch

from dcoco_hf import DCOCOStats


def test_chain_acceptance_counts_only_cycles_that_reached_the_slot():
    stats = DCOCOStats()  # no block given: the slot counters grow with the longest draft observed
    for drafted, accepted in [(3, 0), (3, 1), (3, 3), (3, 2), (2, 2)]:  # the last cycle was cut short at the end
        stats.observe_draft(drafted, accepted)
    assert stats.per_slot_accept() == [4 / 5, 3 / 5, 1 / 4]
    assert stats.chain_accept() == [4 / 5, 3 / 4, 1 / 2]  # slot 3 was reached by the cycles accepting 2 and 3
    assert stats.committed_tokens == (0 + 1) + (1 + 1) + (3 + 1) + (2 + 1) + (2 + 1)  # default: accepted + 1
    assert stats.accept_hist() == {"0": 1, "1": 1, "2": 2, "3": 1} and stats.mean_accepted == pytest.approx(8 / 5)


def test_coverage_books_the_longest_runs_of_top1_and_topk_slots():
    """Per cycle, slot s counts toward the ceiling only if slots 1..s all held the committed token in their top-K."""
    stats = DCOCOStats(block_size=4, top_k=2)
    blocks = [  # (candidates [S, K], the tokens finally committed at those slots)
        (torch.tensor([[1, 0], [0, 2], [3, 0]]), torch.tensor([1, 2, 3])),  # top-1, top-2, top-1
        (torch.tensor([[0, 7], [8, 0], [9, 0]]), torch.tensor([7, 8, 9])),  # slot 1 misses top-1: argmax run ends
        (torch.tensor([[0, 0], [9, 9], [9, 9]]), torch.tensor([9])),  # the sequence ended after slot 1
    ]
    for candidates, truth in blocks:
        stats.observe_candidates(candidates[: truth.shape[0]] == truth[:, None])
    assert stats.slot_seen == [3, 2, 2] and stats.slot_top1 == [1, 1, 2] and stats.slot_topk == [2, 2, 2]
    assert stats.prefix_top1 == [1, 0, 0] and stats.prefix_topk == [2, 2, 2]
    assert stats.prefix_walk == [1, 1, 1]  # the paper's walk keeps slot 1 at top-1: only the first cycle can go on
    assert stats.prefix_tau("top1") == pytest.approx(1 + 1 / 3)
    assert stats.prefix_tau("topk") == pytest.approx(1 + 2 / 3 + 2 / 2 + 2 / 2)
    assert stats.prefix_tau("walk") == pytest.approx(1 + 1 / 3 + 1 / 2 + 1 / 2)
    assert DCOCOStats(block_size=4, top_k=2).prefix_tau("topk") is None  # no cycle booked yet
    with pytest.raises(ValueError, match="runs='top2' is unknown"):
        stats.prefix_tau("top2")


def test_merging_sums_every_counter_across_block_sizes():
    """Runs drafted with blocks of 3 and 5 (the bench's @B methods) merge slot by slot; sum() gives the same."""
    short, long = DCOCOStats(3, 4), DCOCOStats(5, 4)
    short.observe_draft(2, 2, committed=3)
    long.observe_draft(4, 1, committed=2)
    long.observe_candidates(torch.tensor([[True, False], [False, True], [False, False], [False, False]]))
    short.target_forwards, long.target_forwards, short.corrector_seconds, long.corrector_seconds = 2, 3, 0.5, 0.25
    merged = short.merge(long)
    assert merged.slot_proposed == [2, 2, 1, 1] and merged.slot_accepted == [2, 1, 0, 0]
    assert merged.slot_reached == [2, 2, 0, 0] and merged.slot_seen == [1, 1, 1, 1]
    assert (merged.cycles, merged.committed_tokens, merged.target_forwards) == (2, 5, 5)
    assert merged.corrector_seconds == pytest.approx(0.75) and merged.accepted == [2, 1]
    assert sum([short, long], DCOCOStats()).as_dict() == merged.as_dict()


def test_one_statistics_type_is_filled_by_the_engines_and_the_bench():
    """The assisted engine, the batched loop and the benchmark's forward trace all book into `DCOCOStats`."""
    import inspect

    from dcoco_hf.cli import bench
    from dcoco_hf.runtime import candidate_generator
    from dcoco_hf.runtime import generation
    from dcoco_hf.runtime import stats
    for module in (bench, candidate_generator, generation):
        assert module.DCOCOStats is stats.DCOCOStats
    assert "observe_draft" in inspect.getsource(bench.ForwardTrace.acceptance)
    assert not hasattr(bench, "Acceptance")


def test_both_engines_book_the_prompts_forward_apart_from_the_cycles():
    """prefill_seconds is the time of the forward over the prompt (the only one starting at position 0), inside
    target_seconds; the bench's cycle share leaves it out."""
    from conftest import make_target

    from dcoco_hf import DCOCODrafter, speculative_generate

    target = make_target("llama")
    drafter = DCOCODrafter.from_target(target, block_size=4, top_k=4).eval()
    ids = torch.randint(1, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assisted = drafter.generation_stats(target.generate(ids, assistant_model=drafter, max_new_tokens=12,
                                                        do_sample=False))
    batched = speculative_generate(target, ids, drafter=drafter, max_new_tokens=12, do_sample=False,
                                   pad_token_id=0).stats[0]
    for stats in (assisted, batched):
        assert stats.target_forwards > 1
        assert 0 < stats.prefill_seconds < stats.target_seconds
        assert stats.as_dict()["prefill_seconds"] == stats.prefill_seconds
