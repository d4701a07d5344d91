"""`dcoco_hf.serving.export`: the DFlash backbone in the public z-lab format (what vLLM / SGLang load), and the way
back: a DCOCO corrector trained on top of a DFlash folder (`train_drafter.py --corrector-only --init DFLASH_FOLDER`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_target, scrambled
from safetensors import safe_open
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from dcoco_hf import DCOCOCandidateGenerator, DCOCODrafter
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.serving.export import export_dflash
from dcoco_hf.training import target_context

REPO = Path(__file__).resolve().parents[1]
CARD = REPO / "model_cards" / "dcoco-smollm2-135m"
# The public format, as z-lab's drafters ship it (../shared/notes/dflash-checkpoints.md).
LAYER_TENSORS = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
QWEN3_FIELDS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "attention_bias",
    "tie_word_embeddings", "layer_types", "num_target_layers", "block_size", "dflash_config",
}


def _format_tensors(layers: int) -> set[str]:
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(layers) for name in LAYER_TENSORS
    }


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        names = file.keys()  # a safetensors file handle, not a dict
        return {key: file.get_tensor(key) for key in names}


def _check_format(folder: Path, drafter: DCOCODrafter, block_size: int) -> dict:
    """config.json and model.safetensors hold exactly the public DFlash format; returns the config."""
    cfg = drafter.config
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert QWEN3_FIELDS <= set(config), QWEN3_FIELDS - set(config)
    assert config["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids}
    assert config["block_size"] == block_size and config["tie_word_embeddings"] is False
    assert config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert not {"auto_map", "top_k", "corrector_rank", "corpus_bigrams", "block_tau"} & set(config)
    tensors = _tensors(folder)
    assert set(tensors) == _format_tensors(cfg.num_hidden_layers), set(tensors) ^ _format_tensors(cfg.num_hidden_layers)
    state = drafter.state_dict()
    for key, value in tensors.items():
        assert torch.equal(value, state[key].cpu()), key
    card = (folder / "README.md").read_text()
    assert "corrector" in card and "vllm serve" in card and "sglang.launch_server" in card
    assert f'"num_speculative_tokens": {block_size - 1}' in card and \
        f"--speculative-num-draft-tokens {block_size}" in card
    return config


def _drafts(drafter, target, seed: int = 0, correct: bool = False) -> list[torch.Tensor]:
    """Proposals (tokens, candidates) after several committed prefixes of target-written text."""
    prompts = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False)
    states, _ = target_context(target, drafter.config.target_layer_ids, sequences)
    out = []
    for cut in range(2, 20, 3):
        positions = torch.arange(cut - 1 + drafter.config.block_size).expand(2, -1)
        proposal = drafter.propose(sequences[:, cut - 1], states[:, : cut - 1], positions, DraftContextCache(),
                                   correct=correct, context_ids=sequences[:, :cut])
        out += [proposal.tokens, proposal.candidates]
    return out


def _same(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    """Same proposals; candidate lists compared on the shorter width (the export does not carry our `top_k`, so a
    reloaded drafter keeps the default 16 candidates, whose first K are the original's K)."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        k = min(a.shape[-1], b.shape[-1]) if a.dim() == 3 else None
        assert torch.equal(a[..., :k], b[..., :k])


@pytest.fixture(scope="module")
def qwen3_fitted():
    from conftest import fit_drafter

    target = make_target("qwen3")
    return target, fit_drafter(target, block_size=6, top_k=4, steps=60).attach(target)


def test_export_is_the_public_format_and_reloads_with_the_same_proposals(tmp_path, fitted):
    target, drafter = fitted
    noisy = scrambled(drafter, context_bigrams=True)  # a corrector that changes proposals: the export must drop it
    assert any(not torch.equal(a, b) for a, b in zip(_drafts(noisy, target, correct=True), _drafts(noisy, target)))
    folder = export_dflash(noisy, tmp_path / "dflash")
    _check_format(folder, noisy, noisy.config.block_size)

    reloaded = DCOCODrafter.from_pretrained(folder).attach(target)
    assert not reloaded.corrector.delta_out.weight.any()  # a fresh, pass-through corrector
    assert reloaded.config.block_size == noisy.config.block_size and not reloaded.config.context_bigrams
    _same(_drafts(reloaded, target), _drafts(noisy, target))  # == our drafter with the corrector off
    _same(_drafts(reloaded, target, correct=True), _drafts(noisy, target))  # its zero corrector changes nothing


def test_export_runs_under_transformers_dflash_path_like_our_engine_with_the_corrector_off(
    tmp_path, qwen3_fitted, monkeypatch
):
    """transformers' `speculation_type="dflash"` drafts, from the exported folder, exactly what our engine drafts
    with the corrector off (wherever both drafted after the same committed prefix: transformers skips the first
    round, our first draft of a call precedes the prefill), and both stay equal to plain greedy decoding."""
    target, drafter = qwen3_fitted
    noisy = scrambled(drafter, seed=3)
    noisy.generation_config.num_assistant_tokens_schedule = "constant"  # whole blocks, as transformers' DFlash path
    reloaded = DCOCODrafter.from_pretrained(export_dflash(noisy, tmp_path / "dflash")).attach(target)
    drafts = {}
    for cls in (DCOCOCandidateGenerator, DFlashTokenCandidateGenerator):
        drafts[cls] = recorded = {}
        original = cls.get_candidates

        def recording(self, input_ids, *args, _original=original, _recorded=recorded, **kwargs):
            ids, logits = _original(self, input_ids, *args, **kwargs)
            if ids.shape[1] > input_ids.shape[1]:  # transformers' DFlash drafts nothing in its first round
                _recorded[input_ids.shape[1]] = ids[0, input_ids.shape[1]:].tolist()
            return ids, logits

        monkeypatch.setattr(cls, "get_candidates", recording)
    monkeypatch.setattr(DCOCOCandidateGenerator, "__init__", _corrector_off(DCOCOCandidateGenerator.__init__))
    for seed in (0, 1):
        ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(ids, max_new_tokens=16, do_sample=False)
        ours = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=noisy)
        theirs = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=reloaded,
                                 speculation_type="dflash")
        assert ours.tolist() == expected.tolist() == theirs.tolist()
        mine, hf = drafts[DCOCOCandidateGenerator], drafts[DFlashTokenCandidateGenerator]
        common = sorted(set(mine) & set(hf))
        assert len(common) >= 3, (sorted(mine), sorted(hf))
        for length in common:
            n = min(len(mine[length]), len(hf[length]))
            assert mine[length][:n] == hf[length][:n], length
        mine.clear()
        hf.clear()


