"""dcoco-hf: lossless speculative decoding in Hugging Face Transformers with a DFlash parallel drafter and the DCOCO
contextual corrector.

    drafter = DCOCODrafter.from_pretrained(folder).attach(target)
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
    batch = speculative_generate(target, **batch_inputs, drafter=drafter, max_new_tokens=256)  # left-padded batch
"""

from .bench import set_block_size
from .block_choice import BlockSizeChoice, choose_block_size
from .candidate_generator import DCOCOCandidateGenerator, DCOCOStats, TargetTap
from .configuration_dcoco import DCOCOConfig
from .cpu_attention import CPU_GQA_ATTENTION
from .cpu_linear import FewRowsLinear, restore_linear, use_few_rows_linear
from .corrector import ContextBigrams, CorpusBigrams, DCOCOCorrector, prefix_first_walk, select_candidates, viterbi_walk
from .generation import SpeculativeOutput, speculative_generate
from .modeling_dcoco import DCOCODrafter, DraftProposal, spread_layer_ids

DCOCOConfig.register_for_auto_class("AutoConfig")
DCOCODrafter.register_for_auto_class("AutoModel")

__version__ = "0.1.0"

__all__ = [
    "BlockSizeChoice",
    "CPU_GQA_ATTENTION",
    "ContextBigrams",
    "CorpusBigrams",
    "DCOCOCandidateGenerator",
    "DCOCOConfig",
    "DCOCOCorrector",
    "DCOCODrafter",
    "DCOCOStats",
    "DraftProposal",
    "FewRowsLinear",
    "SpeculativeOutput",
    "TargetTap",
    "choose_block_size",
    "prefix_first_walk",
    "restore_linear",
    "select_candidates",
    "set_block_size",
    "speculative_generate",
    "spread_layer_ids",
    "use_few_rows_linear",
    "viterbi_walk",
]
