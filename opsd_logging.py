"""Run logging: the `[OPSD kl]` console line and `metrics.jsonl` in the run folder.

Both receive exactly the dict that goes to `report_to`, so the console, the file
and wandb/tensorboard never disagree.
"""

from __future__ import annotations

import json
import math
import os

# Metric keys the trainer records (one place, so the line and the docs agree).
KL_LINE_FIELDS = (
    ("true_kl", "opsd/true_kl"),
    ("loss_unclipped", "opsd/loss_unclipped"),
    ("clip_entries", "opsd/clipped_entry_frac"),
    ("clip_tokens", "opsd/clipped_token_frac"),
    ("argmax_clipped", "opsd/teacher_argmax_clipped_frac"),
    ("teacher_mass_removed", "opsd/clipped_teacher_mass"),
    ("H_student", "opsd/student_entropy"),
    ("H_teacher", "opsd/teacher_entropy"),
    ("nll", "opsd/nll"),
)


def kl_line(step: int, logs: dict) -> str | None:
    """One human-readable line per log, or None when no OPSD metric is in `logs`."""
    parts = []
    for label, key in KL_LINE_FIELDS:
        value = logs.get(key)
        if value is not None:
            parts.append(f"{label}={value:.4g}")
    if not parts:
        return None
    loss = logs.get("loss")
    head = f"[OPSD kl] step={step}" + (f" loss={loss:.4g}" if loss is not None else "")
    return head + " " + " ".join(parts)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN / inf
    return value


def append_metrics(path: str, step: int, logs: dict) -> None:
    """Append one JSON object per log call; each line is flushed whole."""
    record = {"step": step, **{k: _jsonable(v) for k, v in logs.items()}}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
