"""LiLiCorr corrector (dcoco_hf/network/lilicorr.py), its public checkpoint format, its training loss,
and DScout's AWL."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import PROMPT_LEN, fit_drafter, make_target
from safetensors.torch import save_file
from torch.nn import functional as F

from dcoco_hf import DCOCOConfig, DCOCODrafter, speculative_generate
from dcoco_hf.network.lilicorr import LiLiCorrCorrector, PairEvidence
from dcoco_hf.training import drafter_loss, target_context
from dcoco_hf.training.losses import awl_slot_weights, lilicorr_loss

HEAD = {"lilicorr_hidden_size": 16, "lilicorr_num_layers": 1, "lilicorr_num_heads": 2, "lilicorr_factor_dim": 8}
# The public format as its servers read it: every lilicorr_* key inside dflash_config (candidate_topk included).
PUBLIC_GEOMETRY = {
    "lilicorr_enabled": True, "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16, "lilicorr_num_layers": 1,
    "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8, "lilicorr_vector_eps": 1e-4,
    "lilicorr_logit_scale": 8.0,
}


@pytest.fixture(scope="module")
def lilicorr_setup():
    """(target, a LiLiCorr drafter whose backbone is the session's fitted one and whose head is random)."""
    target = make_target("llama")
    fitted = fit_drafter(target, block_size=5, top_k=4, steps=60)
    drafter = lilicorr_copy(fitted, target)
    randomise(drafter.corrector)
    return target, drafter


def lilicorr_copy(drafter: DCOCODrafter, target, **fields) -> DCOCODrafter:
    """The same backbone with a fresh (zero-gated) LiLiCorr head; `fields` set more config fields."""
    config = copy.deepcopy(drafter.config)
    config.corrector_type = "lilicorr"
    config.context_bigrams, config.corpus_bigrams = False, None
    for name, value in {**HEAD, **fields}.items():
        setattr(config, name, value)
    clone = DCOCODrafter(config)
    clone.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("corrector.")},
                          strict=False)
    return clone.eval().attach(target, tune=False)


def randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights for a LiLiCorr head (gate 1) or a part of one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    if isinstance(module, LiLiCorrCorrector):
        module.set_gate(1.0)


