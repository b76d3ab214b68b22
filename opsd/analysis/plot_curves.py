"""One run's training curves (`python -m opsd.analysis.plots curves`, and curves.png at the end
of every run): what a run folder's metrics.jsonl holds, one panel per quantity.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opsd.analysis import plot_common as common
from opsd.analysis.plot_common import PlotError, check_output, run_name, step_axis
from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE
from opsd.run_log import KL_LINE_FIELDS

CURVES_FILE = "curves.png"  # beside metrics.jsonl (opsd_train.py) and beside results.md (opsd/research/grid.py)

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
    ("truncated completions", "share that hit the length cap", ("completions/truncated_ratio",)),
    # OPSD only (opsd.objective.EOS_STAT_KEYS): each role's log-prob of the EOS the student sampled
    ("ending here (EOS log-prob)", "log-prob of the sampled EOS", ("opsd/teacher_eos_logp", "opsd/student_eos_logp")),
    # GRPO runs only (the keys of opsd.grpo.reward_stats): is there signal in the groups?
    ("GRPO reward", "mean reward (share correct)", ("grpo/reward_mean",)),
    ("GRPO completions without signal", "share in zero-std groups", ("grpo/frac_reward_zero_std",)),
    ("learning rate", "learning rate", ("learning_rate",)),
    ("gradient norm", "gradient norm", ("grad_norm",)),
)
# y-axis label of one metric's panel (`overlay`, `curves --metric`): its CURVE_PANELS label; a key
# of no panel is labelled with its name.
Y_LABELS = {key: ylabel for _, ylabel, keys in CURVE_PANELS for key in keys}
# What a healthy run's panel looks like, one short line under each panel's title (docs/OUTPUTS.md,
# "Figures", says more). The collapse is the signature of opsd.run_log.CollapseSignature: true KL,
# student entropy and clip share climbing together.
HEALTHY = {
    "loss": "healthy: falls, then levels off",
    "true KL (teacher || student)": "healthy: falls or stays level; a climb = collapse",
    "divergence before the clip": "healthy: falls or stays level, as the true KL",
    "clip shares": "healthy: small, level or falling; a climb = collapse",
    "teacher mass removed": "healthy: near 0, level or falling",
    "entropy": "healthy: student's level or falling; a climb = collapse",
    "completion length (tokens)": "healthy: level; a steady fall = drift to short answers",
    "truncated completions": "healthy: near 0; a rise = answers run past the cap",
    "ending here (EOS log-prob)": "teacher above student: it pulls answers shorter; a widening gap = length drift",
    "GRPO reward": "healthy: rises",
    "GRPO completions without signal": "healthy: well below 1 (groups that teach)",
    "learning rate": "the recipe's schedule (recipe.env: cosine)",
    "gradient norm": "healthy: bounded, no growing spikes",
}
_PANEL_OF = {key: title for title, _, keys in CURVE_PANELS for key in keys}
_PANEL_KEYS = {title: keys for title, _, keys in CURVE_PANELS}


def metric_key(name: str) -> str:
    """The metrics.jsonl key of a metric given by key or by its `[OPSD kl]` label."""
    return LABEL_TO_KEY.get(name, name)


def metric_label(key: str) -> str:
    return KEY_TO_LABEL.get(key, key)


# Panel titles a reader without the README understands: a CURVE_PANELS title where the panel
# draws that key alone, else these words, else the `[OPSD kl]` label.
_READABLE = {LABEL_TO_KEY["H_student"]: "student entropy", LABEL_TO_KEY["H_teacher"]: "teacher entropy",
             "completions/mean_length": "mean completion length", "completions/max_length": "longest completion"}


def panel_title(key: str) -> str:
    own = [title for title, _, keys in CURVE_PANELS if keys == (key,)]
    return own[0] if own else _READABLE.get(key, metric_label(key))


def y_label(key: str) -> str:
    return Y_LABELS.get(key, metric_label(key))


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


def logged_keys(records: Sequence[dict]) -> list[str]:
    return sorted({k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))})


def no_metric(name: str, where: str, records: Sequence[dict]) -> PlotError:
    known = logged_keys(records)
    shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return PlotError(f"metric {name!r} is not in {where} (logged: {shown or 'nothing'})")


# A default panel's series is left out of a run's curves.png when it carries no information for
# this run; the figure's footer names it with its value instead. Decided from the data:
ZERO_ATOL = 1e-12   # all 0: every |value| at most this
FLAT_RTOL = 1e-3    # constant: over 2 steps or more, max - min at most this share of the largest |value|
REPEAT_RTOL = 1e-4  # a repeat of a series drawn before it: the same steps, and every difference at
#                     most this share of the largest |value| of the two


@dataclass(frozen=True)
class RunPanel:
    """One panel of a run's curves.png: its metrics.jsonl keys and the healthy-run note."""
    title: str
    ylabel: str
    keys: tuple[str, ...]
    note: str = ""


