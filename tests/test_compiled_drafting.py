"""`drafter.compile_drafting()` captures every draft (backbone forward over the block, top-K candidates, transition
scores, walk) in one compiled graph per block shape, over a static context cache, and drafts exactly what eager
drafting drafts on that cache; the static cache itself drafts what the growing one does.

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
from conftest import VOCAB, make_target, scrambled
from test_batched import PAD, left_padded
from test_lilicorr import lilicorr_copy, randomise

from torch._dynamo import lookup_backend

from dcoco_hf import CorpusBigrams, DCOCODrafter, speculative_generate, use_few_rows_linear
from dcoco_hf.runtime.context_cache import DraftContextCache, StaticDraftContextCache
from dcoco_hf.runtime.cpu_linear import available_layouts, few_rows_plan

CPU_CAPTURE = dict(backend="aot_eager")  # the traced graph on the eager kernels: no C++ build on CPU


def corrector_variants(target, drafter) -> dict:
    texts = [(torch.arange(40) % VOCAB, torch.ones(40, dtype=torch.bool))]
    full = scrambled(drafter, seed=4, context_bigrams=True, corpus=CorpusBigrams.count(texts, VOCAB))
    full.config.correct_first_slot = True
    lilicorr = lilicorr_copy(drafter, target)
    randomise(lilicorr.corrector)
    return {"dcoco": scrambled(drafter, seed=2), "dcoco-bigrams-corpus-first": full, "lilicorr": lilicorr}


def propose_cycles(drafter, batch: int, block: int, selection: str, cache=None, seed: int = 0):
    """Consecutive proposals for `batch` rows (context rows added, block dropped, as the engines do), with the
    committed tokens as context ids, on `cache` (default the drafter's own, `draft_cache`): the DraftProposals.
    The first reads more new rows than a block commits (a prompt: eager), the others fewer (captured)."""
    cfg = drafter.config
    generator = torch.Generator().manual_seed(seed)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    states = torch.randn(batch, 16, width, generator=generator)  # [B, N, layers * H]
    ids = torch.randint(1, VOCAB, (batch, 16), generator=generator)  # [B, N] committed tokens
    cache, proposals = cache if cache is not None else drafter.draft_cache(capacity=24), []
    for start, end in ((0, 9), (9, 12), (12, 16)):
        positions = torch.arange(start, end + block).expand(batch, -1)  # [B, new rows + block]
        proposals.append(drafter.propose(
            ids[:, end - 1], states[:, start:end], positions, cache, selection=selection, context_ids=ids[:, :end],
            block_size=block,
        ))
    return proposals


def static_cache(drafter, capacity: int = 40) -> StaticDraftContextCache:
    cfg = drafter.config
    return StaticDraftContextCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                                   drafter.dtype, cfg.block_size)


def assert_same_drafts(expected, got, where) -> None:
    for one, other in zip(expected, got, strict=True):
        assert torch.equal(one.candidates, other.candidates), where
        assert torch.equal(one.tokens, other.tokens), where
        assert torch.equal(one.chosen, other.chosen), where
        for name in ("transition_scores", "first_slot_scores"):
            mine, theirs = getattr(one, name), getattr(other, name)
            assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs)), (where, name)


def test_captured_drafts_are_eager_drafts_on_the_static_cache(fitted):
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
        assert isinstance(compiled.draft_cache(40), StaticDraftContextCache)
        assert isinstance(drafter.draft_cache(40), DraftContextCache)
        propose_cycles(compiled, 2, 8, "prefix_first", cache=static_cache(compiled))
        # One graph for the shape, no graph break: the prompt-sized draft ran eagerly, the two others replayed it,
        # whatever the context's length (context ids span the buffer, new rows are padded to a block).
        assert len(graphs) == 1, (name, len(graphs))
        for batch, block, selection in ((1, 8, "prefix_first"), (3, 8, "viterbi"), (3, 4, "prefix_first")):
            eager = propose_cycles(drafter, batch, block, selection, cache=static_cache(drafter))
            captured = propose_cycles(compiled, batch, block, selection, cache=static_cache(compiled))
            assert_same_drafts(eager, captured, (name, batch, block, selection))
        assert not compiled.compile_drafting(enabled=False).drafting_compiled


def test_static_context_cache_drafts_what_the_growing_cache_drafts(fitted):
    """Padding rows, masked buffer columns and a reallocation (capacity 20 is outgrown on the second draft) change
    nothing a draft picks."""
    target, fitted_drafter = fitted
    for name, drafter in corrector_variants(target, fitted_drafter).items():
        for batch, block in ((1, 8), (3, 4)):
            growing = propose_cycles(drafter, batch, block, "prefix_first", cache=DraftContextCache())
            cache = static_cache(drafter, capacity=20)
            static = propose_cycles(drafter, batch, block, "prefix_first", cache=cache)
            assert cache.capacity >= 40 and cache.length == 16
            for one, other in zip(growing, static, strict=True):
                assert torch.equal(one.candidates, other.candidates), (name, batch, block)
                assert torch.equal(one.tokens, other.tokens), (name, batch, block)
                # Attention sums over more (masked) keys: the scores agree to float rounding.
                torch.testing.assert_close(one.transition_scores, other.transition_scores, atol=1e-4, rtol=1e-4)


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


@pytest.mark.parametrize("loop", ["batched", "assisted"])
def test_a_call_replays_one_graph_per_block_shape(fitted, loop):
    """A whole call at one block and batch (constant schedule, one row): one graph, every draft after the prompt's
    replaying it; outputs are plain generate()'s. (Rows leaving a batch make a graph per batch size.)"""
    target, fitted_drafter = fitted
    graphs = []

    def recording(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    drafter = scrambled(fitted_drafter, seed=8).compile_drafting(backend=recording)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(8))
    common = dict(max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    if loop == "batched":
        got = speculative_generate(target, ids, drafter=drafter, **common)
        cycles, got = got.stats[0].cycles, got.sequences
    else:
        got = target.generate(ids, assistant_model=drafter, **common)
        cycles = drafter.generation_stats().cycles
    assert got.tolist() == target.generate(ids, **common).tolist()
    assert cycles > 3 and len(graphs) == 1, (cycles, len(graphs))


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


@pytest.mark.skipif("packed" not in available_layouts(), reason="this torch build has no MKL packed GEMM")
def test_compiled_drafting_with_inductor_after_a_packed_layout_equals_plain_generate():
    """A tuned attach may lay the drafter's linear layers out packed (MKL's opaque weights), which inductor cannot
    compile: compile_drafting() with its CPU default hands the graph plain linear layers, and records it."""
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    use_few_rows_linear(drafter, layout="packed")
    torch._dynamo.reset()
    drafter.compile_drafting()  # the default backend: inductor on CPU
    assert few_rows_plan(drafter) is None
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    expected = target.generate(ids, max_new_tokens=10, do_sample=False)
    assert target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter).tolist() == \
        expected.tolist()
    assert drafter.generation_stats().cycles > 0


@pytest.mark.skipif("packed" not in available_layouts(), reason="this torch build has no MKL packed GEMM")
def test_unpacking_for_the_capture_is_recorded_in_the_tuning():
    from dcoco_hf.runtime.tuning import Tuning, unpack_for_capture

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    plan = use_few_rows_linear(model, layout={2: "transposed", 3: "packed"})
    tuning = Tuning(device="CPU", target_layout=plan, drafter_layout=plan)
    unpack_for_capture(model, tuning)
    assert few_rows_plan(model) is None and tuning.drafter_layout is None and tuning.target_layout == plan
    assert "plain for compiled drafting" in tuning.summary()
    use_few_rows_linear(model, layout="transposed")  # no packed weight: the graph takes this layout as it is
    unpack_for_capture(model, tuning)
    assert few_rows_plan(model) == {2: "transposed", 3: "transposed", 4: "transposed", 5: "transposed",
                                    6: "transposed"}


@pytest.mark.skipif("packed" not in available_layouts(), reason="this torch build has no MKL packed GEMM")
def test_a_tuned_attach_after_compile_drafting_keeps_the_drafter_unpacked(monkeypatch, tmp_path):
    """attach() lays the drafter out anew; with drafting compiled, a packed layout would reach the graph."""
    from dcoco_hf.runtime import tuning

    monkeypatch.setenv("DCOCO_HF_TUNING_DIR", str(tmp_path))
    lay_out = tuning.use_few_rows_linear
    monkeypatch.setattr(tuning, "use_few_rows_linear", lambda model, max_rows: lay_out(model, max_rows, "packed"))
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    drafter.compile_drafting(**CPU_CAPTURE).attach(target)
    assert "packed" in few_rows_plan(target).values() and few_rows_plan(drafter) is None
    assert drafter.tuning.drafter_layout is None and drafter.drafting_compiled
