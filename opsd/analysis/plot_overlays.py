"""Runs and a grid's arms overlaid (`python -m opsd.analysis.plots overlay`, and a grid's
curves.png): one panel per metric, one line per run or per arm (the mean over its seeds with
the seed range as a band); a grid's figure opens with each arm's accuracy from its results.json.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opsd.analysis import plot_common as common
from opsd.analysis.plot_common import PlotError, check_output, panel_heading, run_name, seed_number, step_axis
from opsd.analysis.plot_curves import (
    CURVES_FILE,
    LABEL_TO_KEY,
    healthy_note,
    logged_keys,
    metric_key,
    metric_label,
    no_information,
    no_metric,
    panel_title,
    read_metrics,
    series,
    y_label,
)
from opsd.run_folder import METRICS_FILE

# `overlay` without --metric: the quantities that tell arms apart (OPSD_EXPERIMENTS.md); the
# loss last, since the SFT baseline's loss is another quantity (an NLL) than OPSD's.
# The completions' length and truncated share show drift (shorter answers, answers cut at the cap).
OVERLAY_METRICS = (LABEL_TO_KEY["true_kl"], LABEL_TO_KEY["H_student"], LABEL_TO_KEY["teacher_mass_removed"],
                   "completions/mean_length", "completions/truncated_ratio", "loss")


@dataclass(frozen=True)
class Curve:
    """One line of an overlay panel: a run, or an arm's seed mean with its seed range."""
    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    low: tuple[float, ...] | None = None
    high: tuple[float, ...] | None = None


def _path_labels(folders: Sequence[Path]) -> list[str]:
    """The shortest path tails that tell the folders apart (grid cells are all named `run`)."""
    parts = [folder.resolve().parts for folder in folders]
    for depth in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(folder) for folder in folders]


def run_curves(run_dirs: Sequence, keys: Sequence[str], required: bool = True) -> dict[str, list[Curve]]:
    """{key: one Curve per run that logged it}. A key that no run logged is a PlotError, or,
    when not `required` (the default metrics), left out."""
    folders = [Path(d) for d in run_dirs]
    seen = set()
    for folder in folders:
        if folder.resolve() in seen:
            raise PlotError(f"{folder}: given more than once")
        seen.add(folder.resolve())
    runs = [(label, read_metrics(folder)) for label, folder in zip(_path_labels(folders), folders, strict=True)]
    curves = {}
    for key in keys:
        curves[key] = [Curve(label, *map(tuple, series(records, key))) for label, records in runs]
        curves[key] = [c for c in curves[key] if c.steps]
    return _drop_absent(curves, required, f"the metrics.jsonl of any of the {len(runs)} runs",
                        [r for _, records in runs for r in records])


def _drop_absent(curves: dict[str, list[Curve]], required: bool, where: str, records) -> dict[str, list[Curve]]:
    for key, lines in curves.items():
        if not lines and required:
            raise no_metric(key, where, records)
    kept = {key: lines for key, lines in curves.items() if lines}
    if not kept:
        raise PlotError(f"none of {', '.join(map(metric_label, curves))} is in {where} "
                        f"(logged: {', '.join(logged_keys(records)) or 'nothing'})")
    return kept


def grid_arms(grid_dir, arms: Sequence[str] | None = None) -> dict[str, list[Path]]:
    """{arm: its trained run folders} of a opsd.research.grid folder (GRID/ARM/seed-N/run), in
    the order given or by name; arms without a trained run (the untrained base) are left out."""
    grid = Path(grid_dir)
    if not grid.is_dir():
        raise PlotError(f"{grid_dir}: no such folder")
    names = list(arms) if arms is not None else sorted(p.name for p in grid.iterdir() if p.is_dir())
    found = {}
    for name in names:
        runs = sorted((grid / name).glob(f"seed-*/run/{METRICS_FILE}"), key=lambda p: seed_number(p.parent.parent))
        if runs:
            found[name] = [p.parent for p in runs]
    if not found:
        raise PlotError(f"{grid_dir}: no ARM/seed-N/run/{METRICS_FILE} in it (not a opsd.research.grid folder, "
                        "or no cell has trained yet)")
    return found


