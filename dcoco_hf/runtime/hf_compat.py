"""The adapter to transformers: what differs between the releases dcoco-hf supports (pyproject: 5.17 up to the newest
tested), the one place that asks which release is installed, so the rest of the package is written once.

* 5.24 renamed the key-value cache from `past_key_values` to `cache`: in model and mask-function keywords, in model
  outputs and in what an assistant's `generate()` hands back to the assisted loop. 5.24+ still accept the old
  keyword with a deprecation warning; older releases know only `past_key_values`.
* 5.18 made the assisted loop cut an accepted block after its first EOS token; 5.17 commits the tokens after it, so
  the drafter must not propose past an EOS there.
* 5.24 lets assisted generation run on a static cache (`cache_implementation="static"`, a `StaticCache`); older
  releases refuse it in `_assisted_decoding`.

It is also the one place in the runtime that reads or writes transformers' internals (checked on 5.17 and 5.25, the
ends of the supported range; tests/test_hf_compat.py checks each against the installed release and lists every private
name the package touches, so a new one cannot slip in elsewhere):

* the assisted loop's stopping criteria, its scores and the `AssistedCandidateGenerator` driving the drafter, which no
  candidate generator is handed, read off the call stack (`assisted_stopping_criteria`, `assisted_loop_scores`,
  `assisted_driver`); the verifications it reports to that generator only (`report_verifications`); its proposal
  length, set to 0 for a plain step (`set_proposal_length`);
* a model's attention implementation, which transformers 5.x stores as `config._attn_implementation` with a public
  setter only (`attention_implementation`); the network a Hub folder carries reads it as every transformers modeling
  file does, since it cannot import the runtime;
* the special-token tensors `generate()` prepares on its generation config (`special_token_tensors`), which also
  tell a config `generate()` prepared from a user's (`prepared_by_generate`);
* the flag that keeps transformers from dropping our own generation-config keys on load (`keep_own_keys`);
* the cache keyword of a model forward seen by a hook (`forward_cache`);
* the decoding loop `generate()` runs for greedy search and sampling, `GenerationMixin._sample` (the same signature on
  5.17 and 5.25), which a batched call whose schedule takes only plain steps runs itself (`plain_decoding`).
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

TRANSFORMERS_VERSION = Version(transformers.__version__)

# Detected from the output class rather than the version number, so a patched or pre-release build gets it right too.
CACHE_KEY = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"

# The first release whose assisted loop cuts an accepted block at EOS.
ASSISTED_EOS_CUT = Version("5.18")
# The first release whose assisted loop accepts a static cache.
ASSISTED_STATIC_CACHE = Version("5.24")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword a model forward, a mask function or an output class takes the key-value cache by."""
    return {CACHE_KEY: cache}


def output_cache(output: Any) -> Any:
    """The key-value cache in a model output (or in the keywords of an assistant's `generate()` call), or None."""
    if isinstance(output, dict):
        return output.get(CACHE_KEY)
    return getattr(output, CACHE_KEY, None)


def forward_cache(keywords: dict[str, Any]) -> Any:
    """The key-value cache among a model forward's keywords (a forward pre-hook's view), or None: 5.24+ callers may
    pass either keyword (the old one is deprecated, not gone), older ones `past_key_values`."""
    return keywords.get("cache", keywords.get("past_key_values"))


def attention_implementation(model: Any) -> str:
    """The attention implementation a model (or its config) runs: transformers 5.x keeps it as
    `config._attn_implementation`, set through the public `set_attn_implementation`."""
    config = getattr(model, "config", model)
    return config._attn_implementation


