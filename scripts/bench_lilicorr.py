r"""DFlash, DCOCO, LiLiCorr and the DFlash2 selector side by side: one run, the same prompts, every method
interleaved per prompt.

`dcoco-hf bench` loads one drafter; this loads those that share their DFlash backbone (the DCOCO drafter, a LiLiCorr
drafter trained on its frozen backbone and, with --selector-drafter, a DFlash2 selector trained the same way) and
runs, for each prompt, in an order shuffled per prompt (`dcoco-hf bench`'s `run_order`):

* vanilla:   plain greedy `target.generate()`;
* dflash@B:  the DCOCO drafter with its corrector off (plain DFlash argmax blocks, our engine);
* dcoco@B:   the DCOCO drafter;
* lilicorr@B: the LiLiCorr drafter;
* lilicorr-plain@B: the same LiLiCorr drafter with its pair evidence off (loaded with context_bigrams=False,
  corpus_bigrams=None), the head alone, as the public format exports it; only when the drafter has evidence;
* dflash2@B: with `--selector-drafter FOLDER`, the DFlash2 candidate selector drafter (dcoco_hf/network/selector.py);
* dflash-LABEL@B: with `--backbone LABEL=FOLDER`, another backbone with its corrector off (DScout's AWL, its control),

all through the bench's `MethodRunner`, so tau, speedup (tokens/s against vanilla on the same prompts), the head's
share of the time and equality with plain greedy are measured exactly as `dcoco-hf bench` measures them; the head's
share is given of the cycles (draft, head, verification: the run's time less its prompt's prefill) and of all time.
fp32, with the CLI's CPU speed-ups (the "sdpa_cpu_gqa" attention and few-rows linear layouts, as measured here).

    python scripts/bench_lilicorr.py --suite humaneval,mtbench --limit 40 --max-new-tokens 64 \
        --backbone awl=runs/awl/final --backbone decay=runs/decay/final \
        --json docs/bench_lilicorr.json
    python scripts/bench_lilicorr.py --render docs/bench_lilicorr.json --write docs/lilicorr.md   # its table
    python scripts/bench_lilicorr.py --suite humaneval,mtbench --prompts scripts/prompts/mixed-heldout.jsonl \
        --selector-drafter model_cards/dflash2-selector-smollm2-135m --json docs/bench_selector.json   # + DFlash2

Summaries are kept per suite and per segment of 20 prompts (1-20, 21-40), so a choice tuned on the first prompts is
checked on prompts it was not made on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dcoco_hf.cli.bench import (
    BenchSettings,
    MethodRunner,
    _compare_with_vanilla,
    build_report,
    format_table,
    run_order,
    summarise,
)
from dcoco_hf.runtime.block_choice import measure_cycle_costs, set_block_size
from dcoco_hf.cli.common import (
    add_prompt_arguments,
    collect_prompts,
    load_drafter,
    load_target,
)
from dcoco_hf.runtime.cpu_linear import use_few_rows_linear
from dcoco_hf.runtime.prompts import prompt_input_ids
from dcoco_hf.runtime.tuning import tuning_line
from dcoco_hf.network.lilicorr import LiLiCorrCorrector
from dcoco_hf.network.selector import SelectorCorrector

ROOT = Path(__file__).resolve().parents[1]
# The few-rows layouts `attach` measured for SmolLM2-135M on the 2-core AMD EPYC machine of docs/lilicorr.md.
TARGET_LAYOUT = {2: "transposed", 3: "transposed", 4: "packed", 5: "packed", 6: "transposed"}
SEGMENT = 20  # prompts per reported segment of a suite


def table_markers(source: str) -> tuple[str, str]:
    """The lines between which a document holds the table of report `source`."""
    return f"<!-- table of {source}: start -->", f"<!-- table of {source}: end -->"

SUITE_NAMES = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "mixed-heldout": "held-out (mixed)"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(p)
    p.add_argument("--dcoco-drafter", default=str(ROOT / "model_cards" / "dcoco-smollm2-135m"))
    p.add_argument("--lilicorr-drafter", default=str(ROOT / "model_cards" / "lilicorr-smollm2-135m"))
    p.add_argument("--selector-drafter", default=None, metavar="FOLDER",
                   help="a drafter with a DFlash2 candidate selector on the same backbone, run as method dflash2@B")
    p.add_argument("--backbone", action="append", default=[], metavar="LABEL=FOLDER",
                   help="another drafter whose backbone to compare, corrector off, as method dflash-LABEL@B (e.g. "
                   "awl=runs/awl/final); repeatable")
    p.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--block-size", type=int, default=4, help="the block every drafter method drafts (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--plain-linear", action="store_true", help="keep torch's F.linear for few-row forwards")
    p.add_argument("--json", default=None, help="write the report (summaries, configuration, every call) here")
    p.add_argument("--render", default=None, metavar="REPORT.json", help="print the markdown table of a finished "
                   "report instead of benchmarking")
    p.add_argument("--write", default=None, metavar="DOC.md", help="with --render: replace the table in DOC.md "
                   f"between the lines {' and '.join(table_markers('REPORT.json'))}")
    p.add_argument("--methods", default=None, help="comma-separated subset of the methods to run (default: all; "
                   "vanilla always runs: outputs are compared with it)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.render:
        table = markdown_table(json.loads(Path(args.render).read_text()), args.render)
        if args.write:
            write_between_markers(Path(args.write), table, args.render)
        print(table)
        return
    prompts = round_robin(collect_prompts(args))  # suites alternate, so a run cut short still covers each
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer, target_name = load_target(args.target, device, torch.float32, "sdpa")  # fp32: token-exact
    dcoco = load_drafter(args.dcoco_drafter, target.device, target.dtype, "sdpa")
    lilicorr = load_drafter(args.lilicorr_drafter, target.device, target.dtype, "sdpa")
    extra = {}  # runner label -> more drafters: the LiLiCorr head alone, --backbone folders
    for given in args.backbone:
        label, sep, folder = given.partition("=")
        if not sep or not label or not folder or label in ("dcoco", "lilicorr", "lilicorr-plain", "dflash2"):
            raise SystemExit(f"--backbone {given}: give LABEL=FOLDER with a new label (awl=runs/awl/final)")
        extra[label] = load_drafter(folder, target.device, target.dtype, "sdpa")
    if not isinstance(lilicorr.corrector, LiLiCorrCorrector):
        raise SystemExit(f"--lilicorr-drafter {args.lilicorr_drafter}: its corrector_type is "
                         f"{lilicorr.config.corrector_type!r}, not 'lilicorr'")
    if args.selector_drafter:
        extra["dflash2"] = load_drafter(args.selector_drafter, target.device, target.dtype, "sdpa")
        if not isinstance(extra["dflash2"].corrector, SelectorCorrector):
            raise SystemExit(f"--selector-drafter {args.selector_drafter}: its corrector_type is "
                             f"{extra['dflash2'].config.corrector_type!r}, not 'dflash2'")
    if lilicorr.corrector.evidence is not None:  # the head alone, next to it
        extra["lilicorr-plain"] = load_drafter(args.lilicorr_drafter, target.device, target.dtype, "sdpa",
                                               context_bigrams=False, corpus_bigrams=None)
    # The CLI's CPU speed-ups, with the layouts it measured on this machine (`~/.cache/dcoco-hf/tuning`) given
    # explicitly: measuring them again under a loaded machine takes minutes and could differ between two drafters.
    for drafter in (dcoco, lilicorr, *extra.values()):
        drafter.attach(target, tune=False)
        set_block_size(drafter, args.block_size)
    if device.type == "cpu":
        target.set_attn_implementation("sdpa_cpu_gqa")
        if not args.plain_linear:
            use_few_rows_linear(target, max_rows=6, layout=TARGET_LAYOUT)
            for drafter in (dcoco, lilicorr, *extra.values()):
                use_few_rows_linear(drafter, max_rows=6, layout="transposed")
    # What every speedup below depends on, timed on the target and drafter as they run here.
    tuning = tuning_line(measure_cycle_costs(target, dcoco, [args.block_size], max_rows=8, repeats=5))
    print(tuning)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, warmup=args.warmup)
    b = args.block_size
    # (label, runner, the runner's method) per method; labels are what the report calls them.
    runners = {"dcoco": MethodRunner(target, dcoco, settings), "lilicorr": MethodRunner(target, lilicorr, settings),
               **{label: MethodRunner(target, drafter, settings) for label, drafter in extra.items()}}
    plan = [("vanilla", "dcoco", "vanilla"), (f"dflash@{b}", "dcoco", f"dflash@{b}"),
            (f"dcoco@{b}", "dcoco", f"dcoco@{b}"), (f"lilicorr@{b}", "lilicorr", f"dcoco@{b}")]
    plan += [(f"lilicorr-plain@{b}", "lilicorr-plain", f"dcoco@{b}")] if "lilicorr-plain" in extra else []
    plan += [(f"dflash2@{b}", "dflash2", f"dcoco@{b}")] if "dflash2" in extra else []
    plan += [(f"dflash-{label}@{b}", label, f"dflash@{b}") for label in extra if label not in ("lilicorr-plain",
                                                                                                "dflash2")]
    if args.methods:
        wanted = {"vanilla", *args.methods.split(",")}
        unknown = wanted - {label for label, _, _ in plan}
        if unknown:
            raise SystemExit(f"--methods: {sorted(unknown)} not among {[label for label, _, _ in plan]}")
        plan = [step for step in plan if step[0] in wanted]
    labels = [label for label, _, _ in plan]
    encoded = [prompt_input_ids(tokenizer, item.text).to(target.device) for item in prompts]
    records = []
    try:
        for _, runner, method in plan[: len(plan) * args.warmup]:  # untimed: lazy initialisation, allocator growth
            runners[runner].run(method, prompts[0].suite, prompts[0].index, encoded[0])
        for position, (item, input_ids) in enumerate(zip(prompts, encoded)):
            row = []
            for label, runner, method in run_order(plan, position):
                record = runners[runner].run(method, item.suite, item.index, input_ids)
                record.method = label
                row.append(record)
            _compare_with_vanilla(row, settings.greedy)
            records += sorted(row, key=lambda r: labels.index(r.method))
            timings = ", ".join(f"{r.method} {r.seconds:.1f}s" for r in records[-len(plan):])
            print(f"[{time.strftime('%H:%M:%S')}] prompt {position + 1}/{len(prompts)} ({item.suite} #{item.index}): "
                  f"{timings}", file=sys.stderr, flush=True)
            write_report(args, records, labels, len(prompts), target_name, tuning)  # a partial run counts
    finally:
        for runner in runners.values():
            runner.close()
    report = write_report(args, records, labels, len(prompts), target_name, tuning)
    for suite, summaries in report["suites"].items():
        print(format_table(summaries, f"{suite} ({summaries['vanilla']['prompts']} prompts)"))


def round_robin(prompts: list) -> list:
    """Prompts reordered so the suites alternate (humaneval #0, mtbench #0, humaneval #1, ...)."""
    by_suite: dict[str, list] = {}
    for item in prompts:
        by_suite.setdefault(item.suite, []).append(item)
    columns = list(by_suite.values())
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]


