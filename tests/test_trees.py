"""Draft trees scored by the corrector (dcoco_hf/runtime/trees.py) in the batched loop: the best-first tree, its
verification in one target forward, and exactness against plain generate() for trees of every shape.

Greedy: identical tokens for bushy, deep and single-path trees, ragged batches, EOS and max_new_tokens inside a
branch, static and dynamic caches, sliding-window targets, the LiLiCorr and DFlash2 correctors and a drafter without
corrector. Sampling: the batched rows' distribution at the plain-vs-plain TV floor. A tree that is a single path is
the chain, through the same code (same tokens, same accepted counts).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, fit_drafter, make_target, scrambled
from sampling_reference import (
    PROMPT,
    T,
    exact_distribution,
    histogram,
    iid_tv_quantiles,
    peaked_target,
    random_drafter,
    total_variation,
)
from test_batched import PAD, SETTINGS, left_padded
from test_lilicorr import lilicorr_copy, randomise

from dcoco_hf import DCOCOStats, speculative_generate
from dcoco_hf.runtime import trees as trees_module
from dcoco_hf.runtime.acceptance import AcceptanceModel, NodeFeatures, PlannedTree, tree_expected
from dcoco_hf.runtime.costs import CycleCosts
from dcoco_hf.runtime.proposal import CostModel, CostSchedule, Draft, Proposal
from dcoco_hf.runtime.target_cache import reorder_block
from dcoco_hf.runtime.trees import TreeNode, best_first, chain_of, path_order, tree_scores

# ------------------------------------------------------------------------------------------------ the tree


def _log_probs(rows: list[list[float]]) -> list[list[float]]:
    return [[math.log(p / sum(row)) for p in row] for row in rows]


def _random_scores(seed: int, slots: int, k: int):
    generator = torch.Generator().manual_seed(seed)
    first = torch.log_softmax(torch.randn(k, generator=generator) * 2, -1).tolist()
    transitions = torch.log_softmax(torch.randn(slots - 1, k, k, generator=generator) * 2, -1).tolist()
    marginals = torch.log_softmax(torch.randn(slots, k, generator=generator) * 2, -1).tolist()
    return first, transitions, marginals


def _every_path(first, transitions, slots: int, k: int) -> dict[tuple[int, ...], float]:
    """Every path of every length by brute force: its candidates per slot -> its log-probability."""
    paths = {}
    for length in range(1, slots + 1):
        for choice in itertools.product(range(k), repeat=length):
            score = first[choice[0]] + sum(transitions[p][choice[p]][choice[p + 1]] for p in range(length - 1))
            paths[choice] = score
    return paths


@pytest.mark.parametrize("seed", range(6))
def test_best_first_takes_the_most_likely_nodes_with_their_ancestors(seed):
    slots, k, budget = 4, 3, 11
    first, transitions, marginals = _random_scores(seed, slots, k)
    nodes = best_first(first, transitions, marginals, budget)
    assert len(nodes) == budget
    # Ancestors first, scores never rising along a path, and each node's path score as its path says.
    paths = []
    for node in nodes:
        path = (node.candidate,) if node.parent < 0 else (*paths[node.parent], node.candidate)
        assert node.parent < len(paths) and len(path) == node.slot + 1
        paths.append(path)
    everything = _every_path(first, transitions, slots, k)
    for node, path in zip(nodes, paths):
        assert node.log_prob == pytest.approx(everything[path])
    # The N best nodes of the whole tree (brute force), up to ties.
    best = sorted(everything.values(), reverse=True)[:budget]
    assert sorted((n.log_prob for n in nodes), reverse=True) == pytest.approx(best)
    # The chain is the all-rank-0 path: every node on it is its parent's best child.
    for node, path in zip(nodes, paths):
        scores = first if node.parent < 0 else transitions[node.slot - 1][paths[node.parent][-1]]
        on_best = node.candidate == max(range(k), key=scores.__getitem__)
        parent_on_chain = node.parent < 0 or nodes[node.parent].on_chain
        assert node.on_chain == (on_best and parent_on_chain)
        assert node.sibling_share == pytest.approx(math.exp(scores[node.candidate] - max(scores)))


def test_without_a_corrector_every_parent_has_the_slots_marginals():
    first, _, marginals = _random_scores(1, 3, 3)
    nodes = best_first(marginals[0], None, marginals, 9)
    for node in nodes:
        assert node.confidence == pytest.approx(math.exp(marginals[node.slot][node.candidate]))


def test_a_peaked_chain_makes_a_single_path_tree_equal_to_the_walk():
    """When every successor distribution is peaked, the budget's best nodes are the walk's block: the tree is a
    single path, node i under node i - 1, each its parent's best child."""
    k, slots = 4, 5
    first = _log_probs([[0.97, 0.01, 0.01, 0.01]])[0]
    transitions = [_log_probs([[0.01] * 4 for _ in range(4)]) for _ in range(slots - 1)]
    for p in range(slots - 1):  # candidate (p + 1) % k is every candidate's best successor at slot p + 1
        transitions[p] = _log_probs([[0.97 if c == (p + 1) % k else 0.01 for c in range(k)] for _ in range(k)])
    nodes = best_first(first, transitions, [[0.0] * k] * slots, slots)
    assert [n.parent for n in nodes] == [-1, 0, 1, 2, 3] and all(n.on_chain for n in nodes)
    assert [n.candidate for n in nodes] == [0, 1, 2, 3, 0]


