"""Statistics for comparing evaluation runs: is arm B better than arm A, or is it noise?

    python -m opsd.analysis.stats summary RUN.json [RUN2.json ...]            [--bootstrap N] [--seed S] [--json OUT]
                                                                    [--plot FILE.png]
    python -m opsd.analysis.stats compare --a A1.json [A2.json ...] --b B1.json [B2.json ...]
                                [--bootstrap N] [--seed S] [--run-sd SD] [--json OUT] [--plot FILE.png]
    python -m opsd.analysis.stats tokens GRID_DIR [--json OUT] [--plot FILE.png]
    python -m opsd.analysis.stats equivalence GRID_DIR --a ARM[@STEP] --b ARM[@STEP] --margin POINTS
        (opsd.analysis.evidence)
    python -m opsd.analysis.stats reach GRID_DIR --target X [--ratio-to ARM]
        (opsd.analysis.evidence)

`tokens` puts a grid's arms (a opsd.research.grid folder) on the sampled-tokens axis
(opsd.analysis.tokens): per arm, step | sampled tokens | accuracy, the means over its seeds at each
swept checkpoint (or the last one without `sweep_every`); sampled tokens are the runs' cumulative
`tokens/sampled` (metrics.jsonl) at the checkpoint's step, "not recorded" for a run that did not
log it. `--plot` draws accuracy against sampled tokens (opsd.analysis.plots.plot_accuracy_vs_tokens).

`sweep_checkpoints` (with `format_sweep_markdown`, `sweep_final_line`) tabulates the
checkpoints of one run against its last one, for `dev_eval.sh RUN_FOLDER` (opsd/evaluation/sweep.py).

`--plot` draws the printed numbers (opsd.analysis.plots): each arm's run means with its mean and
t interval, and the difference with each of its intervals (`compare`); each run with its
problems CI, and the arm's mean with its t and bootstrap intervals (`summary`).

Inputs are the reports the evaluation (`python -m opsd.evaluation`, dev_eval.sh) writes (`eval_<name>.json`).
One file is one
training run of an arm (one training seed); give several per arm. All files must
share the dataset, the frozen settings block and the problem set, else the tool
prints one line `error: FILE: ...` on stderr and exits with status 2. Numbers are
avg@k in percentage points, recomputed from the per-sample `correct` flags.

Where the noise comes from, and which number sees which part of it
-------------------------------------------------------------------
An avg@k moves for three reasons: (1) evaluation sampling: re-evaluating the
same checkpoint with another sampling seed gives other completions; (2) training:
retraining the arm with another seed gives another checkpoint; (3) the problem
set: 30 AIME problems are a small draw from "problems like these".

* sampling se (one run): the standard error of that run's avg@k from (1) alone,
  problems and checkpoint fixed: sqrt(sum_i p_i (1 - p_i) / (k - 1)) / P, where p_i
  is the share of the k samples of problem i that are correct (unbiased for the
  binomial variance p_i (1 - p_i) / k of each problem's accuracy).
* problems 95% CI (one run): percentile bootstrap over problems, (1) + (3).
* sd / se / 95% CI across runs: spread of the runs' avg@k, (1) + (2) on these
  problems; the CI is a Student-t interval for the arm's mean over training seeds.
* runs+problems 95% CI: the hierarchical bootstrap below, (1) + (2) + (3).

compare: the difference of means B - A, in points, with
1. a hierarchical bootstrap CI. Each of `--bootstrap` resamples draws P problems
   with replacement (ONE draw shared by both arms: the comparison stays paired by
   problem), then, independently in each arm, that arm's R runs with replacement;
   an arm's resampled mean is the average of its per-problem accuracies over the
   drawn runs x drawn problems; the resampled difference is B - A. The 95% CI is
   the 2.5th and 97.5th percentile (percentile bootstrap). An arm with one run has
   nothing to resample at the run level: its training-seed noise is then missing.
   Caveats: resampling only 2-4 runs understates run-to-run variance (by a factor
   (R-1)/R) and is coarse, so the verdict also requires the t test below; sampling
   noise enters through both levels, which errs on the wide side (on simulated
   arms with a known effect the tests see it covered in nearly all data sets).
   Problems are put in one canonical order (sorted by text and gold answer) first,
   so the numbers do not depend on the order of problems inside the files.
2. a run-level t test on the run means: Welch's t (unequal variances,
   Welch-Satterthwaite df) when both arms have >= 2 runs; when one arm has a single
   run and the other >= 2, a t test that assumes the single run has the other
   arm's run-to-run sd: t = d / (s * sqrt(1 + 1/R)), df = R - 1. The p-value comes
   from the Student-t distribution (`scipy.stats.t`). Not available for 1 vs 1.
3. per-problem paired tests, on each problem's mean accuracy over an arm's runs:
   an exact sign test (problems where B beats A vs where A beats B, ties dropped)
   and an exact sign-flip permutation test of the summed per-problem differences
   (all 2^m sign patterns of the m untied problems, counted by convolution). These condition on the runs
   given: they see evaluation-sampling noise, not training-seed noise, so they can
   say "these checkpoints differ" but never "these arms differ".
4. optionally `--run-sd SD`, an assumed per-run sd from elsewhere (e.g. the 1.48 of
   the retrained anchor, docs/SPEC.md §7): a normal interval d +- 1.96 SD sqrt(1/R_A + 1/R_B).

The verdict calls a difference real only when the bootstrap CI excludes 0 AND the
run-level test gives p < 0.05; if only one does, it says "inconclusive". With 1 vs
1 runs it never claims an arm difference (unless `--run-sd` is given, and then it
says the noise level was assumed).

The statistics are pure functions on numbers and arrays (no files); the file
handling and the command line sit at the bottom. Standard library and numpy only (with
`--plot`, matplotlib through opsd.analysis.plots).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from opsd.analysis.tokens import (
    TokensError,
    format_grid_table,
    mean_or_none,
    read_sampled_tokens,
    tokens_at,
)
from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE

CONFIDENCE = 0.95
ALPHA = 0.05
# One resample count for every comparison, so that `compare` and opsd.research.grid print the same
# interval for the same reports (both state it).
DEFAULT_BOOTSTRAP = 10000
MIN_BOOTSTRAP = 100
# Printed with every verdict: the two claims a comparison can make, which newcomers conflate.
CHECKPOINTS_VS_ARMS = ("two checkpoints differ: these trained models score differently on these problems, beyond "
                       "the noise of re-sampling their answers; two arms differ: retraining each arm with other "
                       "seeds keeps the gap, which only several training seeds per arm can show")


# --------------------------------------------------------------------------
# 1. The Student-t distribution (scipy.stats.t)
# --------------------------------------------------------------------------

def _student_t():
    """scipy.stats.t, imported when a t is first needed: scipy.stats takes most of a second to
    import, which callers that want this module's constants or tables alone (opsd.research.grid's
    final lines, `opsd stats tokens`) need not pay."""
    from scipy.stats import t

    return t


def _check_df(df: float) -> None:
    if not df > 0:  # scipy answers nan for df <= 0; a caller's bug here must not become a p of nan
        raise ValueError(f"df must be > 0, got {df}")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` > 0 degrees of freedom (df may be
    fractional, as Welch's is; df = inf is the standard normal)."""
    _check_df(df)
    return float(_student_t().cdf(t, df))


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|)."""
    _check_df(df)
    return min(1.0, 2.0 * float(_student_t().sf(abs(t), df)))


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (inverse of t_cdf)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    _check_df(df)
    return float(_student_t().ppf(q, df))


# --------------------------------------------------------------------------
# 2. One arm: descriptive statistics and within-run uncertainty
# --------------------------------------------------------------------------

def describe(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """n, mean, sample sd (n-1), standard error of the mean and a Student-t
    interval for the mean; sd, se and ci are None for a single value."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("describe needs at least one value")
    n, mean = int(x.size), float(x.mean())
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "se": None, "ci": None}
    sd = float(x.std(ddof=1))
    se = sd / math.sqrt(n)
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * se
    return {"n": n, "mean": mean, "sd": sd, "se": se, "ci": [mean - half, mean + half]}


