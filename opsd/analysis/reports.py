"""Reading and checking the evaluation's reports (`eval_<name>.json`, opsd/evaluation/evaluate.py)
for the statistics: one file is one training run of an arm (`load_run`), and runs compared with
each other must share the dataset, the frozen settings block and the problem set
(`check_comparable`); otherwise one line `error: FILE: ...` (ReportError), exit status 2.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
    correct: np.ndarray | None = None     # [problem, sample] each sample's `correct`
    # [problem, sample] each sample's normalised answer as a number, 0, 1, ... in the order first
    # seen in its problem, -1 without an answer; None when a sample has no `answer` field
    # (answer_error says where): the metrics that read answers (opsd.analysis.problem_metrics) refuse it
    answer_ids: np.ndarray | None = None
    answer_error: str | None = None

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

    keys, counts, flag_rows, answer_rows, answer_error, seen = [], [], [], [], None, set()
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
        flag_rows.append(flags)
        answers = [s.get("answer", False) for s in samples]
        bad = next((j for j, a in enumerate(answers, start=1) if a is not None and not isinstance(a, str)), None)
        if bad is not None and answer_error is None:
            answer_error = f"problem {i} sample {bad} has none"
        answer_rows.append(answer_ids(answers) if answer_error is None else None)

    run = Run(path=path, dataset=_dataset_label(report["dataset"]), settings=report["settings"],
              checkpoint=str(report.get("checkpoint", "?")), keys=tuple(keys),
              num_correct=np.asarray(counts, dtype=np.int64), k=k, correct=np.asarray(flag_rows, dtype=bool),
              answer_ids=None if answer_error else np.asarray(answer_rows, dtype=np.int64),
              answer_error=answer_error)
    metrics = report.get("metrics")
    stated = metrics.get(f"avg@{k}") if isinstance(metrics, dict) else None
    if isinstance(stated, (int, float)) and abs(stated - run.avg) > 1e-6:
        raise ReportError(path, f"metrics avg@{k} is {stated} but its samples give {run.avg:.4f}")
    return run


def sweep_reports(sweep_path) -> list[tuple[int, Path]]:
    """(step, report) of each checkpoint a cell's sweep.json lists (opsd/evaluation/sweep.py), in
    its order. A report that moved with its grid folder is found where the cell keeps its reports
    (CELL/eval/, by its file name). A missing or malformed sweep.json is a ReportError naming it;
    whether each report is there is the caller's (load_run says so)."""
    sweep_path = Path(sweep_path)
    try:
        sweep = json.loads(sweep_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(sweep_path, "no such file (a checkpoint sweep's table)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(sweep_path, f"not readable JSON ({exc})") from None
    rows = sweep.get("checkpoints") if isinstance(sweep, dict) else None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("file"), str) for r in rows):
        raise ReportError(sweep_path, "no 'checkpoints' list of rows with an integer 'step' and a report 'file'")
    found = []
    for row in rows:
        path = Path(row["file"])
        found.append((row["step"], path if path.is_file() else sweep_path.parent / "eval" / path.name))
    return found


def answer_ids(answers) -> list[int]:
    """Each answer's number in one problem: its normalised form (opsd.grading.normalize_answer, what
    the majority vote compares) numbered 0, 1, ... in the order first seen; -1 for no answer."""
    from opsd.grading import normalize_answer

    numbers: dict[str, int] = {}
    return [-1 if a is None else numbers.setdefault(normalize_answer(a), len(numbers)) for a in answers]


def _dataset_label(dataset: str) -> str:
    """A report's dataset as reports now name it: reports written before the tiny sets were
    named by seed and size say `tiny` or `tiny:SEED`, and compare with `tiny:SEED:N` ones of
    the same set (opsd.evaluation.evaluate.dataset_label)."""
    if dataset == "tiny" or dataset.startswith("tiny:"):
        from opsd import tiny_default  # standard library at import

        return tiny_default.eval_set_name(dataset)
    return dataset


def check_comparable(runs: Sequence[Run], metric=None) -> np.ndarray:
    """Same dataset, settings and problem set in every run (checked against the
    first one). Returns correct counts [run, problem], or with `metric` (an
    opsd.analysis.problem_metrics.Metric) its integer numerators, problems sorted by (text, gold)
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
        values = run.num_correct if metric is None else metric.numerators(run)
        for key, count in zip(run.keys, values, strict=True):
            row[order[key]] = count
        rows.append(row)
    return np.stack(rows)

