"""Batched lossless speculative decoding with a DCOCO / DFlash drafter, as a transformers `custom_generate` repo.

    drafter = DCOCODrafter.from_pretrained(DRAFTER).attach(target)
    out = target.generate(**batch, custom_generate=THIS_REPO, trust_remote_code=True, drafter=drafter,
                          max_new_tokens=128)

transformers calls `generate(model=target, **every generate() argument)`. This hands the call back to
`target.generate` with the package's loop, `dcoco_hf.speculative_generate`, as a callable `custom_generate`, so
generate() prepares the generation config, pad / EOS tokens, max length and logits processors as usual, and the loop
serves left-padded batches with each row accepting its own number of drafted tokens. The code lives in the dcoco-hf
package (requirements.txt); this file only routes the call, so the Hub repo and the package never drift apart.
"""

from __future__ import annotations

from typing import Any

from dcoco_hf import speculative_generate


def generate(
    model: Any, drafter: Any = None, correct: bool = True, selection: str | None = None,
    tree_budget: int | None = None, **kwargs: Any,
):
    """`model`: the target (a causal LM); `drafter`: a `DCOCODrafter` attached to it; `correct=False` drafts plain
    DFlash blocks with the same weights; `selection`: the corrector's walk for this call (default the drafter's
    `generation_config.selection`); `tree_budget`: the most nodes a cycle's draft tree may have (0: chains only;
    default the drafter's `generation_config.tree_budget`). Returns what `generate()` returns."""
    if drafter is None:
        raise TypeError(
            "this custom_generate needs a drafter: target.generate(..., custom_generate=REPO, trust_remote_code=True, "
            "drafter=DCOCODrafter.from_pretrained(DRAFTER).attach(target))"
        )
    return model.generate(custom_generate=speculative_generate, drafter=drafter, correct=correct, selection=selection,
                          tree_budget=tree_budget, **kwargs)