def grid_curves(grid_dir, keys: Sequence[str], arms: Sequence[str] | None = None,
                required: bool = True) -> dict[str, list[Curve]]:
    """{key: one Curve per arm}: the mean over the arm's seeds at each step (over the seeds
    that logged that step) with the lowest and highest seed as the band. A key that no arm
    logged: as in run_curves."""
    per_arm = {arm: [read_metrics(folder) for folder in folders] for arm, folders in grid_arms(grid_dir, arms).items()}
    curves = {}
    for key in keys:
        curves[key] = []
        for arm, seeds in per_arm.items():
            by_step: dict[int, list[float]] = {}
            for records in seeds:
                for step, value in zip(*series(records, key), strict=True):
                    by_step.setdefault(step, []).append(value)
            if not by_step:
                continue
            steps = tuple(sorted(by_step))
            label = f"{arm} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
            means = tuple(sum(by_step[s]) / len(by_step[s]) for s in steps)
            band = len(seeds) > 1
            curves[key].append(Curve(label, steps, means,
                                     tuple(min(by_step[s]) for s in steps) if band else None,
                                     tuple(max(by_step[s]) for s in steps) if band else None))
    return _drop_absent(curves, required, f"the metrics.jsonl of any arm of {grid_dir}",
                        [r for seeds in per_arm.values() for records in seeds for r in records])


def curve_colors(curves: dict[str, list[Curve]]) -> dict[str, str]:
    """{curve label: colour}: one colour per run or arm in every panel, also where a panel
    lacks some of them (an SFT arm has no clip metrics)."""
    colors: dict[str, str] = {}
    for lines in curves.values():
        for curve in lines:
            colors.setdefault(curve.label, f"C{len(colors) % 10}")
    return colors


@dataclass(frozen=True)
class ArmAccuracy:
    """One arm's evaluated accuracy (a grid's results.json): its mean over the seeds, each seed's,
    and its difference to the baseline with that difference's 95% interval (results.json's
    `difference` and `ci`; None for the baseline itself or without them)."""
    arm: str
    mean: float
    per_run: tuple[float, ...]
    trained: bool
    difference: float | None = None
    ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class AccuracyPanel:
    """The grid's answer, drawn before its training curves: each arm's accuracy on the eval set."""
    title: str
    xlabel: str
    arms: tuple[ArmAccuracy, ...]
    baseline: ArmAccuracy | None = None  # the arm the intervals are differences to

    def whisker(self, arm: ArmAccuracy) -> tuple[float, float] | None:
        """Where the arm's interval is drawn: the baseline's mean plus the difference's 95% CI,
        so that it reaches the baseline's line when 0 is inside the interval."""
        if arm.ci is None or self.baseline is None:
            return None
        return self.baseline.mean + arm.ci[0], self.baseline.mean + arm.ci[1]


def _arm_accuracy(name: str, entry: dict) -> ArmAccuracy:
    ci = entry.get("ci")
    has_ci = isinstance(ci, list) and len(ci) == 2 and isinstance(entry.get("difference"), (int, float))
    return ArmAccuracy(name, float(entry["mean"]), tuple(float(v) for v in entry["per_run"]),
                       bool(entry.get("trained", True)), float(entry["difference"]) if has_ci else None,
                       (float(ci[0]), float(ci[1])) if has_ci else None)


