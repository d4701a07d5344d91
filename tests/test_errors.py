"""Misuse fails early with a message naming the problem and the fix (or is pinned down where transformers decides)."""

from __future__ import annotations

import copy
import json
import logging
import re

import pytest
import torch
import transformers
from conftest import VOCAB, make_target
from transformers.utils import logging as hf_logging

from dcoco_hf import DCOCOConfig, DCOCODrafter, speculative_generate

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture
def drafter(target):
    torch.manual_seed(0)
    return DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)


def _ids(length: int = 6, seed: int = 0) -> torch.LongTensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 4, **overrides})
    return transformers.LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------------------------------------------- attach


def test_hidden_size_mismatch(drafter):
    wide = _llama(hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match=r"Hidden size mismatch: the drafter is 32 wide, the target 64") as error:
        drafter.attach(wide)
    assert "DCOCODrafter.from_target(target)" in str(error.value)


def test_vocab_mismatch(drafter):
    with pytest.raises(ValueError, match=r"Vocabulary mismatch: the drafter expects 48 tokens.* has 64") as error:
        drafter.attach(make_target("llama", vocab=64))
    assert "Use the target the drafter was trained for" in str(error.value)


def test_target_layer_ids_out_of_range_at_attach(target):
    config = DCOCOConfig(**{k: v for k, v in TINY.items() if not k.endswith("token_id")}, num_hidden_layers=1,
                         block_size=4, top_k=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 6])
    drafter = DCOCODrafter(config)
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 6\] is out of range: the target has 4 decoder "
                                         r"layers \(valid ids 0\.\.3\)") as error:
        drafter.attach(target)
    assert "use a matching one" in str(error.value)


def test_target_layer_ids_out_of_range_in_config():
    with pytest.raises(ValueError, match=r"out of range for a target with num_target_layers=36 \(valid: 0\.\.35\)"):
        DCOCOConfig(target_layer_ids=[1, 9, 17, 25, 36], num_target_layers=36)
    with pytest.raises(ValueError, match="negative layer index"):
        DCOCOConfig(target_layer_ids=[-1, 3])
    # The public Qwen3-8B layout is valid.
    assert DCOCOConfig(target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36).target_layer_ids[-1] == 33


def test_older_block_size_fields_fold_into_block_size():
    """config.json files once kept max_block_size (the longest block of mixed-horizon training) and
    lilicorr_block_size (a LiLiCorr head's size) beside block_size: they load as the one block_size, checked."""
    assert DCOCOConfig(block_size=3, max_block_size=6).block_size == 6
    assert DCOCOConfig(block_size=4, max_block_size=3).block_size == 4  # block_size was the longer one
    assert DCOCOConfig(block_size=8, lilicorr_block_size=4, corrector_type="lilicorr").block_size == 4  # the head's
    assert "max_block_size" not in DCOCOConfig(block_size=3, max_block_size=6).to_dict()
    with pytest.raises(ValueError, match=r"max_block_size='6' must be an integer"):
        DCOCOConfig(block_size=3, max_block_size="6")
    with pytest.raises(ValueError, match=r"block_size=1: a block needs the anchor plus at least one mask slot"):
        DCOCOConfig(block_size=1, max_block_size=1)


def test_a_block_size_beyond_the_positions_is_refused_at_load(tmp_path, drafter):
    with pytest.raises(ValueError, match=r"block_size=1000000 .*max_position_embeddings=40960"):
        DCOCOConfig(block_size=1_000_000)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "block_size": 1_000_000}))
    with pytest.raises(ValueError, match=r"block_size=1000000 .*max_position_embeddings=512.*config\.json"):
        DCOCODrafter.from_pretrained(tmp_path)


def test_a_block_size_beyond_the_targets_positions_is_refused_at_attach():
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(_llama(), num_hidden_layers=1, block_size=100, top_k=4).detach()
    short = _llama(max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"block_size=100 .*max_position_embeddings=64"):
        drafter.attach(short, tune=False)


