"""Saving and loading drafters: our own folders (remote code), public DFlash checkpoints, PEFT adapters, bad files."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict

import pytest
import torch
from conftest import VOCAB, make_target, scrambled
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from dcoco_hf import DCOCOCandidateGenerator, DCOCOConfig, DCOCODrafter
from dcoco_hf.runtime.context_cache import DraftContextCache
from dcoco_hf.training import target_context

# A saved folder carries the network's code only; the runtime (candidate_generator.py and the rest) is the package's.
CODE_FILES = ("configuration_dcoco.py", "modeling_dcoco.py", "corrector.py", "correctors.py", "lilicorr.py",
              "selector.py")
AUTO_MAP = {
    "AutoConfig": "configuration_dcoco.DCOCOConfig",
    "AutoModel": "modeling_dcoco.DCOCODraftModel",
}
DRAFTER_KEY = re.compile(r"^(fc\.weight|hidden_norm\.weight|norm\.weight|layers\.\d+\.[\w.]+|corrector\.[\w.]+)$")


@pytest.fixture(scope="module")
def llama():
    return make_target("llama")


@pytest.fixture(scope="module")
def qwen3():
    return make_target("qwen3")


def _ids(seed: int, length: int = 6) -> torch.LongTensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _proposals(drafter, target, seed: int = 0, cuts=range(2, 20, 3)) -> list:
    """Proposals after several committed prefixes of two target-written sequences (the very `propose` generate uses)."""
    prompts = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False)
    states, _ = target_context(target, drafter.config.target_layer_ids, sequences)
    out = []
    for cut in cuts:
        positions = torch.arange(cut - 1 + drafter.config.block_size).expand(2, -1)
        out.append(drafter.propose(sequences[:, cut - 1], states[:, : cut - 1], positions, DraftContextCache()))
    return out


def _assert_same_proposals(first: list, second: list) -> None:
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.candidates, b.candidates)
        # Same weights, same inputs, yet not always the same bits: MKL's sgemm takes alignment-dependent paths on
        # AVX-512 machines, so the same product on another copy of a weight moves in the last bits (seen: 7e-7 on
        # a LoRA layer, 7e-5 after the corrector's MLP). A wrong or missing weight moves scores by O(1).
        torch.testing.assert_close(a.transition_scores, b.transition_scores, rtol=1e-4, atol=1e-4)


def _greedy_equal(target, drafter, seeds=(0, 1), new: int = 20) -> list:
    outputs = []
    for seed in seeds:
        expected = target.generate(_ids(seed), max_new_tokens=new, do_sample=False)
        got = target.generate(_ids(seed), max_new_tokens=new, do_sample=False, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        outputs.append(got.tolist())
    return outputs


# ---------------------------------------------------------------------------------------------------- our folders


def test_save_pretrained_and_auto_classes(tmp_path, llama):
    torch.manual_seed(0)
    drafter = scrambled(DCOCODrafter.from_target(llama, num_hidden_layers=2, block_size=6, top_k=4), seed=0)
    assert drafter.corrector.delta_out.weight.abs().sum() > 0  # a non-zero corrector travels too
    folder = tmp_path / "dcoco-drafter"
    drafter.save_pretrained(folder)

    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", *CODE_FILES} <= names, names
    assert {name for name in names if name.endswith(".py")} == set(CODE_FILES)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["model_type"] == "dcoco" and config["architectures"] == ["DCOCODrafter"]
    assert config["top_k"] == 4 and config["block_size"] == 6 and config["target_layer_ids"] == [1]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_assistant_tokens"] == 5 and generation["num_assistant_tokens_schedule"] == "cost"

    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        keys = set(file.keys())
        shapes = {key: tuple(file.get_slice(key).get_shape()) for key in keys}
    assert keys == set(drafter.state_dict()), keys ^ set(drafter.state_dict())
    assert all(DRAFTER_KEY.match(key) for key in keys), sorted(k for k in keys if not DRAFTER_KEY.match(k))
    assert {key.split(".")[0] for key in keys} == {"fc", "hidden_norm", "layers", "norm", "corrector"}
    assert not any(VOCAB in shape for shape in shapes.values()), "the target's embedding / lm_head leaked into the file"

    # With the package imported, the Auto classes build the package's classes for the folder's model type, also
    # with trust_remote_code: the runtime is the installed one, whatever code the folder carries.
    auto_config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(auto_config) is DCOCOConfig
    assert auto_config.to_dict()["target_layer_ids"] == [1] and auto_config.top_k == 4

    reference = _proposals(drafter, llama)
    reference_outputs = _greedy_equal(llama, drafter)
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):  # a drafter cannot generate alone
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    loaded = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded) is DCOCODrafter
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.attach(llama) is loaded
    _assert_same_proposals(_proposals(loaded, llama), reference)
    assert _greedy_equal(llama, loaded) == reference_outputs
    assert loaded.generation_stats().cycles > 0
    assert any(not torch.equal(p.chosen, torch.zeros_like(p.chosen)) for p in reference)  # the corrector acted


_NETWORK_ALONE = """
import sys, torch
sys.modules["dcoco_hf"] = None  # as where the package is not installed: importing it fails, find_spec finds none
from transformers import AutoModel, AutoModelForCausalLM
folder, target_folder, inputs, out = sys.argv[1:]
network = AutoModel.from_pretrained(folder, trust_remote_code=True)
target = AutoModelForCausalLM.from_pretrained(target_folder)
assert sys.modules["dcoco_hf"] is None, "the folder's code imported the package"
try:
    network.attach(target)
