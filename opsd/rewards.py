"""GRPO's verifiable reward: the evaluation's own grader (opsd.grading, docs/SPEC.md §5) on each
completion against its row's reference answer. 1.0 when the grader says correct, 0.0 otherwise
(a wrong answer, no \\boxed{}). A truncated completion (it hit max_completion_length) is graded
like any other, as the evaluation grades it: the last \\boxed{} of its text counts (a box the
cut left open is none), and without one it is wrong. TRL 1.16 does the same by default (its
reward functions see truncated completions; `mask_truncated_completions` is off).

What cannot be graded is an error, never a silent 0: a row without a reference answer (no
`Answer` and no \\boxed{} in its `solution`) is refused before training (`check_gradable`) and
again here, and a grader that fails raises opsd.grading.GradingError.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from opsd.answers import reference_answer
from opsd.grading import grade_sample


class UngradableError(ValueError):
    """A training row has no reference answer to reward completions against (one line)."""


def gold_answer(row: Mapping, where: str = "a training row") -> str:
    answer = reference_answer(row)
    if answer is None:
        problem = " ".join(str(row.get("problem", "")).split())[:60]
        raise UngradableError(f"{where} has no reference answer to reward against (no Answer, no \\boxed{{}} in its "
                              f"solution): problem {problem!r}")
    return answer


def check_gradable(rows: Iterable[Mapping], name: str = "the training data") -> None:
    """Every row has a reference answer (UngradableError naming the first row that has none)."""
    for i, row in enumerate(rows):
        gold_answer(row, f"{name} row {i}")


def grader_rewards(texts: Sequence[str], truncated: Sequence[bool], rows: Sequence[Mapping]) -> list[float]:
    """The reward of each decoded completion against its row's reference answer."""
    rewards = []
    for text, cut, row in zip(texts, truncated, rows, strict=True):
        result, _ = grade_sample(text, gold_answer(row), cut)
        rewards.append(1.0 if result.correct else 0.0)
    return rewards
