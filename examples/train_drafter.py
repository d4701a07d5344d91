"""Train a DCOCO drafter for your own causal LM with `transformers.Trainer`, then load it like any Hub model.

    python examples/train_drafter.py --output runs/my-drafter
    python examples/train_drafter.py --target my-org/my-model --prompts 64 --stage1-steps 200 --stage2-steps 100

A short version of the shipped recipe (scripts/ has the full, resumable one): the target answers prompts itself
(greedy, chat template); stage 1 trains the DFlash backbone, stage 2 adds the DCOCO corrector's joint loss; the
result is a folder with config, safetensors and the modeling code, so `AutoModel.from_pretrained(folder,
trust_remote_code=True)` loads it anywhere. tau (tokens committed per target forward) is measured on held-out prompts
before and after training. `accelerate launch examples/train_drafter.py ...` runs the same code on several GPUs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    TrainingArguments,
)

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.prompts import chat_input_ids
from dcoco_hf.training import measure_tau
from dcoco_hf.training.data import load_shards, regenerate, stdlib_code_prompts
from dcoco_hf.training.trainer import (
    DrafterCollator,
    DrafterTrainer,
    DrafterTrainingModel,
)


def train_stage(drafter, target, records, stage: int, steps: int, output: Path, pad_token_id: int) -> None:
    """One Trainer run of the drafter objective: stage 1 = DFlash, stage 2 = DFlash + DCOCO."""
    args = TrainingArguments(
        output_dir=str(output / f"stage{stage}"), max_steps=steps, per_device_train_batch_size=4, learning_rate=6e-4,
        lr_scheduler_type="cosine", warmup_steps=0.04, max_grad_norm=1.0, logging_steps=max(1, steps // 5),
        save_strategy="no", report_to=[], remove_unused_columns=False,
    )
    model = DrafterTrainingModel(drafter, target, stage=stage, num_anchors=16)
    DrafterTrainer(model=model, args=args, train_dataset=records,
                   data_collator=DrafterCollator(pad_token_id=pad_token_id, max_length=512)).train()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output", type=Path, default=Path("runs/example-drafter"))
    parser.add_argument("--prompts", type=int, default=32, help="training prompts the target answers")
    parser.add_argument("--held-out", type=int, default=4, help="prompts kept out of training, for tau")
    parser.add_argument("--stage1-steps", type=int, default=60)
    parser.add_argument("--stage2-steps", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    target_path = args.target or default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_path).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    prompts = stdlib_code_prompts(args.prompts + args.held_out)  # documented stdlib functions: "complete this"
    train_prompts, held_out = prompts[: args.prompts], prompts[args.prompts :]

    # 1. The target writes its own training answers (resumable shards of token ids + response mask).
    data = regenerate(target, tokenizer, train_prompts, args.output / "data", max_new_tokens=args.max_new_tokens)
    records = load_shards(data)

    # 2. A fresh drafter sized for the target: 1 layer warm-started from the target's last one, blocks of 8.
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=8, init_from_target=True)
    held_out_ids = [chat_input_ids(tokenizer, p) for p in held_out]
    tau_before = measure_tau(target, drafter.eval(), held_out_ids, args.max_new_tokens)

    # 3. Stage 1 (DFlash backbone), then stage 2 (joint DFlash + DCOCO corrector), both on transformers.Trainer.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_stage(drafter.train(), target, records, 1, args.stage1_steps, args.output, pad)
    train_stage(drafter, target, records, 2, args.stage2_steps, args.output, pad)

    # 4. A Hub-ready folder: anyone loads it with trust_remote_code, then attaches it to the target.
    final = args.output / "final"
    drafter.save_pretrained(final)
    reloaded = AutoModel.from_pretrained(final, trust_remote_code=True).attach(target).eval()
    with torch.no_grad():
        tau_after = measure_tau(target, reloaded, held_out_ids, args.max_new_tokens)
    print(f"held-out tau: {tau_before:.2f} untrained -> {tau_after:.2f} trained; drafter saved to {final}")
    return {"tau_before": tau_before, "tau_after": tau_after, "folder": final}


if __name__ == "__main__":
    main()
