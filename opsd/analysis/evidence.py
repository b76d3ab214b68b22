"""Claims sized to the evidence, over a opsd.research.grid folder's per-run accuracies:

    python -m opsd.analysis.stats equivalence GRID_DIR --a ARM[@STEP] --b ARM[@STEP] --margin POINTS
                                         [--alpha A] [--json OUT]
    python -m opsd.analysis.stats reach GRID_DIR --target ACCURACY [--arms ARM ...]
                                   [--ratio-to ARM] [--bootstrap N] [--seed S] [--json OUT]

`equivalence`: are two arms the same within +-margin points? A difference test that fails to
reject (Welch p = 0.5) is not evidence of equality; TOST is: two one-sided Welch t tests on the
arms' per-run accuracies (one value per training seed), H0_low: B - A <= -margin and H0_high:
B - A >= +margin (scipy.stats.ttest_ind, equal_var=False, on the shifted values). Equivalence
is shown at level alpha when both reject, i.e. when TOST p = max(p_low, p_high) < alpha, which
is the same as the (1 - 2 alpha) Welch interval of B - A lying inside (-margin, +margin). The
margin is the user's statement of "the same for our purposes" and is printed with the result;
also printed is the smallest margin these runs could show (the larger end of that interval).

`reach`: how many sampled tokens an arm needs to reach an accuracy X, given in advance
(`--target`, required: a target read off an arm's own results, e.g. its mean, moves with them,
and a seed below its own arm's mean would never reach it). Per seed, the accuracy of its swept
checkpoints (sweep.json) against the run's cumulative `tokens/sampled` at each checkpoint,
linearly interpolated; the first crossing of X is the seed's value. The grid's untrained arm
(base, 0 tokens) is the curve's origin when there is one (a target it already reaches is
refused), so a seed already above X at its first checkpoint crosses between the origin and it;
without one, such a seed's value is its first checkpoint's tokens (an upper bound, flagged). A
seed that never reaches X has no value ("not reached"). The arm's estimate is the mean over
seeds when all reach X. Its spread: with one seed none; with 2-4 seeds the seeds' range, min to
max, labelled "seed range" and never called an interval (n seeds' min-max holds the median of
their distribution, the mean of a symmetric one, with probability 1 - 2^(1 - n): 50% with 2
seeds, 75% with 3, 88% with 4); from 5 seeds a 95% percentile interval of a
hierarchical bootstrap: each resample draws the problems (one draw shared by every arm and the
origin, opsd.analysis.stats's draw), recomputes every checkpoint's accuracy on them from the
evaluation reports' per-problem counts, then draws the seeds, each drawn seed's crossing
recomputed; a resample with a drawn seed that does not reach X is not reached (so the upper
end can be "not reached" while the estimate is finite). `--ratio-to ARM` divides each arm's
value by that arm's, labelled "not reached", "0 (the reference arm not reached)" or "neither
reached" where a mean is missing; its interval (both arms with 5+ seeds) is that of the ratio
of resampled means, paired by problem.

Inputs are what opsd.research.grid writes (ARM/seed-N/{run/metrics.jsonl, sweep.json, eval.json},
read by opsd.analysis.stats.grid_table, which passes the table in; for an arm of 5+ seeds also the
reports of its swept checkpoints, ARM/seed-N/eval/, and base/eval.json, read by
opsd.analysis.reports). Bad input is one `error: ...` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The evaluation reports' reader and the problems' bootstrap draw that `compare` uses (one import each).
from opsd.analysis.reports import check_comparable, load_run, sweep_reports
from opsd.analysis.significance import _problem_weights
from opsd.analysis.tokens import format_tokens

COMMANDS = ("equivalence", "reach")
NOT_REACHED = "not reached"
NEITHER_REACHED = "neither reached"  # a ratio of two arms that both miss the target
NOT_DEFINED = "not defined"  # a ratio to an arm that reaches the target at 0 tokens
# The spread of an arm's tokens to reach: its kinds. Fewer than MIN_SEEDS_FOR_INTERVAL seeds give their
# range only, never called an interval: n seeds' min-max holds their median with probability 1 - 2^(1 - n).
ONE_SEED, SEED_RANGE, INTERVAL = "one seed", "seed range", "95% interval"
MIN_SEEDS_FOR_INTERVAL = 5


class EvidenceError(Exception):
    """Bad input for an evidence command; one line (`error: ...`, exit 2)."""


# --------------------------------------------------------------------------
# Equivalence (TOST)
# --------------------------------------------------------------------------

def tost(values_a: Sequence[float], values_b: Sequence[float], margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided Welch t tests of B - A against -margin and +margin (module docstring).

    Returns diff, se, df (Welch-Satterthwaite), p_low (H0: diff <= -margin), p_high (H0: diff
    >= +margin), p (the larger), the (1 - 2 alpha) interval of diff, the smallest margin that
    interval shows, and `equivalent` (p < alpha). EvidenceError with fewer than 2 runs in an
    arm, no spread in either, or a margin that is not > 0."""
    from scipy import stats  # only this command needs scipy

    a, b = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    if not (math.isfinite(margin) and margin > 0):
        raise EvidenceError(f"--margin must be a number of points > 0, got {margin}")
    if not 0 < alpha < 0.5:
        raise EvidenceError(f"--alpha must be in (0, 0.5), got {alpha}")
    if a.size < 2 or b.size < 2:
        raise EvidenceError(f"TOST needs >= 2 runs an arm (Welch t), got {a.size} and {b.size}")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb == 0:
        raise EvidenceError("neither arm's runs vary: a t test has no spread to work with")
    diff, se = float(b.mean() - a.mean()), math.sqrt(va + vb)
    df = float((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)))
    p_low = float(stats.ttest_ind(b + margin, a, equal_var=False, alternative="greater").pvalue)
    p_high = float(stats.ttest_ind(b - margin, a, equal_var=False, alternative="less").pvalue)
    half = float(stats.t.ppf(1 - alpha, df)) * se
    ci = [diff - half, diff + half]
    p = max(p_low, p_high)
    return {"test": "TOST (two one-sided Welch t tests)", "margin": margin, "alpha": alpha, "diff": diff, "se": se,
            "df": df, "p_low": p_low, "p_high": p_high, "p": p, "ci": ci, "ci_level": 1 - 2 * alpha,
            "smallest_margin": max(abs(ci[0]), abs(ci[1])), "equivalent": p < alpha}


