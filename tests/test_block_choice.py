"""The cycle costs (dcoco_hf/runtime/block_choice.py) and the constant schedule's block, DScout's tau / cycle time, on
the tiny fitted drafter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcoco_hf import DCOCOConfig, DCOCODrafter
from dcoco_hf.runtime.block_choice import candidate_block_sizes, choose_block_size, measure_cycle_costs
from dcoco_hf.network.configuration_dcoco import DecodingChoices
from dcoco_hf.runtime.costs import CycleCosts

# The shipped SmolLM2 drafter's HumanEval tau per block size (its bench_block_sizes.json): it grows fast up to blocks
# of 4, then hardly.
BLOCK_TAU = {"2": 1.62, "3": 1.93, "4": 2.08, "5": 2.10, "6": 2.08, "7": 2.05, "8": 2.03}


@pytest.mark.parametrize(
    "verify_ms, best",
    [
        # Made-up cycle costs of the two CPU patterns we met: the 4-token verify nearly as cheap as the 3-token one
        # (blocks of 4 win), or clearly dearer (blocks of 3 win); on a GPU, where T barely grows, the highest tau wins.
        ({2: 100, 3: 104, 4: 106, 5: 125, 6: 128, 7: 131, 8: 134}, 4),
        ({2: 100, 3: 104, 4: 116, 5: 125, 6: 128, 7: 131, 8: 134}, 3),
        ({2: 10, 3: 10, 4: 10, 5: 10, 6: 10, 7: 10, 8: 10}, 5),
    ],
)
def test_the_block_of_highest_tau_per_cycle_wins(fitted, verify_ms, best):
    # The draft is free here, so a cycle of B costs a verify of B rows.
    verify = [verify_ms.get(rows, verify_ms[2]) / 1e3 for rows in range(1, 9)]
    costs = CycleCosts(verify=verify, draft={size: 1e-9 for size in range(2, 9)})
    _, drafter = fitted
    drafter.generation_config.block_tau = BLOCK_TAU
    try:
        choice = choose_block_size(drafter, costs)
    finally:
        drafter.generation_config.block_tau = None
    assert choice.block_size == best
    assert sorted(choice.tau) == list(range(2, 9)) and choice.tau[3] == 1.93
    assert f"* block {best}:" in choice.summary()


def test_cost_timing_leaves_the_drafter_as_it_was_and_is_monotone(fitted):
    target, drafter = fitted
    block, assistant_tokens = drafter.config.block_size, drafter.generation_config.num_assistant_tokens
    prompt = torch.arange(3, 19)[None]
    before = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    costs = measure_cycle_costs(target, drafter, [2, 5, 8], max_rows=8, context_length=32, repeats=3)
    assert len(costs.verify) == 8 and sorted(costs.draft) == [2, 5, 8]
    # a plain step as timed; from 2 columns on, each width priced as the cheapest forward covering it
    assert costs.verify[0] > 0 and all(0 < a <= b for a, b in zip(costs.verify[1:], costs.verify[2:]))
    assert costs.draft[2] <= costs.draft[5] <= costs.draft[8] and costs.spread >= 0
    assert (drafter.config.block_size, drafter.generation_config.num_assistant_tokens) == (block, assistant_tokens)
    after = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(before, after)


def test_block_tau_is_checked_and_names_the_candidates():
    config = DCOCOConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, num_hidden_layers=1, block_size=6, top_k=4,
                         target_layer_ids=[0])
    drafter = DCOCODrafter(config)
    with pytest.raises(ValueError, match="records no block_tau"):
        candidate_block_sizes(drafter)
    drafter.generation_config.block_tau = {"4": 1.9, "2": 1.5}
    assert candidate_block_sizes(drafter) == [2, 4]
    for bad in ({"7": 2.0}, {"3": 3.5}, {"3": 0.9}, {}):
        with pytest.raises(ValueError, match=r"needs one tau per measured block size B in \[2, 6\]"):
            DecodingChoices.read({"block_tau": bad}, config)
    assert DecodingChoices.read({"block_tau": {3: 2}}, config).block_tau == {"3": 2.0}  # JSON keys: str


def test_record_block_tau_script(tmp_path):
    """scripts/record_block_tau.py writes the dcoco@B taus of benches on the same prompts into generation_config.json
    (and moves an older config.json's decoding choices there)."""
    config = DCOCOConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, num_hidden_layers=1, block_size=4, top_k=4)
    config.save_pretrained(tmp_path / "drafter")
    config_path = tmp_path / "drafter" / "config.json"
    legacy = {"block_tau": {"2": 1.1}, "selection": "viterbi"}
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | legacy))

    def bench(path, taus, suites):
        methods = {name: {"tau": tau} for name, tau in taus.items()}
        report = {"methods": methods, "suites": {}, "config": {"temperature": 0.0, "suites": suites,
                                                               "max_new_tokens": 128}}
        path.write_text(json.dumps(report))
        return str(path)

    first = bench(tmp_path / "a.json", {"vanilla": None, "dcoco@2": 1.51234, "dflash@3": 1.7}, {"humaneval": 20})
    second = bench(tmp_path / "b.json", {"dcoco@3": 1.8, "dcoco@4": 1.9}, {"humaneval": 20})
    script = Path(__file__).resolve().parents[1] / "scripts" / "record_block_tau.py"
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "drafter"), first, second],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    generation = json.loads((tmp_path / "drafter" / "generation_config.json").read_text())
    assert generation["block_tau"] == {"2": 1.5123, "3": 1.8, "4": 1.9} and generation["selection"] == "viterbi"
    assert not {"block_tau", "selection"} & set(json.loads(config_path.read_text()))
    other = bench(tmp_path / "c.json", {"dcoco@4": 1.9}, {"humaneval": 5})
    refused = subprocess.run([sys.executable, str(script), str(tmp_path / "drafter"), first, other],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "different prompt sets" in refused.stderr