except RuntimeError as error:
    message = str(error)
network.bind_target(target)
x = torch.load(inputs)
with torch.no_grad():
    hidden = network(x["embeds"], x["context"], x["positions"]).last_hidden_state
    logits, columns = network.proposal_logits(hidden[:, 1:])
    candidates, candidate_logits, log_probs = network.slot_candidates(logits, columns)
    _, scores = network.score_candidates(hidden, x["anchor"], candidates, candidate_logits, log_probs)
torch.save({"class": type(network).__module__ + "." + type(network).__name__, "message": message,
            "hidden": hidden, "candidates": candidates, "scores": scores}, out)
"""


def test_folder_code_alone_is_the_network(tmp_path, llama):
    """A saved folder's own code, loaded where the package is not installed, is the network: the same forward,
    candidates and transition scores as the package's drafter, and `attach` says the runtime is the package."""
    import subprocess
    import sys

    drafter = scrambled(DCOCODrafter.from_target(llama, num_hidden_layers=2, block_size=5, top_k=4), seed=2)
    drafter.save_pretrained(tmp_path / "drafter")
    llama.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    anchor = torch.randint(0, VOCAB, (2,))
    block = torch.cat([anchor[:, None], torch.full((2, 4), drafter.config.mask_token_id)], dim=1)
    inputs = {"embeds": drafter.embed(block).detach(), "context": torch.randn(2, 3, width),
              "positions": torch.arange(3 + 5).expand(2, -1), "anchor": anchor}
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", _NETWORK_ALONE, str(tmp_path / "drafter"), str(tmp_path / "target"),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], check=True, cwd=tmp_path)
    alone = torch.load(tmp_path / "out.pt")
    assert alone["class"].startswith("transformers_modules") and alone["class"].endswith(".DCOCODraftModel")
    assert "pip install dcoco-hf" in alone["message"]
    with torch.no_grad():
        hidden = drafter(inputs["embeds"], inputs["context"], inputs["positions"]).last_hidden_state
        logits, columns = drafter.proposal_logits(hidden[:, 1:])
        candidates, candidate_logits, log_probs = drafter.slot_candidates(logits, columns)
        _, scores = drafter.score_candidates(hidden, anchor, candidates, candidate_logits, log_probs)
    torch.testing.assert_close(alone["hidden"], hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone["candidates"], candidates)
    torch.testing.assert_close(alone["scores"], scores, rtol=1e-4, atol=1e-4)
    assert scores.abs().sum() > 0  # a scrambled corrector: the folder's corrector code really scored


DECODING = ("selection", "geometric_lambda", "block_tau")