def test_path_order_puts_the_accepted_path_first():
    path = torch.tensor([[0, 2, 5, 5, 5], [0, 1, 3, 4, 6], [0, 0, 0, 0, 0]])
    order = path_order(path, 7)
    assert order.tolist() == [[0, 2, 5, 1, 3, 4, 6], [0, 1, 3, 4, 6, 2, 5], [0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("static", [False, True])
def test_reorder_block_moves_the_last_forwards_columns_in_place(static):
    from dcoco_hf.runtime.target_cache import static_target_cache
    from transformers import DynamicCache

    cache = static_target_cache(16) if static else DynamicCache()
    keys = torch.arange(2 * 1 * 9 * 2, dtype=torch.float).view(2, 1, 9, 2)
    cache.update(keys, -keys, 0)
    order = torch.tensor([[0, 3, 1, 2], [0, 1, 2, 3]])
    reorder_block(cache, order)
    layer = cache.layers[0]
    assert torch.equal(layer.keys[:, :, :5], keys[:, :, :5])  # the cached context is untouched
    assert torch.equal(layer.keys[0, 0, 5:], keys[0, 0, 5:][[0, 3, 1, 2]])
    assert torch.equal(layer.keys[1, 0, 5:], keys[1, 0, 5:])
    assert torch.equal(layer.values, -layer.keys)


# ------------------------------------------------------------------------------------------------ the choice


def _bushy_tree(siblings: int, confidence: float) -> PlannedTree:
    """`siblings` children of the anchor at slot 1 (the first on the chain), each as likely as the best."""
    nodes = [NodeFeatures(0, confidence, 1.0, False) for _ in range(siblings)]
    return PlannedTree.of(nodes, [-1] * siblings)


def _tree_choice(costs: CycleCosts, tree_node: float, model: CostModel | None = None) -> tuple[Proposal, float]:
    """What the cost-aware schedule verifies of a draft whose chain's slots are accepted with chances 0.8, 0.6, 0.5,
    0.4, 0.3, ... and whose tree has 16 nodes under the anchor, each accepted with chance `tree_node` (each adds that
    many expected tokens); and the choice's expected tokens per second."""
    model = model or CostModel(costs, AcceptanceModel([0.5] * 7))
    model.acceptance.weights, model.acceptance.node_weights = [1.0, 0.0, 0.0], [0.0, 0.0]  # p = confidence
    chain = [0.8, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3]
    trees = SimpleNamespace(chain=lambda: ([chain], [list(range(7))]), planned=[_bushy_tree(16, tree_node)], size=16)
    proposal = SimpleNamespace(tokens=torch.zeros(1, 7, dtype=torch.long))
    schedule = CostSchedule(model, 1, 7, 0.0, [[]], [DCOCOStats()])
    choice = schedule.propose(Draft(proposal, [0], 7, trees))
    if choice.tree:
        tokens, seconds = 1 + tree_node * choice.tree, model.tree_seconds(8, choice.tree, 1)[-1]
    else:
        survival = itertools.accumulate(chain[: choice.k], lambda a, b: a * b)
        tokens, seconds = 1 + sum(survival), model.cycle_seconds(8, 1)[choice.k]
    return choice, tokens / seconds


def test_the_schedule_verifies_a_tree_where_verify_is_cheap_and_the_chain_where_not():
    """Same draft: with a flat verify cost (a GPU) the largest tree pays; with a steep one (a CPU's) the chain or a
    small tree, whichever is expected faster: trees and chains are priced by one rule (`proposal.fastest`)."""
    flat = CycleCosts(verify=[1.0] * 17, draft={8: 0.1})
    assert _tree_choice(flat, 0.35)[0].tree == 16
    assert _tree_choice(flat, 0.05)[0] == Proposal(7)  # siblings that add little: the whole chain
    steep = CycleCosts(verify=[1.0 + 0.5 * n for n in range(17)], draft={8: 0.1})
    choice, rate = _tree_choice(steep, 0.35)
    assert choice.tree < 16
    for k in range(1, 8):  # no chain length is expected faster than the choice
        survival = list(itertools.accumulate([0.8, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3][:k], lambda a, b: a * b))
        assert (1 + sum(survival)) / (0.1 + steep.verify[k]) <= rate + 1e-12


def test_trees_that_commit_less_than_forecast_give_way_to_the_chain():
    """The plan discounts a tree's forecast by what tree cycles committed of theirs, measured against the chain's
    own record: trees that keep falling short stop being chosen; a record as good as the chain's changes nothing."""
    flat = CycleCosts(verify=[1.0] * 17, draft={8: 0.1})
    model = CostModel(flat, AcceptanceModel([0.5] * 7))
    assert model.tree_yield() == 1.0 and _tree_choice(flat, 0.35, model)[0].tree == 16
    for _ in range(50):  # chains commit what they forecast, trees as often as the chains
        model.observe_yield(3.0, 3.0, tree=False)
        model.observe_yield(4.0, 4.0, tree=True)
    assert model.tree_yield() == pytest.approx(1.0)
    assert _tree_choice(flat, 0.35, model)[0].tree == 16
    for _ in range(300):  # then trees commit none of their forecast drafted tokens
        model.observe_yield(4.0, 1.0, tree=True)
    assert model.tree_yield() < 0.2
    choice = _tree_choice(flat, 0.35, model)[0]
    assert choice.tree == 0 and choice.k > 0


def test_nodes_off_the_chain_teach_only_the_node_terms():
    """A verified tree's siblings (and their children) move only the sibling-share and off-chain weights; its chain
    nodes teach the chain's fit like a chain's slots, so trees leave the chain's forecast as chain cycles set it."""
    acceptance = AcceptanceModel([0.5] * 7)
    bias, weights = list(acceptance.bias), list(acceptance.weights)
    sibling, under_sibling = NodeFeatures(0, 0.2, 0.3, False), NodeFeatures(1, 0.6, 1.0, True)
    acceptance.observe_nodes([sibling, under_sibling], [False, False], recent=0.7)
    assert acceptance.bias == bias and acceptance.weights == weights
    assert acceptance.node_weights[0] > 1.0 and acceptance.node_weights[1] < 0.0  # log(share) < 0, label False
    acceptance.observe_nodes([NodeFeatures(0, 0.9, 1.0, False)], [True], recent=0.7)
    assert acceptance.bias[0] > bias[0] and acceptance.bias[1:] == bias[1:]


def test_tree_expected_multiplies_acceptance_along_each_path():
    # anchor -> node 0 (0.5) -> node 2 (0.4); anchor -> node 1 (0.2): E = 1 + 0.5 + 0.2 + 0.5 * 0.4
    assert tree_expected([0.5, 0.2, 0.4], [-1, -1, 0]) == pytest.approx([1.0, 1.5, 1.7, 1.9])


# ------------------------------------------------------------------------------------------------ exact, greedy

_MODELS: dict[str, tuple] = {}


def _models(kind: str):
    """(target, drafter) pairs, built once: fitted (its chain mostly right), scrambled (the corrector overrules the
    drafter: bushy trees whose siblings get accepted), LiLiCorr and the DFlash2 selector, no corrector."""
    if kind not in _MODELS:
        target = make_target("llama", seed=5)
        fitted = fit_drafter(target, seed=5)
        fitted.generation_config.num_assistant_tokens_schedule = "constant"
        drafters = {"fitted": fitted, "scrambled": scrambled(fitted, seed=7, scale=6.0)}
        lilicorr = lilicorr_copy(fitted, target)
        randomise(lilicorr.corrector)
        drafters["lilicorr"] = lilicorr
        _MODELS.update({name: (target, drafter) for name, drafter in drafters.items()})
    return _MODELS[kind]


def _greedy(
    target, drafter, seed: int, lengths: list[int], max_new_tokens: int, tree_budget: int, **kwargs
) -> list[DCOCOStats]:
    ids, mask = left_padded(seed, lengths)
    common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, **kwargs)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, tree_budget=tree_budget, **common)
    assert got.sequences.tolist() == expected.tolist()
    return got.stats


