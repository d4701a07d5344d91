"""docs/your-model.md's training pieces on an architecture other than Llama: a drafter trained from scratch for a tiny
random GPT-NeoX target (parallel attention and MLP, partial rotary, no `num_key_value_heads`, layers under
`gpt_neox`) with the Trainer classes each stage of `dcoco-hf train` runs, saved, reloaded as a Hub folder, attached
and exact."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedModel, TrainingArguments

from dcoco_hf import DCOCODrafter
from dcoco_hf.training import measure_tau
from dcoco_hf.training.trainer import DrafterCollator, DrafterTrainer, DrafterTrainingModel

VOCAB, PROMPT_LEN = 48, 5


def gpt_neox_target() -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        rotary_pct=0.5, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return GPTNeoXForCausalLM(config).eval().requires_grad_(False)


def own_answers(target: PreTrainedModel, prompts: torch.Tensor, new_tokens: int = 30) -> list[dict[str, torch.Tensor]]:
    """The target's greedy answers as training records: token ids and a mask over the answer."""
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                do_sample=False)
    mask = torch.zeros_like(sequences, dtype=torch.bool)
    mask[:, prompts.shape[1]:] = True
    return [{"input_ids": ids.to(torch.int32), "loss_mask": answer} for ids, answer in zip(sequences, mask)]


def train(drafter: DCOCODrafter, target: PreTrainedModel, records: list, stage: int, steps: int, out: Path
          ) -> DrafterTrainer:
    args = TrainingArguments(
        output_dir=str(out / f"stage{stage}"), per_device_train_batch_size=8, max_steps=steps, learning_rate=3e-3,
        save_strategy="no", report_to=[], remove_unused_columns=False, use_cpu=True, disable_tqdm=True,
    )
    trainer = DrafterTrainer(model=DrafterTrainingModel(drafter.train(), target, stage=stage, num_anchors=8),
                             args=args, train_dataset=records, data_collator=DrafterCollator())
    trainer.train()
    return trainer


def greedy(target: PreTrainedModel, ids: torch.Tensor, **kwargs) -> list[int]:
    ids = ids.view(1, -1)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, **kwargs)
    return out[0].tolist()


def test_a_drafter_trained_from_scratch_for_a_gpt_neox_target(tmp_path):
    target = gpt_neox_target()
    prompts = torch.randint(0, VOCAB, (32, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    records = own_answers(target, prompts)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    seen = [prompts[0], prompts[1]]
    tau_untrained = measure_tau(target, drafter.eval(), seen, 24)

    train(drafter, target, records, stage=1, steps=200, out=tmp_path)            # the DFlash backbone
    trainer = train(drafter, target, records, stage=2, steps=50, out=tmp_path)   # + the DCOCO corrector
    assert drafter.corrector.delta_out.weight.abs().sum() > 0
    trainer.export_drafter(tmp_path / "final")

    loaded = AutoModel.from_pretrained(tmp_path / "final", trust_remote_code=True).attach(target, tune=False).eval()
    assert isinstance(loaded, DCOCODrafter)  # with the package imported, AutoModel builds its runtime class
    with torch.no_grad():
        tau = measure_tau(target, loaded, seen, 24)
        fresh = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
        for ids in (*seen, fresh):
            assert greedy(target, ids, assistant_model=loaded) == greedy(target, ids)
    assert tau > max(1.5, tau_untrained), (tau_untrained, tau)  # it learned the target's own answers
