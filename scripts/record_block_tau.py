"""Record a drafter's tau at each block size, measured by benches on held-out prompts, in its generation_config.json.

`--block-size auto` (dcoco_hf/runtime/block_choice.py) weighs these against cycle times timed on the machine at hand and
drafts the block of highest tau / cycle time. Measure with the corrector on (dcoco@B methods), at every block size
worth considering; greedy tau does not depend on timing, so benches run separately (or on another machine) combine:

    dcoco-hf bench --suite humaneval,mtbench --limit 20 --methods dcoco@2,dcoco@3,dcoco@4,dcoco@5 --json runs/a.json
    python scripts/record_block_tau.py model_cards/dcoco-smollm2-135m runs/a.json [runs/b.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dcoco_hf import DCOCOConfig
from dcoco_hf.cli.bench import split_method
from dcoco_hf.network.configuration_dcoco import DECODING_FIELDS, DecodingChoices


def block_tau(report: dict, method: str, suite: str | None) -> dict[str, float]:
    """{"B": tau} of every `method@B` in a bench report, over all its suites or one."""
    summaries = report["methods"] if suite is None else report["suites"].get(suite)
    if summaries is None:
        raise SystemExit(f"suite {suite!r} is not in this bench; it has {sorted(report['suites'])}")
    if report["config"]["temperature"] != 0:
        raise SystemExit("this bench sampled; record tau from greedy benches, whose tau is reproducible")
    found = {}
    for name, summary in summaries.items():
        base, size = split_method(name)
        if base == method and size is not None and summary["tau"] is not None:
            found[str(size)] = round(summary["tau"], 4)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", type=Path, help="the drafter folder whose generation_config.json gets block_tau")
    parser.add_argument("benches", type=Path, nargs="+", help="`dcoco-hf bench --json` files with method@B runs")
    parser.add_argument("--method", default="dcoco", help="the method whose tau to record (default dcoco)")
    parser.add_argument("--suite", default=None, help="one suite of the benches (default: all of their prompts)")
    args = parser.parse_args()
    config_path = args.drafter / "config.json"
    if not config_path.exists():
        parser.error(f"{args.drafter}: no config.json there; pass a drafter folder (save_pretrained output)")
    taus: dict[str, float] = {}
    prompts: set[tuple] = set()
    for path in args.benches:
        report = json.loads(path.read_text(encoding="utf-8"))
        prompts.add(tuple(sorted(report["config"]["suites"].items())) + (report["config"]["max_new_tokens"],))
        taus |= block_tau(report, args.method, args.suite)
    if len(prompts) > 1:
        parser.error(f"the benches ran different prompt sets or lengths ({sorted(prompts)}): tau is only comparable "
                     "across block sizes on the same prompts")
    if not taus:
        parser.error(f"no {args.method}@B method in {[str(p) for p in args.benches]}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    generation_path = args.drafter / "generation_config.json"
    generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.exists() else {}
    for name in DECODING_FIELDS:  # an older config.json's decoding choices move too (one there already wins)
        if name in config:
            generation.setdefault(name, config.pop(name))
    generation["block_tau"] = dict(sorted(taus.items(), key=lambda item: int(item[0])))
    generation["_from_model_config"] = False  # else transformers drops our keys when it loads the file
    DecodingChoices.read(generation, DCOCOConfig(**config))  # the checks of a load, before anything is written
    for path, content in ((config_path, config), (generation_path, generation)):
        path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{generation_path}: block_tau = {generation['block_tau']}")


if __name__ == "__main__":
    main()
