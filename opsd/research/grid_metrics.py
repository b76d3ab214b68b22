"""What a grid's results say beyond pass@1 (issues 58 and 59): each arm's pass@1 (= avg@n),
pass@n, maj@n and distinct answers a problem against the baseline and against the grid file's
`compare_to` arms, the verdict's added sentences (pass@1 and pass@n disagreeing; with the grid's
`margin`, equivalence by TOST), and for swept grids pass@1 and pass@n at every step, the best
step, the last step against it and where the collapse watch fired. opsd/research/grid.py's
`results` puts them into results.json, its `markdown` into results.md.

The numbers are opsd.analysis's: `compare_arms` (paired hierarchical bootstrap over runs and
problems, run-level t test, exact per-problem tests) on each metric's per-problem numerators
(opsd.analysis.problem_metrics), TOST from opsd.analysis.evidence.
"""
from __future__ import annotations

import sys

from opsd.analysis import evidence
from opsd.analysis.comparison import compare_arms
from opsd.analysis.problem_metrics import resolve_metric
from opsd.analysis.reports import InputError, Run, check_comparable, load_run, sweep_reports
from opsd.analysis.significance import ALPHA, DEFAULT_BOOTSTRAP, shown_direction
from opsd.jsonl import read_jsonl
from opsd.run_folder import METRICS_FILE
from opsd.run_log import COLLAPSE_FIELD

DISTINCT = "distinct"


def metric_names(runs: list[Run]) -> list[str]:
    """The grid's metrics for these reports (n samples a problem): pass@1, pass@n, maj@n, distinct;
    the last two only where every sample has its `answer` (reports of every version do)."""
    n = runs[0].k
    answered = all(run.answer_ids is not None for run in runs)
    return list(dict.fromkeys(["pass@1", f"pass@{n}", *([f"maj@{n}", DISTINCT] if answered else [])]))


def arm_metrics(runs: list[Run]) -> dict:
    """{metric: {unit, mean, per_run}} of one arm's runs (mean over its runs of each run's mean)."""
    out = {}
    for name in metric_names(runs):
        metric = resolve_metric(name, runs[0].k)
        per_run = [metric.mean(row) for row in check_comparable(runs, metric)]
        out[name] = {"unit": metric.unit, "mean": sum(per_run) / len(per_run), "per_run": per_run}
    return out


def compare_metrics(ref: str, ref_runs: list[Run], arm: str, arm_runs: list[Run]) -> dict:
    """{metric: compare_arms result} of `arm` against `ref` on every metric of metric_names."""
    runs = [*ref_runs, *arm_runs]
    results = {}
    for name in metric_names(runs):
        metric = resolve_metric(name, runs[0].k)
        results[name] = compare_arms(ref_runs, arm_runs, check_comparable(runs, metric), DEFAULT_BOOTSTRAP, 0,
                                     names=(ref, arm), metric=metric)
    return results


def _numbers(result: dict) -> dict:
    test = result["run_level_test"]
    return {"difference": result["difference"], "ci": result["bootstrap"]["ci"],
            "run_level_p": None if test is None else test["p"], "sign_flip_p": result["per_problem"]["sign_flip_p"],
            "verdict_sentence": result["verdict_sentence"]}


def _says(direction: int) -> str:
    return {1: "gains", -1: "loses", 0: "shows no difference beyond noise"}[direction]


def disagreement(arm: str, results: dict, n: int) -> str | None:
    """One sentence when pass@1 and pass@n show different things (a gain at one with none or a
    loss at the other, either way round), by the verdict's rule (shown_direction); else None. Without
    a run-level test (one run a side) it speaks of the checkpoints, as the verdict then does."""
    if n < 2:
        return None
    at_1, at_n = results["pass@1"], results[f"pass@{n}"]
    one, many = shown_direction(at_1), shown_direction(at_n)
    if one == many:
        return None
    low, high = at_n["bootstrap"]["ci"]
    who = arm if at_1["run_level_test"] is not None else f"{arm}'s checkpoint"
    return (f"pass@1 and pass@{n} disagree: {who} {_says(one)} at pass@1 but {_says(many)} at pass@{n} "
            f"({at_n['difference']:+.2f} points, 95% CI [{low:+.2f}, {high:+.2f}])")


def equivalence(result: dict, ref_runs: list[Run], arm_runs: list[Run], margin: float) -> dict:
    """With the grid's margin: TOST on the two arms' pass@1 run means (opsd.analysis.evidence.tost)
    beside the difference test, and the verdict's words for the pair."""
    different = shown_direction(result, arms_only=True) != 0
    entry = {"margin": margin, "shown_different": different}
    try:
        tost = evidence.tost([r.avg for r in ref_runs], [r.avg for r in arm_runs], margin, ALPHA)
    except evidence.EvidenceError as exc:
        entry.update(tost=None, equivalent=False, untested=str(exc))
    else:
        entry.update(tost={k: tost[k] for k in ("p", "p_low", "p_high", "ci", "ci_level", "smallest_margin", "df")},
                     equivalent=tost["equivalent"])
    within = f"within {margin:g} points"
    if different and entry["equivalent"]:
        words = f"shown different, and shown equivalent {within}: a difference smaller than the margin"
    elif different:
        words = "shown different"
    elif entry["equivalent"]:
        words = f"shown equivalent {within}"
    else:
        words = f"neither shown different nor shown equivalent {within}"
    how = (f"TOST p = {entry['tost']['p']:.3g}" if entry["tost"] else
           f"no equivalence test: {entry['untested']}")
    entry["words"] = f"Against the margin of {margin:g} points stated before the run: {words} ({how})"
    return entry


