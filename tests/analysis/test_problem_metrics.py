"""`opsd stats compare / summary --metric avg@k | pass@K | maj@K | distinct` (issue 58 item 1): each
metric's per-problem numerators against a hand computation on a fixed report, maj@K against the
evaluation's own majority vote, the exact sign-flip test on integer numerators against a brute-force
enumeration, the one-line errors, and avg@k's output as it was."""
import itertools
import json
from dataclasses import asdict, replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from opsd.analysis import stats as run_stats
from opsd.analysis.problem_metrics import MAX_SUBSETS, majority_numerator, resolve_metric
from opsd.analysis.reports import answer_ids, load_run
from opsd.evaluation.evaluate import TINY_SETTINGS, write_json_atomic
from opsd.evaluation.metrics import majority_vote, problem_summary, summarize

SETTINGS = replace(TINY_SETTINGS, n_samples=4)  # the tiny preset's settings, 4 samples a problem
N = SETTINGS.n_samples
# (gold, answers, correct) per problem, worked by hand below.
FIXED = [
    ("5", ["5", "5", "7", None], [True, True, False, False]),
    ("9", ["\\text{9}", "4", "4", "9"], [True, False, False, True]),  # \text{9} is 9 once normalised
    ("3", [None, None, None, None], [False, False, False, False]),
    # "6." and "6" are one answer; graded differently here, so the vote takes its first sample's grade
    ("6", ["6.", "6", "2", "2"], [False, True, False, False]),
]
# Per problem: numerator over C(4, K) (avg@4: over 4).
HAND = {
    "avg@4": ([2, 2, 0, 1], 4),
    "pass@1": ([2, 2, 0, 1], 4),
    # 1 - C(4 - c, 2) / C(4, 2): c = 2 -> 5/6, c = 1 -> 3/6
    "pass@2": ([5, 5, 0, 3], 6),
    "pass@4": ([1, 1, 0, 1], 1),
    # subsets of 2: problem 0 all but {7, none}; problem 1 {9,4} {9,4} {9,9} win, {4,4} {4,9} {4,9} lose
    # (ties to the first seen); problem 3 only {6, 2} with the correct "6" first: {1,2}, {1,3}
    "maj@2": ([5, 3, 0, 2], 6),
    # subsets of 3: problem 0: all four vote 5 (a tie with 7 goes to 5, seen first); problem 1: {0,1,3},
    # {0,2,3}; problem 3: 6 wins {0,1,2} {0,1,3} with sample 0's grade (wrong), 2 wins {0,2,3} {1,2,3}
    "maj@3": ([4, 2, 0, 0], 4),
    "maj@4": ([1, 1, 0, 0], 1),
    "distinct": ([2, 2, 0, 2], 1),
}


def write_report(path, problems, settings=SETTINGS, checkpoint="run/checkpoint-4") -> Path:
    """An eval report as opsd.evaluation.evaluate writes it, from (gold, answers, correct) per problem."""
    records = []
    for i, (gold, answers, correct) in enumerate(problems):
        samples = [{"answer": a, "correct": ok, "reason": "correct" if ok else "wrong_answer", "num_tokens": 10,
                    "truncated": False, "completion": f"\\boxed{{{a}}}"}
                   for a, ok in zip(answers, correct, strict=True)]
        records.append({"index": i, "problem": f"Find {gold}.", "gold": gold, **problem_summary(samples),
                        "samples": samples})
    write_json_atomic(path, {"settings": asdict(settings), "model": "tiny", "checkpoint": checkpoint,
                             "dataset": "tiny:5:4", "backend": "transformers",
                             "metrics": summarize(records, settings.n_samples), "elapsed_s": 1.0,
                             "problems": records})
    return Path(path)


@pytest.fixture
def fixed(tmp_path):
    return load_run(write_report(tmp_path / "eval_fixed.json", FIXED))


@pytest.mark.parametrize("name", HAND)
def test_each_metric_against_a_hand_computation(fixed, name):
    metric = resolve_metric(name, N)
    numerators, denominator = HAND[name]
    assert list(metric.numerators(fixed)) == numerators and metric.denominator == denominator
    expected = (100.0 if name != "distinct" else 1.0) * sum(numerators) / (denominator * len(FIXED))
    assert metric.mean(metric.numerators(fixed)) == pytest.approx(expected)
    assert metric.unit == ("distinct answers a problem" if name == "distinct" else "points")


def test_the_reports_own_metrics_agree(fixed, tmp_path):
    """maj@n is the report's majority vote and pass@K its pass@K (opsd.evaluation.metrics.summarize)."""
    report = json.loads((tmp_path / "eval_fixed.json").read_text())
    votes = [int(p["majority_correct"]) for p in report["problems"]]
    assert list(resolve_metric(f"maj@{N}", N).numerators(fixed)) == votes
    for k in range(1, N + 1):
        metric = resolve_metric(f"pass@{k}", N)
        assert metric.mean(metric.numerators(fixed)) == pytest.approx(report["metrics"][f"pass@{k}"])
    avg, pass1 = resolve_metric("avg@k", N), resolve_metric("pass@1", N)
    assert avg.mean(avg.numerators(fixed)) == pass1.mean(pass1.numerators(fixed)) == fixed.avg


