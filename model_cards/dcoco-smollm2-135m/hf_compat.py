"""What differs between the transformers releases dcoco-hf supports (pyproject: 5.17 up to the newest tested): the one
place that asks which release is installed, so the rest of the package is written once.

* 5.24 renamed the key-value cache from `past_key_values` to `cache`: in model and mask-function keywords, in model
  outputs and in what an assistant's `generate()` hands back to the assisted loop. 5.24+ still accept the old
  keyword with a deprecation warning; older releases know only `past_key_values`.
* 5.18 made the assisted loop cut an accepted block after its first EOS token; 5.17 commits the tokens after it, so
  the drafter must not propose past an EOS there.
* 5.24 lets assisted generation run on a static cache (`cache_implementation="static"`, a `StaticCache`); older
  releases refuse it in `_assisted_decoding`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers
from packaging.version import Version
from transformers.modeling_outputs import CausalLMOutputWithPast

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


def cache_argument(cache: Any, kwargs: dict[str, Any]) -> Any:
    """The cache a forward of ours was given, by either name: transformers < 5.24 passes `past_key_values=` (its
    DFlash path calls the drafter's forward so)."""
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


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


__all__ = [
    "ASSISTED_EOS_CUT", "ASSISTED_STATIC_CACHE", "CACHE_KEY", "TRANSFORMERS_VERSION", "assisted_loop_cuts_at_eos",
    "assisted_static_cache", "cache_argument", "cache_kwargs",
    "output_cache", "require_assisted_static_cache",
]
