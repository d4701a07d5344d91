"""Per-cycle proposal length (dcoco_hf/runtime/proposal.py): the cost model, the acceptance fit, the choice, and
exactness of `generate(assistant_model=drafter)` under the cost-aware schedule, with plain steps (k = 0) and full
blocks."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from copy import deepcopy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sampling_reference import (
    T,
    exact_distribution,
    histogram,
    iid_tv_quantiles,
    peaked_target,
    random_drafter,
    total_variation,
)
from test_sampling import SETTINGS, speculative_samples
from transformers import StoppingCriteria, StoppingCriteriaList

import dcoco_hf.runtime.candidate_generator as candidate_generator
import dcoco_hf.runtime.proposal as proposal_module
from dcoco_hf import DCOCOStats
from dcoco_hf.runtime.acceptance import (
    AcceptanceModel,
    chain_labels,
    chain_prior,
    draftable_share,
    slot_confidence,
)
from dcoco_hf.runtime.costs import CycleCosts, cheapest_cover, isotonic
from dcoco_hf.runtime.proposal import (
    MAX_PLAIN_RUN,
    PROBE_EVERY,
    ConstantSchedule,
    CostModel,
    CostSchedule,
    Draft,
    HeuristicSchedule,
    Proposal,
    Verified,
    check_schedule,
    fastest,
    next_plain_run,
)

# Cycle costs of three kinds of machine, in seconds (8 verify widths: the fitted drafter drafts blocks of 8).
FREE_VERIFY = CycleCosts(verify=[1.0] * 8, draft={8: 1e-9})  # a GPU: k = every slot, and drafting always pays
# drafting never wins a plain step
NEVER_PAYS = CycleCosts(verify=[1.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0], draft={8: 5.0})
CPU_LIKE = CycleCosts(verify=[1.0, 1.4, 1.6, 1.75, 1.9, 2.0, 2.1, 2.2], draft={8: 0.3})


# ------------------------------------------------------------------------------------------------ the parts


def test_isotonic_fit_is_monotone_and_keeps_sorted_input():
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([5.0, 1.0, 1.0]) == pytest.approx([7 / 3] * 3)


def test_cycle_costs_fit_round_trip_and_refuse_other_shapes():
    costs = CycleCosts.fit({1: [1.0, 1.1, 0.9, 1.0], 2: [0.9, 1.0, 1.0, 5.0], 3: [2.0] * 4},
                           {2: [0.1] * 4, 4: [0.2] * 4})
    assert costs.verify == [1.0, 1.0, 2.0]
    assert costs.cycle(0, 4) == 1.0 and costs.cycle(2, 4) == 0.2 + 2.0 and costs.cycle(1, 2) == 0.1 + 1.0
    assert CycleCosts.from_dict(costs.to_dict()) == costs
    for bad in (None, [], 5, "x", {"verify": [1.0], "draft": {}}, {"verify": [1.0, 2.0, 1.5], "draft": {"2": 1.0}},
                {"verify": [0.0], "draft": {"2": 1.0}}, {"verify": [1.0], "draft": {"99": 1.0}},
                {"verify": [float("nan")], "draft": {"2": 1.0}}):
        with pytest.raises((ValueError, TypeError)):
            CycleCosts.from_dict(bad)
    # a verify of 2 columns timed below a plain step is what it is (the few-rows layouts against 1-row F.linear)
    assert CycleCosts.from_dict({"verify": [1.0, 0.7, 0.8], "draft": {"2": 0.1}}).verify == [1.0, 0.7, 0.8]


def test_a_width_costs_the_cheapest_forward_that_covers_it():
    # 4 columns timed cheaper than 3 (a SIMD-wide tile): 3 is priced as 4, and the plan proposes 3 tokens there.
    assert cheapest_cover([1.0, 1.2, 1.6, 1.3, 2.0]) == [1.0, 1.2, 1.3, 1.3, 2.0]
    # a few-column forward may cost less than a plain step (1-row F.linear): priced as timed, its rise kept
    assert cheapest_cover([1.0, 0.65, 0.8, 0.8, 0.95]) == [1.0, 0.65, 0.8, 0.8, 0.95]
    assert cheapest_cover([1.0, 0.8, 0.7, 1.5]) == [1.0, 0.7, 0.7, 1.5]
    costs = CycleCosts.fit({1: [1.0] * 3, 2: [1.2] * 3, 4: [2.0] * 3, 8: [1.8] * 3, 9: [2.5] * 3}, {2: [0.1] * 3})
    assert costs.verify == pytest.approx([1.0, 1.2, 1.6, 1.8, 1.8, 1.8, 1.8, 1.8, 2.5])  # 3 interpolated, 4..7 as 8
    assert CycleCosts.from_dict(costs.to_dict()) == costs


def test_chain_prior_follows_block_tau():
    # tau(2) = 1.5: slot 1 accepted half the time; tau(3) = 1.75: slot 2 half the time after slot 1.
    assert chain_prior({"2": 1.5, "3": 1.75}, 3) == pytest.approx([0.5, 0.5, 0.5])
    assert chain_prior({"2": 1.8, "3": 2.16}, 2) == pytest.approx([0.8, 0.45])
    flat = chain_prior({"2": 1.4, "3": 1.4}, 2)  # a slot that adds nothing: a small floor, not zero
    assert flat[0] == pytest.approx(0.4) and 0 < flat[1] <= 0.05
    assert chain_prior(None, 3) == [0.5] * 3


def test_chain_labels_stop_at_the_first_wrong_slot():
    assert chain_labels([5, 6, 7], [5, 6, 7]) == [True, True, True]
    assert chain_labels([5, 6, 7], [5, 9, 7]) == [True, False]
    assert chain_labels([5, 6, 7], [5]) == [True]  # the rest is not committed yet
    assert chain_labels([5, 6], []) == []


def test_slot_confidence_reads_the_walks_scores():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]])  # [B=1, S=3, K=2]
    chosen = torch.tensor([[0, 1, 0]])
    plain = slot_confidence(logits, chosen, None, None)
    assert plain[0].tolist() == pytest.approx([torch.sigmoid(torch.tensor(2.0)).item(), 0.5, 0.5])
    transitions = torch.zeros(1, 2, 2, 2)
    transitions[0, 0, 0] = torch.tensor([0.0, 3.0])  # from slot 1's candidate 0, slot 2's candidate 1 is likely
    transitions[0, 1, 1] = torch.tensor([-3.0, 0.0])  # from slot 2's candidate 1, slot 3's candidate 0 is not
    first = torch.tensor([[0.0, 0.0]])
    corrected = slot_confidence(logits, chosen, transitions, first)[0]
    sig3 = torch.sigmoid(torch.tensor(3.0)).item()
    assert corrected.tolist() == pytest.approx([0.5, sig3, 1 - sig3])


def test_acceptance_fit_learns_what_the_prior_does_not_know():
    model = AcceptanceModel([0.5, 0.5])
    assert model.predict([0.9, 0.9], recent=0.5) == pytest.approx([0.5, 0.5])
    for _ in range(300):  # confident slots are right, unsure ones wrong
        model.observe([0.95, 0.95], 0.5, [True, True])
        model.observe([0.2, 0.2], 0.5, [False])
    sure, unsure = model.predict([0.95, 0.95], 0.5), model.predict([0.2, 0.2], 0.5)
    assert sure[0] > 0.8 and unsure[0] < 0.2 and model.weights[0] > 0
    # A call whose drafts keep failing lowers every slot's prediction, and so does text the draft vocabulary lacks.
    assert model.predict([0.95, 0.95], recent=0.05)[0] < sure[0]
    fresh = AcceptanceModel([0.5, 0.5])
    assert fresh.predict([0.9], recent=0.5, draftable=0.25)[0] < 0.5 * fresh.predict([0.9], recent=0.5)[0]


def test_draftable_share_reads_the_draft_vocabulary():
    assert draftable_share([1, 2, 3, 9], frozenset({1, 2, 3})) == 0.75
    assert draftable_share([1, 2], None) == 1.0 and draftable_share([], frozenset({1})) == 1.0


# ------------------------------------------------------------------------------------------- the schedules


def _model(costs, slots=7, block_tau=None):
    """A cost model whose acceptance predicts each slot's confidence itself (bias 0, confidence weight 1, the other
    features off)."""
    acceptance = AcceptanceModel([0.5] * slots)
    acceptance.weights = [1.0, 0.0, 0.0]
    return CostModel(costs, acceptance, block_tau or {})


def _draft(confidence, cap=7, rows=(0,)):
    """A drafted block whose slots' walk scores give them these confidences (two candidates per slot, the first
    chosen), one row per entry of `rows`."""
    logit = torch.logit(torch.tensor(confidence, dtype=torch.float64))
    logits = torch.stack([logit, torch.zeros_like(logit)], -1)[None].expand(len(rows), -1, -1)  # [b, S, 2]
    chosen = torch.zeros(len(rows), len(confidence), dtype=torch.long)
    proposal = SimpleNamespace(candidate_logits=logits, chosen=chosen, transition_scores=None, first_slot_scores=None,
                               tokens=torch.arange(len(confidence)).expand(len(rows), -1))
    return Draft(proposal, list(rows), cap)


def _schedule(model, rows=1, cap=7, floor=0.0):
    return CostSchedule(model, rows, cap, floor, [[] for _ in range(rows)], [DCOCOStats() for _ in range(rows)])


def test_the_proposal_trades_expected_tokens_against_cycle_costs():
    predicted = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    assert _schedule(_model(FREE_VERIFY)).propose(_draft(predicted)) == Proposal(7)
    cpu = _schedule(_model(CPU_LIKE)).propose(_draft(predicted)).k
    assert 1 < cpu < 7
    assert _schedule(_model(CPU_LIKE)).propose(_draft(predicted, cap=2)).k <= 2  # the cap
    assert _schedule(_model(FREE_VERIFY), floor=0.65).propose(_draft(predicted)).k == 3  # the floor
    assert _schedule(_model(NEVER_PAYS)).propose(_draft([0.1] * 7)).k == 1  # a cycle that drafted proposes one
    assert _schedule(_model(None), cap=5).propose(_draft([0.1] * 7, cap=5)).k == 5  # untuned: every slot
    # One rule prices every option: the k of most expected tokens per second.
    assert fastest([1.5, 2.0, 2.2], [1.0, 1.2, 1.6]) == 1 and fastest([1.0, 1.0], [1.0, 1.0]) == 0


def test_the_block_is_dscouts_per_machine():
    """tau(B) / T(B) with the drafter's recorded tau and this machine's costs; capped by num_assistant_tokens;
    without tau per block the largest timed block, untuned the largest allowed."""
    costs = CycleCosts(verify=[1.0, 1.0, 1.0, 1.0, 1.5, 1.8, 2.0, 2.2], draft={2: 0.1, 3: 0.15, 4: 0.2, 8: 0.4})
    tau = {2: 1.5, 3: 1.7, 4: 1.8, 8: 2.0}
    assert _model(costs, block_tau=tau).machine_block(1, cap=7) == 4  # 1.8 / 1.2 beats 2.0 / 2.6 and 1.7 / 1.15
    assert _model(costs, block_tau=tau).machine_block(1, cap=2) == 3
    assert _model(FREE_VERIFY, block_tau={8: 2.0}).machine_block(1, cap=7) == 8
    assert _model(costs).machine_block(1, cap=7) == 8
    assert _model(None).machine_block(1, cap=5) == 6


def test_a_call_drafts_the_block_its_own_drafts_forecast_fastest():
    """Where 2 verify columns cost less than 4 (a CPU's few-rows layouts), a call starts with DScout's block and, after
    RECENT_DRAFTS drafts, drafts the block its drafts forecast fastest: longer where slots are mostly right, shorter
    where they mostly fail; the choice holds for the next RECENT_DRAFTS drafts."""
    costs = CycleCosts(verify=[1.0, 0.6, 0.8, 0.8, 0.95], draft={2: 0.1, 4: 0.2})
    tau = {2: 1.5, 4: 1.8}  # DScout: 1.5 / 0.7 beats 1.8 / 1.0

    def after_drafts(confidence: list[float]) -> list[int]:
        call = _schedule(_model(costs, block_tau=tau))
        blocks = []
        for _ in range(2 * proposal_module.RECENT_DRAFTS):
            blocks.append(call.block([0], may_skip=False))
            call.propose(_draft(confidence))
        return blocks

    first = proposal_module.RECENT_DRAFTS
    sure, unsure = after_drafts([0.9] * 3), after_drafts([0.2] * 3)
    assert sure[:first] == unsure[:first] == [2] * first  # the machine's block until the call has evidence
    assert sure[first:] == [4] * first  # (1 + .9 + .81 + .73) / 1.0 beats (1 + .9) / 0.7
    assert unsure[first:] == [2] * first  # (1 + .2) / 0.7 beats the best k of 4: (1 + .2) / 0.8


def test_plain_steps_run_while_recent_drafts_do_not_pay():
    """Drafts that fail make the next cycles plain steps, in runs that double; drafts that pay keep drafting; before
    any draft the recorded tau decides."""
    hopeless = _schedule(_model(NEVER_PAYS, block_tau={8: 1.2}))
    assert hopeless.block([0]) is None  # tau 1.2 in a cycle of 11 plain steps: not worth a draft
    hopeful = _schedule(_model(CPU_LIKE, block_tau={8: 4.0}))
    assert hopeful.block([0]) == 8
    hopeful.propose(_draft([0.05] * 7))  # a draft the fit says will fail
    hopeful.verified(Verified([0], 1, [0], [[5]]))
    runs = [hopeful.block([0]) for _ in range(1 + 2 + 4)]
    assert runs == [None] * 7 and hopeful.plain_run == 4  # runs of 1, 2, 4 plain steps
    sure = _schedule(_model(CPU_LIKE))
    sure.propose(_draft([0.99] * 7))
    assert sure.block([0]) == 8
    assert sure.block([0], may_skip=False) == 8  # a loop that must draft is told the block whatever the plan


def test_cycles_slower_than_timed_teach_the_loop_and_one_slow_cycle_does_not_price_drafting_out():
    model = _model(CPU_LIKE)
    assert model.loop(1, "chain") == model.loop(1, "plain") == 0.0  # nothing seen yet
    for _ in range(40):  # chain cycles take 0.8 s more than their timed draft and verify, plain steps run as timed
        model.observe_loop(0.8, 1, "chain")
        model.observe_loop(0.0, 1, "plain")
    assert model.loop(1, "chain") == pytest.approx(0.8, abs=0.06) and model.loop(1, "plain") < 0.05
    assert model.loop(1, "tree") == model.loop(1, "plain")  # an unseen kind starts from the plain steps'
    assert model.cycle_seconds(8, 1)[3] == pytest.approx(0.3 + 1.75 + model.loop(1, "chain"))
    fresh = _model(CPU_LIKE)
    for _ in range(10):
        fresh.observe_loop(0.01, 1, "plain")
    fresh.observe_loop(5.0, 1, "chain")  # a hiccup of 5 s over a 1 s plain step
    assert fresh.loop(1, "chain") < 0.25  # (4 prior cycles at ~0.01 + one capped at 1.0) / 5


def test_the_simple_schedules():
    constant = ConstantSchedule(5)
    assert constant.block([0]) == 5 and constant.propose(_draft([0.1] * 4, cap=4)) == Proposal(4)
    heuristic = HeuristicSchedule(tokens=3, largest=8)
    assert heuristic.block([0]) == 4 and heuristic.propose(_draft([0.5] * 3, cap=7)) == Proposal(3)
    heuristic.verified(Verified([0], 3, [3], [[1, 2, 3, 4]]))  # all accepted: two more
    assert heuristic.tokens == 5 and heuristic.block([0]) == 6
    heuristic.verified(Verified([0], 5, [2], [[1, 2, 3]]))  # not all: one fewer
    assert heuristic.tokens == 4
    for _ in range(10):
        heuristic.verified(Verified([0], 1, [0], [[1]]))
    assert heuristic.tokens == 1  # at least one


def test_plain_runs_double_while_drafting_does_not_pay():
    runs, run = [], 0
    for gain in [0.5] * 7 + [1.2, 0.5]:
        run = next_plain_run(gain, run)
        runs.append(run)
    assert runs == [1, 2, 4, 8, 16, MAX_PLAIN_RUN, MAX_PLAIN_RUN, 0, 1]


def test_unknown_schedule_names_the_choices():
    assert check_schedule("cost") == "cost"
    with pytest.raises(ValueError, match="choose one of"):
        check_schedule("fastest")


# ------------------------------------------------------------------------------------- through generate()


@contextmanager
def schedule(drafter, name: str = "cost", costs: CycleCosts | None = None, **generation):
    """Run the drafter under schedule `name` (with `costs`, a fresh acceptance fit) and these generation-config
    values, then restore it."""
    config = drafter.generation_config
    saved = {key: getattr(config, key) for key in ["num_assistant_tokens_schedule", *generation]}
    config.num_assistant_tokens_schedule = name
    for key, value in generation.items():
        setattr(config, key, value)
    drafter._cost_model = None
    drafter.cycle_costs = costs
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)
        drafter._cost_model = None


def _prompt(seed: int, length: int, vocab: int) -> torch.LongTensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _greedy_cases(target, drafter, seeds, max_new_tokens=40, **kwargs):
    """Greedy outputs with the drafter equal plain generate()'s; returns the merged statistics."""
    total = None
    for seed in seeds:
        ids = _prompt(seed, 6, target.config.vocab_size)
        expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        got = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter, **kwargs)
        assert got.tolist() == expected.tolist(), seed
        stats = drafter.generation_stats(got)
        assert stats.committed_tokens == got.shape[1] - ids.shape[1]
        total = stats if total is None else total.merge(stats)
    return total


