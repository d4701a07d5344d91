"""Print the headline results table (README and model card) from the benchmark JSON files it names.

    python scripts/results_table.py            # print it
    python scripts/results_table.py --write    # and replace it in README.md and the model card

Rows: the public-API runs (`scripts/api_bench.py`: from_pretrained, attach, generate) and the side-by-side bench of
the same engine with the corrector on and off (`dcoco-hf bench --methods vanilla,dflash,dcoco`). A figure in the
README or the card that is not in these files is a defect; `tests/test_model_card.py` checks the tables against them.
The README links each row's file; the card, a Hub page where a relative link to the repository resolves nowhere,
names it as text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
API_RUNS = (
    ("16 held-out chat + code prompts", "api_mixed_heldout.json"),
    ("HumanEval, prompts 1-20", "api_humaneval.json"),
    ("MT-Bench, questions 1-20", "api_mtbench.json"),
    ("8 prompts answered in emoji, Russian, Greek, Hindi", "api_hard_to_draft.json"),
)
BENCHES = (("", "bench_dflash_vs_dcoco.json"), ("@4", "bench_dflash_vs_dcoco_block4.json"))
SUITE_NAMES = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}


def source(file: str, link: bool) -> str:
    """A row's JSON file: a link relative to the repository root, or its path as text."""
    return f"[json]({RESULTS}/{file})" if link else f"`{RESULTS}/{file}`"


def api_rows(link: bool = True) -> list[str]:
    rows = []
    for name, file in API_RUNS:
        path = ROOT / RESULTS / file
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        totals, prompts = report["totals"], len(report["records"])
        rows.append(
            f"| {name} ({source(file, link)}) | {totals['tau']:.2f} | {speedup(report)} | "
            f"{100 * totals['corrector_share']:.1f}% | {totals['identical']}/{prompts} |"
        )
    return rows


def speedup(report: dict) -> str:
    """The run's speedup; for a run repeated in fresh processes, the median one and the range of all."""
    spread = report.get("spread")
    if spread is None:
        return f"{report['totals']['speedup']:.2f}x"
    runs = len(spread["speedups"])
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f}x over {runs} fresh processes)"


def machines() -> str:
    """The machines the public-API runs name (their JSON's `machine`)."""
    names = []
    for _, file in API_RUNS:
        path = ROOT / RESULTS / file
        if path.is_file():
            names.append(json.loads(path.read_text()).get("machine", "?"))
    return "; ".join(dict.fromkeys(names))


def bench_rows(link: bool = True) -> list[str]:
    rows = []
    for suffix, file in BENCHES:
        path = ROOT / RESULTS / file
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        block = report["config"]["block_size"] if not suffix else int(suffix[1:])
        for suite, methods in report["suites"].items():
            dflash, dcoco = methods[f"dflash{suffix}"], methods[f"dcoco{suffix}"]
            rows.append(
                f"| {SUITE_NAMES.get(suite, suite)}, {dcoco['prompts']} prompts, blocks of {block} "
                f"({source(file, link)}) | {dflash['tau']:.2f} / {dcoco['tau']:.2f} | "
                f"{dcoco['tau'] / dflash['tau']:.3f} | {dflash['speedup']:.2f}x / {dcoco['speedup']:.2f}x | "
                f"{100 * dcoco['corrector_share']:.1f}% |"
            )
    return rows


def table(link: bool = True) -> str:
    lines = [
        "Through the public API alone (`from_pretrained`, default `attach`, `generate`; greedy, 128 new tokens, plain",
        "`generate()` and the drafter back to back per prompt, `scripts/api_bench.py`, docs/results.md) on "
            f"{machines()}:",
        "",
        "| prompts | tau | speedup over plain `generate()` (tokens/s) | corrector share of time | identical outputs |",
        "| --- | --- | --- | --- | --- |",
        *api_rows(link),
        "",
        "The corrector alone: the same engine, weights, draft vocabulary, layouts and block, with the corrector off",
        "(`dflash`) and on (`dcoco`), interleaved per prompt (`dcoco-hf bench --methods vanilla,dflash,dcoco`, and",
        "`dflash@4,dcoco@4` for blocks of 4; with blocks of 2 the corrector can only re-select slot 1):",
        "",
        "| prompts | tau DFlash / DCOCO | tau ratio | speedup DFlash / DCOCO | corrector share |",
        "| --- | --- | --- | --- | --- |",
        *bench_rows(link),
    ]
    return "\n".join(lines)


START, END = "<!-- results table: python scripts/results_table.py --write -->", "<!-- end of results table -->"
DOCS = {ROOT / "README.md": True, ROOT / "model_cards" / "dcoco-smollm2-135m" / "README.md": False}  # links?


RESULTS_DOC = ROOT / "docs" / "results.md"  # the public-API table alone, linked from docs/


def api_table() -> str:
    header = [
        "| prompts | tau | speedup over plain `generate()` (tokens/s) | corrector share of time | identical outputs |",
        "| --- | --- | --- | --- | --- |",
    ]
    return "\n".join(header + [row.replace(f"]({RESULTS}/", "](results/") for row in api_rows(True)])


def write() -> None:
    """Replace the table between START and END in each doc: with links in the README, file paths in the card; and
    the public-API table in docs/results.md."""
    for doc, link in DOCS.items():
        _replace(doc, table(link))
    _replace(RESULTS_DOC, api_table())


def _replace(doc: Path, rendered: str) -> None:
    text = doc.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    doc.write_text(f"{before}{START}\n{rendered}\n{END}{after}")


if __name__ == "__main__":
    print(table())
    if "--write" in sys.argv[1:]:
        write()
