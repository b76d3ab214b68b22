"""Plots (PNG): one run's training curves, several runs overlaid, arms with their intervals,
a grid's results.json against tokens, data or a setting.

    python -m opsd.analysis.plots curves RUN_DIR [--metric KEY ...] [--out FILE.png]
    python -m opsd.analysis.plots overlay RUN_DIR [RUN_DIR ...] [--metric KEY ...] --out FILE.png
    python -m opsd.analysis.plots overlay --grid GRID_DIR [--metric KEY ...] [--out FILE.png]
    python -m opsd.analysis.plots results RESULTS.json [--x FIELD] [--group REGEX] [--out FILE.png]

`curves` draws what a run folder's `metrics.jsonl` holds, one panel per quantity (loss,
true KL, divergence before the clip, clip shares, teacher mass removed, entropies,
completion lengths, learning rate, gradient norm; a quantity the run did not log is left
out). Default output: `RUN_DIR/curves.png`, which `opsd_train.py` also draws at the end of
every run. `overlay` draws one panel per metric with one line per run folder or, with
`--grid`, one line per arm of a opsd.research.grid folder: the mean over the arm's seeds, with
a band from the lowest to the highest seed at each step (default output
`GRID_DIR/curves.png`, which `opsd/research/grid.py` also draws); there, a first panel gives each
arm's accuracy (the grid's results.json), and without `--metric` a curve that stays flat in
every arm (teacher mass removed at 0 under the token clip) is left out. A metric is a `metrics.jsonl` key
(`opsd/true_kl`) or its `[OPSD kl]` label (`true_kl`). `python -m opsd.analysis.stats ... --plot FILE.png`
draws its arms with the intervals it prints, through `plot_intervals`; `plot_sweep` draws a
run's accuracy per checkpoint (`dev_eval.sh RUN_FOLDER`, opsd/evaluation/sweep.py);
`plot_accuracy_vs_tokens` a grid's accuracy against the tokens its arms sampled
(`accuracy_vs_tokens.png`, which a grid with `sweep_every` draws; `python -m opsd.analysis.stats
tokens GRID_DIR --plot FILE.png` by hand).

`results` needs only a grid's results.json (opsd/research/grid.py writes it; grids/results/
keeps copies whose run folders are gone): each evaluated arm at its mean x and mean accuracy,
each seed's run as a small dot at its own x (`sampled_tokens_per_run`, ...) and accuracy
(`per_run`), the untrained arm (base) as a dotted line. `--x`: `sampled_tokens` (default),
`forward_tokens` (training compute), `unique_problems` (N of the arm's `--dataset_name
tiny:SEED:N`, log scale) or `learning_rate` (the arm's recipe, else the grid's; log scale).
Arms that `--group REGEX` puts together are one line (default: each arm its own labelled dot
for tokens, the name's prefix, opsd_n64 -> opsd, otherwise). Default output: beside the JSON,
NAME_X.png.

Bad input (a missing folder or file, an unreadable `metrics.jsonl` line, a metric that no
run logged, an --x that no arm of a results.json has, an output that is not a writable .png
path) is one `error: ...` line on stderr with exit status 2, and no PNG is written (figures
are written to a temporary file and renamed into place). matplotlib is imported only when a
figure is drawn, and only its Agg canvas is used (no pyplot): nothing opens a window, no global
backend is switched, and modules that import this one for its constants do not pay for
matplotlib.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE
from opsd.run_log import KL_LINE_FIELDS

CURVES_FILE = "curves.png"  # beside metrics.jsonl (opsd_train.py) and beside results.md (opsd/research/grid.py)
DPI = 100

LABEL_TO_KEY = dict(KL_LINE_FIELDS)  # `[OPSD kl]` label -> metrics.jsonl key
KEY_TO_LABEL = {key: label for label, key in KL_LINE_FIELDS}

# `curves`: (panel title, y-axis label, metrics.jsonl keys drawn in it). The opsd/ keys come
# from the `[OPSD kl]` line's declaration; the others are what the trainer and transformers log.
CURVE_PANELS = (
    ("loss", "loss per token", ("loss",)),
    ("true KL (teacher || student)", "true KL per token (nats)", (LABEL_TO_KEY["true_kl"],)),
    ("divergence before the clip", "divergence per token (nats)", (LABEL_TO_KEY["loss_unclipped"],)),
    ("clip shares", "share clipped", (LABEL_TO_KEY["clip_entries"], LABEL_TO_KEY["clip_tokens"],
                                      LABEL_TO_KEY["argmax_clipped"])),
    ("teacher mass removed", "teacher probability removed", (LABEL_TO_KEY["teacher_mass_removed"],)),
    ("entropy", "entropy per token (nats)", (LABEL_TO_KEY["H_student"], LABEL_TO_KEY["H_teacher"])),
    ("completion length (tokens)", "tokens", ("completions/mean_length", "completions/max_length")),
    # GRPO runs only (the keys of opsd.grpo.reward_stats): is there signal in the groups?
    ("GRPO reward", "mean reward (share correct)", ("grpo/reward_mean",)),
    ("GRPO completions without signal", "share in zero-std groups", ("grpo/frac_reward_zero_std",)),
    ("learning rate", "learning rate", ("learning_rate",)),
    ("gradient norm", "gradient norm", ("grad_norm",)),
)
# y-axis label of one metric's panel (`overlay`, `curves --metric`): its CURVE_PANELS label; a key
# of no panel is labelled with its name.
Y_LABELS = {key: ylabel for _, ylabel, keys in CURVE_PANELS for key in keys}
# `overlay` without --metric: the quantities that tell arms apart (OPSD_EXPERIMENTS.md); the
# loss last, since the SFT baseline's loss is another quantity (an NLL) than OPSD's.
OVERLAY_METRICS = (LABEL_TO_KEY["true_kl"], LABEL_TO_KEY["H_student"], LABEL_TO_KEY["teacher_mass_removed"], "loss")


class PlotError(Exception):
    """Bad input for a plot; the message is one line (printed as `error: ...`, exit 2)."""


def metric_key(name: str) -> str:
    """The metrics.jsonl key of a metric given by key or by its `[OPSD kl]` label."""
    return LABEL_TO_KEY.get(name, name)


def metric_label(key: str) -> str:
    return KEY_TO_LABEL.get(key, key)


# Panel titles a reader without the README understands: a CURVE_PANELS title where the panel
# draws that key alone, else these words, else the `[OPSD kl]` label.
_READABLE = {LABEL_TO_KEY["H_student"]: "student entropy", LABEL_TO_KEY["H_teacher"]: "teacher entropy"}


def panel_title(key: str) -> str:
    own = [title for title, _, keys in CURVE_PANELS if keys == (key,)]
    return own[0] if own else _READABLE.get(key, metric_label(key))


def y_label(key: str) -> str:
    return Y_LABELS.get(key, metric_label(key))


def run_name(run_dir) -> str:
    """A run folder as a reader names it: a grid cell (GRID/ARM/seed-N/run) by its grid, arm and
    seed, any other run by its folder's name."""
    parts = Path(run_dir).resolve().parts
    if len(parts) >= 4 and parts[-1] == "run" and _seed_number(Path(parts[-2])) >= 0:
        return f"{parts[-4]}: arm {parts[-3]}, seed {_seed_number(Path(parts[-2]))}"
    return parts[-1] if parts else str(run_dir)