@pytest.mark.parametrize("costs, expect", [(NEVER_PAYS, "plain"), (FREE_VERIFY, "full"), (CPU_LIKE, "mixed")])
def test_greedy_is_exact_under_the_cost_aware_schedule(fitted, costs, expect):
    target, drafter = fitted
    with schedule(drafter, costs=costs):
        stats = _greedy_cases(target, drafter, range(8))
    lengths = stats.proposal_lengths
    if expect == "plain":  # plain steps instead of most drafts: cheap when drafting cannot pay
        assert lengths[0] > 2 * sum(lengths[1:]), lengths
        assert stats.target_forwards >= stats.committed_tokens - sum(stats.accepted)
    elif expect == "full":  # every slot proposed, full blocks accepted
        assert len(lengths) == 8 and lengths[7] > 0 and not lengths[0], lengths
        assert max(stats.accepted) == 7
    else:  # plain steps where the plan says drafting does not pay, drafts where it does
        assert lengths[0] > 0 and sum(lengths[1:]) > 0, lengths
    predicted, observed = stats.as_dict()["predicted_accept"], stats.as_dict()["observed_accept"]
    assert predicted[0] is not None and observed[0] is not None and stats.slot_labelled[0] > 0


def test_plain_steps_and_full_blocks_in_one_call_stay_exact(fitted, monkeypatch):
    """Alternate plain steps and whole blocks inside each call (k = 0 and k = max), with EOS and a custom stopping
    criterion landing anywhere."""
    target, drafter = fitted
    monkeypatch.setattr(proposal_module, "next_plain_run", lambda gain, run: 0 if run else 2)

    class StopAtLength(StoppingCriteria):
        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    with schedule(drafter, costs=FREE_VERIFY):
        stats = _greedy_cases(target, drafter, range(20, 26), max_new_tokens=45)
        assert stats.proposal_lengths[0] > 5 and stats.proposal_lengths[7] > 5, stats.proposal_lengths
        for seed in range(30, 34):
            ids = _prompt(seed, 6, target.config.vocab_size)
            free = target.generate(ids, max_new_tokens=30, do_sample=False)
            eos = int(free[0, ids.shape[1] + 9 + seed % 5])
            criteria = StoppingCriteriaList([StopAtLength(ids.shape[1] + 13 + seed % 7)])
            for kwargs in ({"eos_token_id": eos}, {"stopping_criteria": criteria}):
                expected = target.generate(ids, max_new_tokens=30, do_sample=False, **kwargs)
                got = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, **kwargs)
                assert got.tolist() == expected.tolist(), (seed, kwargs)