def test_tuning_refuses_a_block_it_cannot_time_before_timing_anything(monkeypatch, target):
    """A block beyond what the tuning times (positions allow it) is refused at once, naming block_size and the ways
    out, instead of timing layouts for minutes."""
    from dcoco_hf.runtime import tuning

    def never(*args, **kwargs):
        raise AssertionError("timed a block the tuning cannot cache")

    monkeypatch.setattr(tuning, "use_few_rows_linear", never)
    monkeypatch.setattr(tuning, "measure_cycle_costs", never)
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=100, top_k=4).detach()
    attention, hooks = target.config._attn_implementation, sum(len(m._forward_hooks) for m in target.modules())
    with pytest.raises(ValueError, match=r"block_size.*100.*attach\(target, block_size=N\).*tune=False"):
        drafter.attach(target)
    assert target.config._attn_implementation == attention  # nothing was switched before the refusal
    assert drafter.generation_config.num_assistant_tokens == 99
    assert drafter._target_ref is None and sum(len(m._forward_hooks) for m in target.modules()) == hooks  # detached


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_target(drafter, kind):
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, decoder_start_token_id=0))
    else:
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=4, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))
    with pytest.raises(ValueError, match="is an encoder-decoder model; DCOCO drafters speculate for decoder-only "
                                         r"causal LMs \(AutoModelForCausalLM\)"):
        drafter.attach(model)


def _qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **TINY, num_hidden_layers=4, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, full_attention_interval=4))


def _mamba():
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=4, expand=2, eos_token_id=None,
        bos_token_id=None, pad_token_id=None))


@pytest.mark.parametrize("build", [_qwen3_next, _mamba], ids=["qwen3_next", "mamba"])
def test_target_with_uncroppable_cache(drafter, build):
    """Recurrent states cannot be rolled back after a rejected draft (transformers itself refuses them mid-generate)."""
    model = build().eval()
    with pytest.raises(ValueError, match=r"\['linear_attention'\] layers whose cache cannot be cropped after a "
                                         "rejected draft; speculative decoding needs a croppable"):
        drafter.attach(model)


def test_short_convolution_hybrid_is_accepted(monkeypatch):
    """LFM2's `conv` layers keep only convolution states, which transformers 5.24 crops: such targets must work.

    An oracle drafter (the true continuation, spoiled from a slot that cycles through 0..S) makes transformers crop
    the convolution states by every possible number of rejected tokens."""
    torch.manual_seed(0)
    lfm2 = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, full_attn_idxs=[1, 3], eos_token_id=None, bos_token_id=None, pad_token_id=None)).eval()
    drafter = DCOCODrafter.from_target(lfm2, num_hidden_layers=1, block_size=4, top_k=4)
    slots = drafter.config.block_size - 1
    ids = _ids()
    expected = lfm2.generate(ids, max_new_tokens=24, do_sample=False)
    assert lfm2.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter).tolist() == expected.tolist()

    propose, calls = DCOCODrafter.propose, []

    def oracle(self, anchor_ids, context, position_ids, *args, **kwargs):
        proposal = propose(self, anchor_ids, context, position_ids, *args, **kwargs)
        drafted = proposal.tokens.shape[1]  # the block's slots (near the end a cycle may draft fewer)
        start = int(position_ids[0, -drafted - 1]) + 1  # position of the first drafted slot
        truth = torch.cat([expected[0, start : start + drafted], proposal.tokens[0]])[:drafted]
        spoil = len(calls) % (slots + 1)  # slots before `spoil` are right, the rest wrong
        proposal.tokens = torch.where(torch.arange(drafted) < spoil, truth, (truth + 1) % VOCAB)[None]
        calls.append(spoil)
        return proposal

    monkeypatch.setattr(DCOCODrafter, "propose", oracle)
    got = lfm2.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    assert set(drafter.generation_stats(got).accepted) == set(range(slots + 1))


# ---------------------------------------------------------------------------------------------------- generate


def test_unattached_drafter_as_assistant(target, drafter):
    fresh = DCOCODrafter(drafter.config)
    copied = copy.deepcopy(drafter)  # copies carry weights, not the binding to a live target
    for unattached in (fresh, copied):
        with pytest.raises(RuntimeError, match=r"not attached to a target model\. Call `drafter\.attach\(target\)`"):
            target.generate(_ids(), max_new_tokens=8, do_sample=False, assistant_model=unattached)