def write_report(
    args: argparse.Namespace, records: list, labels: list[str], planned: int, target_name: str, tuning: str
) -> dict:
    """The bench report of the records so far (written to --json when given)."""
    b = args.block_size
    config = {"command": " ".join(sys.argv), "few_rows_linear": not args.plain_linear, "target": target_name,
              "tuning": tuning,
              "dcoco_drafter": args.dcoco_drafter,
              "lilicorr_drafter": args.lilicorr_drafter, "selector_drafter": args.selector_drafter, "block_size": b,
              "max_new_tokens": args.max_new_tokens,
              "prompts_planned": planned, "prompts_done": len(records) // len(labels), "skip": args.skip,
              "limit": args.limit}
    report = build_report(records, labels, config)
    report["segments"] = {  # suite -> "1-20" -> method -> summary
        suite: {f"{start + 1}-{start + SEGMENT}": summarise(
            [r for r in records if r.suite == suite and start <= r.prompt_index < start + SEGMENT], labels)
            for start in sorted({SEGMENT * (r.prompt_index // SEGMENT) for r in records if r.suite == suite})}
        for suite in report["suites"]
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n")
    return report


def markdown_table(report: dict, source: str) -> str:
    """One table of the report: per suite and segment, each method's tau, ratio to DFlash, chain acceptance, and,
    for a run that recorded its tuning line (the plain step and a verify of 8 rows, timed where it ran), its speed and
    the head's share of the time: tokens per second mean something only beside that line."""
    labels = list(report["methods"])
    dflash = next(label for label in labels if label.startswith("dflash"))
    tuning = report["config"].get("tuning")
    timing = ["speedup over greedy", "head share (cycles / all)"] if tuning else []
    run = f"the run `python {report['config']['command']}`"
    columns = ["prompts", "method", "tau", "tau / DFlash", *timing, "chain accept (slots 1-3)", "output == greedy"]
    lines = [
        f"`python scripts/bench_lilicorr.py --render {source}`, of {run}"
        + (f" (tuning line: {tuning}):" if tuning else " (tau and acceptance; its times are not compared):"),
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    for suite, segments in report["segments"].items():
        for segment, methods in segments.items():
            for label in labels:
                m = methods[label]
                if not m["prompts"]:
                    continue
                chain = " / ".join(f"{rate:.2f}" for rate in m["chain_accept"][:3] if rate is not None) or "-"
                share = " / ".join(percent(m.get(key)) for key in ("cycle_share", "corrector_share"))
                ratio = "-" if label == "vanilla" else f"{m['tau'] / methods[dflash]['tau']:.3f}"
                equal = round(m["equal_to_vanilla"] * m["prompts"])
                timed = [f"{m['speedup']:.2f}x", share] if tuning else []
                cells = [f"{SUITE_NAMES.get(suite, suite)} {segment}", label, f"{m['tau']:.2f}", ratio, *timed, chain,
                         f"{equal}/{m['prompts']}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.2f}%"  # two decimals: the bar sits at 3.00%


def write_between_markers(doc: Path, table: str, source: str) -> None:
    start, end = table_markers(source)
    text = doc.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{doc}: add the lines {start} and {end} where the table goes")
    head, rest = text.split(start, 1)
    doc.write_text(f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