def sampling_se(num_correct: Sequence[int], k: int) -> float | None:
    """Standard error (in points) of one run's avg@k from evaluation sampling alone:
    the problems and the checkpoint fixed, only the k samples per problem random.
    sqrt(sum_i p_i (1 - p_i) / (k - 1)) / P with p_i = num_correct_i / k. None for k = 1."""
    if k < 2:
        return None
    p = np.asarray(num_correct, dtype=float) / k
    return 100.0 * math.sqrt(float(np.sum(p * (1.0 - p))) / (k - 1)) / p.size


def _problem_weights(rng: np.random.Generator, num_problems: int, n_resamples: int) -> np.ndarray:
    """[resample, problem] How often each problem is drawn (multinomial counts)."""
    return rng.multinomial(num_problems, np.full(num_problems, 1.0 / num_problems), size=n_resamples)


def _resampled_means(rng: np.random.Generator, values: np.ndarray, problem_weights: np.ndarray) -> np.ndarray:
    """[resample] Mean of `values` [run, problem] over the drawn problems and a fresh
    draw of runs (with replacement) for each resample."""
    runs, problems = values.shape
    run_weights = rng.multinomial(runs, np.full(runs, 1.0 / runs), size=len(problem_weights))
    return np.einsum("br,rp,bp->b", run_weights, values, problem_weights) / (runs * problems)


def _percentile_ci(draws: np.ndarray, confidence: float) -> list[float]:
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(draws, [tail, 100.0 - tail])
    return [float(low), float(high)]


def bootstrap_mean(values, n_resamples: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                   confidence: float = CONFIDENCE) -> dict:
    """Hierarchical bootstrap of one arm's mean: `values` is [run, problem] (per-problem
    accuracy of each run); each resample draws the problems, then the runs, with
    replacement. With one run this is the plain bootstrap over problems.
    Returns mean, se (sd of the resampled means) and the percentile ci."""
    values = np.atleast_2d(np.asarray(values, dtype=float))
    rng = np.random.default_rng(seed)
    weights = _problem_weights(rng, values.shape[1], n_resamples)
    draws = _resampled_means(rng, values, weights)
    return {"mean": float(values.mean()), "se": float(draws.std(ddof=1)),
            "ci": _percentile_ci(draws, confidence), "n_resamples": n_resamples, "seed": seed}


# --------------------------------------------------------------------------
# 3. Two arms
# --------------------------------------------------------------------------

def bootstrap_difference(values_a, values_b, n_resamples: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                         confidence: float = CONFIDENCE) -> dict:
    """Hierarchical, problem-paired bootstrap of mean(B) - mean(A).

    values_a [runs_a, problem], values_b [runs_b, problem]: per-problem accuracy of
    each run, problems in the same order. Each resample draws P problems with
    replacement (one draw for both arms), then each arm's runs with replacement,
    independently per arm; the statistic is the difference of the two resampled
    means. Returns diff, se, the percentile ci, n_resamples and seed. The same seed
    gives the same numbers."""
    a = np.atleast_2d(np.asarray(values_a, dtype=float))
    b = np.atleast_2d(np.asarray(values_b, dtype=float))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"arms have different numbers of problems: {a.shape[1]} vs {b.shape[1]}")
    rng = np.random.default_rng(seed)
    weights = _problem_weights(rng, a.shape[1], n_resamples)
    draws = _resampled_means(rng, b, weights) - _resampled_means(rng, a, weights)
    return {"diff": float(b.mean() - a.mean()), "se": float(draws.std(ddof=1)),
            "ci": _percentile_ci(draws, confidence), "n_resamples": n_resamples, "seed": seed}


def welch_t(means_a: Sequence[float], means_b: Sequence[float], confidence: float = CONFIDENCE) -> dict | None:
    """Welch's t test of mean(B) - mean(A) on run means (>= 2 runs per arm):
    t, Welch-Satterthwaite df, two-sided p and a t interval for the difference.
    None when either arm has fewer than 2 runs or neither arm has any spread."""
    a, b = np.asarray(means_a, dtype=float), np.asarray(means_b, dtype=float)
    if a.size < 2 or b.size < 2:
        return None
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb == 0:
        return None
    diff, se = float(b.mean() - a.mean()), math.sqrt(va + vb)
    df = float((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)))
    return _t_result("Welch t on run means", diff, se, df, confidence)


def single_run_t(means_a: Sequence[float], means_b: Sequence[float], confidence: float = CONFIDENCE) -> dict | None:
    """t test for one run against R >= 2 runs of the other arm, assuming the single
    run has the same run-to-run sd s as that arm: t = d / (s sqrt(1 + 1/R)), df = R - 1.
    None unless exactly one arm has a single run and the other >= 2 with some spread."""
    a, b = np.asarray(means_a, dtype=float), np.asarray(means_b, dtype=float)
    if min(a.size, b.size) != 1 or max(a.size, b.size) < 2:
        return None
    group = a if a.size > 1 else b
    sd = float(group.std(ddof=1))
    if sd == 0:
        return None
    se = sd * math.sqrt(1.0 + 1.0 / group.size)
    return _t_result("t, single run vs the other arm's run-to-run sd", float(b.mean() - a.mean()),
                     se, float(group.size - 1), confidence)