# --------------------------------------------------------------------------
# Tokens to reach an accuracy
# --------------------------------------------------------------------------

def first_crossing(tokens: Sequence[float], accuracy: Sequence[float], target: float) -> float | None:
    """Tokens at which the piecewise-linear accuracy curve first reaches `target` (points in
    order of tokens); the first point's tokens when it is already there; None when never."""
    if len(tokens) != len(accuracy) or not tokens:
        raise ValueError(f"tokens ({len(tokens)}) and accuracy ({len(accuracy)}) must be equally long, not empty")
    if accuracy[0] >= target:
        return float(tokens[0])
    for t0, a0, t1, a1 in zip(tokens, accuracy, tokens[1:], accuracy[1:], strict=False):
        if a0 < target <= a1:
            return float(t0 + (target - a0) * (t1 - t0) / (a1 - a0))
    return None


def first_crossings(tokens: np.ndarray, accuracy: np.ndarray, target: float) -> np.ndarray:
    """`first_crossing` of many curves at once: tokens [..., C], accuracy [..., C] -> [...],
    inf where a curve never reaches `target`."""
    reached = accuracy >= target
    first = reached.argmax(-1)[..., None]  # the first point at or above the target (0 when none)
    before = np.maximum(first - 1, 0)
    t1, a1 = np.take_along_axis(tokens, first, -1)[..., 0], np.take_along_axis(accuracy, first, -1)[..., 0]
    t0, a0 = np.take_along_axis(tokens, before, -1)[..., 0], np.take_along_axis(accuracy, before, -1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):  # at the first point t0 = t1: no interpolation
        between = t0 + (target - a0) * (t1 - t0) / (a1 - a0)
    crossing = np.where(first[..., 0] == 0, t1, between)
    return np.where(reached.any(-1), crossing, math.inf)


