"""Head-only drafter folders (`config.base_drafter`): a folder that stores only the tensors that differ from another
drafter's, e.g. a corrector head trained on a frozen backbone, loads complete and bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_target, scrambled
from safetensors.torch import load_file
from transformers import AutoModel

from dcoco_hf import DCOCODrafter
from dcoco_hf.assets import load_default_target
from dcoco_hf.network.modeling_dcoco import resolve_base

CARDS = Path(__file__).resolve().parents[1] / "model_cards"
BASE, HEAD = CARDS / "dcoco-smollm2-135m", CARDS / "lilicorr-smollm2-135m"
SELECTOR = CARDS / "dflash2-selector-smollm2-135m"


def _assert_same_state(first: torch.nn.Module, second: torch.nn.Module) -> None:
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A saved base drafter and, next to it, a head-only folder of the same backbone with another corrector."""
    target = make_target("llama")
    base = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4)
    head = scrambled(base, seed=3)
    root = tmp_path_factory.mktemp("cards")
    base.save_pretrained(root / "base")
    head.save_pretrained(root / "head", base_drafter="../base")
    return root, base, head


def test_head_only_folder_holds_only_what_differs(pair):
    root, base, head = pair
    stored = load_file(root / "head" / "model.safetensors")
    assert stored and all(name.startswith("corrector.") for name in stored)
    assert json.loads((root / "head" / "config.json").read_text())["base_drafter"] == "../base"
    assert head.config.base_drafter is None  # naming the base is the saved folder's business, not the model's
    _assert_same_state(DCOCODrafter.from_pretrained(root / "head"), head)
    _assert_same_state(AutoModel.from_pretrained(root / "head", trust_remote_code=True), head)


def test_a_head_trained_in_fp32_finds_its_backbone_in_a_bf16_base(tmp_path):
    """`dcoco-hf train` stores drafters in bf16; a head trained on that frozen backbone in fp32 holds the same values
    in another dtype, so its folder still stores the head alone, and loads those very values back."""
    target = make_target("llama")
    base = DCOCODrafter.from_target(target, num_hidden_layers=1, block_size=4, top_k=4).to(torch.bfloat16)
    base.save_pretrained(tmp_path / "base")
    head = scrambled(base.float(), seed=3)  # the backbone upcast exactly, a new fp32 corrector
    head.save_pretrained(tmp_path / "head", base_drafter="../base")
    assert all(name.startswith("corrector.") for name in load_file(tmp_path / "head" / "model.safetensors"))
    loaded = DCOCODrafter.from_pretrained(tmp_path / "head")  # the head's dtype, the base's values
    _assert_same_state(loaded, head)
    moved = dict(head.state_dict())
    moved["norm.weight"] = moved["norm.weight"] + 2.0**-12  # a value bf16 cannot hold: not the base's any more
    head.save_pretrained(tmp_path / "other", base_drafter="../base", state_dict=moved)
    assert "norm.weight" in load_file(tmp_path / "other" / "model.safetensors")


def test_a_loaded_head_saves_complete(pair, tmp_path):
    root, _, head = pair
    loaded = DCOCODrafter.from_pretrained(root / "head")
    loaded.save_pretrained(tmp_path / "full")
    assert json.loads((tmp_path / "full" / "config.json").read_text()).get("base_drafter") is None
    assert load_file(tmp_path / "full" / "model.safetensors").keys() == head.state_dict().keys()
    _assert_same_state(DCOCODrafter.from_pretrained(tmp_path / "full"), head)


def test_base_named_by_absolute_path(pair, tmp_path):
    root, _, head = pair
    head.save_pretrained(tmp_path / "head", base_drafter=str(root / "base"))
    _assert_same_state(DCOCODrafter.from_pretrained(tmp_path / "head"), head)


def test_a_relative_base_of_a_hub_folder_is_a_sibling_repository():
    assert resolve_base("org/lilicorr-smollm2-135m", "../dcoco-smollm2-135m") == "org/dcoco-smollm2-135m"
    assert resolve_base("org/lilicorr-smollm2-135m", "other/dcoco") == "other/dcoco"  # a Hub id as it stands


def test_missing_base_is_a_clear_error(pair, tmp_path):
    root, _, head = pair
    head.save_pretrained(tmp_path / "head", base_drafter=str(root / "base"))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "base_drafter": "../nowhere"}))
    with pytest.raises(OSError, match=r"base_drafter='../nowhere'.*Put the base drafter's folder at that path"):
        DCOCODrafter.from_pretrained(tmp_path / "head", local_files_only=True)


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_an_unreadable_base_file_names_the_file_and_base_drafter(pair, tmp_path, damage):
    """A base whose model.safetensors is cut short or holds a pickle: an OSError naming that file and the folder's
    base_drafter, not safetensors' bare error."""
    import shutil

    root, _, head = pair
    shutil.copytree(root / "base", tmp_path / "base")
    head.save_pretrained(tmp_path / "head", base_drafter="../base")
    weights = tmp_path / "base" / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        torch.save({"fc.weight": torch.zeros(2, 2)}, weights)
    with pytest.raises(OSError, match=rf"{weights}.*base_drafter='../base'.*truncated or corrupt"):
        DCOCODrafter.from_pretrained(tmp_path / "head")


