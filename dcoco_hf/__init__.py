"""dcoco-hf: lossless speculative decoding in Hugging Face Transformers with a DFlash parallel drafter and the DCOCO
contextual corrector.

    drafter = DCOCODrafter.from_pretrained(folder).attach(target)  # also tunes both for this device, logs how
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
    batch = speculative_generate(target, **batch_inputs, drafter=drafter, max_new_tokens=256)  # left-padded batch
"""

from transformers import AutoConfig, AutoModel

from .runtime.block_choice import BlockSizeChoice, choose_block_size, set_block_size
from .runtime.candidate_generator import DCOCOCandidateGenerator
from .network.configuration_dcoco import DCOCOConfig
from .runtime.context_cache import DraftContextCache
from .network.corrector import (
    ContextBigrams,
    CorpusBigrams,
    DCOCOCorrector,
    prefix_first_walk,
    select_candidates,
    viterbi_walk,
)
from .runtime.cpu_attention import CPU_GQA_ATTENTION
from .runtime.cpu_linear import FewRowsLinear, restore_linear, use_few_rows_linear
from .runtime.generation import SpeculativeOutput, speculative_generate
from .runtime.drafter import DCOCODrafter, spread_layer_ids
from .runtime.drafting import DraftProposal
from .network.modeling_dcoco import DCOCODraftModel
from .runtime.stats import DCOCOStats
from .runtime.tap import TargetTap
from .runtime.tuning import Tuning, tune, untune

# A saved folder names its own code (the network) for the Auto classes; with the package imported, AutoConfig and
# AutoModel build the package's classes for the "dcoco" model type instead, `trust_remote_code` or not, so
# `AutoModel.from_pretrained(folder, trust_remote_code=True)` returns a `DCOCODrafter` that can `attach`.
DCOCOConfig.register_for_auto_class("AutoConfig")
AutoConfig.register(DCOCOConfig.model_type, DCOCOConfig, exist_ok=True)
AutoModel.register(DCOCOConfig, DCOCODrafter, exist_ok=True)

__version__ = "0.3.0"

__all__ = [
    "BlockSizeChoice",
    "CPU_GQA_ATTENTION",
    "ContextBigrams",
    "CorpusBigrams",
    "DCOCOCandidateGenerator",
    "DCOCOConfig",
    "DCOCOCorrector",
    "DCOCODraftModel",
    "DCOCODrafter",
    "DCOCOStats",
    "DraftContextCache",
    "DraftProposal",
    "FewRowsLinear",
    "SpeculativeOutput",
    "TargetTap",
    "Tuning",
    "choose_block_size",
    "prefix_first_walk",
    "restore_linear",
    "select_candidates",
    "set_block_size",
    "speculative_generate",
    "spread_layer_ids",
    "tune",
    "untune",
    "use_few_rows_linear",
    "viterbi_walk",
]
