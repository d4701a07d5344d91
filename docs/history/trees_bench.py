"""Draft trees against the same drafter's chain, in one run: tau, speed and what happens after an accepted sibling.

    python docs/history/trees_bench.py --suites humaneval:10,mtbench:10,mixed-heldout:10 --json docs/history/trees.json
    python docs/history/trees_bench.py --render docs/history/trees.json --write docs/trees.md   # its table

It answered whether draft trees pay on a CPU (docs/trees.md: not on the 2-core CPU timed, hence `tree_budget=0` by
default); its runs are docs/history/trees.json and trees_default.json.

Every method is `speculative_generate` on one prompt at a time (the batched loop at batch 1, where trees live) with
the shipped drafter attached by default `attach`, against plain `generate()`; per prompt the methods run back to
back in an order rotated per prompt, each method with its own copy of the cost schedule's learned state (what a
fixed 32-node tree's cycles teach must not steer the cost-sized default); with `--rounds N` each prompt's methods
run N times so (each round in the next rotation) and each method's median time on the prompt counts. Methods:

* ``chain``: the cost-aware default with `tree_budget=0` (chains sized per cycle); ``trees``: the cost-aware default
  (plain step, chain or a tree of up to 16 nodes, whichever is expected fastest);
* ``chain-constant``: the whole block every cycle; ``tree-N``: the `N`-node tree every cycle (the constant schedule
  with a budget: the tau comparisons);
* ``dflash-tree-16``: the same drafter without its corrector, trees of the slots' marginals (DDTree's);
* ``chain-flat``, ``trees-flat``: ``chain`` and ``trees`` planned with every verify width priced as a plain step
  (the regime of a memory-bound GPU forward, which reads the target's weights once whatever its width; drafts keep
  this machine's timed prices, and the prices stay fixed: the cycles' wall times on this CPU do not re-price them).
  Their tau and tree share show what the cost-sized default chooses where wide verifies are free; their speed is
  this CPU's and is no GPU figure.

tau is committed tokens per target forward, counted. After each accepted tree node with a next slot drafted, the
run counts whether the target's next token was the node's best child as the corrector ranks that node's children
(its transition scores) and as the slot's marginals rank them, separately after an accepted sibling (a node off the
chain) and on the chain; and the share of cycles that verified a tree. The tuning line of the run is printed first.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from dcoco_hf import DCOCOStats, speculative_generate
from dcoco_hf.assets import default_target_path
from dcoco_hf.runtime.costs import CycleCosts
from dcoco_hf.runtime.proposal import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from api_bench import DEFAULT_DRAFTER, chat_inputs, load_suite, machine  # noqa: E402
from results_table import replace_between, tuning_line  # noqa: E402

# name: (schedule, tree budget, corrector on)
METHODS = {
    "chain": ("cost", 0, True),
    "trees": ("cost", 16, True),
    "chain-constant": ("constant", 0, True),
    "tree-4": ("constant", 4, True),
    "tree-8": ("constant", 8, True),
    "tree-16": ("constant", 16, True),
    "tree-32": ("constant", 32, True),
    "dflash-tree-16": ("constant", 16, False),
    "chain-flat": ("cost", 0, True),
    "trees-flat": ("cost", 16, True),
}
FLAT_VERIFY = ("chain-flat", "trees-flat")  # planned with every verify width at a plain step's price


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--suites", default="humaneval:10,mtbench:10,mixed-heldout:10")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of each method per prompt (median kept)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--render", default=None, metavar="REPORT.json", help="print the markdown table of a run")
    parser.add_argument("--write", default=None, metavar="DOC.md", help="with --render: replace the table in DOC.md")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.render:
        table = markdown_table(json.loads(Path(args.render).read_text()))
        print(table)
        if args.write:
            replace_between(Path(args.write), table, *table_marks(Path(args.render).stem))
        return {}
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: time each method at least once per prompt (--rounds 1 or more)")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    suites = dict(load_suite(spec, args.skip) for spec in args.suites.split(","))

    target_path = args.target or default_target_path()
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True).attach(target)
    tuning = drafter.tuning.summary()
    print(tuning)
    generation = drafter.generation_config
    learned = {method: copy.deepcopy(drafter.cost_model) for method in METHODS}
    for method in FLAT_VERIFY:
        flat_verify(learned[method])
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    def run(method: str, inputs: dict) -> tuple[torch.LongTensor, float, DCOCOStats | None]:
        start = time.perf_counter()
        if method == "plain":
            out = target.generate(**inputs, **settings)
            return out, time.perf_counter() - start, None
        schedule, budget, correct = METHODS[method]
        generation.num_assistant_tokens_schedule = schedule
        drafter.cost_model = learned[method]
        result = speculative_generate(target, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                      drafter=drafter, correct=correct, tree_budget=budget, **settings)
        return result.sequences, time.perf_counter() - start, sum(result.stats, DCOCOStats())

    order_all = ["plain", *methods]
    costs = drafter.cycle_costs
    verify = {n: costs.verify_seconds(n) / costs.plain for n in VERIFY_COLUMNS} if costs is not None else {}
    report = {"command_line": ["python", "docs/history/trees_bench.py", *argv], "machine": machine(), "tuning": tuning,
              "verify_over_plain": verify,
              "config": {"command_line": ["python", "docs/history/trees_bench.py", *argv], "block_size":
                         drafter.config.block_size, "max_new_tokens": args.max_new_tokens, "methods": methods,
                         "rounds": args.rounds},
              "suites": {}}
    with torch.no_grad():
        warm = chat_inputs(tokenizer, "Say hi.")
        for method in order_all:  # untimed
            run(method, warm)
        for name, prompts in suites.items():
            totals = {m: {"seconds": 0.0, "tokens": 0, "identical": 0, "stats": DCOCOStats()} for m in order_all}
            for index, prompt in enumerate(prompts):
                inputs = chat_inputs(tokenizer, prompt)
                outputs, seconds = {}, {method: [] for method in order_all}
                for round_ in range(args.rounds):
                    shift = (index + round_) % len(order_all)
                    for method in order_all[shift:] + order_all[:shift]:
                        out, elapsed, stats = run(method, inputs)
                        seconds[method].append(elapsed)
                        if stats is not None:  # tau and the tree counts over every round
                            totals[method]["stats"] = totals[method]["stats"].merge(stats)
                        if round_ == 0:  # every round makes the same tokens: the first round's count
                            outputs[method] = out
                            totals[method]["tokens"] += out.shape[1] - inputs["input_ids"].shape[1]
                        elif not torch.equal(out, outputs[method]):
                            raise SystemExit(f"{method} changed its output between rounds on prompt {index + 1}")
                for method, out in outputs.items():
                    totals[method]["seconds"] += statistics.median(seconds[method])
                    totals[method]["identical"] += int(torch.equal(out, outputs["plain"]))
                print(f"[{name} {index + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
            report["suites"][name] = summarise(totals, methods, len(prompts))
            print_suite(name, report["suites"][name], methods)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")) + "\n", encoding="utf-8")
    return report


def flat_verify(schedule: CostModel) -> None:
    """Price every verify width (up to 33 columns) as this machine's plain step, drafts as timed, for one row, and
    keep those prices: the loop residual is not learned (this CPU's wide forwards would teach their own cost)."""
    costs = schedule.costs
    schedule.costs = CycleCosts(verify=[costs.plain] * max(costs.max_rows, 33), draft=dict(costs.draft))
    schedule.per_batch = False
    schedule.observe_loop = lambda *args, **kwargs: None


def summarise(totals: dict, methods: list[str], prompts: int) -> dict:
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rates = {method: total["tokens"] / total["seconds"] for method, total in totals.items()}
    suite = {}
    for method in methods:
        total, stats = totals[method], totals[method]["stats"]
        rate = rates[method]
        chain = "chain-flat" if method in FLAT_VERIFY else "chain"  # the same drafter's chain, priced alike
        chain_rate = rates.get(chain)
        chain_tau = totals[chain]["stats"].tau if chain in totals else None
        suite[method] = {
            "tree_budget": METHODS[method][1], "schedule": METHODS[method][0], "corrector": METHODS[method][2],
            "flat_verify": method in FLAT_VERIFY,
            "prompts": prompts, "tau": stats.tau, "tokens_per_s": rate, "speedup": rate / plain_rate,
            "over_chain": rate / chain_rate if chain_rate else None,
            "tau_over_chain": stats.tau / chain_tau if chain_tau else None, "identical": total["identical"],
            "tree_share": stats.tree_cycles / stats.cycles if stats.cycles else 0.0,
            "plain_steps": stats.proposal_lengths[0] if stats.proposal_lengths else 0,
            **stats.next_after_accepted(),
        }
    return suite


def print_suite(name: str, suite: dict, methods: list[str]) -> None:
    print(f"{name}: method | tau (over the chain) | speedup over plain | over the chain | tree share | "
          "after a sibling: walk / marginals (nodes) | on the chain: walk / marginals (nodes) | identical")
    for method in methods:
        r = suite[method]
        over = f"{r['over_chain']:.2f}x" if r["over_chain"] else "-"
        tau_over = f"{r['tau_over_chain']:.2f}x" if r["tau_over_chain"] else "-"
        print(f"  {method} | {r['tau']:.2f} ({tau_over}) | {r['speedup']:.2f}x | {over} | {r['tree_share']:.0%} | "
              f"{_hits(r, 'after_sibling')} | {_hits(r, 'after_chain')} | {r['identical']}/{r['prompts']}")


SUITE_NAMES = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "mixed-heldout": "held-out chat + code"}
VERIFY_COLUMNS = (2, 4, 5, 8, 9, 12, 16, 17)  # the widths the caption reports: chains, small trees, the largest tree
REPORTS = ("trees", "trees_default")  # docs/history/NAME.json, each rendered into docs/trees.md