def percentile_interval(draws: np.ndarray, confidence: float = 0.95) -> list[float]:
    """Percentile interval by order statistics (inf-safe: no interpolation between inf and a number)."""
    tail = (1 - confidence) / 2
    return [float(np.quantile(draws, tail, method="lower")), float(np.quantile(draws, 1 - tail, method="higher"))]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class ProblemCurves:
    """One arm's per-problem accuracies for the hierarchical bootstrap: values [seed, point, problem]
    (points in the order of its curves), and the untrained arm's [problem] (None without one)."""

    values: np.ndarray
    origin: np.ndarray | None


def seed_spread(values: Sequence[float | None]) -> dict:
    """The spread of 1-4 seeds' values: nothing for one seed, else their range (min to max; not
    reached counts as beyond every number). Never called an interval: 2-4 runs cannot give one."""
    if len(values) == 1:
        return {"kind": ONE_SEED, "low": None, "high": None}
    x = [math.inf if v is None else v for v in values]
    return {"kind": SEED_RANGE, "low": _finite_or_none(min(x)), "high": _finite_or_none(max(x))}


def resampled_reach(curves: dict[int, list[tuple[float, float]]], problems: ProblemCurves, target: float,
                    problem_weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[resample] The arm's mean tokens to reach `target` when the problems (`problem_weights`
    [resample, problem], the draw all arms share) and the seeds (drawn here) are resampled: each
    drawn seed's curve is recomputed on the drawn problems, the untrained arm's origin too; inf
    where a drawn seed does not reach the target."""
    seeds = list(curves)
    tokens = np.array([[t for t, _ in curves[s]] for s in seeds], dtype=float)  # [seed, point], problems' order
    num_problems = problem_weights.shape[1]
    accuracy = np.einsum("scp,bp->bsc", problems.values, problem_weights) / num_problems
    if problems.origin is not None:
        origin = problem_weights @ problems.origin / num_problems  # [resample]
        accuracy = np.concatenate([np.broadcast_to(origin[:, None, None], accuracy.shape[:2] + (1,)), accuracy], -1)
        tokens = np.concatenate([np.zeros((len(seeds), 1)), tokens], -1)
    crossing = first_crossings(np.broadcast_to(tokens, accuracy.shape), accuracy, target)  # [resample, seed]
    picks = rng.multinomial(len(seeds), np.full(len(seeds), 1.0 / len(seeds)), size=len(problem_weights))
    return (picks * np.where(picks > 0, crossing, 0.0)).sum(1) / len(seeds)  # a drawn seed at inf makes it inf


def reach(per_seed: dict[int, list[tuple[float, float]]], target: float, origin: float | None,
          problems: ProblemCurves | None = None, problem_weights: np.ndarray | None = None,
          rng: np.random.Generator | None = None) -> dict:
    """One arm: each seed's first crossing of `target` (curve of (tokens, accuracy) points,
    `origin` the accuracy at 0 tokens or None), the mean over seeds and its spread: the seed range
    with 2-4 seeds (`seed_spread`), a 95% hierarchical bootstrap interval over seeds and problems
    from MIN_SEEDS_FOR_INTERVAL seeds (`resampled_reach`; needs `problems`, `problem_weights` and
    `rng`). `draws` (the resampled means, None under 5 seeds) is for ratios, popped before output."""
    values, upper_bounds = {}, []
    for seed, points in per_seed.items():
        points = sorted(points)
        if origin is not None:
            points = [(0.0, origin), *points]
        tokens, accuracy = [p[0] for p in points], [p[1] for p in points]
        values[seed] = first_crossing(tokens, accuracy, target)
        if origin is None and values[seed] is not None and accuracy[0] >= target:
            upper_bounds.append(seed)
    reached = [v for v in values.values() if v is not None]
    mean = sum(reached) / len(reached) if len(reached) == len(values) else None
    draws = None
    if len(values) >= MIN_SEEDS_FOR_INTERVAL:
        draws = resampled_reach(per_seed, problems, target, problem_weights, rng)
        low, high = percentile_interval(draws)
        spread = {"kind": INTERVAL, "low": _finite_or_none(low), "high": _finite_or_none(high)}
    else:
        spread = seed_spread(list(values.values()))
    return {"per_seed": values, "reached": len(reached), "seeds": len(values), "mean": mean, "spread": spread,
            "upper_bound_seeds": upper_bounds, "draws": draws}


def ratio(b: dict, a: dict) -> dict:
    """Arm b's tokens to reach over arm a's, labelled where a mean is not reached, with the 95%
    interval of the ratio of resampled means when both arms have an interval (the resamples share
    their problem draw); "neither reached" in a resample leaves the ratio without an interval."""
    if b["mean"] is not None and a["mean"] is not None:
        value = b["mean"] / a["mean"] if a["mean"] > 0 else None
        label = NOT_DEFINED if value is None else f"{value:.2f}"
    else:
        value = None
        label = {(True, True): NEITHER_REACHED, (True, False): NOT_REACHED,
                 (False, True): "0 (the reference arm not reached)"}[(b["mean"] is None, a["mean"] is None)]
    interval, why = None, None
    if b["draws"] is None or a["draws"] is None:
        why = ONE_SEED if min(a["seeds"], b["seeds"]) == 1 else f"under {MIN_SEEDS_FOR_INTERVAL} seeds"
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = b["draws"] / a["draws"]
        if np.isnan(draws).any():  # inf / inf or 0 / 0 in a resample
            why = "neither reached in some resamples"
        else:
            interval = [_finite_or_none(v) for v in percentile_interval(draws)]
    return {"ratio": value, "label": label, "interval": interval, "no_interval": why}


# --------------------------------------------------------------------------
# A grid's arms
# --------------------------------------------------------------------------

def _arm(table: dict, name: str, grid_dir) -> dict:
    if name not in table["arms"]:
        raise EvidenceError(f"{grid_dir}: no arm {name!r} with finished cells (arms: {', '.join(table['arms'])})")
    return table["arms"][name]


def arm_point(table: dict, spec: str, grid_dir) -> tuple[str, dict]:
    """ARM or ARM@STEP -> (label, point of grid_table): the last point, or the swept step."""
    name, _, step = spec.partition("@")
    arm = _arm(table, name, grid_dir)
    if not step:
        return f"{name} @ step {arm['points'][-1]['step']}", arm["points"][-1]
    if not step.isdigit():
        raise EvidenceError(f"{spec!r}: expected ARM or ARM@STEP with STEP a whole number")
    for point in arm["points"]:
        if point["step"] == int(step):
            return f"{name} @ step {step}", point
    steps = ", ".join(str(p["step"]) for p in arm["points"])
    raise EvidenceError(f"{spec!r}: arm {name} has no checkpoint at step {step} in every seed (steps: {steps})")


def equivalence(table: dict, spec_a: str, spec_b: str, margin: float, alpha: float = 0.05, grid_dir="") -> dict:
    """TOST between two arms' points of `table` (opsd.analysis.stats.grid_table of `grid_dir`)."""
    label_a, point_a = arm_point(table, spec_a, grid_dir)
    label_b, point_b = arm_point(table, spec_b, grid_dir)
    result = tost(point_a["accuracy_per_seed"], point_b["accuracy_per_seed"], margin, alpha)
    return {"grid": table["grid"], "metric": table["metric"],
            "a": {"label": label_a, "accuracy_per_seed": point_a["accuracy_per_seed"]},
            "b": {"label": label_b, "accuracy_per_seed": point_b["accuracy_per_seed"]}, **result}