def _rotating_blocks(monkeypatch, sizes=(2, 8, 4, 3)):
    """Make the cost-aware schedule draft each of `sizes` in turn (the costs would pick one)."""
    turn = iter(range(10**6))
    monkeypatch.setattr(CostSchedule, "_call_block", lambda self, rows: sizes[next(turn) % len(sizes)])


def test_greedy_is_exact_whatever_block_each_cycle_drafts(fitted, monkeypatch):
    target, drafter = fitted
    _rotating_blocks(monkeypatch)
    with schedule(drafter, costs=CycleCosts(verify=[1.0] * 8, draft={b: 0.01 for b in (2, 3, 4, 8)})):
        stats = _greedy_cases(target, drafter, range(70, 76))
    assert all(stats.drafted_blocks[b] > 2 for b in (2, 3, 4, 8)), stats.drafted_blocks
    assert max(stats.accepted) > 1 and stats.proposal_lengths[7] > 0  # short and whole blocks both proposed


def test_transformers_knobs_cap_and_floor_the_proposal(fitted):
    target, drafter = fitted
    with schedule(drafter, costs=FREE_VERIFY, num_assistant_tokens=3):
        stats = _greedy_cases(target, drafter, range(40, 44))
    assert len(stats.proposal_lengths) <= 4 and stats.proposal_lengths[3] > 0  # num_assistant_tokens caps k
    with schedule(drafter, costs=FREE_VERIFY, assistant_confidence_threshold=0.999):
        floored = _greedy_cases(target, drafter, range(40, 44))
    assert floored.proposal_lengths[1] > sum(floored.proposal_lengths[2:])  # hardly any slot clears the floor
    with schedule(drafter, "heuristic", costs=CPU_LIKE, num_assistant_tokens=2):
        heuristic = _greedy_cases(target, drafter, range(40, 44))
    assert sum(n > 0 for n in heuristic.proposal_lengths) >= 2  # transformers' rule moves k between cycles
    with schedule(drafter, "constant", costs=CPU_LIKE, num_assistant_tokens=5):
        constant = _greedy_cases(target, drafter, range(40, 44))
    lengths = constant.proposal_lengths
    assert len(lengths) == 6 and lengths[5] >= 0.9 * sum(lengths)  # shorter only where max_new_tokens cuts in


