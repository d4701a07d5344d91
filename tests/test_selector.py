"""The DFlash2 candidate selector (dcoco_hf/network/selector.py): its scores, lossless drafting, training and the public
DFlash2 export."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import PROMPT_LEN, fit_drafter, make_target
from safetensors.torch import load_file

from dcoco_hf import DCOCOConfig, DCOCODrafter, speculative_generate
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.serving.export import export_dflash2
from dcoco_hf.network.corrector import BlockLattice
from dcoco_hf.network.selector import SelectorCorrector
from dcoco_hf.training import drafter_loss, target_context

RANK = 4
DRAFT_VOCAB = list(range(0, 48, 2)) + [1, 3, 5]  # 27 of the 48 tokens: anchors outside it have zero codes


@pytest.fixture(scope="module")
def selector_setup():
    """(target, a selector drafter with random codes over a draft vocabulary, on the session's fitted backbone)."""
    target = make_target("llama")
    fitted = fit_drafter(target, block_size=5, top_k=4, steps=60)
    drafter = selector_copy(fitted, target, draft_vocab=DRAFT_VOCAB)
    randomise(drafter.corrector)
    return target, drafter


def selector_copy(drafter: DCOCODrafter, target, draft_vocab: list[int] | None = None) -> DCOCODrafter:
    """The same backbone with a fresh selector (zero successor codes), over `draft_vocab` if given."""
    config = copy.deepcopy(drafter.config)
    config.corrector_type, config.selector_rank = "dflash2", RANK
    config.draft_vocab_size = None if draft_vocab is None else len(draft_vocab)
    clone = DCOCODrafter(config)
    clone.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("corrector.")},
                          strict=False)
    if draft_vocab is not None:
        clone.set_draft_vocabulary(draft_vocab)
    return clone.eval().attach(target, tune=False)


def randomise(selector: SelectorCorrector, seed: int = 0, scale: float = 2.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)


def prompts(n: int = 3, seed: int = 1) -> torch.LongTensor:
    return torch.randint(0, 48, (n, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def propose(drafter: DCOCODrafter, target, correct: bool = True, seed: int = 1):
    ids = prompts(1, seed)
    with torch.no_grad():
        states, _ = target_context(target, drafter.config.target_layer_ids, ids)
    positions = torch.arange(PROMPT_LEN - 1 + drafter.config.block_size)[None]
    return drafter.propose(ids[:, -1], states[:, :-1], positions, DraftContextCache(), correct=correct)


def test_scores_are_the_bilinear_formula_per_pair():
    head = SelectorCorrector(hidden_size=8, codebook_size=10, rank=3)
    randomise(head)
    g = torch.Generator().manual_seed(2)
    slot_hidden, unary = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 4, generator=g)
    candidates = torch.randint(0, 10, (2, 3, 4), generator=g)
    anchors = torch.tensor([7, -1])  # the second anchor lies outside the codebook: a zero code
    config = DCOCOConfig(target_layer_ids=[0], corrector_type="dflash2")
    with torch.no_grad():
        lattice = BlockLattice(torch.cat([torch.zeros(2, 1, 8), slot_hidden], 1), anchors, candidates, unary)
        start, pairs = head.score(config, lattice, embedding=None)
    assert start.shape == (2, 4) and pairs.shape == (2, 2, 4, 4)
    P, S, W = head.predecessor_codebook, head.successor_codebook, head.hidden_projection.weight

    def naive(p: int, c: int, slot: int, row: int) -> torch.Tensor:
        code = torch.zeros(3) if p < 0 else P[p]
        return unary[row, slot, c] + (code * (W @ slot_hidden[row, slot]) * S[candidates[row, slot, c]]).sum()

    with torch.no_grad():
        for row in range(2):
            for c in range(4):
                torch.testing.assert_close(start[row, c], naive(int(anchors[row]), c, 0, row))
                for slot in range(1, 3):
                    for a in range(4):
                        expected = naive(int(candidates[row, slot - 1, a]), c, slot, row)
                        torch.testing.assert_close(pairs[row, slot - 1, a, c], expected)
    assert torch.equal(start[1], unary[1, 0])  # a zero predecessor code adds nothing to the unary logits


def test_fresh_selector_proposes_the_drafter_argmax(selector_setup):
    target, trained = selector_setup
    fresh = selector_copy(trained, target, draft_vocab=DRAFT_VOCAB)
    assert not fresh.corrector.successor_codebook.any() and fresh.corrector.predecessor_codebook.std() > 0.01
    on, off = propose(fresh, target), propose(fresh, target, correct=False)
    # Zero successor codes: every score is the candidate's drafter logit, so the walk takes candidate 0 everywhere.
    torch.testing.assert_close(on.first_slot_scores, on.candidate_logits[:, 0])
    torch.testing.assert_close(on.transition_scores,
                               on.candidate_logits[:, 1:, None, :].expand_as(on.transition_scores))
    assert torch.equal(on.chosen, torch.zeros_like(on.chosen)) and torch.equal(on.tokens, off.tokens)


def test_trained_codes_reselect_and_drafts_stay_in_the_draft_vocabulary(selector_setup):
    target, drafter = selector_setup
    chosen = torch.cat([propose(drafter, target, seed=s).chosen for s in range(8)])
    assert chosen.any()  # random codes overrule the argmax somewhere, slot 1 included
    tokens = torch.cat([propose(drafter, target, seed=s).tokens for s in range(8)])
    assert set(tokens.flatten().tolist()) <= set(DRAFT_VOCAB)


def test_greedy_output_identical_on_both_generation_paths(selector_setup):
    target, drafter = selector_setup
    ids = prompts(3)
    mask = torch.ones_like(ids)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for row in range(3):
        one = ids[row:row + 1]
        out = target.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=24, do_sample=False,
                              assistant_model=drafter)
        assert torch.equal(out, plain[row:row + 1])
    assert drafter.generation_stats(out).corrector_seconds > 0  # the selector really ran
    batched = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=24)
    assert torch.equal(batched.sequences[:, :plain.shape[1]], plain)


