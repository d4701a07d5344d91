"""`drafter.compile_drafting()` captures the corrector phase of every draft (transition scores + walk) in a compiled
graph, and drafts exactly what eager drafting drafts.

On CPU the capture runs with `backend="aot_eager"`: dynamo and AOT autograd trace the graph (graph breaks, guards,
what the capture sees of the corrector's state), and the traced graph runs the eager kernels, so proposals must be
bit-identical. Inductor's generated kernels (the GPU default) are not built here: they can reorder float sums, and
docs/gpu.md says what `scripts/gpu_check.py` checks of them on a GPU. Correctors: DCOCO (plain; with context bigrams,
corpus counts and the first slot scored) and LiLiCorr; walks: prefix-first and Viterbi; several batch and block
shapes. End to end, the batched loop and assisted generation with compiled drafting equal plain generate().
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, scrambled
from test_batched import PAD, left_padded
from test_lilicorr import lilicorr_copy, randomise

from torch._dynamo import lookup_backend

from dcoco_hf import CorpusBigrams, speculative_generate
from dcoco_hf.context_cache import DraftContextCache

CPU_CAPTURE = dict(backend="aot_eager")  # the traced graph on the eager kernels: no C++ build on CPU


def corrector_variants(target, drafter) -> dict:
    texts = [(torch.arange(40) % VOCAB, torch.ones(40, dtype=torch.bool))]
    full = scrambled(drafter, seed=4, context_bigrams=True, corpus=CorpusBigrams.count(texts, VOCAB))
    full.config.correct_first_slot = True
    lilicorr = lilicorr_copy(drafter, target)
    randomise(lilicorr.corrector)
    return {"dcoco": scrambled(drafter, seed=2), "dcoco-bigrams-corpus-first": full, "lilicorr": lilicorr}


def propose_twice(drafter, batch: int, block: int, selection: str, seed: int = 0):
    """Two consecutive proposals for `batch` rows (context rows added, block dropped, as the engines do), with
    the committed tokens as context ids: the DraftProposals."""
    cfg = drafter.config
    generator = torch.Generator().manual_seed(seed)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    states = torch.randn(batch, 12, width, generator=generator)  # [B, N, layers * H]
    ids = torch.randint(1, VOCAB, (batch, 12), generator=generator)  # [B, N] committed tokens
    cache, proposals = DraftContextCache(), []
    for start, end in ((0, 9), (9, 12)):
        positions = torch.arange(start, end + block).expand(batch, -1)  # [B, new rows + block]
        proposals.append(drafter.propose(
            ids[:, end - 1], states[:, start:end], positions, cache, selection=selection, context_ids=ids[:, :end],
            block_size=block,
        ))
    return proposals


def test_compiled_corrector_drafts_what_eager_drafts(fitted):
    target, fitted_drafter = fitted
    for name, drafter in corrector_variants(target, fitted_drafter).items():
        graphs = []

        def recording(graph, example_inputs):  # the aot_eager backend, counting the graphs dynamo hands it
            graphs.append(graph)
            return lookup_backend("aot_eager")(graph, example_inputs)

        # dynamo keeps its graphs per code object, up to its recompile limit, across drafters: a fresh start for
        # each corrector, so none falls back to eager for want of room
        torch._dynamo.reset()
        compiled = copy.deepcopy(drafter).attach(target, tune=False).compile_drafting(backend=recording)
        assert compiled.drafting_compiled and not drafter.drafting_compiled
        propose_twice(compiled, 2, 8, "prefix_first")
        # One graph per shape, no graph break; the context width is part of the shape when context bigrams are read.
        assert len(graphs) == (2 if drafter.config.context_bigrams else 1), (name, len(graphs))
        for batch, block, selection in ((1, 8, "prefix_first"), (3, 8, "viterbi"), (3, 4, "prefix_first")):
            for eager, captured in zip(propose_twice(drafter, batch, block, selection),
                                       propose_twice(compiled, batch, block, selection)):
                where = (name, batch, block, selection)
                assert torch.equal(eager.tokens, captured.tokens), where
                assert torch.equal(eager.chosen, captured.chosen), where
                assert torch.equal(eager.transition_scores, captured.transition_scores), where
                if eager.first_slot_scores is None:
                    assert captured.first_slot_scores is None, where
                else:
                    assert torch.equal(eager.first_slot_scores, captured.first_slot_scores), where
        assert not compiled.compile_drafting(enabled=False).drafting_compiled


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_loop_with_compiled_drafting_equals_plain_generate(fitted, cache):
    target, fitted_drafter = fitted
    drafter = scrambled(fitted_drafter, seed=5).compile_drafting(**CPU_CAPTURE)
    ids, mask = left_padded(5, [2, 11, 6, 6, 3, 8])
    common = dict(attention_mask=mask, max_new_tokens=22, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, cache_implementation=cache, **common)
    eager = speculative_generate(target, ids, drafter=drafter.compile_drafting(enabled=False), **common)
    assert got.sequences.tolist() == expected.tolist()
    assert [s.accepted for s in got.stats] == [s.accepted for s in eager.stats]  # the same drafts, cycle by cycle


def test_assisted_generation_with_compiled_drafting_equals_plain_generate(fitted):
    target, fitted_drafter = fitted
    drafter = scrambled(fitted_drafter, seed=6).compile_drafting(**CPU_CAPTURE)
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter).tolist() == \
        expected.tolist()


def test_a_drafter_copy_does_not_carry_the_compiled_graph(fitted):
    """Pickling and deep copies leave the graph behind (it belongs to the original's modules)."""
    _, drafter = fitted
    compiled = scrambled(drafter, seed=7).compile_drafting(**CPU_CAPTURE)
    assert not copy.deepcopy(compiled).drafting_compiled
