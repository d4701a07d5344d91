"""One RoPE default: `from_target` copies the target's RoPE settings and otherwise takes DCOCOConfig's own; the
decoding switches are checked with the other decoding choices."""

from __future__ import annotations

import pytest
from conftest import make_target

from dcoco_hf import DCOCODrafter
from dcoco_hf.network.configuration_dcoco import DEFAULT_ROPE_THETA, DCOCOConfig


def test_from_target_copies_the_targets_rope():
    target = make_target("llama")
    target.config.rope_parameters = {"rope_type": "default", "rope_theta": 12345.0}
    drafter = DCOCODrafter.from_target(target, block_size=4, top_k=4)
    assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 12345.0}


def test_one_default_base_without_rope_settings():
    target = make_target("llama")
    target.config.rope_parameters = None
    assert DCOCODrafter.from_target(target, block_size=4, top_k=4).config.rope_parameters["rope_theta"] == (
        DEFAULT_ROPE_THETA)
    assert DCOCOConfig(target_layer_ids=[0]).rope_parameters["rope_theta"] == DEFAULT_ROPE_THETA


def test_decoding_switches_are_checked():
    from dcoco_hf.network.configuration_dcoco import DecodingChoices

    config = DCOCOConfig(target_layer_ids=[0])
    assert DecodingChoices.read({}, config).use_corrector is True
    assert DecodingChoices.read({"time_phases": True}, config).time_phases is True
    for name in ("use_corrector", "time_phases"):
        with pytest.raises(ValueError, match=f"{name}='yes'"):
            DecodingChoices.read({name: "yes"}, config)


def test_each_field_is_declared_once():
    """A field is named, typed and defaulted in DCOCOConfig's declarations only: the constructor names no field of
    its own, every declared default is what a bare config holds, and a value of the wrong type is refused by name."""
    import inspect

    from dcoco_hf.network.configuration_dcoco import CONFIG_FIELDS

    assert set(inspect.signature(DCOCOConfig.__init__).parameters) == {"self", "rope_theta", "dflash_config", "kwargs"}
    bare = DCOCOConfig(target_layer_ids=[0])
    derived = {"head_dim", "rope_parameters", "layer_types", "target_layer_ids"}  # filled in from other fields
    for name in set(CONFIG_FIELDS) - derived:
        assert getattr(bare, name) == getattr(DCOCOConfig, name), name
    assert bare.head_dim == bare.hidden_size // bare.num_attention_heads
    assert bare.layer_types == ["full_attention"] * bare.num_hidden_layers
    for name in CONFIG_FIELDS:  # every field round-trips through config.json's dict
        assert getattr(DCOCOConfig(**bare.to_dict()), name) == getattr(bare, name), name
    with pytest.raises(ValueError, match="top_k"):
        DCOCOConfig(target_layer_ids=[0], top_k="4")
    with pytest.raises(ValueError, match="target_layer_ids"):
        DCOCOConfig(target_layer_ids=["a"])