@pytest.mark.parametrize("kind", ["fitted", "scrambled", "lilicorr"])
@pytest.mark.parametrize("budget", [1, 3, 8, 16, 40])
def test_trees_of_every_size_are_exact(kind, budget):
    """Budgets from one node (a chain of one) to wider than the block's chain (bushy), ragged batches."""
    target, drafter = _models(kind)
    totals = DCOCOStats()
    for seed, lengths in [(0, [6]), (1, [3, 9, 5]), (2, [1, 12, 4, 7, 2])]:
        stats = _greedy(target, drafter, seed, lengths, 18, tree_budget=budget)
        totals = totals.merge(sum(stats, DCOCOStats()))
    assert totals.tree_cycles > 0 and totals.tree_nodes == budget * totals.tree_cycles


def test_bushy_trees_accept_siblings():
    """Non-vacuous: with a scrambled corrector the target takes off-chain nodes, and trees commit more tokens per
    forward than that drafter's chain."""
    target, drafter = _models("scrambled")
    trees = chains = DCOCOStats()
    for seed, lengths in [(3, [5, 8]), (4, [2, 9, 6]), (5, [7])]:
        trees = trees.merge(sum(_greedy(target, drafter, seed, lengths, 24, tree_budget=24), DCOCOStats()))
        chains = chains.merge(sum(_greedy(target, drafter, seed, lengths, 24, tree_budget=0), DCOCOStats()))
    assert trees.after_sibling > 0, trees.as_dict()
    assert trees.tau > chains.tau, (trees.tau, chains.tau)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_trees_with_eos_and_budget_inside_a_branch(cache):
    """EOS and max_new_tokens reached on an accepted branch: the row ends exactly where plain generate() ends it."""
    target, drafter = _models("scrambled")
    for seed in range(3):
        ids, mask = left_padded(40 + seed, [4, 9, 6])
        free = target.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=PAD)
        eos = int(free[seed, ids.shape[1] + 6])
        for max_new in (7, 11, 25):
            _greedy(target, drafter, 40 + seed, [4, 9, 6], max_new, eos_token_id=eos, tree_budget=12,
                    cache_implementation=cache)