def seed_curves(arm: dict, name: str, grid_dir) -> dict[int, list[tuple[float, float]]]:
    """{seed: [(tokens, accuracy) at each point]} of a trained arm; EvidenceError where a seed
    did not record its sampled tokens."""
    curves: dict[int, list[tuple[float, float]]] = {seed: [] for seed in arm["seeds"]}
    for point in arm["points"]:
        for seed, tokens, accuracy in zip(arm["seeds"], point["sampled_tokens_per_seed"], point["accuracy_per_seed"],
                                          strict=True):
            if tokens is None:
                raise EvidenceError(f"{grid_dir}: arm {name} seed {seed} did not record tokens/sampled at step "
                                    f"{point['step']} (a run from before the key)")
            curves[seed].append((float(tokens), float(accuracy)))
    return curves


def _report(cell: Path, step: int) -> Path:
    """The evaluation report of a cell's checkpoint at `step`, as grid_table read its accuracy: the
    swept report (opsd.analysis.reports.sweep_reports), else the cell's eval.json (its last checkpoint)."""
    if not (cell / "sweep.json").is_file():
        return cell / "eval.json"
    return dict(sweep_reports(cell / "sweep.json"))[step]  # grid_table checked the step is there


def problem_curves(grid_dir, table: dict, names: Sequence[str]) -> dict[str, ProblemCurves]:
    """Per-problem accuracies (points) of each named arm's seeds at its points, and of the
    untrained arm, from the grid's evaluation reports (all of one problem set and settings:
    opsd.analysis.stats.check_comparable), for the hierarchical bootstrap."""
    grid = Path(grid_dir)
    paths = {name: [[_report(grid / name / f"seed-{seed}", point["step"]) for point in table["arms"][name]["points"]]
                    for seed in table["arms"][name]["seeds"]] for name in names}
    untrained = [n for n, a in table["arms"].items() if not a["trained"]]
    base = [grid / untrained[0] / "eval.json"] if len(untrained) == 1 else []
    flat = [p for name in names for seed in paths[name] for p in seed] + base
    runs = [load_run(p) for p in flat]
    per_problem = 100.0 * check_comparable(runs) / runs[0].k  # [report, problem], problems in one order
    out, at = {}, 0
    for name in names:
        seeds, points = len(paths[name]), len(paths[name][0])
        values = per_problem[at:at + seeds * points].reshape(seeds, points, -1)
        at += seeds * points
        out[name] = ProblemCurves(values, per_problem[-1] if base else None)
    return out