# The folder's own code where the package is not installed: the network alone, whose head-only folders still load
# their base (or refuse), never a freshly initialised backbone.
_HEAD_WITHOUT_PACKAGE = """
import sys, torch
sys.modules["dcoco_hf"] = None  # as where the package is not installed
from safetensors.torch import load_file
from transformers import AutoModel
head, base = sys.argv[1:]
try:
    network = AutoModel.from_pretrained(head, trust_remote_code=True)
except OSError as error:
    print("REFUSED", error)
    raise SystemExit(0)
assert type(network).__module__.startswith("transformers_modules"), type(network)
stored, backbone = load_file(head + "/model.safetensors"), load_file(base + "/model.safetensors")
state = network.state_dict()
for name, tensor in state.items():
    expected = stored[name].to(tensor.dtype) if name in stored else backbone[name]
    assert torch.equal(tensor, expected), name
print("LOADED", len(state))
"""


@pytest.mark.parametrize("card", [HEAD, SELECTOR], ids=lambda p: p.name)
def test_a_head_folder_without_the_package_loads_its_base(card, tmp_path):
    """A head-only card through AutoModel where dcoco_hf is not installed: every backbone tensor is the base's (the
    probe found 0 of 40 matching: a fresh backbone); with the base gone, it refuses to load."""
    import shutil
    import subprocess
    import sys

    run = [sys.executable, "-c", _HEAD_WITHOUT_PACKAGE, str(card), str(BASE)]
    result = subprocess.run(run, capture_output=True, text=True)
    assert result.returncode == 0 and "LOADED" in result.stdout, result.stderr[-3000:]
    shutil.copytree(card, tmp_path / card.name)  # no ../dcoco-smollm2-135m beside it
    run[3] = str(tmp_path / card.name)
    result = subprocess.run(run, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and "base_drafter='../dcoco-smollm2-135m'" in result.stdout, result.stdout


def test_shipped_lilicorr_folder_is_its_head_on_the_dcoco_backbone():
    """The LiLiCorr card stores its head (floating-point tensors in fp16, which drafted every checked block as fp32
    did) and names the DCOCO card; the head loads as the stored values in the backbone's fp32, every other tensor it
    loads is the DCOCO card's."""
    assert json.loads((HEAD / "config.json").read_text())["base_drafter"] == "../dcoco-smollm2-135m"
    stored, base = load_file(HEAD / "model.safetensors"), load_file(BASE / "model.safetensors")
    assert all(t.dtype == torch.float16 for t in stored.values() if t.is_floating_point())
    state = DCOCODrafter.from_pretrained(HEAD).state_dict()
    for name, tensor in state.items():
        expected = stored[name].to(tensor.dtype) if name in stored else base[name]
        assert torch.equal(tensor, expected), name
    assert not any(name.startswith(("fc.", "layers.", "norm.", "hidden_norm.")) for name in stored)
    assert not any(name in base and torch.equal(stored[name], base[name]) for name in stored)  # nothing twice


def test_shipped_selector_folder_is_its_half_precision_head_on_the_dcoco_backbone():
    """The DFlash2 selector card stores its head alone, in fp16 (it drafted every checked block as the fp32 head did),
    and names the DCOCO card; the head loads as the stored values in the backbone's fp32, every other tensor is the
    DCOCO card's."""
    assert json.loads((SELECTOR / "config.json").read_text())["base_drafter"] == "../dcoco-smollm2-135m"
    stored, base = load_file(SELECTOR / "model.safetensors"), load_file(BASE / "model.safetensors")
    assert sorted(stored) == ["corrector.hidden_projection.weight", "corrector.predecessor_codebook",
                              "corrector.successor_codebook"]
    assert all(tensor.dtype == torch.float16 for tensor in stored.values())
    state = DCOCODrafter.from_pretrained(SELECTOR).state_dict()
    for name, tensor in state.items():
        assert tensor.dtype == (base[name].dtype if name in base else torch.float32), name
        assert torch.equal(tensor, stored[name].float() if name in stored else base[name]), name


@pytest.mark.slow
def test_shipped_lilicorr_drafts_as_its_complete_save(tmp_path):
    """Head + base and a complete save of it draft the same tokens on the real target, cycle by cycle."""
    target, tokenizer = load_default_target()
    loaded = DCOCODrafter.from_pretrained(HEAD)
    loaded.save_pretrained(tmp_path / "full")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    runs = []
    for drafter in (loaded, DCOCODrafter.from_pretrained(tmp_path / "full")):
        drafter.attach(target, tune=False)
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
        stats = drafter.generation_stats(out).as_dict()
        # The predicted acceptance reads the scores' float values: equal up to the last bits of the summation order.
        predicted = stats.pop("predicted_accept")
        runs.append((out.tolist(), {k: v for k, v in stats.items() if not k.endswith("_seconds")}, predicted))
        drafter.detach()
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][2] == pytest.approx(runs[1][2], rel=1e-5)
