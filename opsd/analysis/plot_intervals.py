"""Estimates with their intervals (`python -m opsd.analysis.stats ... --plot`) and one run's
checkpoint sweep (accuracy against step, `dev_eval.sh RUN_FOLDER`).
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from opsd.analysis import plot_common as common
from opsd.analysis.plot_common import DPI, check_output, run_name, step_axis


@dataclass(frozen=True)
class Interval:
    """One row of an interval panel: an estimate, its 95% interval (None: not available)
    and the values it summarises (e.g. the run means of an arm), drawn as dots."""
    label: str
    estimate: float
    ci: tuple[float, float] | None = None
    points: tuple[float, ...] = ()


@dataclass(frozen=True)
class IntervalPanel:
    title: str
    xlabel: str
    rows: tuple[Interval, ...]
    zero_line: bool = False  # differences: is 0 inside the interval?


def plot_intervals(panels: Sequence[IntervalPanel], out, title: str = "") -> list[str]:
    """Estimates with their intervals, one row each, panels stacked. Returns the row labels drawn."""
    out = check_output(out)
    from matplotlib.figure import Figure

    heights = [max(len(p.rows), 1) * 0.55 + 1.1 for p in panels]
    fig = Figure(figsize=(8.0, sum(heights) + 0.7), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights).ravel()
    drawn = []
    for ax, panel in zip(axes, panels, strict=False):
        n = len(panel.rows)
        for i, row in enumerate(panel.rows):
            y = n - 1 - i  # first row on top
            if row.points:
                ax.plot(row.points, [y] * len(row.points), "o", color="0.55", markersize=4, alpha=0.8)
            if row.ci is not None:
                ax.plot(row.ci, [y, y], "-|", color="C0", linewidth=2, markersize=10)
            ax.plot([row.estimate], [y], "D", color="C3", markersize=6)
            interval = f" [{row.ci[0]:.2f}, {row.ci[1]:.2f}]" if row.ci is not None else ""
            ax.annotate(f"{row.estimate:.2f}{interval}", (row.estimate, y), xytext=(0, 7),
                        textcoords="offset points", ha="center", fontsize=8)
            drawn.append(row.label)
        if panel.zero_line:
            ax.axvline(0.0, color="0.3", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(n), [row.label for row in reversed(panel.rows)], fontsize=8)
        ax.set_ylim(-0.7, n - 0.3)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle("\n".join(textwrap.fill(line, 110) for line in title.splitlines()), fontsize=9)
    common.save_png(fig, out)
    return drawn


def plot_sweep(result: dict, out, title: str = "") -> list[int]:
    """Accuracy against step for the checkpoints of one run (a `run_stats.sweep_checkpoints`
    result): each checkpoint's avg@k with its problems 95% CI, the best one marked. Returns the
    steps drawn."""
    out = check_output(out)
    rows = result["checkpoints"]
    steps, avgs = [r["step"] for r in rows], [r["avg"] for r in rows]
    fig, (ax,) = common.new_figure(1, width=6.4, height=3.8)
    low = [a - r["problems_ci"][0] for a, r in zip(avgs, rows, strict=True)]
    high = [r["problems_ci"][1] - a for a, r in zip(avgs, rows, strict=True)]
    ax.errorbar(steps, avgs, yerr=[low, high], marker="o", capsize=3, label=f"{result['metric']} (problems 95% CI)")
    best = next(r for r in rows if r["checkpoint"] == result["best"])
    ax.plot([best["step"]], [best["avg"]], "D", color="C3", markersize=9, label=f"best: {best['checkpoint']}")
    step_axis(ax)
    ax.set_ylabel(f"{result['metric']} accuracy (%)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    run = f" of run {run_name(result['run_folder'])}" if result.get("run_folder") else ""
    ax.set_title(title or f"checkpoint sweep{run} on {result['dataset']}: {result['num_problems']} problems x "
                 f"{result['samples_per_problem']} samples", fontsize=10)
    common.save_png(fig, out)
    return steps