def _corrector_off(init):
    def wrapped(self, *args, **kwargs):
        kwargs["correct"] = False
        init(self, *args, **kwargs)

    return wrapped


def test_draft_vocabulary_exports_as_d2t_and_comes_back(tmp_path, qwen3_fitted):
    target, drafter = qwen3_fitted
    ids = torch.tensor([0, 1, 3, 5, 7, 9, 11, 12, 14, 17, 20, 21, 25, 28, 30, 33, 36, 40, 44, 47])  # >= top_k 16
    vocab = scrambled(drafter, seed=1).set_draft_vocabulary(ids)
    folder = export_dflash(vocab, tmp_path / "dflash", draft_vocab=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == len(ids)
    tensors = _tensors(folder)
    assert set(tensors) == _format_tensors(1) | {"d2t", "lm_head.weight"}
    assert torch.equal(torch.arange(len(ids)) + tensors["d2t"], ids)  # vLLM: target id = draft id + d2t[draft id]
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight[ids])

    reloaded = DCOCODrafter.from_pretrained(folder).attach(target)
    assert torch.equal(reloaded.draft_token_ids, ids)
    _same(_drafts(reloaded, target), _drafts(vocab, target))


def test_export_errors_name_the_problem_and_the_fix(tmp_path, qwen3_fitted):
    _, drafter = qwen3_fitted
    with pytest.raises(ValueError, match=r"block size 9: must lie in \[2, 6\]"):
        export_dflash(drafter, tmp_path / "a", block_size=9)
    with pytest.raises(ValueError, match="proposes from the whole vocabulary"):
        export_dflash(drafter, tmp_path / "b", draft_vocab=True)
    detached = DCOCODrafter(drafter.config).set_draft_vocabulary(list(range(8)))
    with pytest.raises(ValueError, match="needs the target"):
        export_dflash(detached, tmp_path / "c", draft_vocab=True)
    other = make_target("llama")  # same width, but a target the drafter was not built for must still fit
    other.config.hidden_size = 64
    detached.attach = None  # keep attach() out of it: check the export's own compatibility check
    detached._target_ref = lambda: other
    with pytest.raises(ValueError, match="Hidden size mismatch"):
        export_dflash(detached, tmp_path / "d", draft_vocab=True)