def grid_accuracy(grid_dir) -> AccuracyPanel | None:
    """The accuracy panel of a opsd.research.grid folder, from its results.json (written before the
    figure); None without one or without an evaluated arm."""
    import json

    path = Path(grid_dir) / "results.json"
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        arms = tuple(_arm_accuracy(name, a) for name, a in table["arms"].items() if "mean" in a)
        grid = table["grid"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # an older or hand-made folder: the training curves alone
    if not arms:
        return None
    metric = next((a["metric"] for a in table["arms"].values() if "metric" in a), "accuracy")
    baseline = next((a for a in arms if a.arm == grid.get("baseline")), None)
    return AccuracyPanel(f"accuracy on {grid.get('eval_data') or 'the eval set'} (higher is better)",
                         f"{metric} accuracy (%)", arms, baseline)


def accuracy_caption(panel: AccuracyPanel) -> str:
    """What the accuracy panel draws, as drawn: no dots without several seeds, no whisker without
    an interval."""
    seeds = sorted({len(a.per_run) for a in panel.arms if a.trained})
    metric = panel.xlabel.split(" ")[0]
    words = (f"bar: each arm's {metric} (one run each)" if seeds in ([], [1]) else
             f"bar: each arm's {metric}, the mean over its {'/'.join(map(str, seeds))} seeds")
    if any(len(a.per_run) > 1 for a in panel.arms):
        words += ", dots: each seed's run"
    if panel.baseline is not None and any(panel.whisker(a) for a in panel.arms):
        words += (f", whisker: the 95% interval of its difference to {panel.baseline.arm}, drawn from "
                  f"{panel.baseline.arm}'s mean (dotted line)")
    return words


def informative(curves: dict[str, list[Curve]]) -> dict[str, list[Curve]]:
    """The panels that carry information: a metric all 0 or constant in every arm (teacher mass
    removed at 0 under the token clip; plot_curves.no_information, the run's own rule) says
    nothing a reader needs."""
    return {key: lines for key, lines in curves.items()
            if any(no_information(c.steps, [v for v in c.values if math.isfinite(v)] or [0.0]) is None
                   for c in lines)}


def _draw_accuracy(ax, panel: AccuracyPanel, colors: dict[str, str]) -> list[tuple[str, str]]:
    """Horizontal bars, one per arm in the grid's order (top to bottom), each seed's run as a dot,
    the interval as a whisker; the numbers in the arm's label."""
    drawn = []
    rows = list(panel.arms)
    for y, arm in enumerate(reversed(rows)):
        color = next((c for label, c in colors.items() if label.split(" (")[0] == arm.arm), "0.55")
        ax.barh(y, arm.mean, color=color, alpha=0.6, height=0.6)
        if len(arm.per_run) > 1:
            ax.plot(arm.per_run, [y] * len(arm.per_run), "o", color="black", markersize=3)
        whisker = panel.whisker(arm)
        if whisker is not None:
            ax.plot(whisker, [y, y], "-|", color="black", linewidth=1.5, markersize=8)
        drawn.append(("accuracy", arm.arm))
    if panel.baseline is not None and any(panel.whisker(a) for a in rows):
        ax.axvline(panel.baseline.mean, color="0.3", linewidth=0.9, linestyle=":")
    ax.set_yticks(range(len(rows)), [_accuracy_label(panel, a) for a in reversed(rows)], fontsize=8)
    top = max(max(a.mean, *a.per_run, *(panel.whisker(a) or ())) for a in rows)
    ax.set_xlim(0, min(100.0, max(10.0, top * 1.15)))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="x")
    return list(reversed(drawn))


def _accuracy_label(panel: AccuracyPanel, arm: ArmAccuracy) -> str:
    """`token_left` / `60.00 (+14.38 [+6.88, +22.50])`: the arm, its mean and its difference."""
    name = f"{arm.arm}{'' if arm.trained else ' (untrained)'}"
    numbers = f"{arm.mean:.2f}"
    if arm.ci is not None and panel.baseline is not None:
        numbers += f" ({arm.difference:+.2f} [{arm.ci[0]:+.2f}, {arm.ci[1]:+.2f}])"
    return f"{name}\n{numbers}"


