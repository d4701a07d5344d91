"""`dcoco-hf export --format vllm` and the engine-side corrector, without vLLM: the folder holds the backbone, the
corrector and its settings; `DCOCOBlockCorrector` (what the vLLM draft model runs) rebuilt from the folder picks
exactly the tokens `DCOCODrafter.propose` picks from the same block. The vLLM side: tests/test_vllm_serving.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import scrambled
from test_lilicorr import lilicorr_copy
from test_selector import randomise, selector_copy
from safetensors import safe_open

from dcoco_hf import CorpusBigrams
from dcoco_hf.serving.block_corrector import DCOCOBlockCorrector
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.network.configuration_dcoco import DCOCOConfig
from dcoco_hf.serving.export import export_vllm
from dcoco_hf.training import target_context
from dcoco_hf.serving.vllm_plugin import ARCHITECTURE

REPO = Path(__file__).resolve().parents[1]


def _served_drafter(fitted, first_slot: bool = True, corrector: str = "dcoco"):
    """A fitted tiny drafter with every corrector input the shipped one reads: a random corrector reading context
    and corpus pairs, scoring the anchor -> slot 1 transitions, and a draft vocabulary; or ("selector") a random
    DFlash2 selector over a draft vocabulary."""
    target, trained = fitted
    if corrector == "selector":
        drafter = selector_copy(trained, target, draft_vocab=list(range(0, target.config.vocab_size, 2)))
        randomise(drafter.corrector)
        return target, drafter
    texts = [(torch.randint(0, target.config.vocab_size, (40,)), torch.ones(40, dtype=torch.bool))]
    corpus = CorpusBigrams.count(texts, target.config.vocab_size)
    drafter = scrambled(trained, seed=3, context_bigrams=True, corpus=corpus)
    drafter.config.correct_first_slot = first_slot
    drafter.set_draft_vocabulary(list(range(0, target.config.vocab_size, 2)))
    return target, drafter


def _load(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 -- a handle, not a dict
    return json.loads((folder / "config.json").read_text()), tensors


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_vllm_export_keeps_the_corrector(fitted, tmp_path):
    target, drafter = _served_drafter(fitted)
    config, tensors = _load(export_vllm(drafter, tmp_path / "out", block_size=4))
    assert config["architectures"] == [ARCHITECTURE] and ARCHITECTURE.startswith("DFlash")  # vLLM keeps the name
    assert config["block_size"] == 4 and "draft_vocab_size" not in config  # vLLM shares the full lm_head
    rebuilt = DCOCOConfig(**config["dcoco_config"]["model"])
    for field in ("top_k", "correct_first_slot", "context_bigrams", "corpus_bigrams", "draft_vocab_size"):
        assert getattr(rebuilt, field) == getattr(drafter.config, field), field
    assert config["dcoco_config"]["decoding"]["selection"] == drafter.decoding.selection
    state = drafter.state_dict()
    assert {k for k in state if k.startswith("corrector.")} <= set(tensors)
    assert torch.equal(tensors["draft_token_ids"], drafter.draft_token_ids)
    assert torch.equal(tensors["corpus_bigrams.pair_keys"], drafter.corpus_bigrams.pair_keys)
    assert "lm_head.weight" not in tensors and "d2t" not in tensors
    assert "vllm serve" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize(("corrector", "first_slot"), [("dcoco", False), ("dcoco", True), ("selector", True)],
                         ids=["paper", "correct_first_slot", "dflash2_selector"])
@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_engine_corrector_picks_what_the_drafter_picks(fitted, tmp_path, corrector, first_slot):
    """The engine side, rebuilt from the export, walks every block to the drafter's own proposal (the committed
    text reduced to the anchor on both sides: what vLLM hands a draft model)."""
    target, drafter = _served_drafter(fitted, first_slot, corrector)
    config, tensors = _load(export_vllm(drafter, tmp_path / "out"))
    engine = DCOCOBlockCorrector(DCOCOConfig(**config["dcoco_config"]["model"]), target.get_input_embeddings())
    engine.load_state_dict({k: v for k, v in tensors.items() if k.startswith(("corrector.", "corpus_bigrams.",
                                                                              "draft_token_ids"))})
    prompts = torch.randint(0, target.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=20, do_sample=False)
    states, _ = target_context(target, drafter.config.target_layer_ids, sequences)
    block, changed = drafter.config.block_size, 0
    for cut in range(2, sequences.shape[1] - 1, 3):
        anchor = sequences[:, cut - 1]
        positions = torch.arange(cut - 1 + block).expand(sequences.shape[0], -1)
        proposal = drafter.propose(anchor, states[:, :cut - 1], positions, DraftContextCache(),
                                   context_ids=anchor[:, None])
        block_ids = torch.cat([anchor[:, None], anchor.new_full((3, block - 1), drafter.config.mask_token_id)], 1)
        out = drafter(drafter.embed(block_ids), states[:, :cut - 1], positions, None, DraftContextCache())
        logits = drafter.slot_logits(out.last_hidden_state[:, 1:])
        walked = engine.walk(out.last_hidden_state, anchor, logits)
        assert torch.equal(walked, proposal.tokens), cut
        changed += int((proposal.tokens != proposal.candidates[..., 0]).sum())
    assert changed > 0  # the corrector overrules the argmax somewhere, so the equality above says something


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_lilicorr_is_refused_with_the_way_out(fitted, tmp_path):
    target, drafter = fitted
    lilicorr = lilicorr_copy(drafter, target)
    with pytest.raises(ValueError, match="anchor's fused context row.*--format dflash"):
        export_vllm(lilicorr, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # The engine side refuses it too (a hand-written config naming it never reaches a vLLM draft model's forward).
    with pytest.raises(ValueError, match="'lilicorr' corrector reads the anchor's fused context row"):
        DCOCOBlockCorrector(lilicorr.config, target.get_input_embeddings())


def test_cli_exports_the_shipped_selector_for_the_plugin(tmp_path):
    """The shipped selector folder holds the head alone and names its base drafter: the export is whole."""
    result = subprocess.run([sys.executable, "-m", "dcoco_hf", "export", "--format", "vllm",
                             str(REPO / "model_cards" / "dflash2-selector-smollm2-135m"), str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    config, tensors = _load(tmp_path / "out")
    assert config["architectures"] == [ARCHITECTURE] and config["dcoco_config"]["model"]["corrector_type"] == "dflash2"
    assert {"corrector.predecessor_codebook", "corrector.successor_codebook", "fc.weight",
            "draft_token_ids"} <= set(tensors)
    assert "DFlash2 candidate selector" in (tmp_path / "out" / "README.md").read_text()


def test_cli_vllm_export_takes_the_drafter_as_first_path(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dcoco_hf", "export", "--format", "vllm",
                             str(REPO / "model_cards" / "dcoco-smollm2-135m"), str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["dcoco_config"]["model"]["context_bigrams"] is True
    refused = subprocess.run([sys.executable, "-m", "dcoco_hf", "export", "--format", "vllm", "--draft-vocab",
                              str(tmp_path / "other")], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 2 and "--draft-vocab belongs to --format dflash" in refused.stderr


def test_plugin_without_vllm_names_the_fix():
    try:
        import vllm  # noqa: F401
    except ImportError:
        from dcoco_hf.serving.vllm_plugin import register

        with pytest.raises(ImportError, match="pip install vllm"):
            register()
        with pytest.raises(ImportError, match="needs vLLM"):
            import dcoco_hf.serving.vllm_model  # noqa: F401
    else:
        pytest.skip("vLLM is installed here; tests/test_vllm_serving.py checks the plugin")


def test_serving_doc_table_is_the_bench_json():
    """docs/serving.md shows scripts/vllm_bench.py's rendering of docs/results/vllm_bench.json, whose speculative
    outputs all equal plain vLLM's."""
    import runpy

    bench = runpy.run_path(str(REPO / "scripts" / "vllm_bench.py"))
    report = json.loads((REPO / "docs" / "results" / "vllm_bench.json").read_text())
    doc = (REPO / "docs" / "serving.md").read_text()
    shown = doc.split(bench["BEGIN"], 1)[1].split(bench["END"], 1)[0].strip()
    assert shown == bench["table"](report["summary"], report["meta"]), "run python scripts/vllm_bench.py"
    served = [row for row in report["summary"].values() if "refused" not in row]
    assert served and all(row["identical_c1"] and row["identical_c4"] for row in served)
