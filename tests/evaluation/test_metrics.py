"""The evaluation's metrics (opsd/evaluation/metrics.py): pass@k, majority vote, the report's `metrics`
(with `graded_by`, how each sample was graded) and the FINAL line."""
import types

import pytest
from answer_workers import fake_worker, installed_workers

from opsd import grading
from opsd.evaluation import evaluate
from opsd.evaluation.metrics import final_line, graded_by_counts, majority_vote, pass_at_k, problem_summary, summarize

# ---------------------------------------------------------------- metrics and the FINAL line

@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6),
    (12, 3, 12, 1.0), (12, 0, 12, 0.0), (12, 6, 1, 0.5), (5, 2, 3, 0.9),
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("answers, winner", [
    (["5", "7", "7", None], 1),
    (["7", "5", "5", "7"], 0),            # tie: the answer seen first wins
    (["5", None, "7", "7", "5"], 0),
    ([None, None], None),
    (["033", "5", "33", "5 "], 0),        # equal answers vote together after normalising (033 == 33)
    ([None, r"\dfrac12", r"\frac12", "1"], 1),
])
def test_majority_vote(answers, winner):
    assert majority_vote(answers) == winner


def graded(*rows):
    """Problems from rows of answers; gold is "1". '1' correct, others wrong, None no answer."""
    problems = []
    for answers in rows:
        samples = [{"answer": a, "correct": a == "1", "truncated": a is None, "num_tokens": 10}
                   for a in answers]
        problems.append({"samples": samples, **problem_summary(samples)})
    return problems


def test_summary_metrics_on_a_hand_made_table():
    problems = graded(["1", "1", "2", None],     # 2/4, majority 1 (right)
                      ["2", "2", "1", "3"],      # 1/4, majority 2 (wrong)
                      [None, None, None, None])  # 0/4, no majority
    metrics = summarize(problems, k=4)
    assert (metrics["num_correct"], metrics["num_samples"], metrics["num_problems"]) == (3, 12, 3)
    assert metrics["avg@4"] == pytest.approx(25.0)
    assert metrics["pass@1"] == pytest.approx(25.0)                     # pass@1 is avg@k
    assert metrics["pass@2"] == pytest.approx(100 * (5 / 6 + 1 / 2 + 0) / 3)
    assert metrics["pass@4"] == pytest.approx(100 * 2 / 3)
    assert metrics["maj@4"] == pytest.approx(100 / 3)
    assert metrics["truncated_rate"] == pytest.approx(100 * 5 / 12)
    assert metrics["no_answer_rate"] == pytest.approx(100 * 5 / 12)
    assert final_line(3, 12, 3, 4) == "FINAL avg@4 accuracy: 25.00% (3/12 solutions correct on 3 problems)"


def test_final_line_format():
    line = final_line(193, 360, 30, 12)
    assert line == "FINAL avg@12 accuracy: 53.61% (193/360 solutions correct on 30 problems)"
    assert final_line(2, 3, 1, 3).startswith("FINAL avg@3 accuracy: 66.67% ")


# ---------------------------------------------------------------- how answers were graded

@pytest.fixture
def use_worker(monkeypatch):
    """Install an answer checker running `command` for the test; closed after it."""
    yield from installed_workers(monkeypatch)


def test_the_report_counts_how_answers_were_graded(use_worker, tmp_path, monkeypatch):
    monkeypatch.setattr(grading, "MATH_VERIFY_TIMEOUT_S", 0.5)
    use_worker(fake_worker("""\
        if request["answer"] == "hang":
            time.sleep(60)
        if request["answer"] == "bad":
            reply({"ok": False, "error": "ValueError: cannot parse"})
        else:
            reply({"ok": True, "equal": request["answer"] == "0.50"})
    """, tmp_path))
    texts = [r"\boxed{033}", r"\boxed{0.50}", r"\boxed{7}", r"\boxed{hang}", r"\boxed{bad}", "no box", "trunc"]
    completions = [types.SimpleNamespace(ids=list(range(i + 1)), truncated=text == "trunc")
                   for i, text in enumerate(texts)]
    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[len(ids) - 1])
    record = evaluate.grade_problem(0, {"problem": "p", "answer": "33"}, completions, tokenizer)
    samples = record["samples"]
    assert [s["graded_by"] for s in samples] == ["string_match", "math_verify", "math_verify", "timeout",
                                                 "math_verify_error", "no_box", "no_box"]
    assert [s["correct"] for s in samples] == [True, True, False, False, False, False, False]
    assert [s["reason"] for s in samples][-2:] == ["no_answer", "truncated"]

    metrics = summarize([record], k=len(texts))
    assert metrics["graded_by"] == {"string_match": 1, "math_verify": 2, "math_verify_error": 1, "timeout": 1,
                                    "no_box": 2}
    assert metrics["num_correct"] == 2 and metrics["no_answer_rate"] == pytest.approx(100 * 2 / 7)
    # counts of answers each method decided, not of correct ones (1 + 2 graded, 2 of them correct)
    assert evaluate.format_grading(metrics) == (
        "graded by: string match 1 answer, math-verify 2 answers (of 7 samples); "
        "graded wrong: math-verify error 1, timed out 1; no \\boxed{} to grade: 2")
    assert evaluate.format_grading({"graded_by": {"string_match": 104, "math_verify": 136, "math_verify_error": 0,
                                                  "timeout": 0, "no_box": 0}}) == (
        "graded by: string match 104 answers, math-verify 136 answers (of 240 samples)")
    # a sample of a report written before "graded_by" existed
    old = {**samples[0]}
    del old["graded_by"]
    assert graded_by_counts([old])["unrecorded"] == 1
