"""Print the headline results tables (README and model card) from the benchmark JSON files they name.

    python scripts/results_table.py            # print them
    python scripts/results_table.py --write    # and replace them in README.md, the model card and docs/results.md

Tables: the public-API run (`scripts/api_bench.py`: from_pretrained, attach, generate; every suite in one process)
and the side-by-side bench of the same engine with the corrector on and off (`dcoco-hf bench --methods
vanilla,dflash,dcoco`); in docs/results.md also the batched loop's runs (`dcoco-hf bench-batch`), beside the same
command on an earlier commit. Each table names its command, its machine and its run's tuning line (the plain step and a
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
SAMPLING_RUN = "bench_sampling.json"
SPLIT_RUN = "split_costs.json"
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


def api_rows(link: bool = True, file: str = API_RUN, names: dict[str, str] = SUITE_NAMES) -> list[str]:
    """One row per suite: transformers' assisted generate() and, where measured, speculative_generate at batch 1."""
    report = _load(file)
    if report is None:
        return []
    rows = []
    for suite, result in report["suites"].items():
        totals, prompts = result["totals"], result["prompts"]
        assisted, batched = totals["assisted"], totals.get("batched")
        cells = [f"{names.get(suite, suite)} ({source(file, link)})", f"{assisted['tau']:.2f}",
                 f"{assisted['speedup']:.2f}x", f"{100 * assisted['corrector_share']:.1f}%"]
        if batched is not None:
            cells += [f"{batched['tau']:.2f}", f"{batched['speedup']:.2f}x"]
        identical = [totals[m]["identical"] for m in ("assisted", "batched") if m in totals]
        cells.append(" / ".join(f"{n}/{prompts}" for n in identical))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def api_header(file: str = API_RUN) -> list[str]:
    report = _load(file) or {"methods": []}
    if "batched" in report["methods"]:
        return ["| prompts | tau (`generate`) | speedup (`generate`) | corrector share | tau (`speculative_generate`) "
                "| speedup (`speculative_generate`) | identical outputs |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
    return ["| prompts | tau | speedup over plain `generate()` (tokens/s) | corrector share of time | identical "
            "outputs |", "| --- | --- | --- | --- | --- |"]


def api_caption(file: str = API_RUN) -> list[str]:
    report = _load(file)
    if report is None:
        return []
    command = " ".join(report["command_line"])
    return [f"`{command}` on {report['machine']}; tuning line of the run: {tuning_line(report['tuning'])}."]


SPLIT_PARTS = ("prefill", "draft", "corrector", "verify", "other")


def time_split_rows(file: str, names: dict[str, str]) -> list[str]:
    """Where `generate(assistant_model=)`'s time went per suite of an API run (`api_bench.py`'s `time_split`): the
    prompt's forward, the drafter's backbone and lm_head, the corrector, the target's verify forwards, the rest."""
    report = _load(file)
    if report is None or "time_split" not in next(iter(report["suites"].values()))["totals"]["assisted"]:
        return []
    rows = ["| prompts | " + " | ".join(SPLIT_PARTS) + " |", "|" + " --- |" * (len(SPLIT_PARTS) + 1)]
    for suite, result in report["suites"].items():
        split = result["totals"]["assisted"]["time_split"]
        rows.append(f"| {names.get(suite, suite)} | " + " | ".join(f"{100 * split[p]:.1f}%" for p in SPLIT_PARTS)
                    + " |")
    return rows


# The header of every corrector-on/off table (`bench_rows`).
BENCH_HEADER = ("| prompts | tau DFlash / DCOCO | tau ratio | speedup DFlash / DCOCO | corrector share |",
                "| --- | --- | --- | --- | --- |")


def bench_rows(link: bool = True, benches: tuple[tuple[str, str], ...] = BENCHES,
               names: dict[str, str] = BENCH_SUITES) -> list[str]:
    rows = []
    for suffix, file in benches:
        report = _load(file)
        if report is None:
            continue
        blocks = (f"blocks up to {report['config']['block_size']} sized per cycle" if not suffix
                  else f"whole blocks of {suffix[1:]}")
        for suite, methods in report["suites"].items():
            dflash, dcoco = methods[f"dflash{suffix}"], methods[f"dcoco{suffix}"]
            rows.append(
                f"| {names.get(suite, suite)}, {dcoco['prompts']} prompts, {blocks} "
                f"({source(file, link)}) | {dflash['tau']:.2f} / {dcoco['tau']:.2f} | "
                f"{dcoco['tau'] / dflash['tau']:.3f} | {dflash['speedup']:.2f}x / {dcoco['speedup']:.2f}x | "
                f"{100 * dcoco['corrector_share']:.1f}% |"
            )
    return rows


def bench_caption(benches: tuple[tuple[str, str], ...] = BENCHES) -> list[str]:
    lines = []
    for _, file in benches:
        report = _load(file)
        if report is not None:
            config = report["config"]
            lines.append(f"`{' '.join(config['command_line'])}`: tuning line {tuning_line(config.get('tuning'))}.")
    return lines


def table(link: bool = True) -> str:
    lines = [
        "The public API alone (`from_pretrained`, default `attach`, `generate(..., assistant_model=drafter)` or",
        "`speculative_generate` on one prompt; greedy, 128 new tokens, beside plain `generate()` per prompt):",
        "",
        *api_header(),
        *api_rows(link),
        "",
        *api_caption(),
        "",
        "The corrector alone: the same engine, weights, draft vocabulary, layouts and blocks, with the corrector",
        "off (`dflash`) and on (`dcoco`), interleaved per prompt (`dcoco-hf bench`):",
        "",
        *BENCH_HEADER,
        *bench_rows(link),
        "",
        *bench_caption(),
    ]
    return "\n".join(lines)


START, END = "<!-- results table: python scripts/results_table.py --write -->", "<!-- end of results table -->"
DOCS = {ROOT / "README.md": True, ROOT / "model_cards" / "dcoco-smollm2-135m" / "README.md": False}  # links?


RESULTS_DOC = ROOT / "docs" / "results.md"  # the public-API table and the batch tables, linked from docs/


def _from_docs(rows: list[str]) -> list[str]:
    """Rows whose links lead from the repository root, as linked from a page in docs/."""
    return [row.replace(f"]({RESULTS}/", "](results/") for row in rows]


def api_table() -> str:
    rows = _from_docs(api_rows(True))
    return "\n".join([*api_header(), *rows, "", *api_caption()])


# bench-batch runs: {suite: prompts}; each suite has this release's run (bench_batch_SUITE.json) and the same command
# run on commit BEFORE_COMMIT (bench_batch_before_SUITE.json, its log beside it: that release's JSON had no tuning).
BATCH_SUITES = {"mixed": "16 held-out chat + code prompts", "humaneval": "HumanEval, prompts 1-16"}
BEFORE_COMMIT = "1e7f254"


def _speed(entry: dict | None) -> str:
    """"0.98x / 1.00x (1.46)": summed tokens/s over plain's / median per batch run (where recorded) (tau)."""
    if entry is None:
        return "-"
    median = f" / {entry['median_speedup']:.2f}x" if entry.get("median_speedup") is not None else ""
    return f"{entry['speedup']:.2f}x{median} ({entry['tau']:.2f})"


def batch_rows(suite: str) -> list[str]:
    """One row per batch size: plain batched generate()'s tokens/s, DFlash and DCOCO as speedup (tau) before and
    now, and how DCOCO's row-cycles split between plain steps, chains and trees now (the plan's tree option; a tree
    whose nodes form one path is verified as that chain)."""
    now, before = _load(f"bench_batch_{suite}.json"), _load(f"bench_batch_before_{suite}.json")
    if now is None:
        return []
    rows = []
    for size, methods in now["results"].items():
        earlier = (before or {}).get("results", {}).get(size, {})
        dcoco = methods["dcoco"]
        lengths = {int(k): n for k, n in dcoco["proposal_lengths"].items()}
        cycles = sum(lengths.values())
        rows.append(" | ".join([
            f"| {size}", f"{methods['vanilla']['tokens_per_s']:.1f}", _speed(earlier.get("dflash")),
            _speed(earlier.get("dcoco")), _speed(methods["dflash"]), _speed(dcoco),
            f"{lengths.get(0, 0)} / {cycles - lengths.get(0, 0)} / {dcoco['tree_cycles']}",
        ]) + " |")
    return rows


def _before_tuning(suite: str) -> str:
    log = ROOT / RESULTS / f"bench_batch_before_{suite}.log"
    return tuning_line(log.read_text() if log.is_file() else None)


def batch_costs_line(config: dict) -> str:
    """"batch 4: plain step 71 ms, verify of 8 rows per sequence 2.65x it; ..." from a run's timed batch costs."""
    return "; ".join(f"batch {size}: plain step {costs['plain_ms']:.0f} ms, verify of 8 rows per sequence "
                     f"{costs['verify_8_over_plain']:.2f}x it" for size, costs in config.get("batch_costs", {}).items())


def batch_table(suite: str) -> str:
    now, before = _load(f"bench_batch_{suite}.json"), _load(f"bench_batch_before_{suite}.json")
    if now is None:
        return ""
    config = now["config"]
    lines = [
        f"{BATCH_SUITES[suite]}, {config['max_new_tokens']} new tokens, greedy, every batch run "
        f"{config.get('rounds', 1)} times per method: speedup over plain batched `generate()` in the same run (summed "
        "tokens/s over plain's / the median of each batch run's ratio to plain on the same batch; the run at "
        f"{BEFORE_COMMIT} ran every batch once and recorded the first only), tau in brackets:",
        "",
        f"| batch | plain tok/s | DFlash, {BEFORE_COMMIT} | DCOCO, {BEFORE_COMMIT} | DFlash | DCOCO "
        "| DCOCO row-cycles: plain steps / chains / trees |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *batch_rows(suite),
        "",
        f"`{' '.join(config['command_line'])}`; tuning line {tuning_line(config.get('tuning'))}; "
        f"{batch_costs_line(config)}.",
    ]
    if before is not None:
        lines += ["", f"{BEFORE_COMMIT}: the same command in a checkout of that commit; tuning line "
                  f"{_before_tuning(suite)} ([log](results/bench_batch_before_{suite}.log))."]
    return "\n".join(lines)


def bench_table() -> str:
    """docs/results.md's table of the corrector alone: the README's rows, linked from docs/."""
    rows = _from_docs(bench_rows(True))
    return "\n".join([*BENCH_HEADER, *rows, "", *bench_caption()])


def sampling_table() -> str:
    """One row per method of the sampling bench: tokens (lengths differ under sampling), tok/s, speedup, tau."""
    report = _load(SAMPLING_RUN)
    if report is None:
        return ""
    lines = ["| prompts | method | tokens | tok/s | speedup (tokens/s) | tau | corrector share |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for suite, methods in report["suites"].items():
        for name, r in methods.items():
            share = "-" if name == "vanilla" else f"{100 * r['corrector_share']:.1f}%"
            lines.append(f"| {BENCH_SUITES.get(suite, suite)}, {r['prompts']} | {name} | {r['new_tokens']} | "
                         f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {share} |")
    config = report["config"]
    lines += ["", f"`{' '.join(config['command_line'])}`: temperature {config['temperature']}, tuning line "
              f"{tuning_line(config.get('tuning'))}."]
    return "\n".join(lines)


def proposal_table() -> str:
    """docs/proposal.md's table: per suite and call of the public-API run, speedup, tau and how the cycles split
    (proposal lengths, 0: plain steps; trees)."""
    report = _load(API_RUN)
    if report is None:
        return ""
    lines = ["| prompts | call | speedup | tau | cycles per proposal length (0: plain step) | tree cycles |",
             "| --- | --- | --- | --- | --- | --- |"]
    for suite, result in report["suites"].items():
        for method in report["methods"][1:]:
            t = result["totals"][method]
            lengths = ", ".join(f"{k}: {n}" for k, n in t["proposal_lengths"].items())
            lines.append(f"| {SUITE_NAMES.get(suite, suite)} | {method} | {t['speedup']:.2f}x | {t['tau']:.2f} | "
                         f"{lengths} | {t['tree_cycles']} |")
    return "\n".join([*lines, "", *api_caption()])


SCHEDULE_RUNS = {"schedule_code.json": "HumanEval, prompts 41-60", "schedule_chat.json": "MT-Bench, questions 21-32"}
FIXED_BLOCKS = (2, 3, 4, 5)


def schedule_table() -> str:
    """docs/proposal.md's comparison of the default schedule with whole blocks of 2 to 5 (the constant schedule),
    through both calls, interleaved on the same held-out prompts: speedup over plain `generate()` (tokens per second)
    and tau, and the default's speed over the best fixed block's (of those the run timed)."""
    lines = ["| prompts | call | default | " + " | ".join(f"block {b}" for b in FIXED_BLOCKS) +
             " | default / best of blocks 3-5 (2-5) | identical |", "|" + " --- |" * (len(FIXED_BLOCKS) + 5)]
    captions = []
    for file, name in SCHEDULE_RUNS.items():
        report = _load(file)
        if report is None:
            continue
        methods = report["methods"]
        for call, method in (("`generate(assistant_model=)`", "dcoco"), ("`speculative_generate`", "speculative")):
            fixed = [methods.get(f"{method}@{b}") for b in FIXED_BLOCKS]
            default = methods[method]
            timed = [entry for entry in fixed if entry is not None]
            # the yardstick: the best of whole blocks of 3, 4 and 5; in brackets, with blocks of 2 as well
            best = max(entry["tokens_per_s"] for b, entry in zip(FIXED_BLOCKS, fixed) if entry and b >= 3)
            best_any = max(entry["tokens_per_s"] for entry in timed)
            identical = all(entry["equal_to_vanilla"] == 1.0 for entry in [default, *timed])
            cells = [f"{entry['speedup']:.2f}x (tau {entry['tau']:.2f})" if entry else "-"
                     for entry in [default, *fixed]]
            ratio = f"{default['tokens_per_s'] / best:.4f} ({default['tokens_per_s'] / best_any:.4f})"
            lines.append(f"| {name} | {call} | " + " | ".join(cells) +
                         f" | {ratio} | {'all' if identical else 'NOT all'} |")
        config = report["config"]
        captions.append(f"`{' '.join(config['command_line'])}`: tuning line {tuning_line(config.get('tuning'))}.")
    return "\n".join([*lines, "", *captions]) if captions else ""


def split_table() -> str:
    """Two forwards (a plain step of the failing half, a verify of the rest) over one, per batch size and k."""
    report = _load(SPLIT_RUN)
    if report is None:
        return ""
    proposals = list(next(iter(report["ratios"].values())))
    lines = ["| batch | " + " | ".join(f"k = {k}" for k in proposals) + " |", "|" + " --- |" * (len(proposals) + 1)]
    for size, row in report["ratios"].items():
        lines.append(f"| {size} | " + " | ".join(f"{row[k]:.2f}" for k in proposals) + " |")
    caption = f"`{' '.join(report['command_line'])}`: tuning line {tuning_line(report['tuning'])}."
    return "\n".join([*lines, "", caption])


CHOICES_RUN = "training_choices.json"
TRAINING_DOC = ROOT / "docs" / "training.md"


def choices_table() -> str:
    """docs/training.md's table of the shipped recipe's choices (`scripts/compare_runs.py`): each run on the same
    answers and held-out prompts, named by the options where it differs from the reference, with its held-out tau at
    every checkpoint step the runs share and its slots' chain acceptance at the last."""
    report = _load(CHOICES_RUN)
    if report is None:
        return ""
    steps, last = report["steps"], report["steps"][-1]
    lines = ["| run | differs from the reference in | " + " | ".join(f"tau at {s}" for s in steps) +
             f" | slots 1-3 accepted at {last} |", "|" + " --- |" * (len(steps) + 3)]
    commands = []
    for run in report["runs"]:
        at = {line["step"]: line for line in run["progress"]}
        differs = ", ".join(f"`{k}` {v}" for k, v in run["differs"].items()) or "(reference)"
        accepted = " / ".join("-" if a is None else f"{a:.2f}" for a in at[last]["chain_accept"][:3])
        lines.append(f"| {run['run']} | {differs} | " + " | ".join(f"{at[s]['tau']:.3f}" for s in steps) +
                     f" | {accepted} |")
        commands.append(f"`{' '.join(run['command'])}`")
    caption = (f"Stage {report['stage']}, whole blocks, greedy. The runs: " + "; ".join(commands) +
               f". Table: `{' '.join(report['command_line'])}`.")
    return "\n".join([*lines, "", caption])


# The Gemma 3 270M drafter's runs: the card's tables, a compact one in the README, all of them in docs/results.md.
GEMMA3_CARD = ROOT / "model_cards" / "dcoco-gemma3-270m" / "README.md"
GEMMA3_API_RUN = "api_bench_gemma3.json"
GEMMA3_BENCHES = (("", "bench_dflash_vs_dcoco_gemma3.json"),)
GEMMA3_SUITES = {
    "humaneval-code": "HumanEval, prompts 1-20, as code completions",
    "prose-openings": "24 prose openings",
    "hard-to-draft": "8 requests for emoji, Russian, Greek, Hindi text",
}


def gemma3_table(link: bool = True, full: bool = True) -> str:
    """The Gemma 3 270M drafter's public-API run and, with `full`, where its time went and the corrector alone."""
    report = _load(GEMMA3_API_RUN)
    if report is None:
        return ""
    lines = [
        "Gemma 3 270M (the base model) through the public API (`from_pretrained`, default `attach`,",
        f"`generate(..., assistant_model=drafter)`; greedy, {report['max_new_tokens']} new tokens, beside plain "
        "`generate()` per prompt):",
        "",
        *api_header(GEMMA3_API_RUN),
        *api_rows(link, GEMMA3_API_RUN, GEMMA3_SUITES),
        "",
        *api_caption(GEMMA3_API_RUN),
    ]
    if not full:
        return "\n".join(lines)
    split = time_split_rows(GEMMA3_API_RUN, GEMMA3_SUITES)
    if split:
        lines += ["", "Where the time of `generate(assistant_model=drafter)` went, as shares of it (same run):", "",
                  *split]
    rows = bench_rows(link, GEMMA3_BENCHES, GEMMA3_SUITES)
    if rows:
        lines += ["", "The corrector alone: the same engine, weights, draft vocabulary and blocks, with the corrector "
                  "off (`dflash`) and on (`dcoco`), interleaved per prompt (`dcoco-hf bench`):", "",
                  *BENCH_HEADER, *rows, "", *bench_caption(GEMMA3_BENCHES)]
    return "\n".join(lines)


SECTIONS = {"bench": bench_table, "sampling": sampling_table, "split": split_table}  # docs/results.md's others
PROPOSAL_DOC = ROOT / "docs" / "proposal.md"


def section_marks(name: str) -> tuple[str, str]:
    return f"<!-- {name} table: python scripts/results_table.py --write -->", f"<!-- end of {name} table -->"


def batch_marks(suite: str) -> tuple[str, str]:
    return section_marks(f"batch {suite}")


def write() -> None:
    """Replace the tables between START and END in each doc: with links in the README, file paths in the card; and
    the public-API table in docs/results.md."""
    for doc, link in DOCS.items():
        replace_between(doc, table(link))
    replace_between(RESULTS_DOC, api_table())
    for suite in BATCH_SUITES:
        replace_between(RESULTS_DOC, batch_table(suite), *batch_marks(suite))
    for name, render in SECTIONS.items():
        replace_between(RESULTS_DOC, render(), *section_marks(name))
    replace_between(PROPOSAL_DOC, proposal_table(), *section_marks("proposal"))
    replace_between(PROPOSAL_DOC, schedule_table(), *section_marks("schedule"))
    if _load(CHOICES_RUN) is not None:
        replace_between(TRAINING_DOC, choices_table(), *section_marks("choices"))
    if _load(GEMMA3_API_RUN) is not None:
        replace_between(ROOT / "README.md", gemma3_table(link=True, full=False), *section_marks("gemma3 results"))
        replace_between(GEMMA3_CARD, gemma3_table(link=False), *section_marks("gemma3 results"))
        replace_between(RESULTS_DOC, "\n".join(_from_docs(gemma3_table(link=True).split("\n"))),
                        *section_marks("gemma3 results"))


def replace_between(doc: Path, rendered: str, start: str = START, end: str = END) -> None:
    """Put `rendered` between the marker lines `start` and `end` of `doc`."""
    text = doc.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{doc}: add the lines {start} and {end} where the table goes")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    doc.write_text(f"{before}{start}\n{rendered}\n{end}{after}")


if __name__ == "__main__":
    print(table())
    if "--write" in sys.argv[1:]:
        write()