def test_the_acceptance_fit_is_kept_across_calls(fitted):
    target, drafter = fitted
    with schedule(drafter, costs=CPU_LIKE):
        _greedy_cases(target, drafter, range(50, 52))
        seen = drafter.cost_model.acceptance.observed
        _greedy_cases(target, drafter, range(52, 54))
        assert seen > 0 and drafter.cost_model.acceptance.observed > seen
        # A schedule assigned for a while (a copy per setting) learns in place of the drafter's own.
        own, kept = drafter.cost_model, deepcopy(drafter.cost_model)
        drafter.cost_model = kept
        _greedy_cases(target, drafter, range(54, 56))
        assert kept.acceptance.observed > own.acceptance.observed
        drafter.cost_model = own
        assert drafter.cost_model is own
    with pytest.raises(TypeError, match="CostModel"):
        drafter.cost_model = {"costs": None}


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_sampling_is_exact_with_plain_steps_and_full_blocks(setting, monkeypatch):
    """The sampling test of tests/test_sampling.py under the cost-aware schedule, every other cycle a plain step."""
    target = peaked_target()
    drafter = random_drafter(target, 24, soft=True)
    monkeypatch.setattr(proposal_module, "next_plain_run", lambda gain, run: 0 if run else 1)
    kwargs = SETTINGS[setting]
    probs = exact_distribution(target, kwargs)
    n = 400
    q01, q99 = iid_tv_quantiles(probs, n)
    lengths = np.zeros(T + 1, dtype=int)
    with schedule(drafter, costs=CycleCosts(verify=[1.0] * 3, draft={3: 0.01})):
        torch.manual_seed(99)
        samples = []
        for _ in range(n):
            out = speculative_samples(target, drafter, kwargs, 1)
            samples.append(out)
            counts = drafter.generation_stats(out).proposal_lengths
            lengths[: len(counts)] += counts
    spec_tv = total_variation(histogram(torch.cat(samples)), probs)
    assert spec_tv < q99, (spec_tv, q01, q99)
    assert lengths[0] > 0.05 * n and lengths[2] > 0.05 * n, lengths  # plain steps and full blocks both ran