def test_training_lowers_the_chain_loss_and_moves_the_selector_alone(selector_setup):
    target, drafter = selector_setup
    student = selector_copy(drafter, target, draft_vocab=DRAFT_VOCAB)  # fresh: the loss starts at the argmax's
    student.requires_grad_(False)
    student.corrector.requires_grad_(True)
    backbone = {k: v.clone() for k, v in student.state_dict().items() if not k.startswith("corrector.")}
    ids = target.generate(prompts(6, seed=5), attention_mask=torch.ones(6, PROMPT_LEN, dtype=torch.long),
                          max_new_tokens=24, do_sample=False)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    states, argmax = target_context(target, student.config.target_layer_ids, ids)
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=3e-2)

    def loss():
        return drafter_loss(student, ids, loss_mask, states, argmax, num_anchors=8,
                            generator=torch.Generator().manual_seed(0))

    before = float(loss().dcoco)
    for _ in range(15):
        optimizer.zero_grad()
        loss().loss.backward()
        optimizer.step()
    assert float(loss().dcoco) < 0.9 * before
    assert student.corrector.successor_codebook.any()  # the zero factor got a gradient from the first step
    for name, tensor in student.state_dict().items():
        if name in backbone:
            assert torch.equal(tensor, backbone[name]), name


def test_save_and_load_round_trip(selector_setup, tmp_path):
    target, drafter = selector_setup
    drafter.save_pretrained(tmp_path)
    loaded = DCOCODrafter.from_pretrained(tmp_path).eval().attach(target, tune=False)
    assert loaded.config.corrector_type == "dflash2" and loaded.config.selector_rank == RANK
    assert loaded.corrector.predecessor_codebook.shape == (len(DRAFT_VOCAB), RANK)
    assert torch.equal(propose(loaded, target).tokens, propose(drafter, target).tokens)


def public_scores(tensors: dict, config: dict, slot_hidden, candidates, unary, anchors):
    """The DFlash2 format's transition scores, written from its description: token-indexed codebooks over the whole
    vocabulary, the slot's projected hidden, the anchor as slot 1's predecessor."""
    P = tensors["candidate_selector.predecessor_codebook"]  # [V, r]
    S = tensors["candidate_selector.successor_codebook"]
    W = tensors["candidate_selector.hidden_projection.weight"]  # [r, H]
    assert P.shape == (config["vocab_size"], config["dflash_config"]["selector_rank"])
    k = candidates.shape[-1]
    before = torch.cat([anchors[:, None, None].expand(-1, 1, k), candidates[:, :-1]], dim=1)  # [R, S, K]
    context = slot_hidden @ W.T  # [R, S, r]
    return unary[:, :, None, :] + torch.einsum("rspd,rscd->rspc", P[before] * context[:, :, None], S[candidates])


def test_dflash2_export_is_the_public_format_of_the_same_scores(selector_setup, tmp_path):
    target, drafter = selector_setup
    out = export_dflash2(drafter, tmp_path / "dflash2", block_size=5)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 5
    keys = config["dflash_config"]
    assert (keys["selector_rank"], keys["selector_top_k"], keys["conv_kernel_size"]) == (RANK, 4, 1)
    hidden = drafter.config.hidden_size
    assert hidden % keys["conv_group_size"] == 0
    assert not any(name.startswith(("corrector.", "draft_token_ids", "d2t", "lm_head")) for name in tensors)
    for layer in range(drafter.config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = tensors[f"layers.{layer}.{conv}.base_kernel"]
            projection = tensors[f"layers.{layer}.{conv}.kernel_projection.weight"]
            assert base.shape == (2, 1, hidden) and torch.equal(base, torch.ones_like(base))
            assert projection.shape == (2 * hidden // keys["conv_group_size"], hidden) and not projection.any()
    # Same scores as ours wherever the candidates are ours (draft-vocabulary tokens); zero codes elsewhere.
    ids = torch.tensor(DRAFT_VOCAB)
    g = torch.Generator().manual_seed(6)
    candidates = ids[torch.randint(0, len(DRAFT_VOCAB), (2, 4, 4), generator=g)]
    anchors = torch.tensor([int(ids[3]), 47])  # 47 is outside the draft vocabulary
    slot_hidden, unary = torch.randn(2, 4, hidden, generator=g), torch.randn(2, 4, 4, generator=g)
    with torch.no_grad():
        start, pairs = drafter.score_candidates(torch.cat([torch.zeros(2, 1, hidden), slot_hidden], 1), anchors,
                                                candidates, unary)
        theirs = public_scores(tensors, config, slot_hidden, candidates, unary, anchors)
    torch.testing.assert_close(start, theirs[:, 0, 0])
    torch.testing.assert_close(pairs, theirs[:, 1:])
    outside = [t for t in range(48) if t not in DRAFT_VOCAB]
    assert not tensors["candidate_selector.successor_codebook"][outside].any()


def test_other_correctors_do_not_export_as_dflash2(selector_setup, tmp_path):
    target, drafter = selector_setup
    config = copy.deepcopy(drafter.config)
    config.corrector_type, config.draft_vocab_size = "dcoco", None
    with pytest.raises(ValueError, match="candidate selector"):
        export_dflash2(DCOCODrafter(config), tmp_path / "out")
