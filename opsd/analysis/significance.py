"""The statistics of comparing evaluation runs, pure functions on numbers and arrays (no files):
Student's t (scipy.stats.t), one arm's spread, the hierarchical bootstrap, the run-level t tests,
the per-problem sign and sign-flip tests, and the verdict sentence. `opsd.analysis.stats` (the
command line), `opsd.analysis.comparison` (summary, compare, the checkpoint sweep) and
opsd.research.grid use them; the metric a comparison is on (avg@k, pass@K, maj@K, distinct
answers) is `opsd.analysis.problem_metrics`'s, the reports `opsd.analysis.reports`'s.

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

Every metric (opsd.analysis.problem_metrics) is compared the same way, in its own unit: per
problem an integer numerator over one denominator (avg@k: correct samples over k; pass@K and
maj@K: subsets of K samples over C(n, K); distinct: answers over 1), so the per-problem scores
of the sign and sign-flip tests stay integers and the sign-flip test stays exact.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from statistics import NormalDist

import numpy as np

POINTS = "points"  # the unit of avg@k, pass@K and maj@K (opsd.analysis.problem_metrics)
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


@lru_cache(maxsize=4)
def _problem_draw(seed: int, num_problems: int, n_resamples: int) -> tuple[np.ndarray, dict]:
    """The problem weights of default_rng(seed), and the generator's state after drawing them."""
    rng = np.random.default_rng(seed)
    weights = _problem_weights(rng, num_problems, n_resamples)
    weights.setflags(write=False)
    return weights, rng.bit_generator.state


def _seeded_problem_weights(seed: int, num_problems: int, n_resamples: int) -> tuple[np.random.Generator, np.ndarray]:
    """(generator, problem weights) exactly as default_rng(seed) followed by _problem_weights: the
    draw, most of a bootstrap's time, is made once per (seed, problems, resamples) and reused (a
    grid bootstraps every run, arm and metric with seed 0 on the same problems); the generator
    continues from the state it had after the draw, so every number is the same."""
    weights, state = _problem_draw(seed, num_problems, n_resamples)
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = state
    return rng, weights


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
    rng, weights = _seeded_problem_weights(seed, values.shape[1], n_resamples)
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
    rng, weights = _seeded_problem_weights(seed, a.shape[1], n_resamples)
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
    convolving the per-problem two-point distributions on the integer grid. Each step
    touches only the sums reachable so far (pass@K numerators over C(n, K) make long grids)."""
    signed = np.asarray(scores, dtype=np.int64)
    s = np.abs(signed[signed != 0])
    divisor = math.gcd(*map(int, s)) if s.size else 1  # a smaller grid, same p
    s //= divisor
    observed = abs(int(signed.sum())) // divisor
    total = int(s.sum())
    dist = np.zeros(2 * total + 1)
    dist[total] = 1.0  # index = sum + total
    new = np.zeros_like(dist)
    reach = 0  # dist is 0 outside total +- reach
    for v in s:
        v = int(v)
        low, high = total - reach, total + reach + 1
        new[low - v:high + v] = 0.0
        new[low + v:high + v] += 0.5 * dist[low:high]
        new[low - v:high - v] += 0.5 * dist[low:high]
        dist, new = new, dist
        reach += v
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


def _gap(diff: float, names: Sequence[str], num_problems: int | None, unit: str = POINTS) -> str:
    """The sentence's subject: "B is 4.20 points above A on these 30 problems" (a count such as
    distinct answers: "B has 0.40 more distinct answers a problem than A ...")."""
    a, b = names
    where = f" on these {num_problems} problems" if num_problems else ""
    if unit != POINTS:
        if round(abs(diff), 2) == 0:
            return f"{b} has as many {unit} as {a}{where}"
        return f"{b} has {abs(diff):.2f} {'more' if diff > 0 else 'fewer'} {unit} than {a}{where}"
    if round(abs(diff), 2) == 0:
        return f"{b} scores the same as {a}{where}"
    return f"{b} is {abs(diff):.2f} points {'above' if diff > 0 else 'below'} {a}{where}"


def verdict(diff: float, ci: Sequence[float], runs_a: int, runs_b: int, run_p: float | None = None,
            problem_p: float | None = None, assumed: dict | None = None, alpha: float = ALPHA,
            names: Sequence[str] = ("A", "B"), num_problems: int | None = None, unit: str = POINTS) -> str:
    """One plain sentence, what a newcomer reads first (the numbers go to `statistics`). A
    difference is called real only when the bootstrap CI excludes 0 and the run-level test
    agrees (or, without one, the interval from an assumed per-run sd, and then it says so);
    with neither (1 vs 1 runs, no assumed sd) it says at most that the two checkpoints differ,
    never that the arms do (CHECKPOINTS_VS_ARMS)."""
    low, high = ci
    head = _gap(diff, names, num_problems, unit)
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
        sd = f"an assumed per-run sd of {assumed['run_sd']:g} {unit}"
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


def shown_direction(result: dict, alpha: float = ALPHA, arms_only: bool = False) -> int:
    """+1 (B above A), -1 (below) or 0 (not shown) for a `compare_arms` result, by the verdict's
    rule: the bootstrap CI excludes 0 and the run-level test agrees (p < alpha) or, without one
    and unless `arms_only`, the per-problem sign-flip test does (these checkpoints differ)."""
    low, high = result["bootstrap"]["ci"]
    if not (low > 0 or high < 0):
        return 0
    test = result["run_level_test"]
    if test is not None:
        beyond = test["p"] < alpha
    else:
        beyond = not arms_only and result["per_problem"]["sign_flip_p"] < alpha
    return (1 if low > 0 else -1) if beyond else 0


def statistics_text(result: dict) -> str:
    """The numbers behind a `compare_arms` verdict in one line, the same in `compare` and
    opsd.research.grid: the difference, its bootstrap CI with the resample count, and the test that
    decided the verdict."""
    boot = result["bootstrap"]
    low, high = boot["ci"]
    runs_a, runs_b = result["arms"]["A"]["n"], result["arms"]["B"]["n"]
    resampled = "runs and problems" if max(runs_a, runs_b) > 1 else "problems"
    unit = result.get("unit", POINTS)
    parts = [f"difference {result['difference']:+.2f} {unit}, 95% CI [{low:+.2f}, {high:+.2f}] by a paired "
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



def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _ci(ci, spec: str = ".2f") -> str:
    return "-" if ci is None else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"