@pytest.mark.parametrize("attention", ["eager", "sdpa_cpu_gqa"])
def test_trees_are_exact_with_every_attention_that_takes_their_mask(attention):
    """The tree's 4D mask in each format: additive for eager attention, boolean for SDPA and its CPU variant."""
    target, drafter = _models("scrambled")
    before = target.config._attn_implementation
    target.set_attn_implementation(attention)
    try:
        for seed, lengths in [(60, [4, 10, 7]), (61, [8])]:
            stats = _greedy(target, drafter, seed, lengths, 16, tree_budget=10)
            assert sum(s.tree_cycles for s in stats) > 0
    finally:
        target.set_attn_implementation(before)


def test_a_drafter_without_corrector_builds_marginal_trees():
    target, drafter = _models("fitted")
    ids, mask = left_padded(9, [5, 11, 3])
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, correct=False, tree_budget=10, **common)
    assert got.sequences.tolist() == expected.tolist()
    assert sum(s.tree_cycles for s in got.stats) > 0


def test_dflash2_selector_trees_are_exact():
    from test_selector import DRAFT_VOCAB, selector_copy
    from test_selector import randomise as randomise_selector

    target, fitted = _models("fitted")[0], _models("fitted")[1]
    drafter = selector_copy(fitted, target, draft_vocab=DRAFT_VOCAB)
    randomise_selector(drafter.corrector)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    for seed, lengths in [(11, [6, 2]), (12, [9])]:
        stats = _greedy(target, drafter, seed, lengths, 14, tree_budget=9)
        assert sum(s.tree_cycles for s in stats) > 0


def test_sliding_window_target_trees_are_exact():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    target = MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=5, max_position_embeddings=512, pad_token_id=None, eos_token_id=None,
        bos_token_id=None)).eval().requires_grad_(False)
    drafter = scrambled(fit_drafter(target, steps=60), seed=1)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    for seed, lengths in [(20, [3, 8]), (21, [10, 4, 6])]:
        _greedy(target, drafter, seed, lengths, 20, tree_budget=12)


