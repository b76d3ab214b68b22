"""Run logging: the `[OPSD kl]` console line and `metrics.jsonl` in the run folder.

Both receive exactly the dict that goes to `report_to`, so the console, the file
and wandb/tensorboard never disagree. Also the collapse warning's signature
(`CollapseSignature`, `CollapseDetector`: pure, no model), which the trainer checks
at every logged step (opsd.callbacks.CollapseWatch).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass

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


def print_line(line: str, file=None) -> None:
    """One console line of the run (`[OPSD kl]`, `[OPSD warn]`) on a line of its own, whatever
    tqdm progress bars (the trainer's) are drawn on stdout or stderr. A bar on a terminal is
    cleared, the line written and flushed, the bar redrawn below it (tqdm.write's way, with the
    flush before the redraw). A bar on a file or pipe (`train_capped.sh > log 2>&1`) cannot be
    cleared: a carriage return there leaves the bar's text at the start of the log's line, so
    the bar's line is ended with a newline instead and the bar goes on below the line."""
    out = sys.stdout if file is None else file
    try:
        from tqdm import tqdm  # every tqdm class (tqdm.auto's too) registers its bars here
    except ImportError:  # no bars without tqdm
        out.write(line + "\n")
        out.flush()
        return
    with tqdm.get_lock():
        bars = [bar for bar in list(tqdm._instances)
                if not bar.disable and hasattr(bar, "start_t") and _on_console(bar.fp, out)]
        cleared = []
        for bar in bars:
            if _is_terminal(bar.fp):
                bar.clear(nolock=True)
                cleared.append(bar)
            else:
                bar.fp.write("\n")
                bar.fp.flush()
        out.write(line + "\n")
        out.flush()
        for bar in cleared:
            bar.refresh(nolock=True)


def _on_console(stream, out) -> bool:
    """Whether a bar's stream shares the screen or log with `out` (as tqdm.write decides)."""
    return stream == out or (stream in (sys.stdout, sys.stderr) and out in (sys.stdout, sys.stderr))


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


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


# --------------------------------------------------------------------------
# The collapse warning (OPSD_EXPERIMENTS.md, "The collapse warning")
# --------------------------------------------------------------------------

COLLAPSE_FIELD = "opsd/collapse_warning"  # 1 in the metrics.jsonl row of the step where it fired
KL_KEY, ENTROPY_KEY = "opsd/true_kl", "opsd/student_entropy"
# The student's sampled completion tokens so far in the run, all processes (0 while it samples
# none: SFT, off-policy steps); every metrics.jsonl record of a run that samples has it.
SAMPLED_TOKENS_KEY = "tokens/sampled"
# Compute beside it, cumulative over the run (all processes): real (unpadded) tokens through the
# training forwards, every role (student, teacher), and through the backward (the student).
FORWARD_TOKENS_KEY = "tokens/forward"
BACKWARD_TOKENS_KEY = "tokens/backward"
# The clip share that climbs in a collapse: the teacher's argmax entry clipped (entry clip), the
# token clipped (token clip; the entry clip's argmax share is 0 there by construction).
COLLAPSE_SHARE_KEYS = {"entry": "opsd/teacher_argmax_clipped_frac", "token": "opsd/clipped_token_frac"}


@dataclass(frozen=True)
class CollapseSignature:
    """When a run looks like the recorded collapses: over the last `window` logged steps, the mean
    true KL is at least `kl_factor` x, the mean student entropy at least `entropy_factor` x and the
    mean clip share at least `share_factor` x their early level (and above 0), the mean of
    the first `early_steps` logged steps. Checked once `early_steps + window` steps are logged (the
    two windows never overlap). The factors sit between the collapsed and the healthy runs of
    OPSD_EXPERIMENTS.md (the tables there, steps 1-5 -> 96-100): collapsed true KL x2.1 to x3.6,
    entropy x1.17 to x5.6, share x2.1 to x3.4; healthy runs with a rising true KL (left padding
    x1.6, SFT x2.1) have a falling share or none, and healthy OPSD runs a falling entropy."""
    early_steps: int = 5
    window: int = 5
    kl_factor: float = 1.8
    entropy_factor: float = 1.05
    share_factor: float = 1.5


COLLAPSE_SIGNATURE = CollapseSignature()


def _mean(values) -> float:
    return sum(values) / len(values)


def collapse_evidence(records, share_key: str, signature: CollapseSignature = COLLAPSE_SIGNATURE) -> dict | None:
    """The signature on `records` (metrics.jsonl rows in step order, ending at the step checked):
    the evidence (early and trailing means and their ratios) when it holds, else None. Rows
    without all three metrics (an SFT or Tinker run logs no clip share) are not counted."""
    keys = (KL_KEY, ENTROPY_KEY, share_key)
    rows = [r for r in records if all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in keys)]
    if len(rows) < signature.early_steps + signature.window:
        return None
    early, trail = rows[:signature.early_steps], rows[-signature.window:]
    evidence = {"step": trail[-1].get("step"), "share_key": share_key,
                "early_steps": [early[0].get("step"), early[-1].get("step")],
                "window_steps": [trail[0].get("step"), trail[-1].get("step")]}
    factors = {KL_KEY: signature.kl_factor, ENTROPY_KEY: signature.entropy_factor, share_key: signature.share_factor}
    for key, factor in factors.items():
        before, now = _mean([r[key] for r in early]), _mean([r[key] for r in trail])
        if not (now >= factor * before and now > 0):  # a share of 0 (nothing clipped) never counts
            return None
        evidence[key] = {"early": before, "window": now, "ratio": now / before if before > 0 else math.inf}
    return evidence


class CollapseDetector:
    """Feeds `collapse_evidence` one logged step at a time; `update` returns the evidence the
    first time the signature holds and None at every other step (one warning per run)."""

    def __init__(self, share_key: str, signature: CollapseSignature = COLLAPSE_SIGNATURE):
        self.share_key, self.signature = share_key, signature
        self.records: list[dict] = []
        self.fired: dict | None = None

    def update(self, step: int, logs: dict) -> dict | None:
        if self.fired is not None:
            return None
        self.records.append({"step": step, **logs})
        if logs.get(COLLAPSE_FIELD):  # replayed from a resumed run that already warned
            self.fired = {"step": step, "replayed": True}
            return None
        self.fired = collapse_evidence(self.records, self.share_key, self.signature)
        return self.fired


def collapse_line(evidence: dict) -> str:
    """The one `[OPSD warn]` line."""
    share = evidence["share_key"]
    labels = ((KL_KEY, "true_kl", ".3g"), (ENTROPY_KEY, "H_student", ".3g"),
              (share, share.split("/")[-1], ".1%"))
    parts = [f"{label} {evidence[key]['early']:{spec}} -> {evidence[key]['window']:{spec}} "
             f"(x{evidence[key]['ratio']:.2g})" for key, label, spec in labels]
    (e0, e1), (w0, w1) = evidence["early_steps"], evidence["window_steps"]
    return (f"[OPSD warn] step={evidence['step']} collapse signature: {', '.join(parts)} "
            f"(steps {w0}-{w1} vs {e0}-{e1}); the run goes on - check its accuracy per checkpoint "
            f"(bash dev_eval.sh RUN_FOLDER) and OPSD_EXPERIMENTS.md")
