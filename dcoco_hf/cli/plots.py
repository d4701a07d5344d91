"""PNG plots of a benchmark report (the dict `bench.build_report` returns, also what `--json` writes).

matplotlib is an optional dependency (`pip install dcoco-hf[plots]`), imported only when plots are asked for, with
the non-interactive Agg backend so it works on headless machines.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from .bench import METHODS, split_method

PLOT_FILES = ("speedup_tau.png", "accept_hist.png", "per_slot_accept.png", "coverage.png")


def require_matplotlib() -> None:
    """Raise ImportError naming the install command when matplotlib is missing (checked before a long benchmark)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "plots need matplotlib, which is not installed. Install it with `pip install dcoco-hf[plots]` "
            "(or `pip install matplotlib`)."
        )


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # headless: never try to open a window
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the benchmark plots into `out_dir` (created if needed) and return their paths.

    speedup_tau.png: speedup over vanilla and tau per suite and method; accept_hist.png: share of verification
    cycles by accepted draft length; per_slot_accept.png: acceptance rate per draft slot; coverage.png: how often the
    finally committed token was the drafter's top-1 / inside its top-K candidates, per slot (DCOCO methods only).
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    painters = (_speedup_tau, _accept_hist, _per_slot_accept, _coverage)
    paths = []
    for name, paint in zip(PLOT_FILES, painters):
        figure = paint(plt, report)
        path = out / name
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        paths.append(path)
    return paths