@pytest.mark.parametrize("costs", [NEVER_PAYS, FREE_VERIFY, CPU_LIKE], ids=["plain", "full", "mixed"])
def test_batched_loop_is_exact_under_the_cost_aware_schedule(fitted, costs, monkeypatch):
    """speculative_generate: one k per batched cycle, plain steps included, ragged rows, same tokens as plain
    batched generate() (chains: tests/test_trees.py has the trees)."""
    from dcoco_hf import speculative_generate

    target, drafter = fitted
    prompts = [_prompt(60 + i, 3 + 2 * i, target.config.vocab_size)[0] for i in range(4)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    attention_mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    with schedule(drafter, costs=costs, tree_budget=0):
        out = speculative_generate(target, ids, attention_mask=attention_mask, drafter=drafter, max_new_tokens=30)
    assert out.sequences.tolist() == expected.tolist()
    lengths = [sum(column) for column in zip(*(_padded(s.proposal_lengths, 8) for s in out.stats))]
    if costs is NEVER_PAYS:
        assert lengths[0] > sum(lengths[1:]), lengths
    elif costs is FREE_VERIFY:
        assert lengths[7] > 0 and not lengths[0], lengths
    for row, stats in zip(range(4), out.stats):
        assert stats.committed_tokens == 30, (row, stats.as_dict())


def test_batched_loop_is_exact_whatever_block_each_cycle_drafts(fitted, monkeypatch):
    from dcoco_hf import speculative_generate

    target, drafter = fitted
    _rotating_blocks(monkeypatch)
    prompts = [_prompt(80 + i, 4 + 3 * i, target.config.vocab_size)[0] for i in range(3)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    attention_mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    with schedule(drafter, costs=CycleCosts(verify=[1.0] * 8, draft={b: 0.01 for b in (2, 3, 4, 8)})):
        out = speculative_generate(target, ids, attention_mask=attention_mask, drafter=drafter, max_new_tokens=30)
    assert out.sequences.tolist() == expected.tolist()
    blocks = _padded(sum(out.stats, DCOCOStats()).drafted_blocks, 9)
    assert all(blocks[b] > 0 for b in (2, 3, 4, 8)), blocks


def _padded(values, width):
    return list(values) + [0] * (width - len(values))


def test_plain_steps_leave_no_hole_in_the_drafters_context(fitted, monkeypatch):
    """After the longest stretch of plain steps (runs planned one after another up to PROBE_EVERY steps), the next
    draft reads every committed row: the drafter cache holds one row per position, with no gap where the plain steps
    were."""
    target, drafter = fitted
    monkeypatch.setattr(proposal_module, "next_plain_run", lambda gain, run: MAX_PLAIN_RUN)
    seen = []
    original = candidate_generator.DCOCOCandidateGenerator._new_context

    def recording(self, committed):
        context, positions = original(self, committed)
        seen.append((self.cache.get_seq_length(), positions.tolist(), committed.shape[0]))
        return context, positions

    monkeypatch.setattr(candidate_generator.DCOCOCandidateGenerator, "_new_context", recording)
    with schedule(drafter, costs=CPU_LIKE):
        _greedy_cases(target, drafter, [70], max_new_tokens=2 * PROBE_EVERY + 30)
    assert len(seen) >= 3 and max(b[2] - a[2] for a, b in itertools.pairwise(seen)) > PROBE_EVERY
    for cached, positions, length in seen[1:]:
        # the new rows continue the cached ones without a gap, up to just before the anchor
        assert positions == list(range(cached, length - 1)), (cached, positions, length)


def test_a_batched_call_that_drafting_cannot_pay_for_is_plain_generate(fitted, monkeypatch):
    """Where even the drafter's recorded tau is not expected to beat plain steps at the call's batch size, the whole
    call runs transformers' own decoding loop: the same tokens (greedy, and sampling under one seed), no draft, and
    statistics that count plain steps; where it is expected to pay, the call drafts."""
    from dcoco_hf import speculative_generate

    target, drafter = fitted
    prompts = [_prompt(90 + i, 4 + 2 * i, target.config.vocab_size)[0] for i in range(3)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    drafts = []
    real_propose = type(drafter).propose
    monkeypatch.setattr(type(drafter), "propose", lambda self, *a, **k: drafts.append(1) or real_propose(self, *a, **k))
    with schedule(drafter, costs=NEVER_PAYS, tree_budget=0):
        drafter.cost_model.block_tau = {8: 1.5}  # 1.5 tokens for a cycle of 11 plain steps
        for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 0.8}):
            torch.manual_seed(3)
            expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, **sampling)
            torch.manual_seed(3)
            out = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20,
                                       **sampling)
            assert out.sequences.tolist() == expected.tolist(), sampling
            assert all(s.proposal_lengths == [20] and s.committed_tokens == 20 and s.tau == 1.0 for s in out.stats)
        assert not drafts
        drafter.cost_model.block_tau = {8: 12.0}  # now a draft is expected to pay for its cycle
        out = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20)
    assert drafts and out.sequences.tolist() == target.generate(ids, attention_mask=mask, max_new_tokens=20,
                                                               do_sample=False).tolist()
