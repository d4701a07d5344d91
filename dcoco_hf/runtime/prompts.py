"""Prompts as token ids for the target: one chat turn, a left-padded batch, the ids that pad and end a sequence.

Pure helpers, no download: benchmarks, training data and evaluation all feed the target the same way, so they share
these (the prompt suites themselves are fetched by `dcoco_hf.assets`, outside the library layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
"""How a HumanEval record becomes a chat message: the raw ``prompt`` (signature + docstring) in a code fence.

HumanEval was designed for base-model continuation; an instruct target answers better when asked explicitly, and a
fixed, documented wrapper keeps acceptance-rate numbers comparable across runs.
"""


def chat_input_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.LongTensor:
    """Token ids ``[1, T]`` of ``prompt`` as a single user turn, with the assistant header appended.

    The template is rendered to text and then tokenised without extra special tokens, which avoids depending on
    ``apply_chat_template``'s return type (it changed between transformers versions) and avoids a double BOS.
    """
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.long()


def prompt_input_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.LongTensor:
    """Token ids ``[1, T]`` the target answers ``prompt`` from: one user turn of the chat template, or the plain text
    for a tokenizer without one (a base model continues it)."""
    if tokenizer.chat_template:
        return chat_input_ids(tokenizer, prompt)
    return tokenizer(prompt, return_tensors="pt")["input_ids"].long()


def left_pad(prompts: Sequence[torch.LongTensor], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Prompts of token ids ([T] or [1, T] each) -> (input_ids [B, L], attention_mask [B, L]), left-padded."""
    width = max(p.shape[-1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[-1] :] = prompt.reshape(-1)
        mask[row, width - prompt.shape[-1] :] = 1
    return ids, mask


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to left-pad batches with: the pad token, else EOS, else 0. Padded positions are masked out, so any id
    is correct; many chat tokenizers simply define no pad token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def eos_token_ids(eos_token_id: int | list[int] | None) -> list[int]:
    """A generation config's `eos_token_id` (one id, a list or None) as a list of ids."""
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