def test_maj_at_k_is_the_evaluations_vote_over_every_subset():
    """Random problems (answers repeating, some missing, grades not tied to the answer): the
    numerator counts exactly the subsets where opsd.evaluation.metrics.majority_vote picks a correct sample."""
    rng = np.random.default_rng(0)
    n = 6
    for _ in range(40):
        answers = [None if x == 0 else f" {x}" if rng.random() < 0.3 else str(x) for x in rng.integers(0, 4, n)]
        correct = rng.random(n) < 0.5
        ids = np.array(answer_ids(answers))
        for k in range(1, n + 1):
            expected = 0
            for subset in itertools.combinations(range(n), k):
                voted = majority_vote([answers[i] for i in subset])
                expected += voted is not None and bool(correct[subset[voted]])
            assert majority_numerator(ids, correct, k) == expected, (answers, correct, k)


def test_sign_flip_on_integer_numerators_is_the_exact_enumeration(tmp_path):
    """pass@2 and maj@3 on 1 vs 2 runs: the sign-flip p of `compare --metric` equals the share of
    the 2^m sign patterns of the per-problem mean differences (exact fractions) at least as extreme."""
    rng = np.random.default_rng(7)

    def random_report(path):
        problems = []
        for i in range(9):
            answers = [[str(i), "x", "y", None][j] for j in rng.integers(0, 4, N)]
            problems.append((str(i), answers, [a == str(i) for a in answers]))
        return write_report(path, problems, checkpoint=str(path))

    a = [random_report(tmp_path / "eval_a0.json")]
    b = [random_report(tmp_path / f"eval_b{i}.json") for i in range(2)]
    runs_a, runs_b = [load_run(p) for p in a], [load_run(p) for p in b]
    for name in ("pass@2", "maj@3", "distinct"):
        metric = resolve_metric(name, N)
        counts = run_stats.check_comparable([*runs_a, *runs_b], metric)
        result = run_stats.compare_arms(runs_a, runs_b, counts, 200, 0, metric=metric)
        fractions = [[Fraction(int(v), metric.denominator) for v in row] for row in counts]
        diffs = [sum(r[i] for r in fractions[1:]) / 2 - fractions[0][i] for i in range(counts.shape[1])]
        nonzero = [d for d in diffs if d]
        observed = abs(sum(nonzero))
        extreme = sum(abs(sum(s * d for s, d in zip(signs, nonzero, strict=True))) >= observed
                      for signs in itertools.product((1, -1), repeat=len(nonzero)))
        assert result["per_problem"]["sign_flip_p"] == pytest.approx(extreme / 2 ** len(nonzero), abs=1e-12), name
        assert result["metric"] == name and result["difference"] == pytest.approx(float(sum(diffs) / len(diffs))
                                                                                 * metric.scale)


def cli(capsys, *argv):
    status = run_stats.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_compare_on_pass_at_k_prints_the_metric_its_unit_and_a_verdict(tmp_path, capsys):
    a = write_report(tmp_path / "eval_a.json", FIXED)
    worse = [(g, [g] + answers[1:], [True] + correct[1:]) for g, answers, correct in FIXED]  # a right first sample
    b = write_report(tmp_path / "eval_b.json", worse)
    status, out, err = cli(capsys, "compare", "--metric", "pass@2", "--a", a, "--b", b, "--bootstrap", "200",
                           "--json", tmp_path / "c.out.json")
    assert status == 0 and err == ""
    result = json.loads((tmp_path / "c.out.json").read_text())
    assert (result["metric"], result["unit"]) == ("pass@2", "points")
    assert result["definition"].startswith("the chance that K of a problem's n samples")
    # B: problems 2 and 3 gain a correct sample (c 0 -> 1: +3/6, c 1 -> 2: +2/6); 0 and 1 keep c = 2
    assert result["difference"] == pytest.approx(100 * (3 / 6 + 2 / 6) / 4)
    lines = out.splitlines()
    assert lines[0].startswith("verdict: B is 20.83 points above A on these 4 problems")
    assert lines[2] == "compare pass@2 | dataset tiny:5:4 | 4 problems x 4 samples"
    assert lines[3] == f"metric pass@2: {result['definition']}"
    assert "B - A: +20.83 points" in lines

    status, out, _ = cli(capsys, "compare", "--metric", "distinct", "--a", a, "--b", b, "--bootstrap", "200")
    # B's first samples answer the gold: problem 2 gains an answer (0 -> 1), problem 3 keeps 2, problem 1 too
    assert status == 0 and out.startswith("verdict: B has 0.25 more distinct answers a problem than A on these 4 "
                                          "problems")
    assert "B - A: +0.25 distinct answers a problem" in out

    status, out, _ = cli(capsys, "summary", "--metric", "maj@3", a, b, "--bootstrap", "200")
    assert status == 0 and out.splitlines()[0] == "summary maj@3 | dataset tiny:5:4 | 4 problems x 4 samples | 2 run(s)"
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()}
    assert rows["eval_a.json"] == ["37.50", "-"]  # maj@3 of FIXED: (4 + 2) / 4 / 4 problems; no sampling se
    assert "evaluation sampling alone" not in out and "avg@k and pass@1 only" in out