def test_decoding_choices_are_saved_in_the_generation_config(tmp_path, llama):
    """The walk and the measured taus are decoding choices: generation_config.json holds them, config.json does not,
    and they load back as set (block_tau keyed by str(B), however the keys were written)."""
    drafter = scrambled(DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=4, top_k=4), seed=1)
    drafter.generation_config.update(selection="geometric", geometric_lambda=0.5, block_tau={3: 2.1, 2: 1.5})
    drafter.save_pretrained(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    generation = json.loads((tmp_path / "drafter" / "generation_config.json").read_text())
    assert not set(DECODING) & set(config) and "legacy_decoding" not in config
    assert {name: generation[name] for name in DECODING} == {
        "selection": "geometric", "geometric_lambda": 0.5, "block_tau": {"2": 1.5, "3": 2.1}}
    for loaded in (DCOCODrafter.from_pretrained(tmp_path / "drafter"),
                   AutoModel.from_pretrained(tmp_path / "drafter", trust_remote_code=True)):
        assert asdict(loaded.decoding) == asdict(drafter.decoding)  # the remote-code copy has its own class
        _assert_same_proposals(_proposals(loaded.attach(llama, tune=False), llama), _proposals(drafter, llama))


def test_a_folder_from_before_the_move_decodes_with_its_choices(tmp_path, llama):
    """A config.json written when it held the decoding choices (and a generation_config.json without them) loads
    with those choices, moved into the generation config; a generation_config.json value wins; a re-save writes them
    where they now live."""
    drafter = scrambled(DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=4, top_k=4), seed=2)
    folder = tmp_path / "old"
    drafter.save_pretrained(folder)
    config, generation = (json.loads((folder / name).read_text()) for name in ("config.json", "generation_config.json"))
    old_choices = {"selection": "viterbi", "geometric_lambda": 0.5, "block_tau": {"2": 1.4, "3": 1.6}}
    old_generation = {k: v for k, v in generation.items() if k not in DECODING} | {"_from_model_config": True}
    (folder / "config.json").write_text(json.dumps(config | old_choices))
    (folder / "generation_config.json").write_text(json.dumps(old_generation))

    loaded = DCOCODrafter.from_pretrained(folder)
    defaults = {"use_corrector": True, "time_phases": False, "tree_budget": 0}  # what the old folder lacks
    assert asdict(loaded.decoding) == {**old_choices, **defaults}
    assert not {"selection", "legacy_decoding"} & set(loaded.config.to_dict())
    plain = _proposals(drafter, llama)
    drafter.generation_config.update(selection="viterbi", geometric_lambda=0.5)
    walked = _proposals(drafter, llama)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(plain, walked)), "the walks must differ here"
    _assert_same_proposals(_proposals(loaded.attach(llama, tune=False), llama), walked)

    loaded.save_pretrained(tmp_path / "resaved")
    assert not set(DECODING) & set(json.loads((tmp_path / "resaved" / "config.json").read_text()))
    assert DCOCODrafter.from_pretrained(tmp_path / "resaved").decoding == loaded.decoding

    (folder / "config.json").write_text(json.dumps(config | old_choices | {"selection": "greedy"}))
    assert DCOCODrafter.from_pretrained(folder).decoding.selection == "prefix_first"  # the walk's pre-0.2 name
    (folder / "generation_config.json").write_text(json.dumps(generation | {"selection": "geometric"}))
    wins = DCOCODrafter.from_pretrained(folder).decoding
    assert (wins.selection, wins.geometric_lambda) == ("geometric", generation["geometric_lambda"])


# ---------------------------------------------------------------------------------------------------- public DFlash

H, LAYERS, HEADS, KV, HEAD_DIM, INTER = 32, 2, 4, 2, 8, 64
LAYER_IDS, MASK, BLOCK = [0, 1, 2], VOCAB - 1, 6


def _dflash_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny public-DFlash-style state dict: fc, hidden_norm, norm, 11 tensors per layer; no prefix, no corrector."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1 + rand(n, scale=0.1)

    w = {"fc.weight": rand(H, len(LAYER_IDS) * H, scale=0.1), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": rand(KV * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": rand(KV * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(INTER, H), p + "mlp.up_proj.weight": rand(INTER, H),
            p + "mlp.down_proj.weight": rand(H, INTER),
        }
    return {k: v.to(torch.bfloat16) for k, v in w.items()}  # public drafters ship bf16


def _dflash_config(variant: str) -> tuple[dict, float]:
    config = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "vocab_size": VOCAB, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "layer_types": ["full_attention"] * LAYERS,
        "num_target_layers": 4, "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "use_cache": True,
    }
    theta = 500_000.0  # not the config default (1e6), so a dropped setting shows
    dflash = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}
    if variant == "dflash_config":
        config |= {"block_size": BLOCK, "rope_theta": theta, "dflash_config": dflash}
    elif variant == "block_in_dflash_config":
        config |= {"rope_theta": theta, "dflash_config": {**dflash, "block_size": BLOCK}}
    elif variant == "top_level":
        config |= {"rope_theta": theta, "block_size": BLOCK, **dflash}
    elif variant == "rope_parameters":
        theta = 10_000.0
        config |= {"block_size": BLOCK, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                   "dflash_config": dflash}
    else:
        raise ValueError(variant)
    return config, theta


def _record_drafts(monkeypatch, cls) -> dict[int, list[int]]:
    """Committed length -> drafted tokens, for every draft a candidate generator class makes."""
    drafts: dict[int, list[int]] = {}
    original = cls.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            drafts[input_ids.shape[1]] = ids[0, input_ids.shape[1]:].tolist()
        return ids, logits

    monkeypatch.setattr(cls, "get_candidates", recording)
    return drafts