def _t_result(method: str, diff: float, se: float, df: float, confidence: float) -> dict:
    t = diff / se
    half = t_ppf(0.5 + confidence / 2.0, df) * se
    return {"method": method, "diff": diff, "se": se, "t": t, "df": df,
            "p": t_two_sided_p(t, df), "ci": [diff - half, diff + half]}


def run_level_test(means_a: Sequence[float], means_b: Sequence[float], confidence: float = CONFIDENCE) -> dict | None:
    """Welch when both arms have >= 2 runs, the single-run t when one arm has 1, None for 1 vs 1."""
    return welch_t(means_a, means_b, confidence) or single_run_t(means_a, means_b, confidence)


def problem_scores(correct_a, correct_b) -> np.ndarray:
    """Integer per-problem differences, proportional to mean accuracy of B minus
    mean accuracy of A: R_A * sum_runs(correct_B) - R_B * sum_runs(correct_A), from
    correct-sample counts [run, problem] (same k in both arms)."""
    a = np.atleast_2d(np.asarray(correct_a, dtype=np.int64))
    b = np.atleast_2d(np.asarray(correct_b, dtype=np.int64))
    return a.shape[0] * b.sum(axis=0) - b.shape[0] * a.sum(axis=0)


def sign_test(scores: Sequence[int]) -> dict:
    """Exact two-sided sign test: problems where B beats A vs where A beats B (ties dropped)."""
    s = np.asarray(scores)
    wins, losses = int((s > 0).sum()), int((s < 0).sum())
    m = wins + losses
    low = min(wins, losses)
    p = 1.0 if m == 0 else min(1.0, 2.0 * sum(math.comb(m, j) for j in range(low + 1)) / 2.0 ** m)
    return {"b_better": wins, "a_better": losses, "tied": int(s.size - m), "p": p}


def sign_flip_test(scores: Sequence[int]) -> float:
    """Exact two-sided paired permutation test: under the null each problem's
    difference is as likely to have either sign. p = P(|sum of +-s_i| >= |sum of s_i|)
    over all 2^m sign patterns of the m nonzero scores, counted exactly by
    convolving the per-problem two-point distributions on the integer grid."""
    signed = np.asarray(scores, dtype=np.int64)
    s = np.abs(signed[signed != 0])
    divisor = math.gcd(*map(int, s)) if s.size else 1  # a smaller grid, same p
    s //= divisor
    observed = abs(int(signed.sum())) // divisor
    total = int(s.sum())
    dist = np.zeros(2 * total + 1)
    dist[total] = 1.0  # index = sum + total
    for v in s:
        v = int(v)
        new = np.zeros_like(dist)
        new[v:] += 0.5 * dist[:dist.size - v]
        new[:dist.size - v] += 0.5 * dist[v:]
        dist = new
    sums = np.abs(np.arange(dist.size) - total)
    return float(min(1.0, dist[sums >= observed].sum()))


def assumed_noise_interval(diff: float, run_sd: float, runs_a: int, runs_b: int,
                           confidence: float = CONFIDENCE) -> dict:
    """Normal interval for the difference when the per-run sd is taken from elsewhere."""
    se = run_sd * math.sqrt(1.0 / runs_a + 1.0 / runs_b)
    half = NormalDist().inv_cdf(0.5 + confidence / 2.0) * se
    return {"run_sd": run_sd, "se": se, "ci": [diff - half, diff + half]}


def _runs(a: int, b: int) -> str:
    return f"{a} vs {b} runs"


def _gap(diff: float, names: Sequence[str], num_problems: int | None) -> str:
    """The sentence's subject: "B is 4.20 points above A on these 30 problems"."""
    a, b = names
    where = f" on these {num_problems} problems" if num_problems else ""
    if round(abs(diff), 2) == 0:
        return f"{b} scores the same as {a}{where}"
    return f"{b} is {abs(diff):.2f} points {'above' if diff > 0 else 'below'} {a}{where}"


def verdict(diff: float, ci: Sequence[float], runs_a: int, runs_b: int, run_p: float | None = None,
            problem_p: float | None = None, assumed: dict | None = None, alpha: float = ALPHA,
            names: Sequence[str] = ("A", "B"), num_problems: int | None = None) -> str:
    """One plain sentence, what a newcomer reads first (the numbers go to `statistics`). A
    difference is called real only when the bootstrap CI excludes 0 and the run-level test
    agrees (or, without one, the interval from an assumed per-run sd, and then it says so);
    with neither (1 vs 1 runs, no assumed sd) it says at most that the two checkpoints differ,
    never that the arms do (CHECKPOINTS_VS_ARMS)."""
    low, high = ci
    head = _gap(diff, names, num_problems)
    runs = _runs(runs_a, runs_b)
    excludes = low > 0 or high < 0
    if run_p is not None:
        if excludes and run_p < alpha:
            caution = "; few runs, so treat the size as rough" if min(runs_a, runs_b) < 5 else ""
            return f"{head}, beyond run-to-run noise with {runs}: the arms differ{caution}"
        if excludes or run_p < alpha:
            return (f"{head}; with {runs} the bootstrap CI and the run-level test disagree whether that is more "
                    "than run-to-run noise: inconclusive, add runs")
        return f"{head}, within run-to-run noise with {runs}: no evidence that the arms differ"
    if assumed is not None:
        sd = f"an assumed per-run sd of {assumed['run_sd']:g} points"
        beyond = assumed["ci"][0] > 0 or assumed["ci"][1] < 0
        if beyond and excludes:
            return (f"{head}, more than the run-to-run noise of {sd} with {runs}: the arms differ if that noise "
                    "is right (assumed, not measured)")
        if beyond or excludes:
            return (f"{head}; with {runs} the bootstrap CI and the interval from {sd} disagree: inconclusive, "
                    "train more seeds")
        return f"{head}, within the run-to-run noise of {sd} with {runs}: no evidence that the arms differ"
    problem_level = problem_p is not None and problem_p < alpha
    few = "one run per arm" if max(runs_a, runs_b) == 1 else f"{runs} without spread between runs"
    if excludes and problem_level:
        return (f"{head}, more than evaluation-sampling noise: these two checkpoints differ; {few} cannot tell "
                f"whether the gap holds in general (whether the arms differ: train more seeds)")
    if excludes or problem_level:
        return (f"{head}; with {runs} the bootstrap CI and the per-problem test disagree whether that is more "
                "than evaluation-sampling noise: inconclusive even for these two checkpoints; train more seeds")
    return f"{head}, within evaluation-sampling noise: not even these two checkpoints differ measurably with {runs}"


