r"""Retarget a trained DCOCO drafter to another verifier with the same tokenizer (e.g. a fine-tune) with LoRA only.

First have the NEW target write its answers, then train adapters on the drafter backbone and corrector (stage 2):
    dcoco-hf train --target my-finetune --out runs/my-finetune --answers 2000 --until answers
    python scripts/retarget_drafter.py --drafter model_cards/dcoco-smollm2-135m --new-target my-finetune \
        --data runs/my-finetune/data --output runs/retarget --epochs 1
tau (committed tokens per target forward) is measured before and after on held-out prompts: the last
--eval-prompts records of --data (left out of training), or the prompts of a --prompts JSON file (a list of strings).
Only the adapter is saved (<output>/adapter_model.safetensors); load it with
    PeftModel.from_pretrained(DCOCODrafter.from_pretrained(drafter_folder).attach(new_target), output)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dcoco_hf import DCOCODrafter
from dcoco_hf.runtime.prompts import chat_input_ids
from dcoco_hf.training.data import load_shards
from dcoco_hf.training.retarget import lora_config_for_drafter, measure_tau
from dcoco_hf.training.trainer import (
    DrafterCollator,
    DrafterTrainer,
    DrafterTrainingModel,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="trained drafter folder (the one being retargeted)")
    p.add_argument("--new-target", required=True, help="the new verifier: folder or Hub id")
    p.add_argument("--data", type=Path, required=True,
                   help="the NEW target's answers (`dcoco-hf train ... --until answers`: RUN/data)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2 r)")
    p.add_argument("--backbone-only", action="store_true", help="no adapters on the corrector")
    p.add_argument("--prompts", type=Path, default=None, help="JSON list of held-out prompt strings for tau")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out records for tau when --prompts is not given")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per tau prompt")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = AutoModelForCausalLM.from_pretrained(args.new_target).to(device).eval().requires_grad_(False)
    drafter = DCOCODrafter.from_pretrained(args.drafter).to(device).attach(target).eval()

    records = load_shards(args.data)
    if args.prompts is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.new_target)
        prompts = [chat_input_ids(tokenizer, text)[0] for text in json.loads(args.prompts.read_text())]
    else:
        if len(records) <= args.eval_prompts:
            raise SystemExit(f"{args.data} has {len(records)} records: too few to hold out {args.eval_prompts}.")
        held_out, records = records[-args.eval_prompts :], records[: -args.eval_prompts]
        prompts = [r["input_ids"][~r["loss_mask"]] for r in held_out]

    tau_before = measure_tau(target, drafter, prompts, args.max_new_tokens)
    print(f"tau before retargeting: {tau_before:.3f}")

    model = get_peft_model(drafter, lora_config_for_drafter(args.r, 2 * args.r, not args.backbone_only))
    model.print_trainable_parameters()
    training = DrafterTrainingModel(model, target, stage=2, num_anchors=args.num_anchors)
    checkpoints = args.output / "checkpoints"
    training_args = TrainingArguments(
        output_dir=str(checkpoints), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=0.04, max_grad_norm=1.0, num_train_epochs=args.epochs, max_steps=args.max_steps,
        weight_decay=0.0, logging_steps=10, save_steps=200, save_total_limit=1, bf16=args.bf16, report_to=[],
        remove_unused_columns=False, dataloader_num_workers=0, seed=args.seed,
    )
    trainer = DrafterTrainer(
        model=training, args=training_args, train_dataset=records,
        data_collator=DrafterCollator(pad_token_id=target.generation_config.pad_token_id or 0,
                                      max_length=args.max_length),
    )
    start = time.time()
    trainer.train(resume_from_checkpoint=get_last_checkpoint(str(checkpoints)) if checkpoints.exists() else None)
    model.eval().requires_grad_(False)

    tau_after = measure_tau(target, model, prompts, args.max_new_tokens)
    print(f"tau after retargeting: {tau_after:.3f} (before {tau_before:.3f})")
    model.save_pretrained(args.output)  # the adapter only: adapter_config.json + adapter_model.safetensors
    summary = {"tau_before": tau_before, "tau_after": tau_after, "eval_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "train_records": len(records),
               "wall_seconds": time.time() - start, "args": {k: str(v) for k, v in vars(args).items()},
               "log": trainer.state.log_history[-3:]}
    (args.output / "retarget_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"tau_before": tau_before, "tau_after": tau_after}))


if __name__ == "__main__":
    main()