def _step_axis(ax) -> None:
    """Steps are whole numbers: ticks only there (matplotlib would put one at 4.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# --------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------

def read_metrics(run_dir) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl; a bad line is a PlotError naming its number."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise PlotError(f"{run_dir}: no such folder")
    path = folder / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path}: no such file (a run writes it from its first logged step)")
    records = []
    for number, record in read_jsonl(path, PlotError):
        if type(record.get("step")) is not int:
            raise PlotError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        records.append(record)
    return records


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, by step. Records without a finite value are skipped
    (metrics.jsonl stores a non-finite value as null; the end-of-run summary has no metrics)."""
    points = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            points[record["step"]] = float(value)
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _logged_keys(records: Sequence[dict]) -> list[str]:
    return sorted({k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))})


def _no_metric(name: str, where: str, records: Sequence[dict]) -> PlotError:
    known = _logged_keys(records)
    shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return PlotError(f"metric {name!r} is not in {where} (logged: {shown or 'nothing'})")


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
            raise _no_metric(key, where, records)
    kept = {key: lines for key, lines in curves.items() if lines}
    if not kept:
        raise PlotError(f"none of {', '.join(map(metric_label, curves))} is in {where} "
                        f"(logged: {', '.join(_logged_keys(records)) or 'nothing'})")
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
        runs = sorted((grid / name).glob(f"seed-*/run/{METRICS_FILE}"), key=lambda p: _seed_number(p.parent.parent))
        if runs:
            found[name] = [p.parent for p in runs]
    if not found:
        raise PlotError(f"{grid_dir}: no ARM/seed-N/run/{METRICS_FILE} in it (not a opsd.research.grid folder, "
                        "or no cell has trained yet)")
    return found


def _seed_number(folder: Path) -> int:
    tail = folder.name.removeprefix("seed-")
    return int(tail) if tail.isdigit() else -1


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


# --------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------