@pytest.mark.parametrize("variant", ["dflash_config", "block_in_dflash_config", "top_level", "rope_parameters"])
def test_public_dflash_checkpoint(tmp_path, qwen3, variant, monkeypatch):
    config, theta = _dflash_config(variant)
    tensors = _dflash_tensors()
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    drafter = DCOCODrafter.from_pretrained(tmp_path, dtype=torch.float32)
    cfg = drafter.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (BLOCK, MASK, LAYER_IDS)
    assert cfg.num_target_layers == 4
    assert cfg.rope_parameters["rope_theta"] == theta
    torch.testing.assert_close(drafter.rotary_emb.inv_freq[1].double(), torch.tensor(theta ** (-2 / HEAD_DIM)).double())
    assert cfg.auto_map == AUTO_MAP  # re-saving gives a folder our auto classes load, not the public `dflash` code
    state = drafter.state_dict()
    assert set(state) == set(tensors) | {k for k in state if k.startswith("corrector.")}
    for key, value in tensors.items():
        assert torch.equal(state[key], value.float()), f"{key} was not loaded as stored"
    assert not drafter.corrector.delta_out.weight.any() and not drafter.corrector.delta_out.bias.any()
    assert drafter.corrector.delta_pair.weight.abs().sum() > 0  # the rest of the corrector is initialised normally

    drafter.attach(qwen3)
    for proposal in _proposals(drafter, qwen3):
        assert torch.equal(proposal.tokens, proposal.candidates[..., 0])
        assert not proposal.chosen.any()
    # The DFlash argmax, computed from the backbone by hand for one context.
    prompts = _ids(5, length=9)
    states, _ = target_context(qwen3, LAYER_IDS, prompts)
    block = torch.cat([prompts[:, -1:], torch.full((1, BLOCK - 1), MASK)], dim=1)
    with torch.no_grad():
        hidden = drafter(qwen3.get_input_embeddings()(block), states[:, :-1], torch.arange(8 + BLOCK)[None])
        argmax = qwen3.lm_head(hidden.last_hidden_state[:, 1:]).argmax(-1)
    proposal = drafter.propose(prompts[:, -1], states[:, :-1], torch.arange(8 + BLOCK)[None], DraftContextCache())
    assert torch.equal(proposal.tokens, argmax)

    # Same weights under transformers' own DFlash generator: same proposals wherever both drafted after the same
    # committed prefix (DCOCO's first draft of a call precedes the prefill, transformers' DFlash skips that round).
    # Both draft whole blocks (the cost-aware schedule may draft shorter ones, which a bidirectional drafter fills
    # differently).
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    ours = _record_drafts(monkeypatch, DCOCOCandidateGenerator)
    theirs = _record_drafts(monkeypatch, DFlashTokenCandidateGenerator)
    for seed in (0, 1):
        ids = _ids(seed)
        expected = qwen3.generate(ids, max_new_tokens=16, do_sample=False)
        got = qwen3.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        dflash = qwen3.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                                speculation_type="dflash")
        assert got.tolist() == expected.tolist() == dflash.tolist()
        common = sorted(set(ours) & set(theirs))
        assert len(common) >= 3, (sorted(ours), sorted(theirs))
        for length in common:
            n = min(len(ours[length]), len(theirs[length]))
            assert ours[length][:n] == theirs[length][:n], length
        ours.clear()
        theirs.clear()


def test_public_dflash_checkpoint_default_dtype(tmp_path, qwen3):
    """Loaded as published (bf16 weights, `torch_dtype: bfloat16`) next to an fp32 target: attach casts it to the
    target's dtype (every generation path then agrees on one dtype), and the output is exact."""
    config, _ = _dflash_config("dflash_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(_dflash_tensors(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    drafter = DCOCODrafter.from_pretrained(tmp_path)
    assert drafter.dtype == torch.bfloat16
    drafter.attach(qwen3)
    assert drafter.dtype == qwen3.dtype == torch.float32
    _greedy_equal(qwen3, drafter, seeds=(3,))


# ---------------------------------------------------------------------------------------------------- PEFT

CORRECTOR_LINEARS = ["cand_proj", "ctx_proj", "fuse_proj", "pair_proj", "delta_pair", "delta_prev", "delta_next",
                     "delta_logits", "delta_out"]


def test_peft_lora_on_the_corrector(tmp_path, llama):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    base = DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=6, top_k=4)  # zero-output corrector
    plain = _proposals(base, llama)
    model = get_peft_model(copy.deepcopy(base).attach(llama), LoraConfig(r=4, lora_alpha=8,
                                                                         target_modules=CORRECTOR_LINEARS))
    model.eval()  # get_peft_model leaves it in training mode; PeftModel.from_pretrained (below) gives eval mode
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lora = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
        assert len(lora) == 2 * len(CORRECTOR_LINEARS)
        for _, param in lora:
            param.copy_(torch.randn(param.shape, generator=generator) * 2 / param.shape[-1] ** 0.5)
    adapted = _proposals(model, llama)
    changed = sum(int((a.tokens != b.tokens).sum()) for a, b in zip(adapted, plain))
    assert changed > 0, "the LoRA weights do not change any proposal: the comparison below would prove nothing"

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base).attach(llama), tmp_path / "adapter")
    _assert_same_proposals(_proposals(reloaded, llama), adapted)
    # The wrapped drafter is still a working assistant, and speculation stays exact.
    _greedy_equal(llama, model)
    _greedy_equal(llama, reloaded)
    assert reloaded.generation_stats().cycles > 0