def statistics_text(result: dict) -> str:
    """The numbers behind a `compare_arms` verdict in one line, the same in `compare` and
    opsd.research.grid: the difference, its bootstrap CI with the resample count, and the test that
    decided the verdict."""
    boot = result["bootstrap"]
    low, high = boot["ci"]
    runs_a, runs_b = result["arms"]["A"]["n"], result["arms"]["B"]["n"]
    resampled = "runs and problems" if max(runs_a, runs_b) > 1 else "problems"
    parts = [f"difference {result['difference']:+.2f} points, 95% CI [{low:+.2f}, {high:+.2f}] by a paired "
             f"bootstrap over {resampled} with {boot['n_resamples']} resamples, seed {boot['seed']}"]
    test, assumed = result["run_level_test"], result["assumed_run_sd"]
    if test:
        parts.append(f"run-level p = {test['p']:.3g}")
    elif assumed:
        parts.append(f"assumed per-run sd {assumed['run_sd']:g}: 95% interval {_ci(assumed['ci'], '+.2f')}")
    else:
        parts.append(f"per-problem sign-flip p = {result['per_problem']['sign_flip_p']:.3g}; run-to-run noise "
                     f"not measured with {_runs(runs_a, runs_b)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------
# 4. Reading and checking eval reports
# --------------------------------------------------------------------------

class InputError(Exception):
    """A bad input; reported as one `error: ...` line, exit status 2."""


class ReportError(InputError):
    """A bad input file; reported as `error: FILE: message`, exit status 2."""

    def __init__(self, path, message: str):
        super().__init__(f"{path}: {message}")


@dataclass(frozen=True)
class Run:
    """One eval report, reduced to what the statistics need."""
    path: str
    dataset: str
    settings: dict
    checkpoint: str
    keys: tuple            # (problem text, gold answer) per problem, in report order
    num_correct: np.ndarray  # [problem] correct samples out of k
    k: int

    @property
    def avg(self) -> float:
        return 100.0 * float(self.num_correct.sum()) / (self.k * len(self.keys))


def load_run(path) -> Run:
    """Read one evaluation report (opsd/evaluation/evaluate.py) and check that it is internally consistent."""
    path = str(path)
    if not Path(path).is_file():
        raise ReportError(path, "no such file")
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(path, f"cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(path, f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(report, dict):
        raise ReportError(path, "not an evaluation report (not a JSON object)")
    for field, kind in (("settings", dict), ("dataset", str), ("problems", list)):
        if not isinstance(report.get(field), kind):
            raise ReportError(path, f"not an evaluation report: no {field!r} {kind.__name__}")
    k = report["settings"].get("n_samples")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ReportError(path, f"settings.n_samples must be a positive integer, got {k!r}")
    if not report["problems"]:
        raise ReportError(path, "the report has no problems")

    keys, counts, seen = [], [], set()
    for i, problem in enumerate(report["problems"], start=1):
        samples = problem.get("samples") if isinstance(problem, dict) else None
        if not isinstance(samples, list) or not isinstance(problem.get("problem"), str):
            raise ReportError(path, f"problem {i} has no 'problem' text or no 'samples' list")
        key = (problem["problem"], str(problem.get("gold")))
        if key in seen:
            raise ReportError(path, f"problem {i} appears twice")
        seen.add(key)
        if len(samples) != k:
            raise ReportError(path, f"problem {i} has {len(samples)} samples, settings.n_samples is {k}")
        flags = [s.get("correct") if isinstance(s, dict) else None for s in samples]
        if not all(isinstance(f, bool) for f in flags):
            raise ReportError(path, f"problem {i}: every sample needs a true/false 'correct'")
        keys.append(key)
        counts.append(sum(flags))

    run = Run(path=path, dataset=_dataset_label(report["dataset"]), settings=report["settings"],
              checkpoint=str(report.get("checkpoint", "?")), keys=tuple(keys),
              num_correct=np.asarray(counts, dtype=np.int64), k=k)
    metrics = report.get("metrics")
    stated = metrics.get(f"avg@{k}") if isinstance(metrics, dict) else None
    if isinstance(stated, (int, float)) and abs(stated - run.avg) > 1e-6:
        raise ReportError(path, f"metrics avg@{k} is {stated} but its samples give {run.avg:.4f}")
    return run


def _dataset_label(dataset: str) -> str:
    """A report's dataset as reports now name it: reports written before the tiny sets were
    named by seed and size say `tiny` or `tiny:SEED`, and compare with `tiny:SEED:N` ones of
    the same set (opsd.evaluation.evaluate.dataset_label)."""
    if dataset == "tiny" or dataset.startswith("tiny:"):
        from opsd import tiny_default  # standard library at import

        return tiny_default.eval_set_name(dataset)
    return dataset


def check_comparable(runs: Sequence[Run]) -> np.ndarray:
    """Same dataset, settings and problem set in every run (checked against the
    first one). Returns correct counts [run, problem], problems sorted by (text, gold)
    so that no result depends on the order of problems inside the files."""
    first = runs[0]
    seen_paths = {}
    for run in runs:
        resolved = Path(run.path).resolve()
        if resolved in seen_paths:
            raise ReportError(run.path, "given more than once (one file is one run)")
        seen_paths[resolved] = run
    order = {key: i for i, key in enumerate(sorted(first.keys))}
    rows = []
    for run in runs:
        if run.dataset != first.dataset:
            raise ReportError(run.path, f"dataset {run.dataset!r} differs from {first.dataset!r} in {first.path}")
        if run.settings != first.settings:
            names = sorted(set(run.settings) | set(first.settings))
            diffs = [f"{n} {run.settings.get(n)!r} vs {first.settings.get(n)!r}"
                     for n in names if run.settings.get(n) != first.settings.get(n)]
            raise ReportError(run.path, f"settings differ from {first.path}: {', '.join(diffs)}")
        if set(run.keys) != set(first.keys):
            missing = len(set(first.keys) - set(run.keys))
            extra = len(set(run.keys) - set(first.keys))
            raise ReportError(run.path, f"problem set differs from {first.path}: "
                                        f"{missing} of its problems missing, {extra} others present")
        row = np.empty(len(first.keys), dtype=np.int64)
        for key, count in zip(run.keys, run.num_correct, strict=True):
            row[order[key]] = count
        rows.append(row)
    return np.stack(rows)


# --------------------------------------------------------------------------
# 5. The two commands
# --------------------------------------------------------------------------

def summarize_runs(runs: Sequence[Run], counts: np.ndarray, n_resamples: int, seed: int) -> dict:
    """All numbers of `summary` for runs already checked by check_comparable."""
    k = runs[0].k
    accuracy = 100.0 * counts / k  # [run, problem], points
    per_run = []
    for i, run in enumerate(runs):
        boot = bootstrap_mean(accuracy[i], n_resamples, seed)
        per_run.append({"file": run.path, "checkpoint": run.checkpoint, "avg": run.avg,
                        "sampling_se": sampling_se(counts[i], k), "problems_ci": boot["ci"],
                        "problems_se": boot["se"]})
    result = {"command": "summary", "metric": f"avg@{k}", "dataset": runs[0].dataset,
              "settings": runs[0].settings, "num_problems": int(counts.shape[1]),
              "samples_per_problem": k, "runs": per_run, "across_runs": None}
    if len(runs) >= 2:
        across = describe([r["avg"] for r in per_run])
        sampling = [r["sampling_se"] for r in per_run if r["sampling_se"] is not None]
        across["sampling_only_sd"] = math.sqrt(sum(s * s for s in sampling) / len(sampling)) if sampling else None
        across["bootstrap"] = bootstrap_mean(accuracy, n_resamples, seed)
        result["across_runs"] = across
    return result


def compare_arms(runs_a: Sequence[Run], runs_b: Sequence[Run], counts: np.ndarray, n_resamples: int,
                 seed: int, run_sd: float | None = None, names: Sequence[str] = ("A", "B")) -> dict:
    """All numbers of `compare`; `counts` [run, problem] holds arm A's runs, then arm B's; `names`
    name the arms in the verdict's sentence. "verdict" is that sentence, then the statistics
    (statistics_text) after "In numbers:"; "verdict_sentence" and "statistics" hold each part."""
    k = runs_a[0].k
    counts_a, counts_b = counts[:len(runs_a)], counts[len(runs_a):]
    means_a, means_b = [r.avg for r in runs_a], [r.avg for r in runs_b]
    boot = bootstrap_difference(100.0 * counts_a / k, 100.0 * counts_b / k, n_resamples, seed)
    run_test = run_level_test(means_a, means_b)
    scores = problem_scores(counts_a, counts_b)
    per_problem = {**sign_test(scores), "sign_flip_p": sign_flip_test(scores)}
    per_problem["sign_test_p"] = per_problem.pop("p")
    diff = boot["diff"]
    assumed = assumed_noise_interval(diff, run_sd, len(runs_a), len(runs_b)) if run_sd else None
    sentence = verdict(diff, boot["ci"], len(runs_a), len(runs_b), run_p=run_test and run_test["p"],
                       problem_p=per_problem["sign_flip_p"], assumed=assumed, names=names,
                       num_problems=int(counts.shape[1]))
    arms = {}
    for label, runs, means in (("A", runs_a, means_a), ("B", runs_b, means_b)):
        arms[label] = {"files": [r.path for r in runs], "per_run": means, **describe(means)}
    result = {"command": "compare", "metric": f"avg@{k}", "dataset": runs_a[0].dataset,
              "settings": runs_a[0].settings, "num_problems": int(counts.shape[1]), "samples_per_problem": k,
              "arms": arms, "difference": diff, "bootstrap": boot, "run_level_test": run_test,
              "per_problem": per_problem, "assumed_run_sd": assumed, "verdict_sentence": sentence}
    result["statistics"] = statistics_text(result)
    result["verdict"] = f"{sentence}. In numbers: {result['statistics']}"
    return result


def sweep_checkpoints(steps: Sequence[int], runs: Sequence[Run], n_resamples: int = DEFAULT_BOOTSTRAP,
                      seed: int = 0) -> dict:
    """The checkpoints of ONE training run (`steps[i]` is the step of `runs[i]`, in step order):
    each one's avg@k with its sampling se and problems CI, the difference to the last checkpoint
    (`compare_arms` with one run on each side: problem-paired bootstrap, sign and sign-flip
    tests), and the best checkpoint (highest avg@k; a tie goes to the later step). The
    comparisons see evaluation-sampling and problem noise only (one training run), and the best
    is picked on these very problems, so its lead over the last is optimistic."""
    counts = check_comparable(runs)
    k, last = runs[0].k, len(runs) - 1
    rows = []
    for i, (step, run) in enumerate(zip(steps, runs, strict=True)):
        boot = bootstrap_mean(100.0 * counts[i] / k, n_resamples, seed)
        versus = compare_arms([runs[last]], [run], counts[[last, i]], n_resamples, seed) if i != last else None
        rows.append({"step": int(step), "checkpoint": Path(run.checkpoint).name, "file": run.path, "avg": run.avg,
                     "sampling_se": sampling_se(counts[i], k), "problems_ci": boot["ci"],
                     "vs_last": None if versus is None else {
                         "difference": versus["difference"], "ci": versus["bootstrap"]["ci"],
                         "sign_flip_p": versus["per_problem"]["sign_flip_p"],
                         "sign_test_p": versus["per_problem"]["sign_test_p"]}})
    best = max(range(len(rows)), key=lambda i: (rows[i]["avg"], rows[i]["step"]))
    versus = rows[best]["vs_last"]
    if versus is None:
        verdict_text = "the best is the last checkpoint"
    else:
        low, high = versus["ci"]
        beyond = (low > 0 or high < 0) and versus["sign_flip_p"] < ALPHA
        verdict_text = ("distinguishable from the last beyond evaluation-sampling noise" if beyond else
                        "not distinguishable from the last"
                        if not (low > 0 or high < 0 or versus["sign_flip_p"] < ALPHA)
                        else "inconclusive against the last (the bootstrap CI and the sign-flip test disagree)")
    return {"command": "sweep", "metric": f"avg@{k}", "dataset": runs[0].dataset, "settings": runs[0].settings,
            "num_problems": int(counts.shape[1]), "samples_per_problem": k, "checkpoints": rows,
            "best": rows[best]["checkpoint"], "best_step": rows[best]["step"], "last": rows[last]["checkpoint"],
            "best_vs_last": versus, "verdict": verdict_text, "n_resamples": n_resamples, "seed": seed}


def format_sweep_markdown(result: dict, title: str = "") -> str:
    """The accuracy-vs-step table of `sweep_checkpoints` as markdown."""
    metric = result["metric"]
    lines = [f"# {title}" if title else "# checkpoint sweep", "",
             (f"{metric} on `{result['dataset']}`, {result['num_problems']} problems x "
              f"{result['samples_per_problem']} samples; differences to the last checkpoint with a "
              f"problem-paired bootstrap ({result['n_resamples']} resamples, seed {result['seed']}) and an exact "
              f"sign-flip test: evaluation-sampling and problem noise only (one training run)."), "",
             f"| step | checkpoint | {metric} | sampling se | problems 95% CI | vs last | vs last 95% CI | "
             "sign-flip p |", "|---|---|---|---|---|---|---|---|"]
    for row in result["checkpoints"]:
        versus = row["vs_last"]
        mark = " (best)" if row["checkpoint"] == result["best"] else ""
        lines.append(f"| {row['step']} | {row['checkpoint']}{mark} | {row['avg']:.2f} | {_f(row['sampling_se'])} | "
                     f"{_ci(row['problems_ci'])} | {'-' if versus is None else format(versus['difference'], '+.2f')} | "
                     f"{'-' if versus is None else _ci(versus['ci'], '+.2f')} | "
                     f"{'-' if versus is None else format(versus['sign_flip_p'], '.3g')} |")
    lines += ["", f"Best: {sweep_final_line(result)[len('FINAL best '):]}",
              "The best is chosen on these same problems, so its lead over the last is optimistic: "
              "confirm it on another eval set before preferring it."]
    return "\n".join(lines) + "\n"


def sweep_final_line(result: dict) -> str:
    """`FINAL best checkpoint-N avg@k X% (last checkpoint-M Y%: ...)`: the sweep's last line."""
    best = next(r for r in result["checkpoints"] if r["checkpoint"] == result["best"])
    last = result["checkpoints"][-1]
    head = f"FINAL best {best['checkpoint']} {result['metric']} {best['avg']:.2f}%"
    count = f"{len(result['checkpoints'])} checkpoint(s)"
    versus = result["best_vs_last"]
    if versus is None:
        return f"{head} (the last checkpoint; {count})"
    return (f"{head} (last {last['checkpoint']} {last['avg']:.2f}%: best - last {versus['difference']:+.2f} points, "
            f"95% CI {_ci(versus['ci'], '+.2f')}, sign-flip p = {versus['sign_flip_p']:.3g}: {result['verdict']}; "
            f"{count})")


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _ci(ci, spec: str = ".2f") -> str:
    return "-" if ci is None else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"


def format_summary(result: dict) -> str:
    metric = result["metric"]
    lines = [(f"summary {metric} | dataset {result['dataset']} | {result['num_problems']} problems x "
              f"{result['samples_per_problem']} samples | {len(result['runs'])} run(s)")]
    width = max(len("run"), *(len(Path(r["file"]).name) for r in result["runs"]))
    lines.append(f"{'run':<{width}}  {metric:>7}  {'sampling se':>11}  problems 95% CI (bootstrap)")
    for r in result["runs"]:
        lines.append(f"{Path(r['file']).name:<{width}}  {r['avg']:>7.2f}  {_f(r['sampling_se']):>11}  "
                     f"{_ci(r['problems_ci'])}")
    across = result["across_runs"]
    if across:
        boot = across["bootstrap"]
        lines += [(f"across runs: mean {across['mean']:.2f}, sd {across['sd']:.2f}, se {across['se']:.2f}, "
                   f"95% CI {_ci(across['ci'])} (t, df {across['n'] - 1})"),
                  f"  evaluation sampling alone would give a run-to-run sd of about {_f(across['sampling_only_sd'])}",
                  (f"  runs + problems resampled ({boot['n_resamples']} bootstrap resamples, seed {boot['seed']}): "
                   f"95% CI {_ci(boot['ci'])}")]
    lines += ["what each number captures:",
              "  sampling se      re-evaluating the same checkpoint (other sampling seed), same problems",
              "  problems 95% CI  another draw of equally many problems like these (includes sampling noise)"]
    if across:
        lines += ["  sd, se, 95% CI   retraining with other seeds (plus sampling noise), same problems",
                  "  runs + problems  both of the above: seeds and problems"]
    else:
        lines.append("  one run cannot show training-seed noise: train more seeds "
                     "(the anchor's per-run sd is about 1.5 points on AIME24 avg@12)")
    return "\n".join(lines)


def format_compare(result: dict) -> str:
    metric, boot = result["metric"], result["bootstrap"]
    # The sentence first, what the two claims mean, then every number behind it.
    lines = [f"verdict: {result['verdict']}", f"  {CHECKPOINTS_VS_ARMS}",
             (f"compare {metric} | dataset {result['dataset']} | {result['num_problems']} problems x "
              f"{result['samples_per_problem']} samples"),
             f"arm  runs     mean      sd      se  per-run {metric}"]
    for label, arm in result["arms"].items():
        per_run = " ".join(f"{v:.2f}" for v in arm["per_run"])
        lines.append(f"{label:<3}  {arm['n']:>4}  {arm['mean']:>7.2f}  {_f(arm['sd']):>6}  {_f(arm['se']):>6}  "
                     f"{per_run}")
    for label, arm in result["arms"].items():
        lines.append(f"{label}: " + ", ".join(Path(f).name for f in arm["files"]))
    lines.append(f"B - A: {result['difference']:+.2f} points")
    runs_a, runs_b = result["arms"]["A"]["n"], result["arms"]["B"]["n"]
    if min(runs_a, runs_b) > 1:
        resampled = "runs + problems (paired)"
    elif max(runs_a, runs_b) == 1:
        resampled = "problems only (paired; one run per arm)"
    else:
        several, single = ("A", "B") if runs_a > 1 else ("B", "A")
        resampled = f"runs of {several} + problems (paired; {single} has one run)"
    lines.append(f"  bootstrap, {resampled}, {boot['n_resamples']} resamples, seed {boot['seed']}: "
                 f"95% CI {_ci(boot['ci'], '+.2f')}")
    test = result["run_level_test"]
    if test:
        lines.append(f"  {test['method']}: t = {test['t']:+.2f}, df = {test['df']:.1f}, p = {test['p']:.3g}, "
                     f"95% CI {_ci(test['ci'], '+.2f')}")
    else:
        lines.append("  run-level test: not possible (needs 2 runs in one arm and some spread between them)")
    pp = result["per_problem"]
    lines.append(f"  per problem (these runs, evaluation noise only): B better on {pp['b_better']}, "
                 f"A better on {pp['a_better']}, tied {pp['tied']}; sign test p = {pp['sign_test_p']:.3g}, "
                 f"sign-flip test p = {pp['sign_flip_p']:.3g} (exact)")
    if result["assumed_run_sd"]:
        assumed = result["assumed_run_sd"]
        lines.append(f"  with an assumed per-run sd of {assumed['run_sd']:g}: "
                     f"95% interval {_ci(assumed['ci'], '+.2f')}")
    return "\n".join(lines)


def interval_panels(result: dict) -> tuple[list, str]:
    """The numbers of a `summary` or `compare` result as run_plots interval panels, and the
    figure's title: exactly the estimates and intervals the text prints."""
    from opsd.analysis.plots import Interval, IntervalPanel

    metric = result["metric"]
    head = (f"{metric} | {result['dataset']} | {result['num_problems']} problems x "
            f"{result['samples_per_problem']} samples")
    if result["command"] == "summary":
        rows = [Interval(f"{Path(r['file']).name}: problems 95% CI", r["avg"], _pair(r["problems_ci"]))
                for r in result["runs"]]
        across = result["across_runs"]
        if across:
            means = tuple(r["avg"] for r in result["runs"])
            rows += [Interval(f"across {across['n']} runs: t 95% CI", across["mean"], _pair(across["ci"]), means),
                     Interval("runs + problems: bootstrap 95% CI", across["bootstrap"]["mean"],
                              _pair(across["bootstrap"]["ci"]), means)]
        return [IntervalPanel("each run, and the arm", f"{metric} (points)", tuple(rows))], f"summary {head}"
    arms = [Interval(f"{label}: {arm['n']} run{'s' if arm['n'] > 1 else ''}, mean"
                     + (", t 95% CI" if arm["ci"] else ""),
                     arm["mean"], _pair(arm["ci"]), tuple(arm["per_run"]))
            for label, arm in result["arms"].items()]
    boot = result["bootstrap"]
    differences = [Interval("bootstrap 95% CI", result["difference"], _pair(boot["ci"]))]
    test = result["run_level_test"]
    if test:
        differences.append(Interval(f"{test['method'].split(' on ')[0].split(',')[0]}: 95% CI (p = {test['p']:.3g})",
                                    test["diff"], _pair(test["ci"])))
    if result["assumed_run_sd"]:
        assumed = result["assumed_run_sd"]
        differences.append(Interval(f"assumed per-run sd {assumed['run_sd']:g}: 95% interval",
                                    result["difference"], _pair(assumed["ci"])))
    panels = [IntervalPanel("arms (dots: run means)", f"{metric} (points)", tuple(arms)),
              IntervalPanel("B - A", "points", tuple(differences), zero_line=True)]
    return panels, f"compare {head}\nverdict: {result['verdict_sentence']}"


def _plot_output(path: str, panels=None, title: str = "") -> None:
    """Check the --plot path (no panels) or draw the panels into it; a problem is an InputError."""
    from opsd.analysis import plots as run_plots  # only with --plot: its figures need matplotlib

    try:
        if panels is None:
            run_plots.check_output(path)
        else:
            run_plots.plot_intervals(panels, path, title)
    except run_plots.PlotError as exc:
        raise InputError(str(exc)) from None


def _pair(ci) -> tuple[float, float] | None:
    return None if ci is None else (float(ci[0]), float(ci[1]))


def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.stats") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Statistics over evaluation reports: one arm's spread "
                                                 "(summary), arm B against arm A (compare), or a grid's "
                                                 "accuracy against sampled tokens (tokens).")
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP, metavar="N",
                        help=f"bootstrap resamples (default {DEFAULT_BOOTSTRAP}, what opsd.research.grid uses)")
    common.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    common.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    common.add_argument("--plot", metavar="FILE.png", help="also draw the printed estimates and intervals (PNG)")
    summary = commands.add_parser("summary", parents=[common], help="avg@k per run and across runs")
    summary.add_argument("runs", nargs="+", metavar="RUN.json")
    compare = commands.add_parser("compare", parents=[common], help="difference of means B - A")
    compare.add_argument("--a", nargs="+", required=True, metavar="RUN.json", help="arm A: one report per run")
    compare.add_argument("--b", nargs="+", required=True, metavar="RUN.json", help="arm B: one report per run")
    compare.add_argument("--run-sd", type=float, metavar="SD",
                         help="assumed per-run sd in points (e.g. 1.48, the anchor's); shown as an extra "
                              "interval, and used by the verdict when no run-level test is possible (1 vs 1)")
    tokens = commands.add_parser(
        "tokens", help="a grid's accuracy against sampled tokens: per arm, step | sampled tokens | accuracy",
        description="Per arm of a opsd.research.grid folder: step | sampled tokens | accuracy, means over the arm's "
                    "seeds, at each swept checkpoint (sweep.json; grids with sweep_every) or else the last one. "
                    "Sampled tokens: the cumulative tokens/sampled of the run's metrics.jsonl at the checkpoint's "
                    "step ('not recorded' for a run that did not log it); the untrained arm samples none.")
    tokens.add_argument("grid", metavar="GRID_DIR", help="a opsd.research.grid folder (ARM/seed-N/...)")
    tokens.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    tokens.add_argument("--plot", metavar="FILE.png", help="also draw accuracy against sampled tokens (PNG)")
    from opsd.analysis import evidence  # the equivalence and reach commands (opsd/analysis/evidence.py)

    evidence.add_commands(commands, DEFAULT_BOOTSTRAP, MIN_BOOTSTRAP)  # equivalence (TOST), reach (tokens to X)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.stats") -> int:
    """The command line; returns the exit status (0, or 2 for bad inputs)."""
    args = parse_args(argv, prog)
    if args.command == "tokens":
        return _tokens_main(args)
    if args.command in ("equivalence", "reach"):
        from opsd.analysis import evidence

        return evidence.main(args, grid_table, (InputError, TokensError),
                             evidence.StatsTools(load_run, check_comparable, _problem_weights))  # reach's readers
    try:
        if args.bootstrap < MIN_BOOTSTRAP:
            raise InputError(f"--bootstrap must be at least {MIN_BOOTSTRAP}, got {args.bootstrap}")
        if getattr(args, "run_sd", None) is not None and not (math.isfinite(args.run_sd) and args.run_sd > 0):
            raise InputError(f"--run-sd must be a positive number, got {args.run_sd}")
        if args.plot:
            _plot_output(args.plot)  # before the work: a bad path costs no bootstrap and writes no --json
        if args.command == "summary":
            runs = [load_run(p) for p in args.runs]
            result = summarize_runs(runs, check_comparable(runs), args.bootstrap, args.seed)
            text = format_summary(result)
        else:
            runs_a, runs_b = [load_run(p) for p in args.a], [load_run(p) for p in args.b]
            counts = check_comparable([*runs_a, *runs_b])
            result = compare_arms(runs_a, runs_b, counts, args.bootstrap, args.seed, args.run_sd)
            text = format_compare(result)
        if args.json:
            _write_json(args.json, result)
        if args.plot:
            panels, title = interval_panels(result)
            _plot_output(args.plot, panels, title)
    except InputError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(text)
    return 0


