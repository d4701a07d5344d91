"""One RoPE default: `from_target` copies the target's RoPE settings and otherwise takes DCOCOConfig's own; the
decoding switches are checked with the other decoding choices."""

from __future__ import annotations

import pytest
from conftest import make_target

from dcoco_hf import DCOCODrafter
from dcoco_hf.configuration_dcoco import DEFAULT_ROPE_THETA, DCOCOConfig


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
    from dcoco_hf.configuration_dcoco import DecodingChoices

    config = DCOCOConfig(target_layer_ids=[0])
    assert DecodingChoices.read({}, config).use_corrector is True
    assert DecodingChoices.read({"time_phases": True}, config).time_phases is True
    for name in ("use_corrector", "time_phases"):
        with pytest.raises(ValueError, match=f"{name}='yes'"):
            DecodingChoices.read({name: "yes"}, config)