def comparison(ref: str, ref_runs: list[Run], arm: str, arm_runs: list[Run], margin: float | None) -> dict:
    """`arm` against `ref`: pass@1's verdict (what `opsd stats compare` prints on avg@k), each
    metric's numbers, and the verdict with its added sentences before its numbers."""
    results = compare_metrics(ref, ref_runs, arm, arm_runs)
    pass1 = results["pass@1"]  # avg@n's numbers and words: `opsd stats compare --a REF --b ARM`
    entry = {"difference": pass1["difference"], "ci": pass1["bootstrap"]["ci"],
             "verdict_sentence": pass1["verdict_sentence"], "statistics": pass1["statistics"],
             "metrics": {name: _numbers(r) for name, r in results.items()}}
    added = []
    if note := disagreement(arm, results, ref_runs[0].k):
        entry["disagreement"] = note
        added.append(note)
    if margin is not None:
        entry["equivalence"] = equivalence(pass1, ref_runs, arm_runs, margin)
        added.append(entry["equivalence"]["words"])
    entry["verdict_words"] = ". ".join([pass1["verdict_sentence"], *added])
    entry["verdict"] = f"{entry['verdict_words']}. In numbers: {pass1['statistics']}"
    return entry


# --------------------------------------------------------------------------
# Swept grids: every checkpoint
# --------------------------------------------------------------------------

def collapse_steps(cells) -> dict[str, int | None]:
    """{seed: the step where the collapse watch fired in that seed's run, None where it did not}:
    the metrics.jsonl record with `opsd/collapse_warning` (opsd.callbacks, once a run)."""
    fired = {}
    for cell in cells:
        path = cell.folder / "run" / METRICS_FILE
        try:
            records = read_jsonl(path, InputError) if path.is_file() else []
        except InputError as exc:
            print(f"warning: collapse watch of {cell.name} not read: {exc}", file=sys.stderr)
            records = []
        steps = [r.get("step") for _, r in records if r.get(COLLAPSE_FIELD) == 1]
        fired[str(cell.seed)] = steps[0] if steps else None
    return fired


def _step_reports(cell) -> dict[int, Run]:
    """{step: the report of that checkpoint} of a swept cell (its sweep.json's rows; reports moved
    with the grid folder found in the cell's eval/). A missing report is load_run's ReportError."""
    return {step: load_run(path) for step, path in sweep_reports(cell.folder / "sweep.json")}


def sweep_entry(cells) -> dict:
    """An arm's swept checkpoints: pass@1 and pass@n at every step (means over its seeds, the steps
    every seed has), the best step by pass@1 (a tie to the later), and the last step's pass@1
    against the best's (compare_arms: paired by problem, each step's seeds resampled)."""
    per_seed = [_step_reports(c) for c in cells if c.report.is_file() and (c.folder / "sweep.json").is_file()]
    if not per_seed:
        return {}
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    if not steps:  # the seeds' sweeps share no checkpoint
        return {}
    n = per_seed[0][steps[0]].k
    table = {name: {} for name in ("pass@1", f"pass@{n}")}
    for step in steps:
        runs = [s[step] for s in per_seed]
        for name in table:
            metric = resolve_metric(name, n)
            table[name][str(step)] = sum(metric.mean(row) for row in check_comparable(runs, metric)) / len(runs)
    best, last = max(steps, key=lambda s: (table["pass@1"][str(s)], s)), steps[-1]
    entry = {"per_step_pass": table, "best_step": best, "last_vs_best": None}
    if best != last:
        best_runs, last_runs = [s[best] for s in per_seed], [s[last] for s in per_seed]
        result = compare_arms(best_runs, last_runs, check_comparable([*best_runs, *last_runs]), DEFAULT_BOOTSTRAP, 0,
                              names=(f"step {best}", f"step {last}"))
        entry["last_vs_best"] = {"best_step": best, "last_step": last, **_numbers(result)}
    return entry


def sweep_line(name: str, arm: dict) -> str:
    """One line: an arm's best step, its last step against it, and the collapse watch."""
    pass1 = arm["per_step_pass"]["pass@1"]
    best = arm["best_step"]
    versus = arm["last_vs_best"]
    if versus is None:
        head = f"{name}: the best step by pass@1 is the last, {best} ({pass1[str(best)]:.2f})"
    else:
        low, high = versus["ci"]
        last = versus["last_step"]
        p = "-" if versus["run_level_p"] is None else f"{versus['run_level_p']:.3g}"
        head = (f"{name}: best step {best} (pass@1 {pass1[str(best)]:.2f}); the last, step {last} "
                f"({pass1[str(last)]:.2f}), minus the best: {versus['difference']:+.2f} points, 95% CI "
                f"[{low:+.2f}, {high:+.2f}], run-level p {p} (the best is picked on these problems: optimistic)")
    return f"{head}; {collapse_words(arm.get('collapse_warning', {}))}"


