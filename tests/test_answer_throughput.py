"""`scripts/answer_throughput.py`: its two settings (the earlier answer script's batched `generate()` calls, and
`dcoco-hf train`'s shortest-first batches whose ended rows leave) write the same answers, so the ratio it reports
compares equal work."""

from __future__ import annotations

import runpy
from pathlib import Path

from conftest import make_target

from dcoco_hf.runtime.prompts import prompt_input_ids
from dcoco_hf.training.data import load_shards

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "answer_throughput.py")


def test_both_settings_write_the_same_answers(tmp_path):
    from test_cli import tiny_tokenizer

    script = runpy.run_path(SCRIPT)
    target, tokenizer = make_target("llama"), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    prompts = [" ".join(f"w{(i * 7 + j) % 40}" for j in range(1 + i % 9)) for i in range(70)]
    # EOS: a token one answer writes third, so answers end at different steps and rows leave the batch.
    first = target.generate(prompt_input_ids(tokenizer, prompts[5]), max_new_tokens=3, do_sample=False)
    target.generation_config.eos_token_id = int(first[0, -1])
    written = {name: script["answer"](name, target, tokenizer, prompts, tmp_path / name.replace(" ", "-"), 10)
               for name in script["SETTINGS"]}
    earlier, train = (sorted(map(tuple, rows)) for rows in written.values())
    assert len(train) == len(prompts) and train == earlier
    answered = [int(r["loss_mask"].sum()) for r in load_shards(tmp_path / "dcoco-hf-train")]
    assert 10 in answered and min(answered) < 10  # some answers ended at EOS, others ran to the cap