def plot_overlay(curves: dict[str, list[Curve]], out, title: str = "",
                 accuracy: AccuracyPanel | None = None) -> list[tuple[str, str]]:
    """One panel per metric, one line per Curve (with its band, if any); with `accuracy`, that
    panel first. Returns the (metrics.jsonl key, curve label) pairs drawn, ("accuracy", arm)
    for the accuracy panel's bars."""
    out = check_output(out)
    fig, axes = common.new_figure(len(curves) + (accuracy is not None))
    colors = curve_colors(curves)
    drawn = []
    if accuracy is not None:
        drawn += _draw_accuracy(axes[0], accuracy, colors)
    curve_axes = axes[1:] if accuracy is not None else axes
    for ax, (key, lines) in zip(curve_axes, curves.items(), strict=False):
        for curve in lines:
            color = colors[curve.label]
            ax.plot(curve.steps, curve.values, color=color, label=curve.label, linewidth=1.2)
            if curve.low is not None:
                ax.fill_between(curve.steps, curve.low, curve.high, color=color, alpha=0.15, linewidth=0)
            drawn.append((key, curve.label))
        panel_heading(ax, panel_title(key), healthy_note(key))
        step_axis(ax)
        ax.set_ylabel(y_label(key), fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    # One legend for the figure: every panel has the same runs (or a subset).
    handles, labels = {}, []
    for ax in curve_axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=False):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    if labels:
        fig.legend([handles[label] for label in labels], labels, loc="outside lower center", fontsize=8,
                   ncols=min(4, len(labels)), frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    common.save_png(fig, out)
    return drawn


def overlay_runs(run_dirs: Sequence, out, metrics: Sequence[str] | None = None) -> list[tuple[str, str]]:
    check_output(out)
    keys = [metric_key(m) for m in (metrics or OVERLAY_METRICS)]
    names = ", ".join(run_name(d) for d in run_dirs)
    return plot_overlay(run_curves(run_dirs, keys, required=bool(metrics)), out,
                        f"training curves of {len(run_dirs)} runs: {textwrap.shorten(names, 100, placeholder=' ...')}")


def overlay_grid(grid_dir, out=None, metrics: Sequence[str] | None = None,
                 arms: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The arms of a opsd.research.grid folder (default output GRID_DIR/curves.png): first each arm's
    accuracy (its results.json, when there), then the training curves, seed mean and seed range
    per arm; without chosen `metrics`, only the curves that carry information (`informative`).
    The title says what is drawn, as drawn (`grid_caption`)."""
    keys = [metric_key(m) for m in (metrics or OVERLAY_METRICS)]
    curves = grid_curves(grid_dir, keys, arms, required=bool(metrics))  # first: a missing folder is the error
    out = check_output(out if out is not None else Path(grid_dir) / CURVES_FILE)
    accuracy = grid_accuracy(grid_dir)
    shown = curves
    if not metrics:
        shown = informative(curves) or (curves if accuracy is None else {})
    left_out = [panel_title(key) for key in curves if key not in shown]
    title = grid_caption(Path(grid_dir).resolve().name, shown, accuracy, left_out)
    return plot_overlay(shown, out, textwrap.fill(title, 130), accuracy)


def grid_caption(name: str, curves: dict[str, list[Curve]], accuracy: AccuracyPanel | None,
                 left_out: Sequence[str] = ()) -> str:
    """The grid figure's title: what its panels draw, as drawn (a band only where an arm has
    several seeds), and the panels left out as flat in every arm."""
    lines = [c for cs in curves.values() for c in cs]
    if not lines:
        drawing = ""
    elif all(c.low is None for c in lines):
        drawing = "each arm's one run"
    else:
        drawing = "each arm's mean over its seeds, band from the lowest to the highest seed"
    parts = [f"grid {name}: {accuracy_caption(accuracy)}" if accuracy is not None else ""]
    if drawing:
        parts.append(f"training curves of grid {name}: {drawing}" if accuracy is None
                     else f"then the training curves, {drawing}")
    if left_out:
        parts.append(f"not drawn (all 0 or constant in every arm): {', '.join(left_out)}")
    return "; ".join(p for p in parts if p)