def prompts(n: int = 3, seed: int = 1) -> torch.LongTensor:
    return torch.randint(0, 48, (n, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def lattice(head: LiLiCorrCorrector, rows: int = 2, slots: int = 4, k: int = 4, width: int = 32, seed: int = 0):
    """Random inputs of `head` (drafter width `width`): slot hiddens, candidate tokens (token_proj of random
    embeddings), log-probs best first, anchor rows (the second one absent)."""
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(rows, slots, k, generator=g).sort(-1, descending=True).values.log_softmax(-1)
    with torch.no_grad():
        tokens = head.token_proj(torch.randn(rows, slots, k, width, generator=g))
    return (torch.randn(rows, slots, width, generator=g), tokens, log_probs, torch.randn(rows, width, generator=g),
            torch.tensor([True, False][:rows]))


def public_vectors(head: LiLiCorrCorrector, slot_hidden, tokens, log_probs, anchor_hidden, anchor_valid):
    """The head's unit vectors as the public description writes them: each candidate state joined with the anchor
    as [x; a; x * a] -> factor_input_proj -> SiLU, then the out, in and anchor_out heads, each normalised."""
    rows, slots, k, width = tokens.shape
    x = tokens + head.pass_hidden_proj(slot_hidden)[:, :, None] + head.feature_mlp(head._features(log_probs))
    x = (x + head.slot_embedding[0, :, :slots] + head.rank_embedding[0, :, :, :k]).reshape(rows, slots * k, width)
    for layer in head.layers:
        x = layer(x, head._attention_bias(slots, k))
    x = head.output_norm(x).view(rows, slots, k, width)
    anchor = head.anchor_norm(head.context_proj(anchor_hidden) * anchor_valid[:, None].float())[:, None, None]
    factor = F.silu(head.factor_input_proj(torch.cat([x, anchor.expand_as(x), x * anchor], dim=-1)))
    vectors = head.anchor_out_head(anchor[:, 0, 0]), head.out_head(factor), head.in_head(factor)
    return tuple(F.normalize(v, dim=-1, eps=head.vector_eps) for v in vectors)


def test_vectors_are_the_public_heads_function():
    """Drafting folds the anchor into factor_input_proj and runs out_head and in_head as one product; it must stay
    the public head's function (public checkpoints score as their servers do)."""
    head = LiLiCorrCorrector(32, block_size=5, top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8)
    randomise(head)
    inputs = lattice(head)
    with torch.no_grad():
        for ours, theirs in zip(head.vectors(*inputs), public_vectors(head, *inputs)):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_drafting_reads_candidate_tokens_from_a_table_that_follows_the_weights():
    head = LiLiCorrCorrector(32, block_size=5, top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8)
    randomise(head)
    embedding = torch.nn.Embedding(48, 32)
    ids = torch.randint(0, 48, (2, 4, 4), generator=torch.Generator().manual_seed(3))
    trained = head.candidate_tokens(ids, embedding)  # autograd on: token_proj(E[c]) as written
    assert trained.requires_grad
    with torch.no_grad():
        drafted = head.candidate_tokens(ids, embedding)  # a gather from token_proj(E)
        torch.testing.assert_close(drafted, trained.detach(), rtol=1e-5, atol=1e-6)
        assert head._token_table(embedding).shape == (48, 16)
        embedding.weight.mul_(2)  # a changed target embedding (or token_proj) rebuilds the table
        head.token_proj.bias.add_(1)
        torch.testing.assert_close(head.candidate_tokens(ids, embedding), head.token_proj(embedding(ids)))


def test_batched_scores_equal_the_per_pair_formula():
    head = LiLiCorrCorrector(32, block_size=5, top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8)
    randomise(head)
    inputs = lattice(head)
    start, pairs = head(*inputs)
    anchor_out, out_vec, in_vec = head.vectors(*inputs)
    assert pairs.shape == (2, 3, 4, 4) and start.shape == (2, 4)
    scale = head.logit_scale * float(head.gate.detach())
    for r in range(2):
        for b in range(4):
            naive = scale * F.cosine_similarity(anchor_out[r], in_vec[r, 0, b], dim=0)
            torch.testing.assert_close(start[r, b], naive, rtol=1e-5, atol=1e-5)
        for p in range(3):
            for a in range(4):
                for b in range(4):
                    naive = scale * F.cosine_similarity(out_vec[r, p, a], in_vec[r, p + 1, b], dim=0)
                    torch.testing.assert_close(pairs[r, p, a, b], naive, rtol=1e-5, atol=1e-5)
    # A shorter block reads the same head (its first slot embeddings and the same relative-slot bias).
    short = [t[:, :2] if t.dim() > 2 else t for t in inputs[:3]] + list(inputs[3:])
    assert head(*short)[1].shape == (2, 1, 4, 4)


def test_untrained_head_proposes_the_drafter_argmax(lilicorr_setup):
    target, trained = lilicorr_setup
    fresh = lilicorr_copy(trained, target)  # zero score gate: every score 0
    ids = prompts(1)
    with torch.no_grad():
        states, _ = target_context(target, fresh.config.target_layer_ids, ids)
    from dcoco_hf.runtime.context_cache import DraftContextCache

    positions = torch.arange(PROMPT_LEN - 1 + fresh.config.block_size)[None]
    args = (ids[:, -1], states[:, :-1], positions)
    on = fresh.propose(*args, DraftContextCache())
    off = fresh.propose(*args, DraftContextCache(), correct=False)
    assert torch.equal(on.first_slot_scores, torch.zeros_like(on.first_slot_scores))
    assert torch.equal(on.transition_scores, torch.zeros_like(on.transition_scores))
    assert torch.equal(on.chosen, torch.zeros_like(on.chosen)) and torch.equal(on.tokens, off.tokens)


def test_greedy_output_identical_on_both_generation_paths(lilicorr_setup):
    target, drafter = lilicorr_setup
    ids = prompts(3)
    mask = torch.ones_like(ids)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for row in range(3):
        one = ids[row:row + 1]
        out = target.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=24, do_sample=False,
                              assistant_model=drafter)
        assert torch.equal(out, plain[row:row + 1])
    stats = drafter.generation_stats(out)
    assert stats.corrector_seconds > 0  # the head really ran
    batched = speculative_generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=24)
    assert torch.equal(batched.sequences[:, :plain.shape[1]], plain)


