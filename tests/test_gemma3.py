"""Gemma 3 as a target: a tiny random-weight Gemma3ForCausalLM with what makes the family differ from Llama for a
drafter that reads the target's states (sliding-window layers with full-attention layers between them, one key/value
head, QK-norm, RMSNorm as x * (1 + w), embeddings scaled by sqrt(hidden) inside the embedding module, a tied LM head
over a vocabulary large next to the model). Prompts run past the window, so drafting and verification cross it.

A drafter fitted for seconds gets few drafts accepted on this target (far fewer than on the tiny Llama and Qwen3
ones), so acceptance is asserted where the batch makes it certain; every verify forward still rolls back rejected
columns across the window. Every path must give plain generate()'s output: the assisted path, speculative_generate
with chains and with trees on a ragged batch, the custom_generate route, and sampling (made deterministic with
top_k=1 so equality shows the processors run at every verified position; the distribution itself is tested on Llama
in test_batched.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from dcoco_hf import DCOCODrafter, speculative_generate
from dcoco_hf.training import fit_on_own_answers

VOCAB = 2048  # large next to a 64-wide model, as Gemma's 262k is next to 640
WINDOW = 8
PAD = 0


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=None, eos_token_id=None, bos_token_id=None,
        initializer_range=0.1,  # a random target with some habits: a drafter fitted for seconds gets drafts accepted
    )
    return Gemma3ForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def gemma():
    target = tiny_gemma3()
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=6, top_k=4)
    drafter = fit_on_own_answers(drafter, target, steps=400, prompt_len=12, new_tokens=40)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # whole blocks every cycle
    return target, drafter.attach(target, tune=False)


def _prompt(length: int, seed: int) -> torch.LongTensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _ragged(lengths: list[int], seed: int = 5) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    generator = torch.Generator().manual_seed(seed)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return ids, mask


def test_the_drafter_takes_the_targets_full_attention_rope(gemma):
    """Gemma 3 keeps RoPE settings per layer type (a local base for sliding layers, a global one for full ones); the
    drafter, whose attention reads the whole context, takes the full-attention ones."""
    target, drafter = gemma
    full = target.config.rope_parameters["full_attention"]
    assert drafter.config.rope_parameters["rope_theta"] == full["rope_theta"] != \
        target.config.rope_parameters["sliding_attention"]["rope_theta"]


def test_the_drafter_borrows_the_targets_own_scaling(gemma):
    """The drafter's embedding of a token is the target's (scaled by sqrt(hidden) inside Gemma's embedding module),
    and its logits come from the target's tied head as the target computes its own."""
    target, drafter = gemma
    ids = _prompt(10, 1)
    assert torch.equal(drafter.embed(ids), target.get_input_embeddings()(ids))
    hidden = torch.randn(1, 3, target.config.hidden_size)
    assert torch.equal(drafter.slot_logits(hidden), target.lm_head(hidden).float())
    assert target.get_input_embeddings().embed_scale.item() == pytest.approx(target.config.hidden_size ** 0.5)


@pytest.mark.parametrize("length", [5, 3 * WINDOW])
def test_assisted_greedy_is_plain_generate(gemma, length):
    target, drafter = gemma
    ids = _prompt(length, length)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    got = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    assert drafter.generation_stats(got).cycles > 0  # blocks drafted, verified and rolled back past the window


def _own_text(target, lengths: list[int], seed: int = 6) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-padded rows of the target's own greedy text (4 random tokens, then its continuation): where the fitted
    drafter's drafts are accepted on any CPU's rounding, unlike random tokens."""
    generator, width = torch.Generator().manual_seed(seed), max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    for row, length in enumerate(lengths):
        start = torch.randint(1, VOCAB, (1, 4), generator=generator)
        text = target.generate(start, max_new_tokens=length - 4, do_sample=False)[0] if length > 4 else start[0]
        ids[row, width - length :] = text[:length]
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return ids, mask


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_batched_chains_and_trees_are_plain_generate(gemma, tree_budget):
    target, drafter = gemma
    ids, mask = _own_text(target, [3, 2 * WINDOW + 3, WINDOW])
    common = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=PAD)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, tree_budget=tree_budget, **common)
    assert got.sequences.tolist() == expected.tolist()
    assert sum(sum(row.accepted) for row in got.stats) > 0
    routed = target.generate(ids, custom_generate=speculative_generate, drafter=drafter, tree_budget=tree_budget,
                             **common)
    assert routed.tolist() == expected.tolist()


def test_sampling_follows_the_processors_at_every_position(gemma):
    target, drafter = gemma
    ids, mask = _ragged([4, 2 * WINDOW], seed=9)
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=1,
                  repetition_penalty=1.3, pad_token_id=PAD)
    torch.manual_seed(0)
    expected = target.generate(ids, **common)
    got = speculative_generate(target, ids, drafter=drafter, **common)
    assert got.sequences.tolist() == expected.tolist()
    single = {k: v for k, v in common.items() if k not in ("attention_mask", "pad_token_id")}
    one = ids[1:, :][:, -2 * WINDOW :]
    assert target.generate(one, assistant_model=drafter, **single).tolist() == target.generate(one, **single).tolist()



def test_a_warm_start_copies_what_computes_the_same():
    """init_from_target: Gemma's layers (norms around attention and MLP, a GELU) are not copied into Llama-style
    drafter layers, nor its final norm, whose scale fits the target's own states; a Llama target's layers and norms
    are, each norm computing what the target's does (norms are copied by effective scale: Gemma's store w of 1 + w)."""
    from conftest import make_target

    from dcoco_hf.runtime.drafter import _copy_norm

    target = tiny_gemma3()
    with torch.no_grad():
        target.model.norm.weight.normal_(0.0, 0.5)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4, init_from_target=True)
    last = target.model.layers[-1]
    assert not torch.equal(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(drafter.norm.weight, torch.ones_like(drafter.norm.weight))
    hidden = torch.randn(2, 5, target.config.hidden_size)
    _copy_norm(target.model.norm, drafter.norm)
    torch.testing.assert_close(drafter.norm(hidden), target.model.norm(hidden), atol=1e-5, rtol=1e-5)

    llama = make_target("llama")
    drafter = DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=4, top_k=4, init_from_target=True)
    last, hidden = llama.model.layers[-1], torch.randn(2, 5, llama.config.hidden_size)
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    torch.testing.assert_close(drafter.layers[0].input_layernorm(hidden), last.input_layernorm(hidden))
    torch.testing.assert_close(drafter.norm(hidden), llama.model.norm(hidden))


def test_a_draft_vocabulary_over_gemmas_tied_head_exports_and_stays_exact(gemma, tmp_path):
    """Over a vocabulary large next to the model the drafter proposes from a draft vocabulary: its LM head is those
    rows of the target's tied head, with Gemma's own (unscaled) weights; the public format carries them with `d2t`,
    and greedy decoding through the reloaded folder is plain generate()'s, prompts crossing the window included."""
    from safetensors.torch import load_file

    from dcoco_hf.serving.export import export_dflash

    target, drafter = gemma
    ids = torch.arange(0, VOCAB, 7)  # 293 of 2048 tokens
    vocab = DCOCODrafter.from_pretrained(_saved(drafter, tmp_path / "full")).set_draft_vocabulary(ids)
    vocab.attach(target, tune=False)
    assert torch.equal(vocab.draft_lm_head()[0], target.lm_head.weight[ids])
    folder = export_dflash(vocab, tmp_path / "dflash", draft_vocab=True)
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(torch.arange(len(ids)) + tensors["d2t"], ids)  # vLLM: target id = draft id + d2t[draft id]
    assert torch.equal(tensors["lm_head.weight"], target.get_input_embeddings().weight[ids])  # tied, unscaled
    reloaded = DCOCODrafter.from_pretrained(folder).attach(target, tune=False)
    reloaded.generation_config.num_assistant_tokens_schedule = "constant"
    for prompt in (_prompt(5, 11), _prompt(3 * WINDOW, 12)):
        expected = target.generate(prompt, max_new_tokens=32, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=32, do_sample=False, assistant_model=reloaded),
                           expected)


def _saved(drafter: DCOCODrafter, folder) -> str:
    drafter.save_pretrained(folder)
    return str(folder)