# --------------------------------------------------------------------------
# Accuracy against sampled tokens (a grid folder)
# --------------------------------------------------------------------------

def _seed_number(folder: Path) -> int:
    tail = folder.name.removeprefix("seed-")
    return int(tail) if tail.isdigit() else -1


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TokensError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise TokensError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise TokensError(f"{path}: expected a JSON object")
    return data


def _arm_names(grid: Path) -> list[str]:
    """The grid's arms in its own order (results.json keeps the grid file's), else by name."""
    results = grid / "results.json"
    named = []
    if results.is_file():
        arms = _read_json(results).get("arms")
        named = list(arms) if isinstance(arms, dict) else []
    others = sorted(p.name for p in grid.iterdir() if p.is_dir() and p.name not in named)
    return [name for name in [*named, *others]
            if (grid / name / "eval.json").is_file() or any((grid / name).glob("seed-*/eval.json"))]


def _accuracy(report: Path) -> tuple[float, str]:
    try:
        run = load_run(report)
    except InputError as exc:
        raise TokensError(str(exc)) from None
    return run.avg, f"avg@{run.k}"


def grid_table(grid_dir) -> dict:
    """Each arm of a opsd.research.grid folder as points (step, sampled tokens, accuracy), means
    over the arm's finished seeds with each seed's value:

        {"grid": NAME, "metric": "avg@8", "swept": bool,
         "arms": {arm: {"trained": bool, "seeds": [0, 1], "points": [
             {"step": 4, "sampled_tokens": 1234.5 | None, "sampled_tokens_per_seed": [..],
              "accuracy": 41.2, "accuracy_per_seed": [..]}, ...]}}}

    A trained arm's points are its cells' swept checkpoints (`sweep.json`; the steps every seed
    has), else the last checkpoint (`eval.json`, the step of the last record of
    `metrics.jsonl`); an untrained arm is one point at step 0 with 0 tokens. A point's sampled
    tokens are None ("not recorded") when a seed did not record them at that step."""
    grid = Path(grid_dir)
    if not grid.is_dir():
        raise TokensError(f"{grid_dir}: no such folder")
    names = _arm_names(grid)
    if not names:
        raise TokensError(f"{grid_dir}: no ARM/eval.json or ARM/seed-N/eval.json in it (not a opsd.research.grid "
                          "folder, or no cell has finished yet)")
    table = {"grid": grid.resolve().name, "metric": None, "swept": False, "arms": {}}
    for name in names:
        folder = grid / name
        if (folder / "eval.json").is_file() and not any(folder.glob("seed-*/eval.json")):
            avg, metric = _accuracy(folder / "eval.json")
            table["metric"] = table["metric"] or metric
            table["arms"][name] = {"trained": False, "seeds": [], "points": [
                {"step": 0, "sampled_tokens": 0, "sampled_tokens_per_seed": [], "accuracy": avg,
                 "accuracy_per_seed": [avg]}]}
            continue
        cells = sorted((p.parent for p in folder.glob("seed-*/eval.json")), key=_seed_number)
        per_seed = []  # ({step: accuracy}, {step: tokens} | None) per seed
        for cell in cells:
            tokens = read_sampled_tokens(cell / "run")
            if (cell / "sweep.json").is_file():
                sweep = _read_json(cell / "sweep.json")
                rows = sweep.get("checkpoints")
                if not isinstance(rows, list) or not all(isinstance(r, dict) and "step" in r and "avg" in r
                                                         for r in rows):
                    raise TokensError(f"{cell / 'sweep.json'}: no 'checkpoints' list of step / avg rows")
                accuracy = {int(r["step"]): float(r["avg"]) for r in rows}
                table["metric"] = table["metric"] or sweep.get("metric")
                table["swept"] = True
            else:
                avg, metric = _accuracy(cell / "eval.json")
                table["metric"] = table["metric"] or metric
                accuracy = {_last_step(cell / "run"): avg}
            per_seed.append((accuracy, tokens))
        steps = sorted(set.intersection(*(set(acc) for acc, _ in per_seed)))
        points = []
        for step in steps:
            tokens = [tokens_at(t, step) for _, t in per_seed]
            accuracy = [acc[step] for acc, _ in per_seed]
            points.append({"step": step, "sampled_tokens": mean_or_none(tokens), "sampled_tokens_per_seed": tokens,
                           "accuracy": sum(accuracy) / len(accuracy), "accuracy_per_seed": accuracy})
        table["arms"][name] = {"trained": True, "seeds": [_seed_number(c) for c in cells], "points": points}
    table["metric"] = table["metric"] or "avg@k"
    return table