# ---------------------------------------------------------------------------------------------------- bad folders


@pytest.fixture
def saved(tmp_path, llama):
    torch.manual_seed(0)
    folder = tmp_path / "drafter"
    DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=6, top_k=4).save_pretrained(folder)
    return folder


def test_missing_backbone_weight(saved):
    path = saved / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    for load in (DCOCODrafter.from_pretrained, lambda f: AutoModel.from_pretrained(f, trust_remote_code=True)):
        with pytest.raises(ValueError, match=r"lacks 1 drafter weight\(s\), e\.g\. \['layers\.0\.self_attn\.q_proj\."
                                             r"weight'\]: it is not a complete DFlash/DCOCO drafter\. Re-download"):
            load(saved)


def test_missing_corrector_is_fine(saved):
    path = saved / "model.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if not k.startswith("corrector.")}, str(path),
              metadata={"format": "pt"})
    drafter = DCOCODrafter.from_pretrained(saved)
    assert not drafter.corrector.delta_out.weight.any()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(saved, damage):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64)
    for load in (DCOCODrafter.from_pretrained, lambda f: AutoModel.from_pretrained(f, trust_remote_code=True)):
        with pytest.raises(OSError, match="truncated or corrupt") as error:
            load(saved)
        message = str(error.value)
        assert str(path) in message and "download or save the checkpoint again" in message, message


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2]", "\x00\xff"], ids=["torn", "a-list", "binary"])
def test_a_garbage_generation_config_is_refused_naming_the_file(saved, garbage):
    """transformers would replace it by defaults, silently: the decoding choices and num_assistant_tokens it holds
    would be lost without a word."""
    path = saved / "generation_config.json"
    path.write_bytes(garbage.encode("latin-1"))
    for load in (DCOCODrafter.from_pretrained, lambda f: AutoModel.from_pretrained(f, trust_remote_code=True)):
        with pytest.raises(ValueError, match="generation_config.json") as error:
            load(saved)
        assert str(path) in str(error.value) and "save the drafter again" in str(error.value)
    path.unlink()  # no file at all: the defaults, as before
    assert DCOCODrafter.from_pretrained(saved).decoding.selection == "prefix_first"


def test_config_keywords_stay_out_of_the_generation_config(tmp_path, llama):
    """`from_pretrained(folder, top_k=..., correct_first_slot=...)` changes config.json's fields only: transformers
    would also copy them into the generation config, which then saved architecture fields beside decoding choices."""
    DCOCODrafter.from_target(llama, num_hidden_layers=1, block_size=4, top_k=4).save_pretrained(tmp_path / "a")
    loaded = DCOCODrafter.from_pretrained(tmp_path / "a", correct_first_slot=True, selection="viterbi")
    assert loaded.config.correct_first_slot and loaded.decoding.selection == "viterbi"
    loaded.save_pretrained(tmp_path / "b")
    generation = json.loads((tmp_path / "b" / "generation_config.json").read_text())
    assert "correct_first_slot" not in generation and generation["selection"] == "viterbi"


@pytest.mark.parametrize("edit", [{"corrector_type": "lilicorr"}, {"num_hidden_layers": 0, "layer_types": []}],
                         ids=["lilicorr-config-over-dcoco-weights", "fewer-layers"])
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, edit):
    target = make_target("llama")
    torch.manual_seed(0)
    DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match="this config has no place for") as error:
        DCOCODrafter.from_pretrained(tmp_path)
    assert ("corrector." if "corrector_type" in edit else "layers.0.") in str(error.value)
