"""Print the headline results tables (README and model card) from the benchmark JSON files they name.

    python scripts/results_table.py            # print them
    python scripts/results_table.py --write    # and replace them in README.md, the model card and docs/results.md

Rows: the public-API run (`scripts/api_bench.py`: from_pretrained, attach, generate; every suite in one process)
and the side-by-side bench of the same engine with the corrector on and off (`dcoco-hf bench --methods
vanilla,dflash,dcoco`). Each table names its command, its machine and its run's tuning line (the plain step and a
verify of 8 rows as a multiple of it: what a speedup depends on, so a reader can compare their machine's). A figure
in the README or the card that is not in these files is a defect; `tests/test_model_card.py` checks the tables
against them. The README links each file; the card, a Hub page where a relative link to the repository resolves
nowhere, names it as text.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
API_RUN = "api_bench.json"
SUITE_NAMES = {
    "mixed-heldout": "16 held-out chat + code prompts",
    "humaneval": "HumanEval, prompts 1-20",
    "mtbench": "MT-Bench, questions 1-20",
    "hard-to-draft": "8 prompts answered in emoji, Russian, Greek, Hindi",
}
BENCHES = (("", "bench_dflash_vs_dcoco.json"), ("@4", "bench_dflash_vs_dcoco_block4.json"))
BENCH_SUITES = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}
_TUNING_LINE = re.compile(r"plain step [0-9.]+ ms, verify of \d+ rows [0-9.]+x it")


def source(file: str, link: bool) -> str:
    """A row's JSON file: a link relative to the repository root, or its path as text."""
    return f"[json]({RESULTS}/{file})" if link else f"`{RESULTS}/{file}`"


def tuning_line(summary: str | None) -> str:
    """"plain step 48.9 ms, verify of 8 rows 1.46x it" out of a tuning summary (`Tuning.summary`)."""
    found = _TUNING_LINE.search(summary or "")
    return found.group(0) if found else "untuned"


def _load(file: str) -> dict | None:
    path = ROOT / RESULTS / file
    return json.loads(path.read_text()) if path.is_file() else None


def api_rows(link: bool = True) -> list[str]:
    """One row per suite: transformers' assisted generate() and, where measured, speculative_generate at batch 1."""
    report = _load(API_RUN)
    if report is None:
        return []
    rows = []
    for suite, result in report["suites"].items():
        totals, prompts = result["totals"], result["prompts"]
        assisted, batched = totals["assisted"], totals.get("batched")
        cells = [f"{SUITE_NAMES.get(suite, suite)} ({source(API_RUN, link)})", f"{assisted['tau']:.2f}",
                 f"{assisted['speedup']:.2f}x", f"{100 * assisted['corrector_share']:.1f}%"]
        if batched is not None:
            cells += [f"{batched['tau']:.2f}", f"{batched['speedup']:.2f}x"]
        identical = [totals[m]["identical"] for m in ("assisted", "batched") if m in totals]
        cells.append(" / ".join(f"{n}/{prompts}" for n in identical))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def api_header() -> list[str]:
    report = _load(API_RUN) or {"methods": []}
    if "batched" in report["methods"]:
        return ["| prompts | tau (`generate`) | speedup (`generate`) | corrector share | tau (`speculative_generate`) "
                "| speedup (`speculative_generate`) | identical outputs |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
    return ["| prompts | tau | speedup over plain `generate()` (tokens/s) | corrector share of time | identical "
            "outputs |", "| --- | --- | --- | --- | --- |"]


def api_caption() -> list[str]:
    report = _load(API_RUN)
    if report is None:
        return []
    command = " ".join(report["command_line"])
    return [f"`{command}` on {report['machine']}; tuning line of the run: {tuning_line(report['tuning'])}."]


def bench_rows(link: bool = True) -> list[str]:
    rows = []
    for suffix, file in BENCHES:
        report = _load(file)
        if report is None:
            continue
        block = report["config"]["block_size"] if not suffix else int(suffix[1:])
        for suite, methods in report["suites"].items():
            dflash, dcoco = methods[f"dflash{suffix}"], methods[f"dcoco{suffix}"]
            rows.append(
                f"| {BENCH_SUITES.get(suite, suite)}, {dcoco['prompts']} prompts, blocks of {block} "
                f"({source(file, link)}) | {dflash['tau']:.2f} / {dcoco['tau']:.2f} | "
                f"{dcoco['tau'] / dflash['tau']:.3f} | {dflash['speedup']:.2f}x / {dcoco['speedup']:.2f}x | "
                f"{100 * dcoco['corrector_share']:.1f}% |"
            )
    return rows


def bench_caption() -> list[str]:
    lines = []
    for _, file in BENCHES:
        report = _load(file)
        if report is not None:
            config = report["config"]
            lines.append(f"`{' '.join(config['command_line'])}`: tuning line {tuning_line(config.get('tuning'))}.")
    return lines


def table(link: bool = True) -> str:
    lines = [
        "Through the public API alone (`from_pretrained`, default `attach`, then `target.generate(...,",
        "assistant_model=drafter)` or `speculative_generate` one prompt at a time; greedy, 128 new tokens, plain",
        "`generate()` and the drafter back to back per prompt; docs/results.md):",
        "",
        *api_header(),
        *api_rows(link),
        "",
        *api_caption(),
        "",
        "The corrector alone: the same engine, weights, draft vocabulary, layouts and block, with the corrector off",
        "(`dflash`) and on (`dcoco`), interleaved per prompt (`dcoco-hf bench --methods vanilla,dflash,dcoco`, and",
        "`dflash@4,dcoco@4` for blocks of 4; with blocks of 2 the corrector can only re-select slot 1):",
        "",
        "| prompts | tau DFlash / DCOCO | tau ratio | speedup DFlash / DCOCO | corrector share |",
        "| --- | --- | --- | --- | --- |",
        *bench_rows(link),
        "",
        *bench_caption(),
    ]
    return "\n".join(lines)


START, END = "<!-- results table: python scripts/results_table.py --write -->", "<!-- end of results table -->"
DOCS = {ROOT / "README.md": True, ROOT / "model_cards" / "dcoco-smollm2-135m" / "README.md": False}  # links?


RESULTS_DOC = ROOT / "docs" / "results.md"  # the public-API table alone, linked from docs/


def api_table() -> str:
    rows = [row.replace(f"]({RESULTS}/", "](results/") for row in api_rows(True)]
    return "\n".join([*api_header(), *rows, "", *api_caption()])


def write() -> None:
    """Replace the tables between START and END in each doc: with links in the README, file paths in the card; and
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