def test_public_format_folder_loads_and_drafts(lilicorr_setup, tmp_path):
    """A folder written from the public format's description alone: config.json with architectures
    LiLiCorrDraftModel, model_type qwen3 and the head geometry inside dflash_config; model.safetensors with the DFlash
    backbone tensors and the head under lilicorr.* (attention in nn.MultiheadAttention's names)."""
    target, drafter = lilicorr_setup
    cfg = drafter.config
    config = {
        "architectures": ["LiLiCorrDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size":
        cfg.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": 48, "tie_word_embeddings": False,
        "num_target_layers": 4,
        "dflash_config": {"block_size": 5, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": cfg.target_layer_ids, **PUBLIC_GEOMETRY},
    }
    h, f, width = 16, 8, 32
    g = torch.Generator().manual_seed(3)
    head = {  # every tensor of the public head, by name and shape
        "token_proj.weight": (h, width), "token_proj.bias": (h,), "pass_hidden_proj.weight": (h, width),
        "pass_hidden_proj.bias": (h,), "feature_mlp.0.weight": (5,), "feature_mlp.0.bias": (5,),
        "feature_mlp.1.weight": (h, 5), "feature_mlp.1.bias": (h,), "feature_mlp.3.weight": (h, h),
        "feature_mlp.3.bias": (h,), "slot_embedding": (1, 1, 4, 1, h), "rank_embedding": (1, 1, 1, 4, h),
        "relative_slot_bias": (2, 9), "same_slot_bias": (2,), "context_proj.weight": (h, width),
        "context_proj.bias": (h,), "layers.0.attn_norm.weight": (h,), "layers.0.attn.in_proj_weight": (3 * h, h),
        "layers.0.attn.in_proj_bias": (3 * h,), "layers.0.attn.out_proj.weight": (h, h),
        "layers.0.attn.out_proj.bias": (h,), "layers.0.mlp_norm.weight": (h,), "layers.0.mlp.0.weight": (2 * h, h),
        "layers.0.mlp.0.bias": (2 * h,), "layers.0.mlp.2.weight": (h, 2 * h), "layers.0.mlp.2.bias": (h,),
        "output_norm.weight": (h,), "anchor_norm.weight": (h,), "factor_input_proj.weight": (h, 3 * h),
        "factor_input_proj.bias": (h,), "out_head.weight": (f, h), "out_head.bias": (f,), "in_head.weight": (f, h),
        "in_head.bias": (f,), "anchor_out_head.weight": (f, h), "anchor_out_head.bias": (f,),
    }
    tensors = {"lilicorr." + name: torch.randn(shape, generator=g) * 0.5 for name, shape in head.items()}
    backbone = {k: v.clone() for k, v in drafter.state_dict().items()
                if k.startswith(("fc.", "hidden_norm.", "layers.", "norm."))}
    save_file({**backbone, **tensors}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = DCOCODrafter.from_pretrained(tmp_path).eval().attach(target, tune=False)
    assert loaded.config.corrector_type == "lilicorr" and loaded.config.top_k == 4
    assert loaded.config.lilicorr_logit_scale == 8.0 and float(loaded.corrector.gate.detach()) == 1.0
    state = loaded.state_dict()
    for name, tensor in tensors.items():
        torch.testing.assert_close(state["corrector." + name[len("lilicorr."):]], tensor)
    ids = prompts(1, seed=4)
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          assistant_model=loaded)
    assert torch.equal(out, plain)

    del config["dflash_config"]["lilicorr_logit_scale"]  # a shape-free field: guessing it would score another function
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lilicorr_logit_scale"):
        DCOCODrafter.from_pretrained(tmp_path)


def test_save_in_public_format_round_trip(lilicorr_setup, tmp_path):
    target, drafter = lilicorr_setup
    drafter.corrector.set_gate(0.5)  # folded into the exported logit_scale
    drafter.save_pretrained(tmp_path, format="lilicorr")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert config["dflash_config"]["lilicorr_logit_scale"] == pytest.approx(drafter.config.lilicorr_logit_scale / 2)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "lilicorr.layers.0.attn.in_proj_weight" in names and "fc.weight" in names
    assert not any(n.startswith("corrector.") or n.endswith("score_gate") for n in names)
    loaded = DCOCODrafter.from_pretrained(tmp_path).eval().attach(target, tune=False)
    ids = torch.randint(0, 48, (2, 4, 4))
    slot_hidden, log_probs = torch.randn(2, 4, 32), torch.randn(2, 4, 4).log_softmax(-1)
    anchor = torch.randn(2, 32), torch.tensor([True, True])
    embedding = target.get_input_embeddings()

    def scores(model: DCOCODrafter) -> tuple[torch.Tensor, torch.Tensor]:
        head = model.corrector
        return head(slot_hidden, head.candidate_tokens(ids, embedding), log_probs, *anchor)

    with torch.no_grad():
        for ours, theirs in zip(scores(drafter), scores(loaded)):
            torch.testing.assert_close(ours, theirs)
    drafter.corrector.set_gate(1.0)


def test_old_configs_load_as_dcoco():
    assert DCOCOConfig(target_layer_ids=[0]).corrector_type == "dcoco"
    config = DCOCOConfig.from_dict({"target_layer_ids": [0], "block_size": 4, "top_k": 4, "vocab_size": 48})
    assert config.corrector_type == "dcoco" and config.block_size == 4
    with pytest.raises(ValueError, match="corrector_type"):
        DCOCOConfig(target_layer_ids=[0], corrector_type="tree")


def stage_2_losses(target, student: DCOCODrafter, steps: int, lr: float) -> tuple[float, float]:
    """The stage-2 (corrector) loss on the target's own answers to six prompts, before and after `steps` Adam steps
    of `student`'s trainable parameters (every step on the same anchors)."""
    ids = target.generate(prompts(6, seed=5), attention_mask=torch.ones(6, PROMPT_LEN, dtype=torch.long),
                          max_new_tokens=24, do_sample=False)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    states, argmax = target_context(target, student.config.target_layer_ids, ids)
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=lr)

    def losses():
        return drafter_loss(student, ids, loss_mask, states, argmax, num_anchors=8,
                            generator=torch.Generator().manual_seed(0))

    before = float(losses().dcoco)
    for _ in range(steps):
        optimizer.zero_grad()
        losses().loss.backward()
        optimizer.step()
    return before, float(losses().dcoco)


def test_training_step_lowers_the_lilicorr_loss(lilicorr_setup):
    target, drafter = lilicorr_setup
    student = copy.deepcopy(drafter).attach(target, tune=False)
    student.requires_grad_(False)
    student.corrector.requires_grad_(True)
    before, after = stage_2_losses(target, student, steps=15, lr=3e-3)
    assert after < 0.8 * before


def test_lilicorr_loss_reads_the_true_predecessor_row_on_the_oracle_prefix():
    start = torch.tensor([[0.0, 2.0]])  # slot 1: true candidate 1
    pairs = torch.tensor([[[[5.0, 0.0], [0.0, 3.0]], [[9.0, 9.0], [9.0, 9.0]]]])  # [1, 2, 2, 2]
    index = torch.tensor([[1, 1, 0]])
    found = torch.tensor([[True, True, False]])  # slot 3's true token is outside the top-K: no loss there
    expected = (F.cross_entropy(torch.tensor([[0.0, 2.0]]), torch.tensor([1]))
                + F.cross_entropy(torch.tensor([[0.0, 3.0]]), torch.tensor([1]))) / 2  # row of candidate 1
    torch.testing.assert_close(lilicorr_loss(start, pairs, index, found), expected)


def test_awl_weights_hand_worked():
    # The drafter's probability of each slot's label, two blocks of four slots; block 2's slot 3 is unlabelled.
    probs = torch.tensor([[0.5, 0.8, 0.25, 0.9], [1.0, 0.5, 0.7, 0.6]], requires_grad=True)
    labelled = torch.tensor([[True, True, True, True], [True, True, False, False]])
    weights = awl_slot_weights(probs, labelled)
    expected = torch.tensor([[1.0, 0.5, 0.4, 0.1], [1.0, 1.0, 0.5, 0.0]])  # prod of the earlier slots' probabilities
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad  # stop-gradient: the weights steer, they are not trained


def test_awl_option_reaches_the_dflash_loss(lilicorr_setup):
    target, drafter = lilicorr_setup
    ids = target.generate(prompts(4, seed=6), attention_mask=torch.ones(4, PROMPT_LEN, dtype=torch.long),
                          max_new_tokens=16, do_sample=False)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, PROMPT_LEN:] = True
    states, argmax = target_context(target, drafter.config.target_layer_ids, ids)
    kwargs = {"num_anchors": 6, "dcoco": False}
    decay = drafter_loss(drafter, ids, loss_mask, states, argmax, generator=torch.Generator().manual_seed(0), **kwargs)
    awl = drafter_loss(drafter, ids, loss_mask, states, argmax, generator=torch.Generator().manual_seed(0),
                       slot_weighting="awl", **kwargs)
    assert torch.isfinite(awl.loss) and not torch.isclose(awl.loss, decay.loss)
    with pytest.raises(ValueError, match="slot_weighting"):
        drafter_loss(drafter, ids, loss_mask, states, argmax, slot_weighting="flat", **kwargs)