def reach_table(table: dict, target: float | None, arms: Sequence[str] | None = None, ratio_to: str | None = None,
                n_resamples: int = 10000, seed: int = 0, grid_dir="") -> dict:
    """Tokens to reach the target accuracy, fixed in advance, per trained arm of `table`
    (opsd.analysis.stats.grid_table of `grid_dir`) that samples (module docstring)."""
    if target is None:
        raise EvidenceError("--target ACCURACY is required: the accuracy to reach, in points, fixed before the "
                            "results are read")
    if not (math.isfinite(target) and 0 < target <= 100):
        raise EvidenceError(f"--target must be an accuracy in points, above 0 and at most 100, got {target}")
    untrained = [n for n, a in table["arms"].items() if not a["trained"]]
    origin = table["arms"][untrained[0]]["points"][0]["accuracy"] if len(untrained) == 1 else None
    if origin is not None and origin >= target:
        raise EvidenceError(f"--target {target:g}: the untrained arm {untrained[0]} is already at {origin:.2f}; "
                            "every arm reaches it at 0 tokens")
    names = list(arms) if arms else [n for n, a in table["arms"].items() if a["trained"]]
    if ratio_to is not None and ratio_to not in names:
        names.append(ratio_to)
    curves, skipped = {}, {}
    for name in names:
        arm = _arm(table, name, grid_dir)
        if not arm["trained"]:
            raise EvidenceError(f"arm {name} is untrained: it samples no tokens")
        curves[name] = seed_curves(arm, name, grid_dir)
        if all(t == 0 for points in curves[name].values() for t, _ in points):
            skipped[name] = "samples no tokens (reference solutions only)"
            del curves[name]
    many = [n for n, c in curves.items() if len(c) >= MIN_SEEDS_FOR_INTERVAL]
    problems = problem_curves(grid_dir, table, many) if many else {}
    rng = np.random.default_rng(seed)
    # One draw of problems for every arm: ratios stay paired by problem.
    weights = _problem_weights(rng, next(iter(problems.values())).values.shape[2], n_resamples) if many else None
    results = {name: reach(c, target, origin, problems.get(name), weights, rng) for name, c in curves.items()}
    if ratio_to is not None:
        if ratio_to in skipped:
            raise EvidenceError(f"--ratio-to {ratio_to}: that arm samples no tokens")
        for name, result in results.items():
            if name != ratio_to:
                result["ratio_to"] = ratio(result, results[ratio_to])
    for result in results.values():
        result.pop("draws")
    return {"grid": table["grid"], "metric": table["metric"], "target": target, "origin": origin,
            "n_resamples": n_resamples, "seed": seed, "ratio_to": ratio_to, "arms": results, "skipped": skipped}


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------