def no_information(steps: Sequence[int], values: Sequence[float]) -> str | None:
    """Why a series says nothing beyond one number ("all 0", "constant at 0.0002"), else None."""
    if all(abs(v) <= ZERO_ATOL for v in values):
        return "all 0"
    if len(steps) >= 2 and max(values) - min(values) <= FLAT_RTOL * max(abs(v) for v in values):
        return f"constant at {values[0]:.3g}"
    return None


def repeats(a: tuple[Sequence[int], Sequence[float]], b: tuple[Sequence[int], Sequence[float]]) -> bool:
    """Series `a` equals series `b` (steps, values) within REPEAT_RTOL."""
    if list(a[0]) != list(b[0]):
        return False
    scale = max(abs(v) for v in (*a[1], *b[1]))
    return all(abs(x - y) <= REPEAT_RTOL * scale for x, y in zip(a[1], b[1], strict=True))


def series_name(key: str) -> str:
    """A series as the footer names it: its panel's title where it is drawn alone, else its label."""
    title = _PANEL_OF.get(key)
    return title if title is not None and _PANEL_KEYS[title] == (key,) else metric_label(key)


def run_panels(records: Sequence[dict]) -> tuple[list[RunPanel], list[str]]:
    """The default panels of a run (CURVE_PANELS, the keys it logged) and what was left out as
    carrying no information ("learning rate: constant at 0.0002"), in panel order: a series all 0
    or constant (`no_information`), or repeating a series drawn before it (`repeats`). When that
    would leave nothing, every logged series is drawn."""
    logged = [(title, ylabel, tuple(k for k in keys if series(records, k)[0])) for title, ylabel, keys in CURVE_PANELS]
    logged = [RunPanel(title, ylabel, keys, HEALTHY.get(title, "")) for title, ylabel, keys in logged if keys]
    drawn: list[tuple[str, tuple]] = []  # (key, its series) kept so far
    panels, left_out = [], []
    for panel in logged:
        keys = []
        for key in panel.keys:
            points = series(records, key)
            why = no_information(*points)
            twin = None if why else next((k for k, other in drawn if repeats(points, other)), None)
            if why or twin:
                left_out.append(f"{series_name(key)}: {why or 'equals ' + series_name(twin)}")
                continue
            drawn.append((key, points))
            keys.append(key)
        if keys:
            panels.append(RunPanel(panel.title, panel.ylabel, tuple(keys), panel.note))
    return (panels, left_out) if panels else (logged, [])


def plot_run_curves(run_dir, out=None, metrics: Sequence[str] | None = None) -> list[str]:
    """Draw one run's curves into `out` (default RUN_DIR/curves.png). With `metrics`, one
    panel each (all must be logged); without, the `run_panels` of the run, each with its
    healthy-run note, and a footer naming what was left out. Returns the metrics.jsonl keys
    drawn, in panel order."""
    records = read_metrics(run_dir)  # first: a missing run folder is the error to report
    out = check_output(out if out is not None else Path(run_dir) / CURVES_FILE)
    where = str(Path(run_dir) / METRICS_FILE)
    left_out: list[str] = []
    if metrics:
        panels = []
        for name in metrics:
            key = metric_key(name)
            if not series(records, key)[0]:
                raise no_metric(name, where, records)
            panels.append(RunPanel(metric_label(key), y_label(key), (key,), healthy_note(key)))
    else:
        panels, left_out = run_panels(records)
        if not panels:
            raise PlotError(f"{where}: none of the curve metrics is in it (logged: "
                            f"{', '.join(logged_keys(records)) or 'nothing'})")
    fig, axes = common.new_figure(len(panels))
    drawn = []
    for ax, panel in zip(axes, panels, strict=False):
        for key in panel.keys:
            steps, values = series(records, key)
            ax.plot(steps, values, label=metric_label(key).split("/")[-1], marker="." if len(steps) <= 30 else None)
            drawn.append(key)
        common.panel_heading(ax, panel.title, panel.note)
        step_axis(ax)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(_PANEL_KEYS.get(panel.title, panel.keys)) > 1:  # also one share left of three: which one
            ax.legend(fontsize=8)
    fig.suptitle(f"training curves of run {run_name(run_dir)}", fontsize=11)
    if left_out:
        width = int(fig.get_figwidth() * 72 / 4.8)  # characters of 8-point type across the figure
        fig.supxlabel(textwrap.fill("not drawn, no information for this run: " + "; ".join(left_out), width),
                      fontsize=8, color="0.3")
    common.save_png(fig, out)
    return drawn


def healthy_note(key: str) -> str:
    """The healthy-run note of the panel that draws `key` (empty for a key of no panel)."""
    return HEALTHY.get(_PANEL_OF.get(key, ""), "")