def evidence_head(seed: int = 0) -> LiLiCorrCorrector:
    """A random LiLiCorr head with pair evidence reading m(a, b) and the corpus inputs."""
    head = LiLiCorrCorrector(32, block_size=5, top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8,
                             context_bigrams=True, corpus_bigrams=True)
    randomise(head, seed)
    return head


def pair_facts(rows: int = 2, slots: int = 4, k: int = 4, seed: int = 5):
    """(seen, corpus) over the pair lattice, as the drafter hands them to the head: m(a, b) [R, S, K, K], whose pair
    0 is anchor -> slot 1 (its K rows equal, the anchor repeated), and the corpus inputs [R, S, K, K, 2]."""
    g = torch.Generator().manual_seed(seed)

    def lattice_of(first: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        return torch.cat([first[:, None, None].expand(rows, 1, k, *first.shape[1:]), rest], dim=1)

    seen = lattice_of((torch.rand(rows, k, generator=g) < 0.5).float(),
                      (torch.rand(rows, slots - 1, k, k, generator=g) < 0.5).float())
    corpus = lattice_of(torch.rand(rows, k, 2, generator=g) * 3, torch.rand(rows, slots - 1, k, k, 2, generator=g) * 3)
    return seen, corpus


def test_pair_evidence_adds_its_mlp_to_every_score_and_starts_at_zero():
    head = evidence_head()
    inputs = lattice(head)
    seen, corpus = pair_facts()
    plain = copy.deepcopy(head)
    plain.evidence = None  # the public head: cosine scores only
    start0, pairs0 = plain(*inputs)
    start, pairs = head(*inputs, seen=seen, corpus=corpus)
    ev, scale = head.evidence, head.logit_scale
    log_probs = inputs[2]

    def by_hand(score: torch.Tensor, gap: torch.Tensor, m: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = ev.inputs.weight @ torch.cat([torch.stack([score / scale, gap, m]), c]) + ev.inputs.bias
        return (ev.out.weight[0] @ F.silu(x) + ev.out.bias[0]).detach()

    for r in range(2):
        for b in range(4):
            gap = log_probs[r, 0, b] - log_probs[r, 0, 0]
            expected = start0[r, b] + by_hand(start0[r, b], gap, seen[r, 0, 0, b], corpus[r, 0, 0, b])
            torch.testing.assert_close(start[r, b], expected, rtol=1e-5, atol=1e-4)
        for p in range(3):
            for a in range(4):
                for b in range(4):
                    gap = log_probs[r, p + 1, b] - log_probs[r, p + 1, 0]
                    facts = seen[r, p + 1, a, b], corpus[r, p + 1, a, b]
                    expected = pairs0[r, p, a, b] + by_hand(pairs0[r, p, a, b], gap, *facts)
                    torch.testing.assert_close(pairs[r, p, a, b], expected, rtol=1e-5, atol=1e-4)
    # Fresh evidence (zero output layer, as the drafter initialises it) scores exactly as the head alone.
    fresh = LiLiCorrCorrector(32, block_size=5, top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8,
                              context_bigrams=True, corpus_bigrams=True)
    fresh.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("evidence.out")},
                          strict=False)
    for ours, theirs in zip(fresh(*inputs, seen=seen, corpus=corpus), (start0, pairs0)):
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="pair evidence"):
        head(*inputs, corpus=corpus)  # m(a, b) not given
    # Trained evidence gaining the corpus input scores as before until trained.
    without_corpus = copy.deepcopy(head)
    without_corpus.evidence = PairEvidence(seen=True, corpus=False)
    randomise(without_corpus.evidence, seed=2)
    before = without_corpus(*inputs, seen=seen)
    without_corpus.add_corpus_input()
    for ours, theirs in zip(without_corpus(*inputs, seen=seen, corpus=corpus), before):
        torch.testing.assert_close(ours, theirs)