def check_output(out) -> Path:
    """A .png path in an existing, writable folder: checked before any work is done."""
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise PlotError(f"{out}: the output must be a .png file")
    folder = path.parent
    if not folder.is_dir():
        raise PlotError(f"{out}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PlotError(f"{out}: folder {folder} is not writable")
    if path.is_dir():
        raise PlotError(f"{out}: is a folder")
    return path


def _figure(panels: int, width: float = 4.4, height: float = 3.0, columns: int = 3):
    from matplotlib.figure import Figure  # here, not at the top: importing this module stays cheap

    columns = 2 if panels == 4 else min(columns, panels)  # 2 x 2 rather than 3 + 1
    rows = math.ceil(panels / columns)
    fig = Figure(figsize=(width * columns, height * rows + 0.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[panels:]:
        ax.remove()
    return fig, list(axes[:panels])


def _save(fig, out: Path) -> None:
    """Render with the Agg canvas and write a 256-colour PNG into a temporary file, then
    rename: a failure leaves no partial PNG. The palette makes line plots about a third of
    the size of a full-colour PNG with no visible difference."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # a dependency of matplotlib

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB").quantize(colors=256)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format="PNG", optimize=True)
        os.replace(tmp, out)
    except OSError as exc:
        raise PlotError(f"{out}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def plot_run_curves(run_dir, out=None, metrics: Sequence[str] | None = None) -> list[str]:
    """Draw one run's curves into `out` (default RUN_DIR/curves.png). With `metrics`, one
    panel each (all must be logged); without, the CURVE_PANELS the run logged. Returns the
    metrics.jsonl keys drawn, in panel order."""
    records = read_metrics(run_dir)  # first: a missing run folder is the error to report
    out = check_output(out if out is not None else Path(run_dir) / CURVES_FILE)
    where = str(Path(run_dir) / METRICS_FILE)
    if metrics:
        panels = []
        for name in metrics:
            key = metric_key(name)
            if not series(records, key)[0]:
                raise _no_metric(name, where, records)
            panels.append((metric_label(key), y_label(key), (key,)))
    else:
        panels = [(title, ylabel, tuple(k for k in keys if series(records, k)[0]))
                  for title, ylabel, keys in CURVE_PANELS]
        panels = [(title, ylabel, keys) for title, ylabel, keys in panels if keys]
        if not panels:
            raise PlotError(f"{where}: none of the curve metrics is in it (logged: "
                            f"{', '.join(_logged_keys(records)) or 'nothing'})")
    fig, axes = _figure(len(panels))
    drawn = []
    for ax, (title, ylabel, keys) in zip(axes, panels, strict=False):
        for key in keys:
            steps, values = series(records, key)
            ax.plot(steps, values, label=metric_label(key).split("/")[-1], marker="." if len(steps) <= 30 else None)
            drawn.append(key)
        ax.set_title(title, fontsize=10)
        _step_axis(ax)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"training curves of run {run_name(run_dir)}", fontsize=11)
    _save(fig, out)
    return drawn


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
    """One arm's evaluated accuracy (a grid's results.json): its mean over the seeds and each seed's."""
    arm: str
    mean: float
    per_run: tuple[float, ...]
    trained: bool


@dataclass(frozen=True)
class AccuracyPanel:
    """The grid's answer, drawn before its training curves: each arm's accuracy on the eval set."""
    title: str
    xlabel: str
    arms: tuple[ArmAccuracy, ...]


def grid_accuracy(grid_dir) -> AccuracyPanel | None:
    """The accuracy panel of a opsd.research.grid folder, from its results.json (written before the
    figure); None without one or without an evaluated arm."""
    import json

    path = Path(grid_dir) / "results.json"
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        arms = tuple(ArmAccuracy(name, float(a["mean"]), tuple(float(v) for v in a["per_run"]),
                                 bool(a.get("trained", True)))
                     for name, a in table["arms"].items() if "mean" in a)
        grid = table["grid"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # an older or hand-made folder: the training curves alone
    if not arms:
        return None
    metric = next((a["metric"] for a in table["arms"].values() if "metric" in a), "accuracy")
    return AccuracyPanel(f"accuracy on {grid.get('eval_data') or 'the eval set'} (higher is better)",
                         f"{metric} accuracy (%): bar = mean, dots = seeds", arms)


def informative(curves: dict[str, list[Curve]]) -> dict[str, list[Curve]]:
    """The panels whose lines move: a metric that stays at one value in every run (teacher mass
    removed at 0 under the token clip) says nothing a reader needs."""
    def moves(curve: Curve) -> bool:
        values = [v for v in curve.values if math.isfinite(v)]
        return bool(values) and max(values) - min(values) > 1e-12 * max(1.0, abs(max(values)))

    return {key: lines for key, lines in curves.items() if any(moves(c) for c in lines)}


def _draw_accuracy(ax, panel: AccuracyPanel, colors: dict[str, str]) -> list[tuple[str, str]]:
    """Horizontal bars, one per arm in the grid's order (top to bottom), the value written beside."""
    drawn = []
    rows = list(panel.arms)
    for y, arm in enumerate(reversed(rows)):
        color = next((c for label, c in colors.items() if label.split(" (")[0] == arm.arm), "0.55")
        ax.barh(y, arm.mean, color=color, alpha=0.6, height=0.6)
        if len(arm.per_run) > 1:
            ax.plot(arm.per_run, [y] * len(arm.per_run), "o", color="black", markersize=3)
        ax.text(arm.mean, y, f" {arm.mean:.2f}", va="center", fontsize=9)
        drawn.append(("accuracy", arm.arm))
    ax.set_yticks(range(len(rows)), [f"{a.arm}{'' if a.trained else ' (untrained)'}" for a in reversed(rows)],
                  fontsize=9)
    top = max(max(a.mean, *a.per_run) for a in rows)
    ax.set_xlim(0, min(100.0, max(10.0, top * 1.25)))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="x")
    return list(reversed(drawn))


def plot_overlay(curves: dict[str, list[Curve]], out, title: str = "",
                 accuracy: AccuracyPanel | None = None) -> list[tuple[str, str]]:
    """One panel per metric, one line per Curve (with its band, if any); with `accuracy`, that
    panel first. Returns the (metrics.jsonl key, curve label) pairs drawn, ("accuracy", arm)
    for the accuracy panel's bars."""
    out = check_output(out)
    fig, axes = _figure(len(curves) + (accuracy is not None))
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
        ax.set_title(panel_title(key), fontsize=10)
        _step_axis(ax)
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
    _save(fig, out)
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
    per arm; without chosen `metrics`, only the curves that move (`informative`)."""
    keys = [metric_key(m) for m in (metrics or OVERLAY_METRICS)]
    curves = grid_curves(grid_dir, keys, arms, required=bool(metrics))  # first: a missing folder is the error
    out = check_output(out if out is not None else Path(grid_dir) / CURVES_FILE)
    accuracy = grid_accuracy(grid_dir)
    if not metrics:
        curves = informative(curves) or (curves if accuracy is None else {})
    name = Path(grid_dir).resolve().name
    if accuracy is None:
        title = (f"training curves of grid {name}: each arm's mean over its seeds, band from the lowest to the "
                 "highest seed")
    else:
        title = (f"grid {name}: each arm's accuracy, then its training curves (mean over its seeds, band from the "
                 "lowest to the highest seed; curves that stay flat left out)")
    return plot_overlay(curves, out, textwrap.fill(title, 110), accuracy)


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
    _save(fig, out)
    return drawn


def plot_sweep(result: dict, out, title: str = "") -> list[int]:
    """Accuracy against step for the checkpoints of one run (a `run_stats.sweep_checkpoints`
    result): each checkpoint's avg@k with its problems 95% CI, the best one marked. Returns the
    steps drawn."""
    out = check_output(out)
    rows = result["checkpoints"]
    steps, avgs = [r["step"] for r in rows], [r["avg"] for r in rows]
    fig, (ax,) = _figure(1, width=6.4, height=3.8)
    low = [a - r["problems_ci"][0] for a, r in zip(avgs, rows, strict=True)]
    high = [r["problems_ci"][1] - a for a, r in zip(avgs, rows, strict=True)]
    ax.errorbar(steps, avgs, yerr=[low, high], marker="o", capsize=3, label=f"{result['metric']} (problems 95% CI)")
    best = next(r for r in rows if r["checkpoint"] == result["best"])
    ax.plot([best["step"]], [best["avg"]], "D", color="C3", markersize=9, label=f"best: {best['checkpoint']}")
    _step_axis(ax)
    ax.set_ylabel(f"{result['metric']} accuracy (%)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    run = f" of run {run_name(result['run_folder'])}" if result.get("run_folder") else ""
    ax.set_title(title or f"checkpoint sweep{run} on {result['dataset']}: {result['num_problems']} problems x "
                 f"{result['samples_per_problem']} samples", fontsize=10)
    _save(fig, out)
    return steps


ACCURACY_VS_TOKENS_FILE = "accuracy_vs_tokens.png"  # beside results.md of a grid with sweep_every


def accuracy_vs_tokens_figure(table: dict):
    """The figure of `plot_accuracy_vs_tokens` (not saved), and the labels of the arms drawn.
    `table`: an `opsd.analysis.stats.grid_table`. A trained arm that samples tokens: its points
    (mean sampled tokens, mean accuracy over its seeds) joined in step order, with a band from
    the lowest to the highest seed's accuracy; an arm that samples nothing (SFT) and the
    untrained arm: horizontal lines at their (last) accuracy, dashed and dotted. Points whose
    sampled tokens a seed did not record are left out (the title names such arms)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from opsd.analysis.tokens import format_tokens, samples_nothing

    metric = table["metric"]
    fig = Figure(figsize=(7.4, 4.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    drawn, lines, missing = [], [], []
    for index, (name, arm) in enumerate(table["arms"].items()):
        color = f"C{index % 10}"
        if not arm["trained"]:
            lines.append((name, f"{name} (untrained): {arm['points'][-1]['accuracy']:.2f}",
                          arm["points"][-1]["accuracy"], ":", "0.35"))
            continue
        if samples_nothing(arm):
            last = arm["points"][-1]
            lines.append((name, f"{name}: samples no tokens, last checkpoint {last['accuracy']:.2f} "
                          f"(mean of {len(arm['seeds'])} seeds)", last["accuracy"], "--", color))
            continue
        points = [p for p in arm["points"] if p["sampled_tokens"] is not None]
        if not points:
            missing.append(name)
            continue
        x = [p["sampled_tokens"] for p in points]
        ax.plot(x, [p["accuracy"] for p in points], marker="o", markersize=4, color=color, linewidth=1.4,
                label=f"{name} ({len(arm['seeds'])} seed{'s' if len(arm['seeds']) != 1 else ''})")
        if len(arm["seeds"]) > 1:
            ax.fill_between(x, [min(p["accuracy_per_seed"]) for p in points],
                            [max(p["accuracy_per_seed"]) for p in points], color=color, alpha=0.15, linewidth=0)
        drawn.append(name)
    if not drawn and not any(style == "--" for *_, style, _ in lines):  # only the untrained line: no axis
        raise PlotError(f"grid {table['grid']}: no trained arm recorded its sampled tokens (tokens/sampled in "
                        f"metrics.jsonl; runs from before it do not have it)")
    for name, label, accuracy, style, color in lines:
        ax.axhline(accuracy, linestyle=style, color=color, linewidth=1.3, label=label)
        drawn.append(name)
    ax.set_xlabel("sampled tokens (cumulative, mean over seeds)", fontsize=9)
    ax.set_ylabel(f"{metric} (%)", fontsize=9)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: "0" if value == 0 else format_tokens(value)))
    ax.set_xlim(left=0)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    title = (f"{metric} against sampled tokens, grid {table['grid']}: each arm's mean over its seeds at each "
             f"{'swept' if table['swept'] else 'last'} checkpoint, band from the lowest to the highest seed")
    if missing:
        title += f"; not drawn (sampled tokens not recorded): {', '.join(missing)}"
    ax.set_title(textwrap.fill(title, 95), fontsize=9)
    return fig, drawn


def plot_accuracy_vs_tokens(table: dict, out) -> list[str]:
    """Accuracy against sampled tokens of a grid (`table`: `opsd.analysis.stats.grid_table` of the
    grid folder) into the PNG `out` (a grid's is GRID_DIR/accuracy_vs_tokens.png). Returns the
    arms drawn."""
    out = check_output(out)
    fig, drawn = accuracy_vs_tokens_figure(table)
    _save(fig, out)
    return drawn


# --------------------------------------------------------------------------
# A grid's results.json alone (no run folders): accuracy against tokens, data or a setting
# --------------------------------------------------------------------------

# `results --x`: what each arm's point is placed at, (axis label, axis scale). Token counts are
# results.json fields (the mean and `FIELD_per_run`); the others are read from the arm's settings.
RESULTS_X = {
    "sampled_tokens": ("sampled tokens (completions the student sampled in training)", "linear"),
    "forward_tokens": ("forward tokens (training compute: tokens through the training forwards)", "linear"),
    "unique_problems": ("unique training problems (N of --dataset_name tiny:SEED:N; log scale)", "log2"),
    "learning_rate": ("learning rate (the arm's recipe, else the grid's; log scale)", "log10"),
}
TOKEN_X = ("sampled_tokens", "forward_tokens")
DEFAULT_GROUP = r"^[^_]+"  # unique_problems, learning_rate: one line per name prefix (opsd_n64 -> opsd)


@dataclass(frozen=True)
class ResultsPoint:
    """One arm of a results.json: its mean (x, accuracy) over its seeds and each seed's run."""
    arm: str
    group: str
    x: float
    accuracy: float
    runs: tuple[tuple[float, float], ...]  # (x, accuracy) of each seed's run


@dataclass(frozen=True)
class ResultsFigure:
    """What `results_points` reads from a results.json, all that `results_figure` draws."""
    name: str
    metric: str
    eval_data: str
    x: str
    points: tuple[ResultsPoint, ...]
    baselines: tuple[tuple[str, float], ...]  # untrained arms: (name, accuracy), horizontal lines
    group_labels: dict  # {group: legend label} of groups of several arms (lines)
    left_out: tuple[str, ...] = ()  # trained arms without the x value ("arm (why)")


def read_results(path) -> dict:
    """A grid's results.json (opsd.research.grid writes it; grids/results/ holds copies)."""
    import json

    file = Path(path)
    if not file.is_file():
        raise PlotError(f"{path}: no such file")
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlotError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(table, dict) or not isinstance(table.get("arms"), dict) or not table["arms"]:
        raise PlotError(f"{path}: no 'arms' in it (not the results.json of a opsd.research.grid)")
    return table


def _flag_value(flags, name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in an arm's flags (the last one given)."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif isinstance(flag, str) and flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def unique_problems(table: dict, arm: str) -> int:
    """How many training rows (unique problems) an arm trained on: N of its `--dataset_name
    tiny:SEED:N` (`tiny` and `tiny:SEED` are the 4,096-row default; the tiny preset's data is
    `tiny`). Another dataset name does not say its size: a PlotError."""
    from opsd import tiny_default

    entry = table["arms"][arm]
    name = _flag_value(entry.get("flags") or [], "--dataset_name")
    if name is None and (table.get("grid") or {}).get("preset") == "tiny":
        name = tiny_default.TINY
    if name is None or not tiny_default.is_tiny_name(name):
        raise PlotError(f"arm {arm}: its unique training problems are not known (--dataset_name {name or 'not given'}; "
                        f"only a tiny set, {tiny_default.NAME_FORMS}, says its size)")
    return tiny_default.train_rows(name)


def recipe_value(table: dict, arm: str, key: str):
    """A recipe key of an arm: its own recipe's, else the grid's; None when neither sets it."""
    own = table["arms"][arm].get("recipe") or {}
    return own[key] if key in own else ((table.get("grid") or {}).get("recipe") or {}).get(key)


def _arm_x(table: dict, arm: str, x: str) -> tuple[float | None, list | None]:
    """(the arm's x, each run's x or None where the JSON has one value for all runs)."""
    entry = table["arms"][arm]
    if x in TOKEN_X:
        per_run = entry.get(f"{x}_per_run")
        return entry.get(x), per_run if isinstance(per_run, list) else None
    if x == "unique_problems":
        return unique_problems(table, arm), None
    value = recipe_value(table, arm, x)
    return (float(value) if isinstance(value, (int, float)) else None), None


def _group_of(arm: str, pattern) -> str:
    """An arm's group: the `--group` regex's capture groups joined by `_`, or its match; an arm
    it does not match (and every arm without a regex) is a group of its own."""
    match = pattern.search(arm) if pattern is not None else None
    if not match:
        return arm
    return "_".join(g for g in match.groups() if g) if pattern.groups else match.group(0) or arm


def _group_labels(table: dict, groups: dict[str, list[str]], x: str) -> dict[str, str]:
    """{group: legend label} for groups of several arms: the group's name and the recipe keys its
    arms share that another group sets otherwise (grpo (learning_rate 0.0001, max_grad_norm 1))."""
    keys = sorted({k for arms in groups.values() for a in arms for k in (table["arms"][a].get("recipe") or {})}
                  | set((table.get("grid") or {}).get("recipe") or {}))
    shared = {}
    for group, arms in groups.items():
        values = {}
        for key in keys:
            seen = {repr(recipe_value(table, a, key)) for a in arms}
            if len(seen) == 1 and key != x:
                values[key] = recipe_value(table, arms[0], key)
        shared[group] = values
    labels = {}
    for group, arms in groups.items():
        if len(arms) < 2:
            continue
        differing = [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shared[group].items()
                     if v is not None and any(other.get(k, "absent") != v
                                              for g, other in shared.items() if g != group)]
        labels[group] = f"{group} ({', '.join(differing)})" if differing else group
    return labels


def results_points(table: dict, x: str = "sampled_tokens", group: str | None = None,
                   name: str = "grid") -> ResultsFigure:
    """The points of a results.json (`read_results`) against `x` (a RESULTS_X key): each trained,
    evaluated arm at its mean x and its `mean` accuracy, with each seed's run at its own x
    (`FIELD_per_run`, where the JSON has it) and accuracy (`per_run`); untrained arms (the
    base) as baselines. `group`: a regex naming each arm's group (default: none for tokens,
    DEFAULT_GROUP otherwise). A trained arm without the x value is left out (named); none with
    it is a PlotError naming the field."""
    import re

    if x not in RESULTS_X:
        raise PlotError(f"--x {x}: expected one of {', '.join(RESULTS_X)}")
    if group is None and x not in TOKEN_X:
        group = DEFAULT_GROUP
    try:
        pattern = re.compile(group) if group else None
    except re.error as exc:
        raise PlotError(f"--group {group!r}: not a regular expression ({exc})") from None
    arms = table["arms"]
    evaluated = {a: e for a, e in arms.items() if isinstance(e, dict) and isinstance(e.get("mean"), (int, float))}
    if not evaluated:
        raise PlotError(f"{name}: no arm has a 'mean' accuracy (no cell evaluated yet)")
    baselines, points, left_out = [], [], []
    for arm, entry in evaluated.items():
        if not entry.get("trained", True):
            baselines.append((arm, float(entry["mean"])))
            continue
        mean_x, per_run_x = _arm_x(table, arm, x)
        if not isinstance(mean_x, (int, float)):
            left_out.append(f"{arm} ({x} not recorded)")
            continue
        accuracies = [float(v) for v in entry.get("per_run") or []]
        if (per_run_x is None or len(per_run_x) != len(accuracies)
                or not all(isinstance(v, (int, float)) for v in per_run_x)):
            per_run_x = [mean_x] * len(accuracies)
        points.append(ResultsPoint(arm, _group_of(arm, pattern), float(mean_x), float(entry["mean"]),
                                   tuple((float(px), acc) for px, acc in zip(per_run_x, accuracies, strict=True))))
    if not points:
        where = "recipe" if x == "learning_rate" else "results"
        raise PlotError(f"{name}: no trained arm has {x!r} in its {where} (fields of an arm: "
                        f"{', '.join(sorted(next(iter(evaluated.values()))))})")
    groups: dict[str, list[str]] = {}
    for point in points:
        groups.setdefault(point.group, []).append(point.arm)
    metric = next((e["metric"] for e in evaluated.values() if "metric" in e), "accuracy")
    eval_data = (table.get("grid") or {}).get("eval_data") or "the eval set"
    return ResultsFigure(name, metric, eval_data, x, tuple(points), tuple(baselines),
                         _group_labels(table, groups, x), tuple(left_out))


def results_figure(data: ResultsFigure):
    """The figure of `plot_results` (not saved) and the arms drawn: each arm's mean as a large dot,
    each seed's run as a small one in its colour; a group of several arms joined by a line (in x
    order, in the legend), an arm of its own labelled beside its dot; untrained arms as dotted
    horizontal lines."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from opsd.analysis.tokens import format_tokens

    fig = Figure(figsize=(8.0, 5.0), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    groups: dict[str, list[ResultsPoint]] = {}
    for point in data.points:
        groups.setdefault(point.group, []).append(point)
    drawn = []
    for index, (group, points) in enumerate(groups.items()):
        color = f"C{index % 10}"
        points = sorted(points, key=lambda p: p.x)
        runs = [run for p in points for run in p.runs]
        ax.plot([r[0] for r in runs], [r[1] for r in runs], "o", color=color, markersize=3.5, alpha=0.55,
                markeredgewidth=0)
        if len(points) > 1:
            ax.plot([p.x for p in points], [p.accuracy for p in points], "-o", color=color, markersize=7,
                    markeredgecolor="black", markeredgewidth=0.6, linewidth=1.4, label=data.group_labels[group])
        else:
            ax.plot([points[0].x], [points[0].accuracy], "o", color=color, markersize=7, markeredgecolor="black",
                    markeredgewidth=0.6)
            ax.annotate(f"{points[0].arm} {points[0].accuracy:.2f}", (points[0].x, points[0].accuracy),
                        xytext=(7, -3), textcoords="offset points", fontsize=8, color=color)
        drawn += [p.arm for p in points]
    for name, accuracy in data.baselines:
        ax.axhline(accuracy, linestyle=":", color="0.35", linewidth=1.3, label=f"{name} (untrained): {accuracy:.2f}")
        drawn.append(name)
    # Seed dots and means in the legend, as a reader needs them once.
    ax.plot([], [], "o", color="0.5", markersize=7, markeredgecolor="black", markeredgewidth=0.6,
            label="arm: mean over its seeds")
    ax.plot([], [], "o", color="0.5", markersize=3.5, alpha=0.55, markeredgewidth=0, label="one seed's run")
    label, scale = RESULTS_X[data.x]
    ax.set_xlabel(label, fontsize=9)
    ax.set_ylabel(f"{data.metric} accuracy (%)", fontsize=9)
    values = sorted({p.x for p in data.points})
    if scale == "linear":
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: "0" if v == 0 else format_tokens(v)))
        right = max(max(r[0] for p in data.points for r in p.runs), max(values))
        ax.set_xlim(0, right * 1.25)  # room for the labels right of the dots
    else:
        ax.set_xscale("log", base=2 if scale == "log2" else 10)
        ax.xaxis.set_major_locator(FixedLocator(values))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if scale == "log2" else f"{v:g}"))
        labelled = any(len(points) == 1 for points in groups.values())  # room for a label right of the dot
        ax.set_xlim(values[0] / 1.5, values[-1] * (2.5 if labelled else 1.5))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    seeds = sorted({len(p.runs) for p in data.points})
    title = (f"{data.metric} on {data.eval_data} against {data.x.replace('_', ' ')}, grid {data.name} "
             f"({'/'.join(map(str, seeds))} seeds an arm): large dot the arm's mean, small dots its seeds' runs")
    if data.left_out:
        title += f"; not drawn: {', '.join(data.left_out)}"
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    return fig, drawn


def results_name(path) -> str:
    """A results file as a reader names its grid: GRID/results.json by its folder, a copy in
    grids/results/ by its file name."""
    file = Path(path)
    return file.resolve().parent.name if file.stem == "results" else file.stem


def plot_results(path, x: str = "sampled_tokens", out=None, group: str | None = None) -> tuple[Path, list[str]]:
    """Draw a grid's results.json against `x` into `out` (default: beside the JSON,
    NAME_X.png). Returns the PNG's path and the arms drawn."""
    table = read_results(path)  # first: a missing file is the error to report
    name = results_name(path)
    out = check_output(out if out is not None else Path(path).with_name(f"{name}_{x}.png"))
    fig, drawn = results_figure(results_points(table, x, group, name))
    _save(fig, out)
    return out, drawn


def draw_or_warn(what: str, draw, *args, **kwargs):
    """For the end of a training run or a grid, whose work is done whatever happens here:
    `draw(*args, **kwargs)`, or None after one `warning:` line on stderr."""
    try:
        return draw(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - no matplotlib, a full disk, ...: the figure is optional
        print(f"warning: {what} not drawn: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return None


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.plots") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="PNG plots of training runs (metrics.jsonl) and of a grid's "
                                                 "results.json.")
    commands = parser.add_subparsers(dest="command", required=True)
    metric = argparse.ArgumentParser(add_help=False)
    metric.add_argument("--metric", action="append", metavar="KEY",
                        help="a metrics.jsonl key (opsd/true_kl) or [OPSD kl] label (true_kl); repeat for "
                             "several panels")
    curves = commands.add_parser("curves", parents=[metric], help="one run's curves")
    curves.add_argument("run", metavar="RUN_DIR", help="a run folder (holding metrics.jsonl)")
    curves.add_argument("--out", metavar="FILE.png", help=f"default RUN_DIR/{CURVES_FILE}")
    overlay = commands.add_parser("overlay", parents=[metric], help="several runs, or the arms of a grid, overlaid")
    overlay.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run folders (holding metrics.jsonl)")
    overlay.add_argument("--grid", metavar="GRID_DIR", help="a opsd.research.grid folder: one line per arm (seed mean "
                                                            "and range) instead of RUN_DIRs")
    overlay.add_argument("--out", metavar="FILE.png", help=f"required with RUN_DIRs; default GRID_DIR/{CURVES_FILE}")
    results = commands.add_parser("results", help="a grid's arms from its results.json alone: accuracy against "
                                                  "tokens, unique problems or learning rate")
    results.add_argument("results", metavar="RESULTS.json", help="the results.json of a opsd.research.grid (or a "
                                                                 "copy in grids/results/)")
    results.add_argument("--x", choices=list(RESULTS_X), default="sampled_tokens",
                         help="where each arm is placed (default sampled_tokens)")
    results.add_argument("--group", metavar="REGEX",
                         help="arms whose names it matches alike (its capture groups joined by _, or the match) "
                              f"are one line; default: none for tokens, {DEFAULT_GROUP!r} (the name's prefix) "
                              "otherwise")
    results.add_argument("--out", metavar="FILE.png", help="default: beside RESULTS.json, NAME_X.png")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.plots") -> int:
    args = parse_args(argv, prog)
    try:
        if args.command == "results":
            out, drawn = plot_results(args.results, args.x, args.out, args.group)
        elif args.command == "curves":
            drawn = plot_run_curves(args.run, args.out, args.metric)
            out = args.out or Path(args.run) / CURVES_FILE
        elif args.grid:
            if args.runs:
                raise PlotError("give either RUN_DIRs or --grid, not both")
            drawn = overlay_grid(args.grid, args.out, args.metric)
            out = args.out or Path(args.grid) / CURVES_FILE
        else:
            if not args.runs:
                raise PlotError("overlay needs RUN_DIRs or --grid GRID_DIR")
            if not args.out:
                raise PlotError("overlay of RUN_DIRs needs --out FILE.png")
            drawn = overlay_runs(args.runs, args.out, args.metric)
            out = args.out
    except PlotError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{out}: {len(drawn)} series")
    return 0


if __name__ == "__main__":
    from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

    sys.exit(exit_status(main))