def table_marks(name: str) -> tuple[str, str]:
    """The markers around the table of docs/history/`name`.json in a document."""
    return (f"<!-- {name} table: python docs/history/trees_bench.py --render docs/history/{name}.json -->",
            f"<!-- end of {name} table -->")


def markdown_table(report: dict) -> str:
    """The run's table: per suite and method, tau (counted), speed over plain and over the same drafter's chain,
    the share of cycles that verified a tree, and the best child's hit rate after an accepted sibling and on the
    chain, as the corrector ranks a node's children (walk) and as the slot's marginals do."""
    verify = report.get("verify_over_plain")
    priced = ", ".join(f"{n}: {ratio:.2f}x" for n, ratio in verify.items()) if verify else ""
    timed = (" Verify of N columns as the plan prices it (the cheapest timed forward of N or more), over a plain "
             f"step: {priced}.") if verify else ""
    flat_note = (" The -flat methods plan with every verify width priced as a plain step (a GPU's regime; tau and "
                 "tree cycles are what such a plan chooses, compared with the chain planned alike; their speed is "
                 "this CPU's)." if any(m in FLAT_VERIFY for m in report["config"]["methods"]) else "")
    lines = [f"`{' '.join(report['command_line'])}` on {report['machine']}; tuning line of the run: "
             f"{tuning_line(report['tuning'])}.{timed}{flat_note}", "",
             "| prompts | method | tau | tau over the chain | speedup over plain | speed over the chain | "
             "tree cycles | after a sibling: walk / marginals (nodes) | on the chain: walk / marginals (nodes) | "
             "identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for suite, methods in report["suites"].items():
        for method, r in methods.items():
            tau_over = r.get("tau_over_chain")
            cells = [f"{SUITE_NAMES.get(suite, suite)}, {r['prompts']}", method, f"{r['tau']:.2f}",
                     f"{tau_over:.2f}x" if tau_over else "-",
                     f"{r['speedup']:.2f}x", f"{r['over_chain']:.2f}x" if r["over_chain"] else "-",
                     f"{r['tree_share']:.0%}", _hits(r, "after_sibling"), _hits(r, "after_chain"),
                     f"{r['identical']}/{r['prompts']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hits(result: dict, prefix: str) -> str:
    walk, marginal = result[f"{prefix}_walk"], result[f"{prefix}_marginal"]
    return "-" if walk is None else f"{walk:.2f} / {marginal:.2f} ({result[f'{prefix}_nodes']})"


if __name__ == "__main__":
    main()
