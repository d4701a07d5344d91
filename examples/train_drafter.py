"""Train a drafter for your own causal LM from Python: the run `dcoco-hf train` makes, as one function call.

    python examples/train_drafter.py --output runs/my-drafter
    python examples/train_drafter.py --target my-org/my-model --answers 64 --steps 200

`train(TrainRun(...), target, tokenizer)` runs the phases of `dcoco-hf train`: prompts, the target's own greedy
answers, its cached features, stage 1 (the DFlash backbone) and stage 2 (with the DCOCO corrector) on
`transformers.Trainer`, and a Hub folder with a model card. Call it again with the same `out` and it resumes where it
stopped. The folder loads anywhere with `AutoModel.from_pretrained(folder, trust_remote_code=True)`. tau (tokens
committed per target forward) is measured on the run's held-out prompts, for an untrained drafter of the same shape
and for the trained one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import default_target_path
from dcoco_hf.training import measure_tau
from dcoco_hf.runtime.prompts import prompt_input_ids
from dcoco_hf.training.pipeline import train
from dcoco_hf.training.run import TrainRun


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output", type=Path, default=Path("runs/example-drafter"))
    parser.add_argument("--answers", type=int, default=32, help="answers the target writes to train on")
    parser.add_argument("--held-out", type=int, default=4, help="prompts kept out of training, for tau")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each stage")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    name = str(args.target or default_target_path())
    target = AutoModelForCausalLM.from_pretrained(name).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(name)

    # Every long option of `dcoco-hf train` is a field of TrainRun.
    run = TrainRun(out=args.output, target=name, answers=args.answers, held_out=args.held_out, steps=args.steps,
                   max_new_tokens=args.max_new_tokens, layers=1, block_size=8, save_steps=args.steps)
    folder = train(run, target, tokenizer)

    held_out = [prompt_input_ids(tokenizer, p) for p in json.loads((run.data / "held_out.json").read_text())]
    untrained = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=8, init_from_target=True).eval()
    trained = AutoModel.from_pretrained(folder, trust_remote_code=True).attach(target).eval()
    with torch.no_grad():
        tau_before = measure_tau(target, untrained, held_out, args.max_new_tokens)
        tau_after = measure_tau(target, trained, held_out, args.max_new_tokens)
    print(f"held-out tau: {tau_before:.2f} untrained -> {tau_after:.2f} trained; drafter and card in {folder}")
    return {"tau_before": tau_before, "tau_after": tau_after, "folder": folder}


if __name__ == "__main__":
    main()
