"""The numbers of `opsd stats summary` and `compare` (one arm's spread over its runs; arm B against
arm A with its verdict) and of the checkpoint sweep (the checkpoints of one run against its last,
`python -m opsd.evaluation RUN_FOLDER`), from reports already read (opsd.analysis.reports) with
the statistics of opsd.analysis.significance. The text they print is opsd.analysis.stats's.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from opsd.analysis.problem_metrics import Metric, resolve_metric
from opsd.analysis.reports import Run, check_comparable
from opsd.analysis.significance import (
    ALPHA,
    DEFAULT_BOOTSTRAP,
    _ci,
    _f,
    assumed_noise_interval,
    bootstrap_difference,
    bootstrap_mean,
    describe,
    problem_scores,
    run_level_test,
    sampling_se,
    sign_flip_test,
    sign_test,
    statistics_text,
    verdict,
)


def summarize_runs(runs: Sequence[Run], counts: np.ndarray, n_resamples: int, seed: int,
                   metric: Metric | None = None) -> dict:
    """All numbers of `summary` for runs already checked by check_comparable; `counts` [run,
    problem] are the metric's numerators (check_comparable(runs, metric); default avg@k: correct
    counts). A run's value is under "avg" (its mean over problems) whatever the metric."""
    k = runs[0].k
    metric = metric or resolve_metric(None, k)
    accuracy = metric.values(counts)  # [run, problem], in the metric's unit
    binomial = metric.kind == "avg" or metric.name == "pass@1"  # the sampling se is a binomial's
    per_run = []
    for i, run in enumerate(runs):
        boot = bootstrap_mean(accuracy[i], n_resamples, seed)
        per_run.append({"file": run.path, "checkpoint": run.checkpoint, "avg": metric.mean(counts[i]),
                        "sampling_se": sampling_se(counts[i], k) if binomial else None, "problems_ci": boot["ci"],
                        "problems_se": boot["se"]})
    result = {"command": "summary", "metric": metric.name, "unit": metric.unit, "definition": metric.definition,
              "dataset": runs[0].dataset, "settings": runs[0].settings, "num_problems": int(counts.shape[1]),
              "samples_per_problem": k, "runs": per_run, "across_runs": None}
    if len(runs) >= 2:
        across = describe([r["avg"] for r in per_run])
        sampling = [r["sampling_se"] for r in per_run if r["sampling_se"] is not None]
        across["sampling_only_sd"] = math.sqrt(sum(s * s for s in sampling) / len(sampling)) if sampling else None
        across["bootstrap"] = bootstrap_mean(accuracy, n_resamples, seed)
        result["across_runs"] = across
    return result


def compare_arms(runs_a: Sequence[Run], runs_b: Sequence[Run], counts: np.ndarray, n_resamples: int,
                 seed: int, run_sd: float | None = None, names: Sequence[str] = ("A", "B"),
                 metric: Metric | None = None) -> dict:
    """All numbers of `compare`; `counts` [run, problem] holds arm A's runs, then arm B's: the
    metric's numerators (default avg@k: correct counts); `names` name the arms in the verdict's
    sentence. "verdict" is that sentence, then the statistics (statistics_text) after "In
    numbers:"; "verdict_sentence" and "statistics" hold each part."""
    k = runs_a[0].k
    metric = metric or resolve_metric(None, k)
    counts_a, counts_b = counts[:len(runs_a)], counts[len(runs_a):]
    means_a, means_b = [metric.mean(row) for row in counts_a], [metric.mean(row) for row in counts_b]
    boot = bootstrap_difference(metric.values(counts_a), metric.values(counts_b), n_resamples, seed)
    run_test = run_level_test(means_a, means_b)
    scores = problem_scores(counts_a, counts_b)  # integers: the numerators share one denominator
    per_problem = {**sign_test(scores), "sign_flip_p": sign_flip_test(scores)}
    per_problem["sign_test_p"] = per_problem.pop("p")
    diff = boot["diff"]
    assumed = assumed_noise_interval(diff, run_sd, len(runs_a), len(runs_b)) if run_sd else None
    sentence = verdict(diff, boot["ci"], len(runs_a), len(runs_b), run_p=run_test and run_test["p"],
                       problem_p=per_problem["sign_flip_p"], assumed=assumed, names=names,
                       num_problems=int(counts.shape[1]), unit=metric.unit)
    arms = {}
    for label, runs, means in (("A", runs_a, means_a), ("B", runs_b, means_b)):
        arms[label] = {"files": [r.path for r in runs], "per_run": means, **describe(means)}
    result = {"command": "compare", "metric": metric.name, "unit": metric.unit, "definition": metric.definition,
              "dataset": runs_a[0].dataset, "settings": runs_a[0].settings, "num_problems": int(counts.shape[1]),
              "samples_per_problem": k, "arms": arms, "difference": diff, "bootstrap": boot,
              "run_level_test": run_test, "per_problem": per_problem, "assumed_run_sd": assumed,
              "verdict_sentence": sentence}
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

