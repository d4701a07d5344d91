"""Exact reference for the sampling tests: the distribution of the first T new tokens after PROMPT, by enumeration.

Shared by the single-sequence (`test_sampling.py`) and batched (`test_batched.py`) distribution tests, with the tiny
peaked target and the random drafters those tests search among.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from conftest import make_target, scrambled
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

V = 6  # vocabulary: V**T outcomes, and random proposals get accepted often
T = 3  # new tokens per sample: the first cycle drafts 2 tokens, so accept-accept, accept-reject and reject all occur
PROMPT = torch.tensor([[1, 2, 3, 4, 0]])


def peaked_target():
    """A tiny Llama target over V tokens with peaked but non-degenerate next-token distributions."""
    target = make_target("llama", seed=1, vocab=V)
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    return target


def random_drafter(target, seed: int, soft: bool = False, tree_budget: int = 0):
    """A drafter with random backbone weights (seeded) and a scrambled corrector, so proposals are arbitrary.

    `soft` shrinks the final norm: the drafter's own distribution is then far from one-hot. It proposes its whole
    block every cycle (the constant schedule), so the first cycle's outcomes are known in advance; with
    `tree_budget` its draft tree of that many nodes instead (tests/test_trees.py). tests/test_proposal.py samples
    under the cost-aware schedule.
    """
    from dcoco_hf import DCOCODrafter

    torch.manual_seed(seed)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=V)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.startswith("corrector."):
                param.copy_(torch.randn(param.shape) * (0.5 if param.dim() > 1 else 0.1) + (param.dim() == 1))
        if soft:
            drafter.norm.weight.mul_(0.05)
    drafter = scrambled(drafter, seed=2)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.tree_budget = tree_budget
    return drafter


def warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """The sampling warpers of GenerationMixin._get_logits_processor (transformers 5.24): same conditions and order."""
    processors = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


@torch.no_grad()
def exact_distribution(target, setting: dict) -> np.ndarray:
    """P(first T new tokens = c) for every c in V**T (lexicographic order), through one batched target forward."""
    processors = warpers(**setting)
    continuations = torch.tensor(list(itertools.product(range(V), repeat=T)))
    sequences = torch.cat([PROMPT.expand(len(continuations), -1), continuations], dim=1)
    length = PROMPT.shape[1]
    logits = target(sequences).logits.float()
    log_prob = torch.zeros(len(continuations), dtype=torch.float64)
    for i in range(T):
        step = processors(sequences[:, : length + i], logits[:, length - 1 + i].clone())
        log_prob += step.log_softmax(-1).double().gather(1, continuations[:, i : i + 1]).squeeze(1)
    probs = log_prob.exp().numpy()
    assert abs(probs.sum() - 1.0) < 1e-6
    # Rounding may leave the sum a hair above 1, which numpy's multinomial refuses (seen with 1 thread).
    return probs / probs.sum()


def histogram(sequences: torch.LongTensor) -> np.ndarray:
    new = sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + T].numpy()
    assert new.shape[1] == T
    return np.bincount((new * V ** np.arange(T - 1, -1, -1)).sum(1), minlength=V**T)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def iid_tv_quantiles(probs: np.ndarray, n: int, seed: int = 0, reps: int = 2000) -> tuple[float, float]:
    """(1st, 99th) percentile of the TV between n iid draws from `probs` and `probs` itself."""
    rng = np.random.default_rng(seed)
    tvs = [total_variation(rng.multinomial(n, probs), probs) for _ in range(reps)]
    return float(np.quantile(tvs, 0.01)), float(np.quantile(tvs, 0.99))