def test_evidence_head_drafts_losslessly_and_exports_as_the_plain_head(lilicorr_setup, tmp_path, capsys):
    target, plain = lilicorr_setup
    drafter = lilicorr_copy(plain, target, context_bigrams=True)
    drafter.corrector.load_state_dict(plain.corrector.state_dict(), strict=False)  # the same head, plus evidence
    randomise(drafter.corrector.evidence, seed=1)
    ids = prompts(2, seed=6)
    out = speculative_generate(target, ids, attention_mask=torch.ones_like(ids), drafter=drafter, max_new_tokens=24)
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences[:, :expected.shape[1]], expected)
    with torch.no_grad():
        states, _ = target_context(target, drafter.config.target_layer_ids, ids[:1])
    from dcoco_hf.runtime.context_cache import DraftContextCache

    positions = torch.arange(PROMPT_LEN - 1 + drafter.config.block_size)[None]
    args = (ids[:1, -1], states[:, :-1], positions)
    with_evidence = drafter.propose(*args, DraftContextCache(), context_ids=ids[:1])
    without = plain.propose(*args, DraftContextCache())
    assert not torch.equal(with_evidence.transition_scores, without.transition_scores)  # the evidence really scores

    capsys.readouterr()
    drafter.save_pretrained(tmp_path / "public", format="lilicorr")
    assert "pair evidence" in capsys.readouterr().err  # dropped, and said so
    exported = DCOCODrafter.from_pretrained(tmp_path / "public").eval().attach(target, tune=False)
    assert exported.corrector.evidence is None and not exported.config.context_bigrams
    # ... and it drafts as the warning says: as our folder loaded with the evidence off.
    drafter.save_pretrained(tmp_path / "ours")
    head_alone = DCOCODrafter.from_pretrained(tmp_path / "ours", context_bigrams=False, corpus_bigrams=None)
    for other in (exported, head_alone.eval().attach(target, tune=False)):
        again = other.propose(*args, DraftContextCache())
        torch.testing.assert_close(again.transition_scores, without.transition_scores)
        torch.testing.assert_close(again.first_slot_scores, without.first_slot_scores)


def test_evidence_only_training_moves_the_evidence_alone(lilicorr_setup):
    from dcoco_hf.training.trainer import DrafterTrainingModel

    target, plain = lilicorr_setup
    with pytest.raises(ValueError, match="pair evidence"):
        DrafterTrainingModel(copy.deepcopy(plain), target, stage=2, evidence_only=True)
    drafter = lilicorr_copy(plain, target, context_bigrams=True)
    drafter.corrector.load_state_dict(plain.corrector.state_dict(), strict=False)
    model = DrafterTrainingModel(drafter, target, stage=2, evidence_only=True)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all(".corrector.evidence." in name for name in trainable)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    first, last = stage_2_losses(target, drafter, steps=10, lr=1e-2)
    assert last < first
    changed = {k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("corrector.evidence.") for k in changed)
