"""The metrics a comparison can be on, per problem from a report's samples (each sample's
`correct` flag and extracted `answer`, opsd/evaluation/evaluate.py):

    avg@k     (the default) the share of the problem's n samples that are correct (= pass@1)
    pass@K    the chance that K of the n samples, drawn without replacement, include a correct one:
              the unbiased estimator 1 - C(n - c, K) / C(n, K) (c correct; 1 <= K <= n)
    maj@K     the chance that the majority answer of K of the n samples is correct: the mean over
              all C(n, K) subsets of the vote within the subset (K = n: the report's own vote)
    distinct  the number of distinct final answers among the n samples

Answers are compared in normalised form (opsd.grading.normalize_answer); samples without an
answer do not vote and are not counted; a vote tie goes to the answer seen first, and a subset in
which nobody answers votes wrong: opsd.evaluation.metrics.majority_vote's rule (a vote's
correctness is that of the first sample giving the winning answer, as the report's).

Each metric is an integer numerator per problem over one denominator: correct samples over n
(avg@k), subsets over C(n, K) (pass@K, maj@K), answers over 1 (distinct). The statistics
(opsd.analysis.significance) work on the numerators, so the per-problem sign-flip test stays exact
for every metric. avg@k, pass@K and maj@K are in points (percent); distinct in answers a problem.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from opsd.analysis.reports import InputError, ReportError, Run

# maj@K with K < n enumerates every subset of K samples of a problem: past this many a problem it
# would take minutes on a few hundred problems (n = 16 stays under it for every K).
MAX_SUBSETS = 20_000
POINTS = "points"
ANSWERS = "distinct answers a problem"
# One line each, for --help and the JSON (`definition`).
DEFINITIONS = {
    "avg": "the share of a problem's n samples that are correct, in points (the default; = pass@1)",
    "pass": "the chance that K of a problem's n samples (drawn without replacement) include a correct one: "
            "1 - C(n-c, K) / C(n, K), c correct, 1 <= K <= n, in points",
    "maj": "the chance that the majority answer of K of a problem's n samples is correct: the mean over all "
           "C(n, K) subsets of K (K = n: the report's majority vote), in points",
    "distinct": "the number of distinct final answers among a problem's n samples (normalised; samples "
                "without an answer not counted), in answers a problem",
}
SYNTAX = "avg@k, pass@K, maj@K or distinct"


@dataclass(frozen=True)
class Metric:
    """One metric bound to the reports' n samples a problem."""
    name: str         # avg@8, pass@4, maj@8, distinct
    kind: str         # a key of DEFINITIONS
    k: int            # K (avg@k: n; distinct: n)
    denominator: int  # of the per-problem numerators
    scale: float      # 100: points; 1: answers
    unit: str

    @property
    def definition(self) -> str:
        return DEFINITIONS[self.kind]

    def values(self, numerators) -> np.ndarray:
        """Per-problem values in the metric's unit from numerators (any shape)."""
        return self.scale * numerators / self.denominator

    def mean(self, numerators) -> float:
        """The mean over problems of one run's numerators [problem]."""
        numerators = np.asarray(numerators)
        return self.scale * float(numerators.sum()) / (self.denominator * numerators.size)

    def numerators(self, run: Run) -> np.ndarray:
        """[problem] The run's integer numerators, problems in report order."""
        if self.kind == "avg":
            return run.num_correct
        if self.kind == "pass":
            n = run.k
            return np.array([math.comb(n, self.k) - math.comb(n - int(c), self.k) for c in run.num_correct],
                            dtype=np.int64)
        if run.answer_ids is None:
            raise ReportError(run.path, f"{self.name} needs every sample's 'answer' (a string or null); "
                                        f"{run.answer_error}")
        if self.kind == "distinct":
            return (run.answer_ids.max(axis=1) + 1).astype(np.int64)
        votes: dict[tuple, int] = {}  # problems with the same answers and grades vote alike
        out = np.empty(len(run.keys), dtype=np.int64)
        for i, (ids, correct) in enumerate(zip(run.answer_ids, run.correct, strict=True)):
            key = (ids.tobytes(), correct.tobytes())
            if key not in votes:
                votes[key] = majority_numerator(ids, correct, self.k)
            out[i] = votes[key]
        return out


def parse_metric(text: str) -> tuple[str, int | None]:
    """(kind, K) of a --metric value (K None for avg@k and distinct); InputError otherwise."""
    if text in ("avg@k", "distinct"):
        return text.split("@")[0], None
    match = re.fullmatch(r"(avg|pass|maj)@(-?\d+)", text)
    if not match:
        raise InputError(f"--metric {text!r}: expected {SYNTAX} (K a whole number of samples)")
    return match.group(1), int(match.group(2))


def resolve_metric(text: str | None, n: int) -> Metric:
    """The metric of a --metric value (None: avg@k) for reports with n samples a problem; one
    InputError line for a K outside 1..n, avg@N with N other than n, or a maj@K whose subsets are
    too many to enumerate."""
    kind, k = parse_metric(text or "avg@k")
    if kind == "distinct":
        return Metric("distinct", "distinct", n, 1, 1.0, ANSWERS)
    if kind == "avg":
        if k is not None and k != n:
            raise InputError(f"--metric {text}: these reports have n = {n} samples a problem, so avg@k is "
                             f"avg@{n}; for fewer samples use pass@K")
        return Metric(f"avg@{n}", "avg", n, n, 100.0, POINTS)
    if not 1 <= k <= n:
        raise InputError(f"--metric {text}: K must be from 1 to n = {n} (the samples a problem in these reports), "
                         f"got {k}")
    subsets = math.comb(n, k)
    if kind == "maj" and subsets > MAX_SUBSETS:
        raise InputError(f"--metric {text}: C({n}, {k}) = {subsets} subsets a problem are too many to enumerate "
                         f"(at most {MAX_SUBSETS}); maj@{n} is the report's own vote")
    return Metric(f"{kind}@{k}", kind, k, subsets, 100.0, POINTS)


@lru_cache(maxsize=16)
def _subsets(n: int, k: int) -> np.ndarray:
    """[subset, k] every subset of k of range(n), each in increasing order."""
    return np.array(list(itertools.combinations(range(n), k)), dtype=np.int64).reshape(-1, k)


def majority_numerator(answer_ids: np.ndarray, correct: np.ndarray, k: int) -> int:
    """How many of the C(n, k) subsets of one problem's n samples vote a correct answer.
    `answer_ids` [n]: each sample's normalised answer as an integer (-1: no answer); `correct` [n].
    In a subset (samples in their order) the answer with the most votes wins, a tie to the one
    seen first; the vote is correct when the first sample giving the winning answer is; a subset
    without answers votes wrong (opsd.evaluation.metrics.majority_vote and problem_summary)."""
    classes = int(answer_ids.max()) + 1
    if classes == 0:
        return 0
    subsets = _subsets(len(answer_ids), k)
    hits = answer_ids[subsets][:, :, None] == np.arange(classes)  # [subset, position, answer]
    votes = hits.sum(axis=1)                                      # [subset, answer]
    first = hits.argmax(axis=1)                                   # position of each answer's first vote
    rank = np.where(votes > 0, votes * (k + 1) - first, -1)       # more votes first, then seen earlier
    winner = rank.argmax(axis=1)
    rows = np.arange(len(subsets))
    voted = subsets[rows, first[rows, winner]]
    return int(((votes[rows, winner] > 0) & correct[voted]).sum())
