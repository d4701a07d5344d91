"""Multi-process training through the real entry point: `accelerate launch --multi_gpu --num_processes 2` on CPU
(DDP over gloo) runs scripts/train_drafter.py on a tiny random target; both processes end with the same weights and the
exported checkpoint reloads. Also: the repository's accelerate configs (DDP, FSDP) parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_target

from dcoco_hf import DCOCODrafter

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_drafter.py"


def training_folders(root: Path, records: int = 16, new_tokens: int = 20) -> tuple[Path, Path]:
    """A saved tiny Qwen3 target and a data folder of its own greedy answers (one shard, as `dcoco-hf train`'s
    answers phase writes them). Returns (target folder, data folder)."""
    target = make_target("qwen3")
    target.save_pretrained(root / "target")
    prompts = torch.randint(0, target.config.vocab_size, (records, 5), generator=torch.Generator().manual_seed(1))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                do_sample=False)
    mask = torch.zeros_like(sequences, dtype=torch.bool)
    mask[:, 5:] = True
    (root / "data").mkdir()
    torch.save([{"input_ids": s.to(torch.int32), "loss_mask": m} for s, m in zip(sequences, mask)],
               root / "data" / "shard-00000.pt")
    return root / "target", root / "data"


def quiet_env() -> dict[str, str]:
    # One thread per process: two processes share the CI machine's cores (more threads only contend).
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
            "CUDA_VISIBLE_DEVICES": ""}  # CPU processes even on a machine with GPUs


def test_two_process_ddp_training_keeps_ranks_in_step_and_the_checkpoint_reloads(tmp_path):
    target_dir, data = training_folders(tmp_path)
    out = tmp_path / "run"
    command = [
        # `--cpu` with several processes needs mpirun in accelerate; `--multi_gpu` on a machine without visible GPUs
        # starts the processes with torchrun and accelerate joins them over gloo: DDP on CPU.
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
        "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", str(SCRIPT),
        "--stage", "1", "--target", str(target_dir), "--data", str(data), "--output", str(out), "--layers", "1",
        "--block-size", "4", "--top-k", "4", "--num-anchors", "4", "--batch-size", "2", "--max-steps", "3",
        "--max-length", "32", "--lr", "3e-3", "--save-steps", "100",
    ]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=quiet_env(), timeout=240,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    digests = summary["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests  # both processes hold the same trained weights
    assert summary["log"] and summary["log"][-1]["step"] == 3

    reloaded = DCOCODrafter.from_pretrained(out / "final")
    target = make_target("qwen3")
    fresh = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    assert not torch.equal(reloaded.fc.weight, fresh.fc.weight)  # trained, not the fresh init
    reloaded.attach(target, tune=False)
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=reloaded).tolist() == \
        expected.tolist()


@pytest.mark.parametrize("name,kind", [("accelerate_ddp.yaml", "MULTI_GPU"), ("accelerate_fsdp.yaml", "FSDP")])
def test_accelerate_configs_parse(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "configs" / name))
    assert config.distributed_type == kind and config.num_processes == 8
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "DCOCODecoderLayer"
