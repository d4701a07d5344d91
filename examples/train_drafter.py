"""Train a DCOCO drafter for your own causal LM with `transformers.Trainer`, then load it like any Hub model.

    python examples/train_drafter.py --output runs/my-drafter
    python examples/train_drafter.py --target my-org/my-model --prompts 64 --stage1-steps 200 --stage2-steps 100

The loop `dcoco-hf train` runs, spelled out with the library's pieces (use that command for real runs: it chooses
prompts from several sources, resumes every phase and writes a model card): the target answers prompts itself
(greedy, chat template); stage 1 trains the DFlash backbone, stage 2 adds the DCOCO corrector's joint loss; the
result is a folder with config, safetensors and the modeling code, so `AutoModel.from_pretrained(folder,
trust_remote_code=True)` loads it anywhere. tau (tokens committed per target forward) is measured on held-out prompts
before and after training. `accelerate launch examples/train_drafter.py ...` runs the same code on several GPUs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.prompts import chat_input_ids
from dcoco_hf.training import measure_tau
from dcoco_hf.training.data import regenerate, stdlib_code_prompts
from dcoco_hf.training.stages import StageOptions, train_stage


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

    # 2. A drafter sized for the target: 1 layer warm-started from the target's last one, blocks of 8. Its tau
    # before training, for comparison.
    shape = {"layers": 1, "block_size": 8, "top_k": 16, "init_from_target": True}
    untrained = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=8, init_from_target=True)
    held_out_ids = [chat_input_ids(tokenizer, p) for p in held_out]
    tau_before = measure_tau(target, untrained.eval(), held_out_ids, args.max_new_tokens)

    # 3. Stage 1 (DFlash backbone), then stage 2 (joint DFlash + DCOCO corrector) from stage 1's drafter: the
    # `train_stage` that scripts/train_drafter.py and `dcoco-hf train` run, on transformers.Trainer.
    common = {"data": [data], "max_length": 512}
    stage1 = train_stage(StageOptions(stage=1, output=args.output / "stage1", max_steps=args.stage1_steps,
                                      save_steps=args.stage1_steps, **shape, **common), target)
    final = train_stage(StageOptions(stage=2, output=args.output / "stage2", init=str(stage1),
                                     max_steps=args.stage2_steps, save_steps=args.stage2_steps, **common), target)

    # 4. final is a Hub-ready folder: anyone loads it with trust_remote_code, then attaches it to the target.
    reloaded = AutoModel.from_pretrained(final, trust_remote_code=True).attach(target).eval()
    with torch.no_grad():
        tau_after = measure_tau(target, reloaded, held_out_ids, args.max_new_tokens)
    print(f"held-out tau: {tau_before:.2f} untrained -> {tau_after:.2f} trained; drafter saved to {final}")
    return {"tau_before": tau_before, "tau_after": tau_after, "folder": final}


if __name__ == "__main__":
    main()