def _points(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def format_equivalence(r: dict) -> str:
    margin, level = r["margin"], round(100 * r["ci_level"])
    lines = [f"equivalence of two arms, grid {r['grid']} ({r['metric']}, points): {r['test']}, margin +-{margin:g}, "
             f"alpha {r['alpha']:g}"]
    for key in ("a", "b"):
        arm = r[key]
        values = arm["accuracy_per_seed"]
        lines.append(f"  {key.upper()} = {arm['label']}: {sum(values) / len(values):.2f} "
                     f"(n = {len(values)}: {_points(values)})")
    lines.append(f"  B - A = {r['diff']:+.2f}, {level}% Welch interval [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}] "
                 f"(se {r['se']:.2f}, df {r['df']:.1f})")
    lines.append(f"  p(B - A <= -{margin:g}) = {r['p_low']:.3g}, p(B - A >= +{margin:g}) = {r['p_high']:.3g}, "
                 f"TOST p = {r['p']:.3g}")
    if r["equivalent"]:
        verdict = f"equivalent within +-{margin:g} points (TOST p = {r['p']:.3g} < {r['alpha']:g})"
    else:
        verdict = (f"not shown equivalent within +-{margin:g} points (TOST p = {r['p']:.3g}): these runs cannot "
                   f"rule out a difference of {margin:g} points or more")
    lines.append(f"verdict: {verdict}; these runs would show equivalence only at a margin wider than "
                 f"+-{r['smallest_margin']:.2f}")
    return "\n".join(lines) + "\n"


def _tokens(value) -> str:
    return NOT_REACHED if value is None else format_tokens(value)


def _spread(spread: dict) -> str:
    """"- (one seed)", "seed range [a, b]" or "95% interval [a, b]"; not reached where an end is."""
    if spread["kind"] == ONE_SEED:
        return f"- ({ONE_SEED})"
    return f"{spread['kind']} [{_tokens(spread['low'])}, {_tokens(spread['high'])}]"


def _ratio_cells(q: dict | None) -> str:
    if q is None:  # the reference arm itself
        return " 1 | - |"
    if q["interval"] is None:
        return f" {q['label']} | - ({q['no_interval']}) |"
    low, high = (NOT_REACHED if v is None else f"{v:.2f}" for v in q["interval"])
    return f" {q['label']} | [{low}, {high}] |"


def format_reach(r: dict) -> str:
    origin = (f"origin: the untrained arm, {r['origin']:.2f} at 0 tokens" if r["origin"] is not None
              else "no untrained arm: a seed above the target at its first checkpoint gets that checkpoint's "
                   "tokens (an upper bound, marked *)")
    lines = [f"sampled tokens to reach {r['metric']} {r['target']:.2f} (the target given), grid {r['grid']}", "",
             f"Per seed: accuracy linearly interpolated against cumulative sampled tokens, first crossing; {origin}. "
             f"Spread over seeds: their range (min to max) with 2-{MIN_SEEDS_FOR_INTERVAL - 1} seeds, not an "
             f"interval; from {MIN_SEEDS_FOR_INTERVAL} seeds a 95% percentile interval of a hierarchical bootstrap "
             f"over seeds and problems ({r['n_resamples']} resamples, seed {r['seed']}; a resample with a seed that "
             "does not reach the target is not reached).", ""]
    header = "| arm | seeds reaching | per seed | mean | spread over seeds |"
    rule = "|---|---|---|---|---|"
    if r["ratio_to"]:
        header, rule = header + f" / {r['ratio_to']} | its 95% interval |", rule + "---|---|"
    lines += [header, rule]
    for name, a in r["arms"].items():
        seeds = ", ".join(f"{_tokens(v)}{'*' if s in a['upper_bound_seeds'] else ''}" for s, v in a["per_seed"].items())
        row = f"| {name} | {a['reached']}/{a['seeds']} | {seeds} | {_tokens(a['mean'])} | {_spread(a['spread'])} |"
        if r["ratio_to"]:
            row += _ratio_cells(a.get("ratio_to"))
        lines.append(row)
    for name, why in r["skipped"].items():
        lines.append(f"| {name} | - | {why} | - | - |" + (" - | - |" if r["ratio_to"] else ""))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Command line (subcommands of `python -m opsd.analysis.stats`)
# --------------------------------------------------------------------------

def add_commands(commands, default_bootstrap: int, min_bootstrap: int) -> None:
    """The `equivalence` and `reach` subcommands on opsd.analysis.stats's subparsers (which passes
    its bootstrap defaults, and the grid reader to `main`: this module does not import it)."""
    eq = commands.add_parser(
        "equivalence", help="TOST: are two arms the same within +-MARGIN points?",
        description="Two one-sided Welch t tests on two arms' per-run accuracies (one per training seed) of a "
                    "opsd.research.grid folder: equivalence within +-MARGIN points is shown when TOST p < alpha.")
    eq.add_argument("grid", metavar="GRID_DIR", help="a opsd.research.grid folder (ARM/seed-N/...)")
    eq.add_argument("--a", required=True, metavar="ARM[@STEP]", help="arm A (its last point, or a swept step)")
    eq.add_argument("--b", required=True, metavar="ARM[@STEP]", help="arm B")
    eq.add_argument("--margin", type=float, required=True, metavar="POINTS",
                    help="the equivalence margin in accuracy points: differences within +-MARGIN count as the same")
    eq.add_argument("--alpha", type=float, default=0.05, help="level of each one-sided test (default 0.05)")
    eq.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    rc = commands.add_parser(
        "reach", help="sampled tokens each arm needs to reach an accuracy fixed in advance",
        description="Per arm of a opsd.research.grid folder with sweeps: each seed's accuracy linearly interpolated "
                    "against its cumulative sampled tokens, first crossing of the target; mean over seeds, the "
                    f"seeds' range with 2-{MIN_SEEDS_FOR_INTERVAL - 1} seeds, a 95% hierarchical bootstrap interval "
                    f"over seeds and problems from {MIN_SEEDS_FOR_INTERVAL} ('not reached' where a seed never gets "
                    "there).")
    rc.add_argument("grid", metavar="GRID_DIR", help="a opsd.research.grid folder (ARM/seed-N/...)")
    rc.add_argument("--target", type=float, metavar="ACCURACY",
                    help="required: the accuracy to reach, in points, fixed before the results are read")
    rc.add_argument("--target-arm", help=argparse.SUPPRESS)  # removed: answered with one line (main)
    rc.add_argument("--arms", nargs="+", metavar="ARM", help="arms to estimate (default: every trained arm)")
    rc.add_argument("--ratio-to", metavar="ARM",
                    help=f"also each arm's tokens over this arm's (an interval when both have "
                         f"{MIN_SEEDS_FOR_INTERVAL}+ seeds)")
    rc.add_argument("--bootstrap", type=int, default=default_bootstrap, metavar="N",
                    help=f"bootstrap resamples (default {default_bootstrap})")
    rc.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    rc.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    rc.set_defaults(min_bootstrap=min_bootstrap)


def main(args: argparse.Namespace, read_grid: Callable[[str], dict], errors: tuple[type[Exception], ...]) -> int:
    """Run an evidence subcommand parsed by opsd.analysis.stats; `read_grid` is its grid_table, which
    raises `errors` on bad input (the reports' readers raise them too). 0, or 2 with one `error:` line."""
    try:
        if args.command == "reach" and args.target_arm is not None:
            raise EvidenceError(f"--target-arm {args.target_arm}: removed; a target read off an arm's own results "
                                "moves with them. Give the accuracy you fixed in advance: --target ACCURACY")
        if args.command == "reach" and args.bootstrap < args.min_bootstrap:
            raise EvidenceError(f"--bootstrap must be at least {args.min_bootstrap}, got {args.bootstrap}")
        table = read_grid(args.grid)
        if args.command == "equivalence":
            result = equivalence(table, args.a, args.b, args.margin, args.alpha, args.grid)
            text = format_equivalence(result)
        else:
            result = reach_table(table, args.target, args.arms, args.ratio_to, args.bootstrap, args.seed, args.grid)
            text = format_reach(result)
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            except OSError as exc:
                raise EvidenceError(f"{args.json}: cannot write it ({exc.strerror or exc})") from None
    except (EvidenceError, *errors) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0
