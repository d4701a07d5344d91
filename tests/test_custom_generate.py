"""The repository's `custom_generate/` folder, loaded the way transformers loads a Hub `custom_generate` repo
(`custom_generate/generate.py` + `requirements.txt`, gated by trust_remote_code): batched greedy output equals
plain batched `generate()`."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_batched import PAD, left_padded

FOLDER = Path(__file__).resolve().parents[1] / "custom_generate"


def test_folder_has_the_hub_layout():
    assert (FOLDER / "custom_generate" / "generate.py").is_file()
    assert "dcoco-hf" in (FOLDER / "custom_generate" / "requirements.txt").read_text()
    front_matter = (FOLDER / "README.md").read_text().split("---")[1]
    assert "- custom_generate" in front_matter


def test_custom_generate_folder_equals_plain_generate(fitted):
    target, drafter = fitted
    ids, mask = left_padded(70, [5, 9, 2])
    common = {"attention_mask": mask, "max_new_tokens": 20, "do_sample": False, "pad_token_id": PAD}
    expected = target.generate(ids, **common)
    got = target.generate(ids, custom_generate=str(FOLDER), trust_remote_code=True, drafter=drafter, **common)
    assert got.tolist() == expected.tolist()
    stats = drafter.generation_stats(got)  # the package's loop ran: one DCOCOStats per row
    assert len(stats) == 3 and all(s.committed_tokens == 20 for s in stats)
    plain = target.generate(ids, custom_generate=str(FOLDER), trust_remote_code=True, drafter=drafter, correct=False,
                            return_dict_in_generate=True, **common)
    assert plain.sequences.tolist() == expected.tolist()


def test_custom_generate_folder_needs_trust_and_a_drafter(fitted):
    target, _ = fitted
    ids, mask = left_padded(71, [4, 6])
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(ids, attention_mask=mask, custom_generate=str(FOLDER), max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(TypeError, match="needs a drafter"):
        target.generate(ids, attention_mask=mask, custom_generate=str(FOLDER), trust_remote_code=True,
                        max_new_tokens=4, pad_token_id=PAD)
