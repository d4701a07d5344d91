"""dcoco-hf: lossless speculative decoding in Hugging Face Transformers with a DFlash parallel drafter and the DCOCO
contextual corrector.

    drafter = DCOCODrafter.from_pretrained(folder).attach(target)
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
"""

from .candidate_generator import DCOCOCandidateGenerator, DCOCOStats, TargetTap
from .configuration_dcoco import DCOCOConfig
from .corrector import DCOCOCorrector, prefix_first_walk, select_candidates, viterbi_walk
from .modeling_dcoco import DCOCODrafter, DraftProposal, spread_layer_ids

DCOCOConfig.register_for_auto_class("AutoConfig")
DCOCODrafter.register_for_auto_class("AutoModel")

__version__ = "0.1.0"

__all__ = [
    "DCOCOCandidateGenerator",
    "DCOCOConfig",
    "DCOCOCorrector",
    "DCOCODrafter",
    "DCOCOStats",
    "DraftProposal",
    "TargetTap",
    "prefix_first_walk",
    "select_candidates",
    "spread_layer_ids",
    "viterbi_walk",
]
