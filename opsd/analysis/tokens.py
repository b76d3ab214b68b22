"""Sampled tokens as an axis: how many completion tokens a run's student sampled, read from its
`metrics.jsonl`, and a grid's accuracy against them.

The trainer writes `tokens/sampled` into every `metrics.jsonl` record: the cumulative number
of completion tokens the student sampled so far in the run (all processes; 0 for a step on
reference solutions, so an SFT run stays at 0; GRPO counts all G completions of a prompt;
continued across a resume). A checkpoint at step s has sampled the value logged at step s.

Beside it, the run's compute: `tokens/forward` and `tokens/backward`, the cumulative real
tokens through the training forwards (student and teacher) and the backward (student), read by
`read_pass_tokens` the same way.

A run that does not record it (a run from before the key, or one resumed across it: its first
logged step lacks the key, so later values would miss the earlier steps' tokens) reads as
None, "not recorded", never as 0. `grid_table` puts an `opsd/research/grid.py` folder's arms on
this axis (each swept checkpoint, or the last one without a sweep), for
`python -m opsd.analysis.stats tokens` and `opsd.analysis.plots.plot_accuracy_vs_tokens`.

Standard library only at import (eval reports are read through opsd.analysis.stats when needed).
"""
from __future__ import annotations

import math
from pathlib import Path

from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE
from opsd.run_log import BACKWARD_TOKENS_KEY, FORWARD_TOKENS_KEY, SAMPLED_TOKENS_KEY

NOT_RECORDED = "not recorded"


class TokensError(Exception):
    """A malformed metrics.jsonl or grid file; one line (`error: ...`, exit 2)."""


def read_sampled_tokens(run_dir) -> dict[int, int] | None:
    """{step: cumulative sampled tokens logged at that step} of a run folder, or None when the run
    did not record them: no metrics.jsonl, or its first logged step has no `tokens/sampled`
    (an older run). A later step without the key is left out. A malformed line or value is a
    TokensError naming the file and line."""
    return read_logged_tokens(run_dir, SAMPLED_TOKENS_KEY)


def read_pass_tokens(run_dir) -> tuple[dict[int, int] | None, dict[int, int] | None]:
    """The run's compute: ({step: cumulative forward tokens}, {step: cumulative backward tokens}),
    each None when not recorded (runs from before the keys), as `read_sampled_tokens`."""
    return read_logged_tokens(run_dir, FORWARD_TOKENS_KEY), read_logged_tokens(run_dir, BACKWARD_TOKENS_KEY)


def read_logged_tokens(run_dir, key: str) -> dict[int, int] | None:
    """{step: the cumulative token count `key` logged at that step} (`read_sampled_tokens`)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    records = read_jsonl(path, TokensError)
    by_step: dict[int, int] = {}
    first_step = None
    for number, record in records:
        step = record.get("step")
        if type(step) is not int:
            raise TokensError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        first_step = step if first_step is None else min(first_step, step)
        if key not in record:
            continue
        value = record[key]
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0 or value != int(value)):
            raise TokensError(f"{path}:{number}: {key} must be a whole number >= 0, got {value!r}")
        by_step[step] = int(value)  # a step logged twice (should not happen: resume cuts the file back): the last
    if first_step is None or first_step not in by_step:
        return None
    return dict(sorted(by_step.items()))


def tokens_at(by_step: dict[int, int] | None, step: int) -> int | None:
    """The value logged at `step` (a checkpoint's), None when not recorded there."""
    return None if by_step is None else by_step.get(int(step))


def format_tokens(value) -> str:
    """1.23 M, 340 k, 12.3 k, 980, 0; None is "not recorded"."""
    if value is None:
        return NOT_RECORDED
    value = float(value)
    if abs(value) < 1000:
        return f"{value:.0f}" if value == int(value) else f"{value:.3g}"
    for scale, unit in ((1e3, "k"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = f"{value / scale:.3g}"
        if "e" not in text and abs(float(text)) < 1000:  # 999.6 k rounds to 1e+03: the next unit says 1 M
            return f"{text} {unit}"
    return f"{value:.3g}"


def mean_or_none(values) -> float | None:
    """The mean, or None when a value is None (a mean over some seeds only would mislead)."""
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


# --------------------------------------------------------------------------
# A grid's arms on the tokens axis
# --------------------------------------------------------------------------

def samples_nothing(arm: dict) -> bool:
    """A trained arm whose every point recorded 0 sampled tokens (SFT: reference solutions only)."""
    return arm["trained"] and bool(arm["points"]) and all(
        p["sampled_tokens_per_seed"] and all(t == 0 for t in p["sampled_tokens_per_seed"]) for p in arm["points"])


def format_grid_table(table: dict) -> str:
    """Per arm: step | sampled tokens | accuracy (markdown), means over the arm's seeds."""
    metric = table["metric"]
    where = "each swept checkpoint" if table["swept"] else "the last checkpoint"
    lines = [f"# {metric} against sampled tokens: grid {table['grid']}", "",
             f"{where} of each arm; sampled tokens: the cumulative `{SAMPLED_TOKENS_KEY}` of the run's "
             f"metrics.jsonl at the checkpoint's step, mean over the arm's seeds ({NOT_RECORDED}: a seed's run did "
             "not log it, e.g. a run from before the key); the untrained arm samples nothing."]
    for name, arm in table["arms"].items():
        seeds = f"{len(arm['seeds'])} seed{'s' if len(arm['seeds']) != 1 else ''}" if arm["trained"] else "untrained"
        lines += ["", f"## {name} ({seeds})", "", f"| step | sampled tokens | {metric} |", "|---|---|---|"]
        for p in arm["points"]:
            tokens = "-" if not arm["trained"] else format_tokens(p["sampled_tokens"])
            lines.append(f"| {p['step'] if arm['trained'] else '-'} | {tokens} | {p['accuracy']:.2f} |")
    return "\n".join(lines) + "\n"
