"""Claims sized to the evidence, over a opsd.research.grid folder's per-run accuracies:

    python -m opsd.analysis.stats equivalence GRID_DIR --a ARM[@STEP] --b ARM[@STEP] --margin POINTS
                                         [--alpha A] [--json OUT]
    python -m opsd.analysis.stats reach GRID_DIR (--target ACCURACY | --target-arm ARM) [--arms ARM ...]
                                   [--ratio-to ARM] [--bootstrap N] [--seed S] [--json OUT]

`equivalence`: are two arms the same within +-margin points? A difference test that fails to
reject (Welch p = 0.5) is not evidence of equality; TOST is: two one-sided Welch t tests on the
arms' per-run accuracies (one value per training seed), H0_low: B - A <= -margin and H0_high:
B - A >= +margin (scipy.stats.ttest_ind, equal_var=False, on the shifted values). Equivalence
is shown at level alpha when both reject, i.e. when TOST p = max(p_low, p_high) < alpha, which
is the same as the (1 - 2 alpha) Welch interval of B - A lying inside (-margin, +margin). The
margin is the user's statement of "the same for our purposes" and is printed with the result;
also printed is the smallest margin these runs could show (the larger end of that interval).

`reach`: how many sampled tokens an arm needs to reach an accuracy X. Per seed, the accuracy
of its swept checkpoints (sweep.json) against the run's cumulative `tokens/sampled` at each
checkpoint, linearly interpolated; the first crossing of X is the seed's value. The grid's
untrained arm (base, 0 tokens) is the curve's origin when there is one, so a seed already
above X at its first checkpoint crosses between the origin and it; without one, such a seed's
value is its first checkpoint's tokens (an upper bound, flagged). A seed that never reaches X
has no value ("not reached"). The arm's estimate is the mean over seeds when all reach X;
its interval is a percentile bootstrap over seeds, a resample with a seed that did not reach
X counting as not reached (so the upper end can be "not reached" while the estimate is
finite). With 3 seeds the bootstrap has 10 distinct means: a coarse interval, narrower than
the truth (the run-to-run spread of 3 runs is resampled as if it were the population's).
`--ratio-to ARM` divides each arm's value by that arm's, resampled independently per arm.
`--target-arm ARM` takes X = that arm's mean accuracy at its last point.

Inputs are what opsd.research.grid writes (ARM/seed-N/{run/metrics.jsonl, sweep.json, eval.json},
read by opsd.analysis.stats.grid_table, which passes the table in). Bad input is one `error: ...` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from opsd.analysis.tokens import format_tokens

COMMANDS = ("equivalence", "reach")
NOT_REACHED = "not reached"


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


def bootstrap_means(values: Sequence[float | None], n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of `n_resamples` resamples of the seeds with replacement; None (not reached) is inf."""
    x = np.array([math.inf if v is None else v for v in values], dtype=float)
    picks = x[rng.integers(0, x.size, size=(n_resamples, x.size))]
    return picks.mean(axis=1)  # a resample holding inf stays inf (not reached)


def percentile_interval(draws: np.ndarray, confidence: float = 0.95) -> list[float]:
    """Percentile interval by order statistics (inf-safe: no interpolation between inf and a number)."""
    tail = (1 - confidence) / 2
    return [float(np.quantile(draws, tail, method="lower")), float(np.quantile(draws, 1 - tail, method="higher"))]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def reach(per_seed: dict[int, list[tuple[float, float]]], target: float, origin: float | None,
          n_resamples: int, rng: np.random.Generator) -> dict:
    """One arm: each seed's first crossing of `target` (curve of (tokens, accuracy) points,
    `origin` the accuracy at 0 tokens or None), the mean over seeds and its bootstrap interval
    (None with one seed). `draws` (the resampled means) is returned for ratios and popped
    before output."""
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
    draws = bootstrap_means(list(values.values()), n_resamples, rng) if len(values) > 1 else None
    interval = None if draws is None else [_finite_or_none(v) for v in percentile_interval(draws)]
    return {"per_seed": values, "reached": len(reached), "seeds": len(values), "mean": mean, "interval": interval,
            "upper_bound_seeds": upper_bounds, "draws": draws}


def ratio(b: dict, a: dict) -> dict:
    """Arm b's tokens to reach over arm a's, with the interval of the ratio of resampled means
    (independent resamples per arm; not reached is inf, so a ratio can be inf or undefined)."""
    value = None if b["mean"] is None or a["mean"] is None or a["mean"] == 0 else b["mean"] / a["mean"]
    interval = None
    if b["draws"] is not None and a["draws"] is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = b["draws"] / a["draws"]
        if not np.isnan(draws).any():
            interval = [_finite_or_none(v) for v in percentile_interval(draws)]
    return {"ratio": value, "interval": interval}


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