def collapse_words(fired: dict) -> str:
    if not fired:
        return "collapse watch: no finished run"
    said = [f"seed {seed} at step {step}" if step is not None else f"not in seed {seed}"
            for seed, step in fired.items()]
    return "collapse watch fired " + ", ".join(said) if any(v is not None for v in fired.values()) else (
        "collapse watch did not fire (" + ", ".join(f"seed {s}" for s in fired) + ")")


# --------------------------------------------------------------------------
# results.md
# --------------------------------------------------------------------------

def _cell(entry: dict | None, versus: dict | None) -> str:
    """"mean (difference [95% CI], p run-level)", the mean alone for the arm compared with, - for a
    metric its reports cannot give (no answers)."""
    if entry is None or versus is None:
        return "-"
    mean = f"{entry['mean']:.2f}"
    if "difference" not in versus:
        return mean
    low, high = versus["ci"]
    p = "-" if versus["run_level_p"] is None else f"{versus['run_level_p']:.3g}"
    return f"{mean} ({versus['difference']:+.2f} [{low:+.2f}, {high:+.2f}], p {p})"


def _columns(table: dict) -> list[str]:
    """Every metric some arm has, in the order of metric_names."""
    names = [m for a in table["arms"].values() for m in a.get("metrics", {})]
    return sorted(set(names), key=names.index)


def _header(names: list[str]) -> str:
    return " | ".join("distinct answers a problem" if n == DISTINCT else n for n in names)


def metrics_lines(table: dict) -> list[str]:
    """results.md's table of every metric against the baseline, and one per `compare_to` arm."""
    names = _columns(table)
    if not names:
        return []
    baseline = table["grid"]["baseline"]
    n = names[1].split("@")[1] if len(names) > 1 else "1"
    lines = ["", f"pass@1 (= avg@{n}), pass@{n} (a problem counts when one of its {n} samples is correct), maj@{n} "
                 f"(when the majority answer of its {n} samples is) and distinct answers a problem (normalised final "
                 "answers among its samples; - for reports without answers), means over each arm's runs; in "
                 "brackets the difference to "
                 f"`{baseline}`, its 95% CI (the paired bootstrap of the verdicts) and the run-level p (-: one run a "
                 "side allows none). `python -m opsd.analysis.stats compare --metric pass@K | maj@K | distinct` "
                 "gives each with its verdict.", "",
             f"| arm | {_header(names)} |", "|---|" + "---|" * len(names)]
    for name, arm in table["arms"].items():
        if "metrics" in arm:
            cells = [_cell(arm["metrics"].get(m), arm["metrics"].get(m)) for m in names]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    references = table.get("compare_to") or {}
    if references:
        lines += ["", "Against the grid's reference arms (`compare_to`), the same columns; the verdict on pass@1:", "",
                  f"| arm | against | {_header(names)} | verdict |", "|---|---|" + "---|" * (len(names) + 1)]
        for ref, rows in references.items():
            for name, row in rows.items():
                cells = [_cell(table["arms"][name]["metrics"].get(m), row["metrics"].get(m)) for m in names]
                lines.append(f"| {name} | {ref} | " + " | ".join(cells) + f" | {row['verdict_words']} |")
    return lines


def sweep_lines(table: dict) -> list[str]:
    """results.md's swept part: pass@1 and pass@n per step for each arm, then each arm's best step,
    last against best and collapse watch in one line."""
    swept = {name: a for name, a in table["arms"].items() if a.get("per_step_pass")}
    if not swept:
        return []
    columns = [(name, metric) for name, a in swept.items() for metric in a["per_step_pass"]]
    steps = sorted({int(s) for a in swept.values() for s in a["per_step_pass"]["pass@1"]})
    lines = ["", "pass@1 and pass@n per checkpoint, mean over each arm's seeds (each checkpoint's eval report):", "",
             "| step | " + " | ".join(f"{name} {metric}" for name, metric in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for step in steps:
        values = [swept[name]["per_step_pass"][metric].get(str(step)) for name, metric in columns]
        lines.append(f"| {step} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |")
    lines += ["", *[f"- {sweep_line(name, a)}" for name, a in swept.items()]]
    return lines


def collapse_lines(table: dict) -> list[str]:
    """Without a sweep: where the collapse watch fired, when it did in some run."""
    fired = {name: a["collapse_warning"] for name, a in table["arms"].items()
             if any(v is not None for v in a.get("collapse_warning", {}).values()) and not a.get("per_step_pass")}
    return ["", *[f"- {name}: {collapse_words(f)}" for name, f in fired.items()]] if fired else []