def _last_step(run_dir: Path) -> int:
    """The last logged step of a run (its last checkpoint's, as the grid trains it); -1 without metrics."""
    path = run_dir / METRICS_FILE
    steps = [r.get("step") for _, r in read_jsonl(path, TokensError)] if path.is_file() else []
    steps = [s for s in steps if type(s) is int]
    return max(steps) if steps else -1


def _write_json(path: str, payload: dict) -> None:
    """`--json OUT`: the printed numbers as JSON (ReportError naming OUT if it cannot be written)."""
    try:
        Path(path).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ReportError(path, f"cannot write: {exc.strerror or exc}") from None


def _tokens_main(args: argparse.Namespace) -> int:
    """`tokens GRID_DIR`: the grid's accuracy against sampled tokens (opsd.analysis.tokens)."""
    try:
        if args.plot:
            _plot_output(args.plot)
        table = grid_table(args.grid)
        if args.json:
            _write_json(args.json, table)
        if args.plot:
            from opsd.analysis import plots as run_plots

            try:
                run_plots.plot_accuracy_vs_tokens(table, args.plot)
            except run_plots.PlotError as exc:
                raise InputError(str(exc)) from None
    except (InputError, TokensError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(format_grid_table(table), end="")
    return 0


if __name__ == "__main__":
    from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

    sys.exit(exit_status(main))