def test_the_network_alone_as_assistant_names_the_fix(target, drafter, tmp_path):
    """The network class (what a folder's own code gives where the package is not installed) cannot draft for
    generate(): transformers' first read of it says so, instead of a bare AttributeError."""
    from dcoco_hf.network.modeling_dcoco import DCOCODraftModel

    drafter.save_pretrained(tmp_path)
    network = DCOCODraftModel.from_pretrained(tmp_path)
    with pytest.raises(AttributeError, match=r"drafter network alone .*pip install dcoco-hf.*attach\(target\)"):
        target.generate(_ids(), max_new_tokens=8, do_sample=False, assistant_model=network)
    assert not hasattr(network, "generation_config")  # still an AttributeError for transformers' own probes


def test_a_prompt_without_tokens_is_refused_on_both_paths(target, drafter):
    drafter.attach(target, tune=False)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids holds no tokens"):
        target.generate(empty, max_new_tokens=8, do_sample=False, assistant_model=drafter)
    with pytest.raises(ValueError, match="input_ids holds no tokens"):
        speculative_generate(target, empty, drafter=drafter, max_new_tokens=8)


def test_a_positional_attention_mask_is_refused_naming_the_keyword(target, drafter):
    drafter.attach(target, tune=False)
    ids = _ids()
    with pytest.raises(TypeError, match=r"got a tensor as logits_processor.*attention_mask=mask"):
        speculative_generate(target, ids, torch.ones_like(ids), drafter=drafter, max_new_tokens=8)


def test_numpy_and_tensor_integers_are_tree_budgets(target, drafter):
    import numpy as np

    drafter.attach(target, tune=False)
    expected = target.generate(_ids(), max_new_tokens=8, do_sample=False)
    for budget in (np.int64(16), torch.tensor(4)):
        got = speculative_generate(target, _ids(), drafter=drafter, max_new_tokens=8, tree_budget=budget)
        assert got.sequences.tolist() == expected.tolist()
    for bad in (1.5, True, np.float32(2)):
        with pytest.raises(ValueError, match="tree_budget"):
            speculative_generate(target, _ids(), drafter=drafter, max_new_tokens=8, tree_budget=bad)


def test_a_users_generation_config_with_processor_and_criteria_lists(target, drafter):
    """A user's generation_config plus logits_processor and stopping_criteria (even empty lists) is a direct call,
    prepared by generate() like any other: exact, not mistaken for the call transformers itself makes."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    drafter.attach(target, tune=False)
    ids = _ids()
    written = target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    cases = [
        (LogitsProcessorList(), StoppingCriteriaList()),
        (LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]),
         StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 5)])),  # replaces max_new_tokens, as in generate()
        (LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 11)])),
        (LogitsProcessorList(), StoppingCriteriaList([EosTokenCriteria(int(written[3]))])),  # the caller's own EOS
    ]
    for processors, criteria in cases:
        config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=VOCAB - 1)  # not in the prompt
        expected = target.generate(ids, generation_config=config, logits_processor=processors,
                                   stopping_criteria=criteria)
        got = speculative_generate(target, ids, processors, criteria, config, drafter=drafter)
        assert got.sequences.tolist() == expected.tolist()


def test_drafter_attached_elsewhere(drafter):
    other = make_target("llama", seed=7)  # same shapes: nothing at attach time could tell them apart
    with pytest.raises(RuntimeError, match=r"generate\(\) was called on a different model than the one this drafter "
                                           r"is attached to\. Call `drafter\.attach\(model\)`"):
        other.generate(_ids(), max_new_tokens=20, do_sample=False, assistant_model=drafter)
    # After re-attaching, the same drafter serves the other model exactly.
    drafter.attach(other)
    expected = other.generate(_ids(), max_new_tokens=20, do_sample=False)
    got = other.generate(_ids(), max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert got.tolist() == expected.tolist()


def test_batch_and_multiple_return_sequences(target, drafter):
    """transformers' own checks; they name the problem (not a DCOCO-specific fix)."""
    with pytest.raises(ValueError, match=r"assisted generate is only supported for batch_size = 1"):
        target.generate(_ids().repeat(2, 1), max_new_tokens=8, do_sample=False, assistant_model=drafter)
    with pytest.raises(ValueError, match="num_return_sequences has to be 1 when doing assisted generate"):
        target.generate(_ids(), max_new_tokens=8, do_sample=True, num_return_sequences=2, assistant_model=drafter)