def test_shipped_drafter_exports(tmp_path):
    """The shipped drafter's backbone, in the public format, from the drafter folder alone (no target)."""
    drafter = DCOCODrafter.from_pretrained(CARD)
    folder = export_dflash(drafter, tmp_path / "dflash", block_size=4)
    config = _check_format(folder, drafter, 4)
    assert config["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27] and config["num_target_layers"] == 30
    assert "draft_vocab_size" not in config  # full vocabulary: writing the draft one needs the target's lm_head rows
    reloaded = DCOCODrafter.from_pretrained(folder)
    assert reloaded.config.block_size == 4 and reloaded.draft_token_ids is None
    backbone = {k: v for k, v in drafter.state_dict().items() if re.match(r"(fc|hidden_norm|norm|layers)\.", k)}
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in backbone.items())


def test_cli_export(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dcoco_hf", "export", "--format", "dflash", str(tmp_path / "out"), "--block-size", "2",
         "--export-dtype", "bfloat16"],
        check=False, capture_output=True, text=True, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["block_size"] == 2 and config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _tensors(tmp_path / "out").values())
    bad = subprocess.run(
        [sys.executable, "-m", "dcoco_hf", "export", str(tmp_path / "bad"), "--block-size", "12"],
        check=False, capture_output=True, text=True, cwd=REPO,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "dcoco-hf export: error: block size 12")


def test_corrector_trains_on_top_of_a_dflash_folder(tmp_path, qwen3_fitted):
    """The documented workflow for any public DFlash drafter: `train_drafter.py --stage 2 --init DFLASH_FOLDER
    --corrector-only` (here from a recipe file) trains a DCOCO corrector alone; the new folder's corrector-off
    proposals are exactly the DFlash folder's (and the original drafter's), and it carries a trained corrector."""
    from test_multiprocess_training import quiet_env, training_folders

    target, drafter = qwen3_fitted
    target_dir, data = training_folders(tmp_path)
    dflash = export_dflash(drafter, tmp_path / "dflash")
    recipe = tmp_path / "corrector.yaml"
    recipe.write_text(f"stage: 2\ninit: {dflash}\ncorrector-only: true\ncontext-bigrams: true\ndata: [{data}]\n"
                      "num-anchors: 4\nbatch-size: 4\nmax-length: 32\nlr: 1.0e-2\nmax-steps: 6\nsave-steps: 100\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_drafter.py"), "--recipe", str(recipe), "--target",
         str(target_dir), "--output", str(tmp_path / "run")],
        check=False, capture_output=True, text=True, env=quiet_env(), timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trained = DCOCODrafter.from_pretrained(tmp_path / "run" / "final").attach(target, tune=False)
    assert trained.config.context_bigrams and trained.corrector.delta_out.weight.abs().sum() > 0
    plain = DCOCODrafter.from_pretrained(dflash).attach(target, tune=False)
    _same(_drafts(trained, target), _drafts(plain, target))
    _same(_drafts(trained, target), _drafts(drafter, target))


