"""Tiny random-weight targets and drafters for fast CPU tests.

Random drafters almost never get a draft accepted, which would leave the acceptance path of the exactness tests
untested. So `fitted_drafter` first fits the drafter backbone to its tiny target for a few seconds (with the library's
own training objective), then `scrambled` randomises the corrector so corrections really change proposals.
"""

from __future__ import annotations

import copy
import math
import os
import re
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dcoco_hf import DCOCODrafter
from dcoco_hf.network.corrector import CorpusBigrams, DCOCOCorrector
from dcoco_hf.runtime import tuning
from dcoco_hf.training import fit_on_own_answers

# attach() caches its CPU measurements on disk; tests keep theirs out of the user's ~/.cache.
os.environ.setdefault("DCOCO_HF_TUNING_DIR", tempfile.mkdtemp(prefix="dcoco-hf-tuning-"))

# Tiny models' cycle timings are microseconds of per-op jitter, noisy on any machine: tests cache their tunings
# however noisy (tests/test_attach.py checks the noisy path with the library's threshold).
tuning.NOISY_SPREAD = math.inf

# Tiny models are dominated by per-op overhead; a second OpenMP thread only adds contention on 2-core machines (10x).
torch.set_num_threads(1)

VOCAB = 48
PROMPT_LEN = 6


def make_target(arch: str, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        raise ValueError(arch)
    model.eval().requires_grad_(False)
    return model


def fit_drafter(target, block_size: int = 8, top_k: int = 4, steps: int = 120, seed: int = 0) -> DCOCODrafter:
    torch.manual_seed(seed)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=block_size, top_k=top_k)
    return fit_on_own_answers(drafter, target, steps=steps, prompt_len=PROMPT_LEN, seed=seed)


def scrambled(
    drafter: DCOCODrafter,
    seed: int = 0,
    scale: float = 3.0,
    context_bigrams: bool = False,
    corpus: CorpusBigrams | None = None,
) -> DCOCODrafter:
    """A copy (attached to the same target) whose corrector is random enough to overrule the drafter's argmax;
    with `context_bigrams`, a corrector that also reads m(a, b); with `corpus`, one that also reads those counts."""
    clone = copy.deepcopy(drafter).attach(drafter.target)
    if context_bigrams:
        cfg = clone.config
        cfg.context_bigrams = True
        clone.corrector = DCOCOCorrector(cfg.hidden_size, cfg.corrector_rank, cfg.corrector_hidden, True)
    if corpus is not None:
        clone.set_corpus_bigrams(corpus)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.corrector.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)
    return clone


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def arch(request) -> str:
    return request.param


_FITTED: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def fitted(arch):
    """(target, fitted drafter) for `arch`, built once per session. It proposes its whole block every cycle (the
    constant schedule), so tests can count full blocks and compare drafts across calls; tests/test_proposal.py
    covers the cost-aware schedule."""
    if arch not in _FITTED:
        target = make_target(arch)
        _FITTED[arch] = (target, fit_drafter(target))
    target, drafter = _FITTED[arch]
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return target, drafter.attach(target)


_SIGNATURE = re.compile(r"def \w+\(.*")


def function_signatures(prompts) -> set[str]:
    """Whole `def name(...)` lines of code prompts: held-out checks compare these, since names alone recur (`add`)."""
    return {m.group(0) for p in prompts for m in _SIGNATURE.finditer(p)}