def test_help_names_and_defines_each_metric(capsys):
    with pytest.raises(SystemExit):
        run_stats.main(["compare", "--help"])
    out = capsys.readouterr().out
    for name in ("avg@k", "pass@K", "maj@K", "distinct"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert len(line.split()) > 6, line  # the name, then its definition on the same line


def one_error_line(status, out, err, expected):
    assert (status, out) == (2, "") and err == f"error: {expected}\n"


def test_bad_metrics_are_one_line_and_exit_2(tmp_path, capsys):
    a = write_report(tmp_path / "eval_a.json", FIXED)
    b = write_report(tmp_path / "eval_b.json", FIXED[::-1], checkpoint="other")
    for metric, expected in (
            ("pass@5", "--metric pass@5: K must be from 1 to n = 4 (the samples a problem in these reports), got 5"),
            ("maj@0", "--metric maj@0: K must be from 1 to n = 4 (the samples a problem in these reports), got 0"),
            ("pass", "--metric 'pass': expected avg@k, pass@K, maj@K or distinct (K a whole number of samples)"),
            ("avg@2", "--metric avg@2: these reports have n = 4 samples a problem, so avg@k is avg@4; for fewer "
                      "samples use pass@K")):
        one_error_line(*cli(capsys, "compare", "--metric", metric, "--a", a, "--b", b), expected)
    one_error_line(*cli(capsys, "summary", "--metric", "pass@x", tmp_path / "nope.json"),
                   "--metric 'pass@x': expected avg@k, pass@K, maj@K or distinct (K a whole number of samples)")
    report = json.loads(a.read_text())
    del report["problems"][1]["samples"][2]["answer"]
    write_json_atomic(tmp_path / "eval_old.json", report)
    for metric in ("maj@4", "distinct"):
        one_error_line(*cli(capsys, "summary", "--metric", metric, tmp_path / "eval_old.json"),
                       f"{tmp_path / 'eval_old.json'}: {metric} needs every sample's 'answer' (a string or null); "
                       "problem 2 sample 3 has none")
    assert cli(capsys, "summary", "--metric", "pass@4", tmp_path / "eval_old.json")[0] == 0  # grades suffice


def test_maj_at_k_refuses_more_subsets_than_it_can_enumerate(tmp_path, capsys):
    settings = replace(TINY_SETTINGS, n_samples=20)
    path = write_report(tmp_path / "eval_20.json", [("1", ["1"] * 20, [True] * 20)], settings=settings)
    one_error_line(*cli(capsys, "summary", "--metric", "maj@10", path),
                   f"--metric maj@10: C(20, 10) = 184756 subsets a problem are too many to enumerate (at most "
                   f"{MAX_SUBSETS}); maj@20 is the report's own vote")
    status, out, _ = cli(capsys, "summary", "--metric", "maj@4", path, "--bootstrap", "100")  # C(20, 4) = 4845
    assert status == 0 and out.splitlines()[3].split()[:2] == ["eval_20.json", "100.00"]


def test_avg_at_k_output_is_the_default_and_pass_at_1_gives_its_numbers(tmp_path, capsys):
    """The default, `--metric avg@k` and `--metric avg@4` print the same bytes, with no metric line
    (avg@k's output as before the metrics); pass@1 is the same comparison under its own name."""
    a = [write_report(tmp_path / f"eval_a{i}.json", FIXED[i:] + FIXED[:i], checkpoint=f"a{i}") for i in range(2)]
    b = [write_report(tmp_path / f"eval_b{i}.json", FIXED[::-1][i:] + FIXED[::-1][:i], checkpoint=f"b{i}")
         for i in range(2)]
    outputs = []
    for extra in ([], ["--metric", "avg@k"], ["--metric", "avg@4"]):
        status, out, _ = cli(capsys, "compare", "--a", *a, "--b", *b, "--bootstrap", "300", *extra,
                             "--json", tmp_path / f"avg{len(outputs)}.out.json")
        outputs.append(out)
    assert status == 0 and outputs[0] == outputs[1] == outputs[2]
    assert not any(line.startswith("metric ") for line in outputs[0].splitlines())
    avg = json.loads((tmp_path / "avg0.out.json").read_text())
    cli(capsys, "compare", "--a", *a, "--b", *b, "--bootstrap", "300", "--metric", "pass@1",
        "--json", tmp_path / "p1.out.json")
    pass1 = json.loads((tmp_path / "p1.out.json").read_text())
    assert (avg["metric"], avg["unit"], pass1["metric"]) == ("avg@4", "points", "pass@1")
    for key in ("difference", "bootstrap", "run_level_test", "per_problem", "arms"):
        assert pass1[key] == avg[key], key