def write_training_plot(progress: list[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """progress.png of a `dcoco-hf train` run: held-out tau and the first slots' chain acceptance at each checkpoint
    (`training.pipeline.CheckpointProgress`), stage 2's steps after stage 1's."""
    plt = _pyplot()
    figure, (tau_axis, slot_axis) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"wspace": 0.3})
    offset = max((line["step"] for line in progress if line["stage"] == 1), default=0)
    steps = [line["step"] + (offset if line["stage"] == 2 else 0) for line in progress]
    tau_axis.plot(steps, [line["tau"] for line in progress], marker="o")
    tau_axis.set(xlabel="training step (stage 2 after stage 1)", ylabel="held-out tau", title="tau")
    for slot in range(min(4, max(len(line["chain_accept"]) for line in progress))):
        values = [line["chain_accept"][slot] if slot < len(line["chain_accept"]) else None for line in progress]
        slot_axis.plot(steps, [float("nan") if v is None else v for v in values], marker="o", label=f"slot {slot + 1}")
    slot_axis.set(xlabel="training step (stage 2 after stage 1)", ylabel="chain acceptance", ylim=(0, 1),
                  title="slot accuracy")
    slot_axis.legend()
    if offset:
        for axis in (tau_axis, slot_axis):
            axis.axvline(offset, color="grey", linestyle=":")
    path = Path(path)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def _speedup_tau(plt, report: dict[str, Any]):
    groups = {**report["suites"], "overall": report["methods"]}
    methods = list(report["methods"])
    figure, axes = plt.subplots(1, 2, figsize=(5 + 1.6 * len(groups), 4), gridspec_kw={"wspace": 0.3})
    width = 0.8 / max(len(methods), 1)
    panels = ((axes[0], "speedup", "speedup over vanilla (x)"), (axes[1], "tau", "tau (tokens / target forward)"))
    for axis, key, label in panels:
        for m, method in enumerate(methods):
            values = [groups[g][method][key] or 0.0 for g in groups]
            positions = [g + (m - (len(methods) - 1) / 2) * width for g in range(len(groups))]
            axis.bar(positions, values, width, label=method, color=_color(method))
        axis.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xticks(range(len(groups)), list(groups))
        axis.set_ylabel(label)
    axes[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(_subtitle(report))
    return figure


def _accept_hist(plt, report: dict[str, Any]):
    methods = {m: s["accept_hist"] for m, s in report["methods"].items() if s["accept_hist"]}
    figure, axis = plt.subplots(figsize=(7, 4))
    longest = max((int(k) for hist in methods.values() for k in hist), default=0)
    width = 0.8 / max(len(methods), 1)
    for m, (method, hist) in enumerate(methods.items()):
        total = sum(hist.values())
        positions = [a + (m - (len(methods) - 1) / 2) * width for a in range(longest + 1)]
        shares = [hist.get(str(a), 0) / total for a in range(longest + 1)]
        axis.bar(positions, shares, width, label=method, color=_color(method))
    axis.set_xlabel("accepted draft tokens per verification")
    axis.set_ylabel("share of verifications")
    _finish(axis, methods, "no speculative method drafted anything")
    figure.suptitle(_subtitle(report))
    return figure


def _per_slot_accept(plt, report: dict[str, Any]):
    figure, axis = plt.subplots(figsize=(7, 4))
    shown = {}
    for method, summary in report["methods"].items():
        rates = summary["per_slot_accept"]
        if rates:
            shown[method] = rates
            rates = [r if r is not None else float("nan") for r in rates]
            axis.plot(range(1, len(rates) + 1), rates, marker="o", label=method, color=_color(method))
    axis.set_xlabel("draft slot (1 = first token after the anchor)")
    axis.set_ylabel("acceptance rate")
    axis.set_ylim(0, 1.02)
    _finish(axis, shown, "no speculative method drafted anything")
    figure.suptitle(_subtitle(report))
    return figure


def _coverage(plt, report: dict[str, Any]):
    figure, axis = plt.subplots(figsize=(7, 4))
    shown = {}
    dcoco = {m: s for m, s in report["methods"].items() if s.get("coverage_top1")}
    for index, (method, summary) in enumerate(dcoco.items()):
        top1, topk = summary["coverage_top1"], summary["coverage_topk"]
        shown[method] = top1
        # The DCOCO walks share one backbone, so their curves often coincide: a small shift keeps each visible.
        shift = 0.06 * (index - (len(dcoco) - 1) / 2)
        slots = [slot + 1 + shift for slot in range(len(top1))]
        color = _color(method)
        axis.plot(slots, [v if v is not None else float("nan") for v in top1], marker="o", color=color,
                  label=f"{method} top-1")
        axis.plot(slots, [v if v is not None else float("nan") for v in topk], marker="s", linestyle="--",
                  color=color, label=f"{method} top-{summary.get('top_k', 'K')}")
    axis.set_xlabel("draft slot")
    axis.set_ylabel("committed token among candidates")
    axis.set_ylim(0, 1.02)
    _finish(axis, shown, "no DCOCO method in this run")
    figure.suptitle(_subtitle(report))
    return figure


def _color(method: str) -> str:
    """One colour per method in every plot, whatever subset of methods ran; a block-size variant ("dcoco@3") gets
    its own, the same in every plot."""
    if method in METHODS:
        return f"C{METHODS.index(method) % 10}"
    try:
        base, block = split_method(method)
    except ValueError:
        block = None
    if block is None:  # a name this version does not know (a report from elsewhere): still plotted
        return "black"
    return f"C{(METHODS.index(base) + 3 * block) % 10}"


def _finish(axis, shown: dict, empty_message: str) -> None:
    if shown:
        axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:  # an empty plot says why rather than failing: the file set stays the same for every method choice
        axis.text(0.5, 0.5, empty_message, ha="center", va="center", transform=axis.transAxes)


def _subtitle(report: dict[str, Any]) -> str:
    config = report.get("config", {})
    target = Path(str(config.get("target", "target"))).name
    mode = "greedy" if config.get("temperature", 0.0) == 0.0 else f"T={config.get('temperature')}"
    return f"{target}, {mode}, block {config.get('block_size', '?')}, {config.get('device', '?')}"


__all__ = ["PLOT_FILES", "require_matplotlib", "write_plots", "write_training_plot"]