def test_beam_search_ignores_the_assistant(target, drafter, monkeypatch):
    """transformers 5.24 keeps beam search and silently drops the assistant (one logged warning): the output is plain
    beam search and the drafter is never consulted. Pinned here so a change of that behaviour is noticed."""
    calls = []
    original = DCOCODrafter.generate
    monkeypatch.setattr(DCOCODrafter, "generate", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers.generation.configuration_utils")
    logger.addHandler(handler)
    try:
        got = target.generate(_ids(seed=3), max_new_tokens=10, num_beams=2, do_sample=False, assistant_model=drafter)
    finally:
        logger.removeHandler(handler)
    assert got.tolist() == target.generate(_ids(seed=3), max_new_tokens=10, num_beams=2, do_sample=False).tolist()
    assert got.tolist() != target.generate(_ids(seed=3), max_new_tokens=10, do_sample=False).tolist()
    assert calls == []
    assert any("assisted generate is only supported with Greedy Search and Sample" in r.getMessage() for r in records)


@pytest.mark.parametrize("schedule", ["cost", "constant"])
@pytest.mark.parametrize(
    "field, value",
    [("num_assistant_tokens", -1), ("num_assistant_tokens", 2.5), ("assistant_confidence_threshold", 1.5),
     ("assistant_confidence_threshold", float("nan")), ("assistant_confidence_threshold", -1),
     ("assistant_confidence_threshold", "0.5")],
)
def test_bad_proposal_settings_are_refused_when_a_call_starts(target, drafter, schedule, field, value):
    """num_assistant_tokens: a positive integer; assistant_confidence_threshold: a number in [0, 1]; checked in one
    place whichever loop starts the call and whichever schedule sizes the proposals."""
    drafter.generation_config.num_assistant_tokens_schedule = schedule
    setattr(drafter.generation_config, field, value)
    message = rf"{field}={re.escape(repr(value))} \(the drafter's generation config\) must be"
    with pytest.raises(ValueError, match=message):
        target.generate(_ids(), assistant_model=drafter, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, _ids(), drafter=drafter, max_new_tokens=8)
    assert not drafter.tap.listening


def test_zero_assistant_tokens(target, drafter):
    """0: transformers' assisted loop never asks the drafter (plain decoding, its rule); our own loop refuses it."""
    drafter.generation_config.num_assistant_tokens = 0
    plain = target.generate(_ids(), max_new_tokens=8, do_sample=False)
    assert target.generate(_ids(), assistant_model=drafter, max_new_tokens=8, do_sample=False).tolist() == \
        plain.tolist()
    with pytest.raises(ValueError, match=r"num_assistant_tokens=0 .* must be a positive integer"):
        speculative_generate(target, _ids(), drafter=drafter, max_new_tokens=8)


def test_drafter_generate_directly(drafter):
    with pytest.raises(TypeError, match=r"does not generate text by itself\. Use "
                                        r"`target\.generate\(\*\*inputs, assistant_model=drafter\)`"):
        drafter.generate(_ids(), max_new_tokens=5)
    with pytest.raises(TypeError, match="does not generate text by itself"):
        drafter.generate(_ids())


def test_stats_of_a_closed_call_are_not_given_to_a_later_call(fitted):
    """Once generation_stats(out) closed a call, a later call that never drafted must not inherit its statistics."""
    target, drafter = fitted
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    stats = drafter.generation_stats(out)
    assert drafter.generation_stats(out) is stats  # asking again with the same sequences is fine
    single = target.generate(ids, max_new_tokens=1, do_sample=False, assistant_model=drafter)
    with pytest.raises(RuntimeError, match="never drafts"):
        drafter.generation_stats(single)