def test_a_single_path_tree_is_the_chain(monkeypatch):
    """A tree whose nodes are the walk's block, one under the other, verifies through the same code as the chain:
    the same tokens, the same accepted count every cycle."""
    target, drafter = _models("scrambled")
    real = trees_module.best_first

    def spine(first, transitions, marginals, budget):  # the budget's first nodes of the chain alone
        chain = [node for node in real(first, transitions, marginals, 64) if node.on_chain][:budget]
        return [dataclasses.replace(node, parent=i - 1) for i, node in enumerate(chain)]

    monkeypatch.setattr(trees_module, "best_first", spine)
    for seed, lengths in [(30, [5, 8, 2]), (31, [9])]:
        as_trees = _greedy(target, drafter, seed, lengths, 20, tree_budget=7)
        as_chains = _greedy(target, drafter, seed, lengths, 20, tree_budget=0)
        assert [s.accepted for s in as_trees] == [s.accepted for s in as_chains]
        assert all(s.tree_cycles == s.cycles for s in as_trees)


def test_the_chain_read_from_the_trees_scores_is_the_walks_block():
    """With a tree budget the chain's tokens and confidences come from the trees' scores on the host
    (`chain_of`): they are the walk's own block and `slot_confidence`'s reading of it."""
    from dcoco_hf.runtime.context_cache import DraftContextCache
    from dcoco_hf.runtime.acceptance import slot_confidence

    target, drafter = _models("scrambled")
    ids = torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    states = torch.randn(3, 11, len(drafter.config.target_layer_ids) * drafter.config.hidden_size)
    positions = torch.arange(11 + drafter.config.block_size)[None]
    proposal = drafter.propose(ids[:, -1], states, positions, DraftContextCache(), context_ids=ids)
    scores = tree_scores(proposal)
    confidence = slot_confidence(proposal.candidate_logits, proposal.chosen, proposal.transition_scores,
                                 proposal.first_slot_scores)
    for row in range(3):
        walk_confidence, tokens = chain_of(scores, row)
        assert tokens == proposal.tokens[row].tolist()
        assert walk_confidence == pytest.approx(confidence[row].tolist(), rel=1e-5)


# ------------------------------------------------------------------------------------------------ exact, sampling


@pytest.fixture(scope="module")
def sampling_trees():
    """A peaked target and a random drafter whose trees of 6 nodes are verified every cycle."""
    target = peaked_target()
    return target, random_drafter(target, 10, tree_budget=6)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tree_sampling_matches_the_exact_distribution(sampling_trees, setting):
    target, drafter = sampling_trees
    probs = exact_distribution(target, SETTINGS[setting])
    n = 3000
    torch.manual_seed(7)
    out = speculative_generate(target, PROMPT.expand(n, -1), drafter=drafter, do_sample=True, max_new_tokens=T,
                               **SETTINGS[setting])
    tv = total_variation(histogram(out.sequences), probs)
    q99 = iid_tv_quantiles(probs, n)[1]
    assert tv < q99, (tv, q99)
    stats = sum(out.stats, DCOCOStats())
    assert stats.tree_cycles > 0 and stats.after_sibling > 0, stats.as_dict()  # siblings were accepted


def test_tree_nodes_label_the_acceptance_fit():
    """Every node whose parent was accepted teaches the fit (its sibling-share weight moves off its start)."""
    target, drafter = _models("scrambled")
    drafter.generation_config.num_assistant_tokens_schedule = "cost"
    drafter.cycle_costs = CycleCosts(verify=[1.0] * 17, draft={8: 1e-9})  # trees always pay: verify is free
    try:
        before = drafter.cost_model.acceptance.observed
        stats = _greedy(target, drafter, 50, [6, 9], 20, tree_budget=16)
        assert sum(s.tree_cycles for s in stats) > 0
        assert drafter.cost_model.acceptance.observed > before
        assert drafter.cost_model.acceptance.node_weights != [1.0, 0.0]
    finally:
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        drafter.detach()
        drafter.attach(target, tune=False)


def test_tree_node_features_read_the_parent():
    node = TreeNode(slot=2, candidate=1, parent=0, log_prob=-1.0, confidence=0.3, sibling_share=0.5, on_chain=False)
    assert node.features(parent_on_chain=False).parent_off_chain
    assert not node.features(parent_on_chain=True).parent_off_chain