def test_export_never_writes_over_a_folder_the_source_reads(tmp_path, qwen3_fitted, monkeypatch, capsys):
    """A head-only folder reads the rest of its weights from its base drafter (config.json's base_drafter):
    exporting it over that base, by any spelling of the path, would destroy both, so it is refused as the source
    folder itself is."""
    from dcoco_hf.cli import main as cli
    from dcoco_hf.serving.export import export_vllm

    target, _ = qwen3_fitted
    base, head = tmp_path / "dcoco-base", tmp_path / "head-only"
    torch.manual_seed(0)
    drafter = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    drafter.save_pretrained(base)
    scrambled(drafter, seed=3).save_pretrained(head, base_drafter="../dcoco-base")  # another corrector, same backbone
    (tmp_path / "link").symlink_to(base, target_is_directory=True)
    saved = {path.name: path.read_bytes() for path in base.iterdir()}
    monkeypatch.chdir(tmp_path)
    for out in (base, tmp_path / "link", Path("head-only/../dcoco-base"), Path("dcoco-base")):
        assert cli.main(["export", "--overwrite", str(head), str(out)]) == 2
        error = capsys.readouterr().err
        assert "base drafter" in error and "base_drafter" in error and "Choose another output folder" in error, error
    loaded = DCOCODrafter.from_pretrained(head)
    for export in (export_dflash, export_vllm):
        with pytest.raises(ValueError, match="base drafter"):
            export(loaded, "link", source="head-only", overwrite=True)
    assert {path.name: path.read_bytes() for path in base.iterdir()} == saved
    DCOCODrafter.from_pretrained(base)
    assert cli.main(["export", "--overwrite", str(head), str(tmp_path / "elsewhere")]) == 0


def _limit_file_size(limit: int):
    """For a child process: files may grow to `limit` bytes, and writing past that is an error (EFBIG) instead of
    the SIGXFSZ that would kill it: a disk that fills mid-export, without filling a disk."""
    import resource
    import signal

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_writes


def test_export_past_a_write_limit_leaves_nothing_and_the_same_command_then_succeeds(tmp_path, qwen3_fitted):
    """A write that fails mid-export (here: weights larger than the file-size limit) is one line of error, leaves no
    half-written folder (nor a staging folder beside it), and the same command then works without --overwrite."""
    source = tmp_path / "drafter"
    DCOCODrafter.from_target(qwen3_fitted[0], num_hidden_layers=1, block_size=4, top_k=4).save_pretrained(source)
    out = tmp_path / "exports" / "out"
    command = [sys.executable, "-m", "dcoco_hf", "export", "--format", "vllm", str(source), str(out)]
    full = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO,
                          preexec_fn=_limit_file_size(4096))
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr  # above the error: the loading log and progress bars only
    assert full.stderr.strip().splitlines()[-1].startswith(f"dcoco-hf export: error: could not write the export to "
                                                          f"{out}: ")
    assert not (tmp_path / "exports").exists()  # the folder it made for the export went too
    result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_export_over_an_existing_folder_replaces_only_its_files(tmp_path, qwen3_fitted):
    _, drafter = qwen3_fitted
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    (out / "config.json").write_text("{}")
    export_dflash(drafter, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "kept" and json.loads((out / "config.json").read_text())["block_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_export_of_a_missing_folder_says_so(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dcoco_hf", "export", str(tmp_path / "nowhere"), str(tmp_path / "out")],
        check=False, capture_output=True, text=True, cwd=REPO,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"dcoco-hf export: error: DRAFTER {tmp_path / 'nowhere'}: no " \
        "such folder (give a local model folder or a Hub id like org/name)"
    assert not (tmp_path / "out").exists()
