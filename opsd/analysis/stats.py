"""Statistics for comparing evaluation runs: is arm B better than arm A, or is it noise?

    python -m opsd.analysis.stats summary RUN.json [RUN2.json ...]            [--bootstrap N] [--seed S] [--json OUT]
                                                                    [--plot FILE.png] [--metric METRIC]
    python -m opsd.analysis.stats compare --a A1.json [A2.json ...] --b B1.json [B2.json ...]
                                [--bootstrap N] [--seed S] [--run-sd SD] [--json OUT] [--plot FILE.png]
                                [--metric avg@k | pass@K | maj@K | distinct]
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
avg@k in percentage points, recomputed from the per-sample `correct` flags, or with `--metric`
pass@K, maj@K (points) or distinct answers a problem, from the samples' flags and answers
(opsd.analysis.problem_metrics); the output and --json name the metric and its unit.

The work is split by job: reading and checking the reports (opsd.analysis.reports), the
statistics and the verdict (opsd.analysis.significance: where the noise comes from and which
number sees which part of it), the numbers of each command and of the checkpoint sweep
(opsd.analysis.comparison); this module prints them and is the command line. Every name
callers used from here is still importable from here. Standard library, numpy and scipy (with
`--plot`, matplotlib through opsd.analysis.plots).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from opsd.analysis.comparison import (  # noqa: F401  (re-exported: callers import them from here)
    compare_arms,
    format_sweep_markdown,
    summarize_runs,
    sweep_checkpoints,
    sweep_final_line,
)
from opsd.analysis.problem_metrics import DEFINITIONS, SYNTAX, Metric, parse_metric, resolve_metric
from opsd.analysis.reports import (  # noqa: F401  (re-exported)
    InputError,
    ReportError,
    Run,
    check_comparable,
    load_run,
)
from opsd.analysis.significance import (  # noqa: F401  (re-exported)
    ALPHA,
    CHECKPOINTS_VS_ARMS,
    CONFIDENCE,
    DEFAULT_BOOTSTRAP,
    MIN_BOOTSTRAP,
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
    single_run_t,
    statistics_text,
    t_cdf,
    t_ppf,
    t_two_sided_p,
    verdict,
    welch_t,
)
from opsd.analysis.tokens import (
    TokensError,
    format_grid_table,
    mean_or_none,
    read_sampled_tokens,
    tokens_at,
)
from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE


def _metric_line(result: dict) -> list[str]:
    """The metric's unit and definition, for a metric other than the default avg@k (whose output
    stays as it always was)."""
    if result["metric"].startswith("avg@"):
        return []
    return [f"metric {result['metric']}: {result['definition']}"]


def format_summary(result: dict) -> str:
    metric = result["metric"]
    lines = [(f"summary {metric} | dataset {result['dataset']} | {result['num_problems']} problems x "
              f"{result['samples_per_problem']} samples | {len(result['runs'])} run(s)"), *_metric_line(result)]
    width = max(len("run"), *(len(Path(r["file"]).name) for r in result["runs"]))
    lines.append(f"{'run':<{width}}  {metric:>7}  {'sampling se':>11}  problems 95% CI (bootstrap)")
    for r in result["runs"]:
        lines.append(f"{Path(r['file']).name:<{width}}  {r['avg']:>7.2f}  {_f(r['sampling_se']):>11}  "
                     f"{_ci(r['problems_ci'])}")
    across = result["across_runs"]
    binomial = metric.startswith("avg@") or metric == "pass@1"  # a share of samples: it has a sampling se
    if across:
        boot = across["bootstrap"]
        lines += [(f"across runs: mean {across['mean']:.2f}, sd {across['sd']:.2f}, se {across['se']:.2f}, "
                   f"95% CI {_ci(across['ci'])} (t, df {across['n'] - 1})"),
                  *([f"  evaluation sampling alone would give a run-to-run sd of about "
                     f"{_f(across['sampling_only_sd'])}"] if binomial else []),
                  (f"  runs + problems resampled ({boot['n_resamples']} bootstrap resamples, seed {boot['seed']}): "
                   f"95% CI {_ci(boot['ci'])}")]
    lines += ["what each number captures:",
              "  sampling se      re-evaluating the same checkpoint (other sampling seed), same problems"
              if binomial else "  sampling se      avg@k and pass@1 only (a share of samples); - for this metric",
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
              f"{result['samples_per_problem']} samples"), *_metric_line(result),
             f"arm  runs     mean      sd      se  per-run {metric}"]
    for label, arm in result["arms"].items():
        per_run = " ".join(f"{v:.2f}" for v in arm["per_run"])
        lines.append(f"{label:<3}  {arm['n']:>4}  {arm['mean']:>7.2f}  {_f(arm['sd']):>6}  {_f(arm['se']):>6}  "
                     f"{per_run}")
    for label, arm in result["arms"].items():
        lines.append(f"{label}: " + ", ".join(Path(f).name for f in arm["files"]))
    lines.append(f"B - A: {result['difference']:+.2f} {result['unit']}")
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

    metric, unit = result["metric"], result.get("unit", "points")
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
        return [IntervalPanel("each run, and the arm", f"{metric} ({unit})", tuple(rows))], f"summary {head}"
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
    panels = [IntervalPanel("arms (dots: run means)", f"{metric} ({unit})", tuple(arms)),
              IntervalPanel("B - A", unit, tuple(differences), zero_line=True)]
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
    common.add_argument("--metric", default="avg@k", metavar="METRIC",
                        help=f"what is compared, per problem: {SYNTAX} (default avg@k; each defined below)")
    metrics = {"avg@k": DEFINITIONS["avg"], "pass@K": DEFINITIONS["pass"], "maj@K": DEFINITIONS["maj"],
               "distinct": DEFINITIONS["distinct"]}
    epilog = "metrics (n: the samples a problem in the reports):\n" + "\n".join(
        f"  {name:<9} {text}" for name, text in metrics.items())
    listed = {"parents": [common], "epilog": epilog, "formatter_class": argparse.RawDescriptionHelpFormatter}
    summary = commands.add_parser("summary", help="avg@k per run and across runs", **listed)
    summary.add_argument("runs", nargs="+", metavar="RUN.json")
    compare = commands.add_parser("compare", help="difference of means B - A", **listed)
    compare.add_argument("--a", nargs="+", required=True, metavar="RUN.json", help="arm A: one report per run")
    compare.add_argument("--b", nargs="+", required=True, metavar="RUN.json", help="arm B: one report per run")
    compare.add_argument("--run-sd", type=float, metavar="SD",
                         help="assumed per-run sd in the metric's unit (e.g. 1.48 points, the anchor's avg@12); "
                              "shown as an extra interval, and used by the verdict when no run-level test is "
                              "possible (1 vs 1)")
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


def _metric_counts(runs: Sequence[Run], spec: str) -> tuple[Metric, np.ndarray]:
    """The metric of --metric for these runs and its numerators [run, problem]; the runs are
    checked against each other first, so that reports of other settings say so before a K is
    measured against their n."""
    counts = check_comparable(runs)
    metric = resolve_metric(spec, runs[0].k)
    return metric, counts if metric.kind == "avg" else check_comparable(runs, metric)


def main(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.stats") -> int:
    """The command line; returns the exit status (0, or 2 for bad inputs)."""
    args = parse_args(argv, prog)
    if args.command == "tokens":
        return _tokens_main(args)
    if args.command in ("equivalence", "reach"):
        from opsd.analysis import evidence

        return evidence.main(args, grid_table, (InputError, TokensError))
    try:
        if args.bootstrap < MIN_BOOTSTRAP:
            raise InputError(f"--bootstrap must be at least {MIN_BOOTSTRAP}, got {args.bootstrap}")
        if getattr(args, "run_sd", None) is not None and not (math.isfinite(args.run_sd) and args.run_sd > 0):
            raise InputError(f"--run-sd must be a positive number, got {args.run_sd}")
        if args.plot:
            _plot_output(args.plot)  # before the work: a bad path costs no bootstrap and writes no --json
        parse_metric(args.metric)  # a misspelt metric costs no file reading
        if args.command == "summary":
            runs = [load_run(p) for p in args.runs]
            metric, counts = _metric_counts(runs, args.metric)
            result = summarize_runs(runs, counts, args.bootstrap, args.seed, metric)
            text = format_summary(result)
        else:
            runs_a, runs_b = [load_run(p) for p in args.a], [load_run(p) for p in args.b]
            metric, counts = _metric_counts([*runs_a, *runs_b], args.metric)
            result = compare_arms(runs_a, runs_b, counts, args.bootstrap, args.seed, args.run_sd, metric=metric)
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
