"""One run's training curves (`python -m opsd.analysis.plots curves`, and curves.png at the end
of every run): what a run folder's metrics.jsonl holds, one panel per quantity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
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
    # GRPO runs only (the keys of opsd.grpo.reward_stats): is there signal in the groups?
    ("GRPO reward", "mean reward (share correct)", ("grpo/reward_mean",)),
    ("GRPO completions without signal", "share in zero-std groups", ("grpo/frac_reward_zero_std",)),
    ("learning rate", "learning rate", ("learning_rate",)),
    ("gradient norm", "gradient norm", ("grad_norm",)),
)
# y-axis label of one metric's panel (`overlay`, `curves --metric`): its CURVE_PANELS label; a key
# of no panel is labelled with its name.
Y_LABELS = {key: ylabel for _, ylabel, keys in CURVE_PANELS for key in keys}

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
                raise no_metric(name, where, records)
            panels.append((metric_label(key), y_label(key), (key,)))
    else:
        panels = [(title, ylabel, tuple(k for k in keys if series(records, k)[0]))
                  for title, ylabel, keys in CURVE_PANELS]
        panels = [(title, ylabel, keys) for title, ylabel, keys in panels if keys]
        if not panels:
            raise PlotError(f"{where}: none of the curve metrics is in it (logged: "
                            f"{', '.join(logged_keys(records)) or 'nothing'})")
    fig, axes = common.new_figure(len(panels))
    drawn = []
    for ax, (title, ylabel, keys) in zip(axes, panels, strict=False):
        for key in keys:
            steps, values = series(records, key)
            ax.plot(steps, values, label=metric_label(key).split("/")[-1], marker="." if len(steps) <= 30 else None)
            drawn.append(key)
        ax.set_title(title, fontsize=10)
        step_axis(ax)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"training curves of run {run_name(run_dir)}", fontsize=11)
    common.save_png(fig, out)
    return drawn