def special_token_tensors(config: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(EOS ids [n] or None, pad id or None) as tensors, which `generate()` prepares on the generation config it
    hands a `custom_generate` (5.17-5.25: `_prepare_special_tokens` sets `_eos_token_tensor`, `_pad_token_tensor`)."""
    return config._eos_token_tensor, config._pad_token_tensor


def prepared_by_generate(config: Any) -> bool:
    """Whether `generate()` prepared this generation config (its special-token tensors are set on the copy it hands a
    `custom_generate`; a user's config, even after a generate() call that read it, has none)."""
    return config is not None and "_eos_token_tensor" in vars(config)


def keep_own_keys(generation_config: Any) -> None:
    """Mark a generation config as our own, not derived from the model config: transformers drops the keys it does
    not know (our decoding choices) when it loads a generation_config.json marked derived (`_from_model_config`)."""
    generation_config._from_model_config = False


def assisted_loop_cuts_at_eos() -> bool:
    """Whether this transformers' assisted loop drops the accepted tokens after an EOS itself."""
    return TRANSFORMERS_VERSION.release >= ASSISTED_EOS_CUT.release


def assisted_static_cache() -> bool:
    """Whether this transformers runs assisted generation on a static cache."""
    return TRANSFORMERS_VERSION.release >= ASSISTED_STATIC_CACHE.release


def require_assisted_static_cache(what: str) -> None:
    """Raise a clear error when `what` needs assisted generation on a static cache and this transformers refuses it."""
    if not assisted_static_cache():
        raise ValueError(
            f"{what} needs assisted generation on a static cache, which transformers supports from "
            f"{ASSISTED_STATIC_CACHE} (installed: {transformers.__version__}). Use the dynamic cache, or upgrade: "
            f'pip install "transformers>={ASSISTED_STATIC_CACHE}".'
        )


# ---------------------------------------------------------------- the assisted loop's locals, read off the stack

def assisted_stopping_criteria(max_depth: int = 8) -> StoppingCriteriaList | None:
    """The stopping criteria of the `generate()` call now asking this drafter for candidates, or None.

    transformers hands candidate generators neither the criteria nor the tokenizer that `stop_strings` need; they
    are a local of `_assisted_decoding` (transformers 5.17-5.25), a few frames up the stack from the drafter's
    `generate()`. Reading them there is the only way to honour custom criteria and stop strings exactly
    (`tokens_before_stop`); when transformers changes that layout, `DCOCODrafter.generate` refuses stop strings
    instead of silently running past them.
    """
    criteria = _assisted_decoding_local("stopping_criteria", max_depth)
    return criteria if isinstance(criteria, StoppingCriteriaList) else None


def assisted_loop_scores(max_depth: int = 8) -> tuple[torch.Tensor, ...] | None:
    """The `scores` the assisted loop now asking for candidates passes its stopping criteria: None unless the call
    asked for `output_scores` (and `return_dict_in_generate`), else its tuple of processed target scores so far."""
    scores = _assisted_decoding_local("scores", max_depth)
    return scores if isinstance(scores, tuple) else None


def _assisted_decoding_local(name: str, max_depth: int) -> Any:
    """A local of the `_assisted_decoding` frame a few frames up the stack, or None (see
    `assisted_stopping_criteria`)."""

    def local(frame: FrameType) -> tuple[Any] | None:  # found: the first such frame's local, None or not
        return (frame.f_locals.get(name),) if frame.f_code.co_name == "_assisted_decoding" else None

    found = _up_the_stack(sys._getframe(2), max_depth, local)
    return None if found is None else found[0]


def assisted_driver(max_depth: int = 8) -> AssistedCandidateGenerator | None:
    """transformers' `AssistedCandidateGenerator` now calling the drafter's `generate()`, or None.

    It asks the drafter for `num_assistant_tokens` tokens each cycle and, when that is 0, runs a plain step without
    asking (transformers 5.x, `_calculate_new_tokens`): the only way an assistant can take a plain step, since it
    may not return an empty proposal. It is the caller a few frames up the stack; when transformers changes that
    layout the cost-aware schedule proposes at least one token every cycle instead (still lossless).
    """

    def driver(frame: FrameType) -> AssistedCandidateGenerator | None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, AssistedCandidateGenerator) and isinstance(owner.num_assistant_tokens, int | float):
            return owner
        return None

    return _up_the_stack(sys._getframe(1), max_depth, driver)


def proposal_length(driver: AssistedCandidateGenerator) -> int:
    """How many tokens the assisted loop's generator asks the drafter for next (`num_assistant_tokens`)."""
    return driver.num_assistant_tokens


def set_proposal_length(driver: AssistedCandidateGenerator, tokens: int) -> None:
    """Make the assisted loop's generator ask for `tokens` next; 0 makes the loop take a plain step without asking
    (`assisted_driver`)."""
    driver.num_assistant_tokens = tokens


def report_verifications(driver: AssistedCandidateGenerator, receiver: Callable[..., None]) -> None:
    """Have the assisted loop's candidate generator (`driver`) pass each verification on to `receiver` too.

    transformers 5.x calls `update_candidate_strategy(input_ids, scores, num_matches)` on its candidate generator
    after every cycle, drafted or plain, with the committed sequence and the number of proposed tokens it accepted
    (after its own cuts at max_length and EOS); the drafter behind an `AssistedCandidateGenerator` is never told.
    This wraps that one generator object's method (not its class); `receiver` is held weakly, like the engine.
    """
    # Weak both ways: a strong self-reference would keep the generator, and with it the drafter's handle of the
    # call, alive until the garbage collector runs, so the call would not end when generate() returns.
    original, owner, method = type(driver).update_candidate_strategy, weakref.ref(driver), weakref.WeakMethod(receiver)

    def update_candidate_strategy(input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        original(owner(), input_ids, scores, num_matches)
        reported = method()
        if reported is not None:
            reported(input_ids, scores, num_matches)

    driver.update_candidate_strategy = update_candidate_strategy


def _up_the_stack(frame: FrameType | None, max_depth: int, read: Callable[[FrameType], Any]) -> Any:
    """The first `read(frame)` that is not None, from `frame` up at most `max_depth` frames; else None. The one
    place that reads transformers' internals off the call stack."""
    for _ in range(max_depth):
        if frame is None:
            return None
        value = read(frame)
        if value is not None:
            return value
        frame = frame.f_back
    return None


def plain_decoding(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    model_kwargs: dict[str, Any],
) -> torch.LongTensor:
    """Plain decoding of a call generate() prepared for a custom_generate (its logits processors, stopping criteria,
    generation config and model kwargs, the cache included), by the very loop generate() runs for greedy search and
    sampling (`GenerationMixin._sample`, transformers 5.x): the same tokens and the same cost. Returns the sequences."""
    output = target._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                            generation_config=generation_config, **model_kwargs)
    return output.sequences if isinstance(output, ModelOutput) else output


__all__ = [
    "ASSISTED_EOS_CUT", "ASSISTED_STATIC_CACHE", "CACHE_KEY", "TRANSFORMERS_VERSION", "assisted_driver",
    "assisted_loop_cuts_at_eos", "assisted_loop_scores", "assisted_static_cache", "assisted_stopping_criteria",
    "attention_implementation", "cache_kwargs", "forward_cache", "keep_own_keys", "output_cache", "plain_decoding",
    "proposal_length",
    "report_verifications", "require_assisted_static_cache", "set_proposal_length", "special_token_tensors",
]
