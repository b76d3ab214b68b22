"""The evaluation's metrics over graded samples (docs/SPEC.md §5): pass@k (unbiased estimator),
majority vote, each problem's summary, the report's `metrics` and the FINAL line.

Pure functions of the graded samples (opsd.grading grades them); opsd.evaluation.evaluate writes
them into its report, and anything that reads or builds a report can use them alone.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from opsd.grading import GRADED_BY, normalize_answer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021):
    the chance that k samples drawn without replacement include a correct one."""
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample holding the most frequent answer (compared in
    normalised form; samples without an answer do not vote). Ties go to the
    answer that appeared first. None when no sample has an answer."""
    counts: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        key = normalize_answer(answer)
        counts[key] += 1
        first_seen.setdefault(key, index)
    if not counts:
        return None
    winner = max(counts, key=lambda key: (counts[key], -first_seen[key]))
    return first_seen[winner]


def problem_summary(samples: Sequence[dict]) -> dict:
    """Per-problem aggregates from graded samples (dicts with answer, correct)."""
    n, c = len(samples), sum(s["correct"] for s in samples)
    voted = majority_vote([s["answer"] for s in samples])
    return {
        "num_correct": c,
        "accuracy": c / n,
        "majority_answer": None if voted is None else samples[voted]["answer"],
        "majority_correct": voted is not None and samples[voted]["correct"],
    }


def summarize(problems: Sequence[dict], k: int) -> dict:
    """Aggregate metrics over problems that each hold `k` graded samples.
    Rates are percentages."""
    samples = [s for p in problems for s in p["samples"]]
    num_correct = sum(s["correct"] for s in samples)
    metrics = {
        "k": k,
        "num_problems": len(problems),
        "num_samples": len(samples),
        "num_correct": num_correct,
        f"avg@{k}": 100.0 * num_correct / len(samples),
    }
    for j in range(1, k + 1):
        metrics[f"pass@{j}"] = 100.0 * _mean(pass_at_k(k, p["num_correct"], j) for p in problems)
    metrics[f"maj@{k}"] = 100.0 * _mean(p["majority_correct"] for p in problems)
    metrics["truncated_rate"] = 100.0 * _mean(s["truncated"] for s in samples)
    metrics["no_answer_rate"] = 100.0 * _mean(s["answer"] is None for s in samples)
    metrics["mean_num_tokens"] = _mean(s["num_tokens"] for s in samples)
    metrics["graded_by"] = graded_by_counts(samples)
    return metrics


def graded_by_counts(samples: Sequence[dict]) -> dict[str, int]:
    """How many samples were graded each way (GRADED_BY; every one listed, zeros
    included). Samples of a report written before the field existed count as
    "unrecorded", listed only when there are some."""
    counts = Counter(s.get("graded_by", "unrecorded") for s in samples)
    return {**{name: counts.pop(name, 0) for name in GRADED_BY}, **dict(sorted(counts.items()))}


def final_line(num_correct: int, num_samples: int, num_problems: int, k: int) -> str:
    accuracy = 100.0 * num_correct / num_samples
    return (f"FINAL avg@{k} accuracy: {accuracy:.2f}% "
            f"({num_correct}/{num_samples} solutions correct on {num_problems} problems)")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