def reach_table(table: dict, target: float | None = None, target_arm: str | None = None,
                arms: Sequence[str] | None = None, ratio_to: str | None = None,
                n_resamples: int = 10000, seed: int = 0, grid_dir="") -> dict:
    """Tokens to reach the target accuracy, per trained arm of `table` (opsd.analysis.stats.grid_table
    of `grid_dir`) that samples (module docstring)."""
    if (target is None) == (target_arm is None):
        raise EvidenceError("give one of --target ACCURACY and --target-arm ARM")
    if target_arm is not None:
        target = _arm(table, target_arm, grid_dir)["points"][-1]["accuracy"]
    if not math.isfinite(target):
        raise EvidenceError(f"--target must be a number, got {target}")
    untrained = [a for a in table["arms"].values() if not a["trained"]]
    origin = untrained[0]["points"][0]["accuracy"] if len(untrained) == 1 else None
    names = list(arms) if arms else [n for n, a in table["arms"].items() if a["trained"]]
    if ratio_to is not None and ratio_to not in names:
        names.append(ratio_to)
    rng = np.random.default_rng(seed)
    results, skipped = {}, {}
    for name in names:
        arm = _arm(table, name, grid_dir)
        if not arm["trained"]:
            raise EvidenceError(f"arm {name} is untrained: it samples no tokens")
        curves = seed_curves(arm, name, grid_dir)
        if all(t == 0 for points in curves.values() for t, _ in points):
            skipped[name] = "samples no tokens (reference solutions only)"
            continue
        results[name] = reach(curves, target, origin, n_resamples, rng)
    if ratio_to is not None:
        if ratio_to in skipped:
            raise EvidenceError(f"--ratio-to {ratio_to}: that arm samples no tokens")
        for name, result in results.items():
            if name != ratio_to:
                result["ratio_to"] = ratio(result, results[ratio_to])
    for result in results.values():
        result.pop("draws")
    return {"grid": table["grid"], "metric": table["metric"], "target": target, "target_arm": target_arm,
            "origin": origin, "n_resamples": n_resamples, "seed": seed, "ratio_to": ratio_to,
            "arms": results, "skipped": skipped}


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


def _interval(interval, fmt) -> str:
    if interval is None:
        return "- (one seed)"
    low, high = interval
    return f"[{fmt(low) if low is not None else NOT_REACHED}, {fmt(high) if high is not None else NOT_REACHED}]"


def format_reach(r: dict) -> str:
    target = f"{r['target']:.2f}" + (f" ({r['target_arm']}'s last point)" if r["target_arm"] else "")
    origin = (f"origin: the untrained arm, {r['origin']:.2f} at 0 tokens" if r["origin"] is not None
              else "no untrained arm: a seed above the target at its first checkpoint gets that checkpoint's "
                   "tokens (an upper bound, marked *)")
    lines = [f"sampled tokens to reach {r['metric']} {target}, grid {r['grid']}", "",
             f"Per seed: accuracy linearly interpolated against cumulative sampled tokens, first crossing; {origin}. "
             f"Interval: 95% percentile bootstrap over seeds ({r['n_resamples']} resamples, seed {r['seed']}; a "
             "resample with a seed that did not reach the target is not reached).", ""]
    header = "| arm | seeds reaching | per seed | mean | 95% interval |"
    rule = "|---|---|---|---|---|"
    if r["ratio_to"]:
        header, rule = header + f" / {r['ratio_to']} | 95% interval |", rule + "---|---|"
    lines += [header, rule]
    for name, a in r["arms"].items():
        seeds = ", ".join(f"{_tokens(v)}{'*' if s in a['upper_bound_seeds'] else ''}" for s, v in a["per_seed"].items())
        row = (f"| {name} | {a['reached']}/{a['seeds']} | {seeds} | {_tokens(a['mean'])} | "
               f"{_interval(a['interval'], _tokens)} |")
        if r["ratio_to"]:
            q = a.get("ratio_to")
            row += (" 1 | - |" if q is None else
                    f" {'-' if q['ratio'] is None else format(q['ratio'], '.2f')} | "
                    f"{_interval(q['interval'], lambda v: format(v, '.2f'))} |")
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
        "reach", help="sampled tokens each arm needs to reach an accuracy, with a bootstrap interval over seeds",
        description="Per arm of a opsd.research.grid folder with sweeps: each seed's accuracy linearly interpolated "
                    "against its cumulative sampled tokens, first crossing of the target; mean over seeds and a "
                    "percentile bootstrap interval over seeds ('not reached' where a seed never gets there).")
    rc.add_argument("grid", metavar="GRID_DIR", help="a opsd.research.grid folder (ARM/seed-N/...)")
    target = rc.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", type=float, metavar="ACCURACY", help="the accuracy to reach, in points")
    target.add_argument("--target-arm", metavar="ARM", help="the target is this arm's mean accuracy at its last point")
    rc.add_argument("--arms", nargs="+", metavar="ARM", help="arms to estimate (default: every trained arm)")
    rc.add_argument("--ratio-to", metavar="ARM", help="also each arm's tokens over this arm's, with an interval")
    rc.add_argument("--bootstrap", type=int, default=default_bootstrap, metavar="N",
                    help=f"bootstrap resamples (default {default_bootstrap})")
    rc.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    rc.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    rc.set_defaults(min_bootstrap=min_bootstrap)


def main(args: argparse.Namespace, read_grid: Callable[[str], dict], errors: tuple[type[Exception], ...]) -> int:
    """Run an evidence subcommand parsed by opsd.analysis.stats; `read_grid` is its grid_table, which
    raises `errors` on bad input. 0, or 2 with one `error:` line."""
    try:
        if args.command == "reach" and args.bootstrap < args.min_bootstrap:
            raise EvidenceError(f"--bootstrap must be at least {args.min_bootstrap}, got {args.bootstrap}")
        table = read_grid(args.grid)
        if args.command == "equivalence":
            result = equivalence(table, args.a, args.b, args.margin, args.alpha, args.grid)
            text = format_equivalence(result)
        else:
            result = reach_table(table, args.target, args.target_arm, args.arms, args.ratio_to,
                                 args.bootstrap, args.seed, args.grid)
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
