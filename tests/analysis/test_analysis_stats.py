"""opsd/analysis/stats.py: the Student-t code against closed forms, table values and numeric
integration; descriptive statistics and tests against hand-computed values;
bootstrap reproducibility and coverage on synthetic arms with a known effect;
input validation; the command line end to end on synthetic eval reports.

The synthetic reports are built with the evaluation's own pieces (opsd.evaluation.evaluate's frozen
settings and write_json_atomic, opsd.evaluation.metrics' problem_summary and summarize) and the same
top-level fields that opsd.evaluation.evaluate.evaluate() writes, so they follow the real report schema."""
import json
import math
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from opsd.analysis import stats as run_stats
from opsd.analysis.stats import (
    bootstrap_difference,
    bootstrap_mean,
    describe,
    problem_scores,
    run_level_test,
    sampling_se,
    sign_flip_test,
    sign_test,
    single_run_t,
    t_cdf,
    t_ppf,
    t_two_sided_p,
    verdict,
    welch_t,
)
from opsd.evaluation.evaluate import FROZEN_SETTINGS, TINY_SETTINGS, write_json_atomic
from opsd.evaluation.metrics import problem_summary, summarize

ROOT = Path(__file__).resolve().parents[2]
DATASET = "HuggingFaceH4/aime_2024"
P, K = 30, FROZEN_SETTINGS.n_samples


# ---------------------------------------------------------------- synthetic reports

def problem_text(i):
    return f"Problem {i}: find the number."


def report_from_flags(flags, settings=FROZEN_SETTINGS, dataset=DATASET, checkpoint="run/checkpoint-100",
                      problem_texts=None):
    """An eval report as opsd.evaluation.evaluate.evaluate() writes it, from correct flags [problem][sample]."""
    records = []
    for i, row in enumerate(flags):
        gold = str(100 + i)
        samples = [{"answer": gold if ok else "0", "correct": bool(ok), "reason": "correct" if ok else "wrong_answer",
                    "num_tokens": 100, "truncated": False, "completion": f"\\boxed{{{gold if ok else 0}}}"}
                   for ok in row]
        text = problem_texts[i] if problem_texts else problem_text(i)
        records.append({"index": i, "problem": text, "gold": gold, **problem_summary(samples), "samples": samples})
    return {"settings": asdict(settings), "model": "Qwen/Qwen3-1.7B", "checkpoint": checkpoint, "dataset": dataset,
            "backend": "vllm", "metrics": summarize(records, settings.n_samples), "elapsed_s": 1.0,
            "problems": records}


def simulate_arm(rng, difficulty, runs, effect=0.0, run_sd=0.015, k=K):
    """[run][problem][sample] correct flags: success probability of problem i in run r is
    difficulty_i + effect + u_r (u_r ~ N(0, run_sd): a training seed shifts every problem)."""
    arm = []
    for _ in range(runs):
        p = np.clip(difficulty + effect + rng.normal(0.0, run_sd), 0.0, 1.0)
        arm.append(rng.random((len(difficulty), k)) < p[:, None])
    return arm


def write_arm(folder, label, arm, **report_kwargs):
    paths = []
    for r, flags in enumerate(arm):
        path = Path(folder) / f"eval_{label}{r}_checkpoint-100.json"
        write_json_atomic(path, report_from_flags(flags, checkpoint=f"{label}{r}/checkpoint-100", **report_kwargs))
        paths.append(str(path))
    return paths


def accuracy(arm):
    """[run, problem] per-problem accuracy in points."""
    return np.array([100.0 * np.mean(flags, axis=1) for flags in arm])


def counts(arm):
    return np.array([np.sum(flags, axis=1) for flags in arm])


def cli(capsys, *argv):
    status = run_stats.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def difficulty():
    return np.random.default_rng(1).uniform(0.15, 0.75, P)


# ---------------------------------------------------------------- Student t

@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.0, 4.2, 100.0])
def test_t_cdf_closed_forms(t):
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)        # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    normal = 0.5 * (1 + math.erf(t / math.sqrt(2)))
    assert t_cdf(t, 1e5) == pytest.approx(normal, abs=2e-6)                 # t -> normal as df grows
    assert t_cdf(t, 1e9) == pytest.approx(normal, abs=1e-9)  # t - normal: about phi(t) (t^3 + t) / (4 df) < 0.2 / df
    assert t_cdf(t, math.inf) == pytest.approx(normal, abs=1e-15)


@pytest.mark.parametrize("t, df, p", [
    (2.228, 10, 0.05), (1.812, 10, 0.10), (3.169, 10, 0.01), (12.706, 1, 0.05), (4.303, 2, 0.05),
    (2.776, 4, 0.05), (2.571, 5, 0.05), (2.045, 29, 0.05), (2.042, 30, 0.05), (2.750, 30, 0.01),
])
def test_t_two_sided_p_against_table(t, df, p):
    assert t_two_sided_p(t, df) == pytest.approx(p, abs=3e-4)
    assert t_two_sided_p(-t, df) == t_two_sided_p(t, df)
    assert 2 * (1 - t_cdf(t, df)) == pytest.approx(t_two_sided_p(t, df), abs=1e-12)


@pytest.mark.parametrize("df", [1.7, 2.94, 4.5, 13.2])
def test_t_cdf_fractional_df_against_numeric_integration(df):
    """Welch's df is fractional: compare with a trapezoid integral of the t density."""
    grid = np.linspace(0.0, 3.0, 300001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(grid ** 2 / df))
    integral = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(grid)))
    assert t_cdf(3.0, df) == pytest.approx(0.5 + integral, abs=1e-8)


@pytest.mark.parametrize("df, q975", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (10, 2.2281),
                                      (29, 2.0452), (1000, 1.9623)])
def test_t_ppf_against_table_and_round_trip(df, q975):
    assert t_ppf(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert t_ppf(0.025, df) == pytest.approx(-q975, abs=1e-4)
    for q in (0.01, 0.3, 0.5, 0.9):
        assert t_cdf(t_ppf(q, df), df) == pytest.approx(q, abs=1e-10)


# ---------------------------------------------------------------- hand-computed statistics

def test_describe_by_hand():
    d = describe([1, 2, 3, 4])
    assert (d["n"], d["mean"]) == (4, 2.5)
    assert d["sd"] == pytest.approx(math.sqrt(5 / 3))
    assert d["se"] == pytest.approx(math.sqrt(5 / 3) / 2)
    assert d["ci"] == pytest.approx([2.5 - 3.182446 * d["se"], 2.5 + 3.182446 * d["se"]], abs=1e-5)
    single = describe([54.2])
    assert single == {"n": 1, "mean": 54.2, "sd": None, "se": None, "ci": None}


def test_sampling_se_by_hand():
    # p = 0.5, 1, 0: sum p(1-p) = 0.25; sqrt(0.25 / 11) / 3 problems, in points
    assert sampling_se([6, 12, 0], 12) == pytest.approx(100 * math.sqrt(0.25 / 11) / 3)
    assert sampling_se([12, 0], 12) == 0.0
    assert sampling_se([1, 0], 1) is None


def test_welch_by_hand():
    w = welch_t([1, 2, 3], [4, 6, 8])
    # variances of the means 1/3 and 4/3: se^2 = 5/3; df = (5/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = 50/17
    assert w["diff"] == 4.0
    assert w["t"] == pytest.approx(4 / math.sqrt(5 / 3))
    assert w["df"] == pytest.approx(50 / 17)
    assert w["p"] == pytest.approx(t_two_sided_p(4 / math.sqrt(5 / 3), 50 / 17))
    assert 0.05 < w["p"] < 0.06                                      # t = 3.10 on 2.94 df
    half = t_ppf(0.975, 50 / 17) * math.sqrt(5 / 3)
    assert w["ci"] == pytest.approx([4 - half, 4 + half])
    assert welch_t([1], [2, 3]) is None and welch_t([1, 1], [2, 2]) is None
    assert welch_t([1, 1], [2, 3])["df"] == pytest.approx(1.0)        # only B varies: df = R_B - 1


def test_single_run_t_by_hand():
    s = single_run_t([10.0], [12.0, 14.0, 16.0])
    assert s["diff"] == 4.0 and s["df"] == 2.0
    assert s["t"] == pytest.approx(4 / (2 * math.sqrt(1 + 1 / 3)))
    assert single_run_t([12.0, 14.0, 16.0], [10.0])["t"] == pytest.approx(-s["t"])  # oriented B - A
    assert single_run_t([1.0], [2.0]) is None and single_run_t([1.0, 2.0], [3.0, 4.0]) is None
    assert run_level_test([1.0], [2.0]) is None
    assert run_level_test([1, 2, 3], [4, 6, 8])["method"].startswith("Welch")
    assert run_level_test([10.0], [12.0, 14.0, 16.0])["method"].startswith("t, single run")


def test_sign_test_by_hand():
    s = sign_test([1, 1, 1, 1, 1, -1, 0])
    assert (s["b_better"], s["a_better"], s["tied"]) == (5, 1, 1)
    assert s["p"] == pytest.approx(2 * (1 + 6) / 64)
    assert sign_test([0, 0])["p"] == 1.0
    assert sign_test([3, -2])["p"] == 1.0


def test_sign_flip_test_by_hand_and_brute_force():
    assert sign_flip_test([1, 2, 3]) == pytest.approx(2 / 8)        # only +-(1+2+3) reach |6|
    assert sign_flip_test([1, 1]) == pytest.approx(0.5)
    assert sign_flip_test([0, 0, 0]) == 1.0
    assert sign_flip_test([4, 0, -1]) == pytest.approx(sign_flip_test([4, -1]))
    rng = np.random.default_rng(3)
    for _ in range(5):
        scores = rng.integers(-6, 7, size=10)
        signs = np.array(np.meshgrid(*[[-1, 1]] * 10)).reshape(10, -1).T
        sums = np.abs(signs @ np.abs(scores))
        assert sign_flip_test(scores) == pytest.approx(np.mean(sums >= abs(scores.sum())))


def test_problem_scores_are_proportional_to_mean_differences():
    a = np.array([[3, 5, 0], [4, 5, 2]])            # 2 runs
    b = np.array([[6, 5, 1], [6, 3, 1], [0, 7, 4]])  # 3 runs
    scores = problem_scores(a, b)
    assert scores.dtype.kind == "i"
    assert scores / 6 == pytest.approx(b.mean(axis=0) - a.mean(axis=0))


# ---------------------------------------------------------------- bootstrap

def test_bootstrap_is_reproducible_with_a_seed(difficulty):
    rng = np.random.default_rng(5)
    a, b = accuracy(simulate_arm(rng, difficulty, 3)), accuracy(simulate_arm(rng, difficulty, 3, effect=0.02))
    first = bootstrap_difference(a, b, 2000, seed=7)
    assert first == bootstrap_difference(a, b, 2000, seed=7)
    assert first["ci"] != bootstrap_difference(a, b, 2000, seed=8)["ci"]
    assert first["diff"] == pytest.approx(b.mean() - a.mean())
    assert first["ci"][0] < first["diff"] < first["ci"][1]
    assert bootstrap_mean(a, 2000, seed=1) == bootstrap_mean(a, 2000, seed=1)


def test_one_run_bootstrap_is_the_plain_problem_bootstrap():
    values = np.arange(30.0)
    boot = bootstrap_mean(values, 20000, seed=0)
    # the plain bootstrap se of a mean is sd(ddof=0) / sqrt(n)
    assert boot["se"] == pytest.approx(values.std() / math.sqrt(30), rel=0.03)


def test_ci_covers_a_known_effect(difficulty):
    """5-point effect, 4 vs 4 runs: the CI of one data set covers it, and over 40
    simulated data sets the CI covers the true difference most of the time."""
    rng = np.random.default_rng(11)
    effect = 0.05
    covered = 0
    for trial in range(40):
        a = accuracy(simulate_arm(rng, difficulty, 4))
        b = accuracy(simulate_arm(rng, difficulty, 4, effect=effect))
        low, high = bootstrap_difference(a, b, 1000, seed=trial)["ci"]
        covered += low <= 100 * effect <= high
        if trial == 0:
            assert low <= 100 * effect <= high
    assert covered >= 34  # nominal 95% (40/40 with this seed); allows for a narrow run bootstrap


def test_huge_effect_excludes_zero_and_identical_arms_include_it(difficulty, tmp_path):
    rng = np.random.default_rng(2)
    arm_a = simulate_arm(rng, difficulty, 3)
    huge = bootstrap_difference(accuracy(arm_a), accuracy(simulate_arm(rng, difficulty, 3, effect=0.2)), 2000)
    assert huge["ci"][0] > 10
    same = bootstrap_difference(accuracy(arm_a), accuracy(arm_a), 2000)
    assert same["diff"] == 0 and same["ci"][0] < 0 < same["ci"][1]
    assert welch_t(accuracy(arm_a).mean(axis=1), accuracy(arm_a).mean(axis=1))["p"] == pytest.approx(1.0)
    assert sign_flip_test(problem_scores(counts(arm_a), counts(arm_a))) == 1.0


# ---------------------------------------------------------------- verdict

def test_verdict_never_overclaims():
    assert verdict(1.2, [-0.8, 3.1], 3, 3, run_p=0.3) == (
        "B is 1.20 points above A, within run-to-run noise with 3 vs 3 runs: no evidence that the arms differ")
    real = verdict(4.0, [2.0, 6.0], 5, 5, run_p=0.001)
    assert real == "B is 4.00 points above A, beyond run-to-run noise with 5 vs 5 runs: the arms differ"
    assert "few runs" in verdict(-4.0, [-6.0, -2.0], 3, 3, run_p=0.01)
    assert verdict(-4.0, [-6.0, -2.0], 3, 3, run_p=0.01).startswith("B is 4.00 points below A, beyond")
    for line in (verdict(3.0, [0.5, 5.5], 3, 3, run_p=0.09), verdict(3.0, [-0.5, 6.5], 3, 3, run_p=0.03)):
        assert "inconclusive" in line and "the arms differ" not in line
    one = verdict(8.0, [4.0, 12.0], 1, 1, problem_p=0.001)
    assert "these two checkpoints differ; one run per arm cannot tell whether the gap holds in general" in one
    assert ": the arms differ" not in one  # one run a side never claims an arm difference
    assert "within evaluation-sampling noise: not even these two checkpoints differ measurably with 1 vs 1 runs" in (
        verdict(1.0, [-2.0, 4.0], 1, 1, problem_p=0.5))
    assert "inconclusive even for these two checkpoints" in verdict(3.0, [0.5, 5.5], 1, 1, problem_p=0.2)
    assumed = run_stats.assumed_noise_interval(3.0, 1.48, 1, 1)
    half = 1.959964 * 1.48 * math.sqrt(2)
    assert assumed["ci"] == pytest.approx([3.0 - half, 3.0 + half])
    line = verdict(3.0, [1.0, 5.0], 1, 1, problem_p=0.01, assumed=assumed)
    assert "inconclusive" in line and "an assumed per-run sd of 1.48 points" in line
    line = verdict(3.0, [-1.0, 7.0], 1, 1, problem_p=0.2, assumed=assumed)
    assert "within the run-to-run noise of an assumed per-run sd of 1.48 points" in line
    line = verdict(0.5, [-0.2, 1.2], 1, 1, problem_p=0.2, assumed=run_stats.assumed_noise_interval(0.5, 0.3, 1, 1),
                   unit="distinct answers a problem")  # the sd is in the metric's unit
    assert "an assumed per-run sd of 0.3 distinct answers a problem" in line and "points" not in line
    big = run_stats.assumed_noise_interval(9.0, 1.48, 1, 1)
    line = verdict(9.0, [5.0, 13.0], 1, 1, problem_p=0.001, assumed=big)
    assert "more than the run-to-run noise of an assumed per-run sd" in line and "assumed, not measured" in line


def test_the_verdict_is_one_plain_sentence_naming_the_arms_and_problems():
    """The quickstart's case (one trained seed against base): the sentence a newcomer reads once,
    the gap in words first, what one seed can and cannot tell after it."""
    line = verdict(14.375, [6.88, 22.5], 1, 1, problem_p=0.0013, names=("base", "trained"), num_problems=40)
    assert line == ("trained is 14.38 points above base on these 40 problems, more than evaluation-sampling "
                    "noise: these two checkpoints differ; one run per arm cannot tell whether the gap holds in "
                    "general (whether the arms differ: train more seeds)")
    assert verdict(0.001, [-3.0, 3.0], 1, 1, problem_p=1.0, names=("a", "b"), num_problems=4).startswith(
        "b scores the same as a on these 4 problems, within evaluation-sampling noise")


# ---------------------------------------------------------------- files and validation

@pytest.fixture
def arms(tmp_path, difficulty):
    rng = np.random.default_rng(4)
    arm_a, arm_b = simulate_arm(rng, difficulty, 3), simulate_arm(rng, difficulty, 3, effect=0.02)
    return arm_a, arm_b, write_arm(tmp_path, "entry", arm_a), write_arm(tmp_path, "token", arm_b)


def one_error_line(status, out, err, *fragments):
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    for fragment in fragments:
        assert fragment in err, err


def test_load_run_reads_the_opsd_eval_schema(arms):
    arm_a, _, paths_a, _ = arms
    run = run_stats.load_run(paths_a[0])
    report = json.loads(Path(paths_a[0]).read_text())
    assert run.k == K and len(run.keys) == P and run.dataset == DATASET
    assert run.avg == pytest.approx(report["metrics"][f"avg@{K}"])
    assert list(run.num_correct) == list(counts(arm_a)[0])


def test_tiny_sets_compare_by_seed_and_size_whatever_the_report_called_them(arms, tmp_path, capsys):
    """A report of before the labels (`tiny`) and one of now (`tiny:20240101:30`) are one set;
    another seed or size of the tiny task is another set."""
    arm_a, arm_b, _, _ = arms
    old = write_arm(tmp_path, "old", arm_a[:2], dataset="tiny")
    new = write_arm(tmp_path, "new", arm_b[:2], dataset="tiny:20240101:30")
    status, out, err = cli(capsys, "compare", "--a", *old, "--b", *new, "--bootstrap", "200")
    assert status == 0, err
    assert "| dataset tiny:20240101:30 |" in out.splitlines()[2]  # below the verdict and its legend
    other = write_arm(tmp_path, "seed7", arm_b[:2], dataset="tiny:7")
    one_error_line(*cli(capsys, "compare", "--a", *old, "--b", *other),
                   "dataset 'tiny:7:30' differs from 'tiny:20240101:30'")


def test_bad_inputs_exit_2_with_one_line(arms, tmp_path, capsys, difficulty):
    _, arm_b, paths_a, paths_b = arms
    flags = arm_b[0]

    other_settings = tmp_path / "eval_settings.json"
    write_json_atomic(other_settings, report_from_flags(flags, settings=replace(FROZEN_SETTINGS, top_p=0.9)))
    one_error_line(*cli(capsys, "compare", "--a", *paths_a, "--b", other_settings),
                   f"error: {other_settings}: settings differ", "top_p 0.9 vs 0.95")

    fewer_samples = tmp_path / "eval_tiny.json"
    write_json_atomic(fewer_samples, report_from_flags([row[:TINY_SETTINGS.n_samples] for row in flags],
                                                       settings=TINY_SETTINGS))
    one_error_line(*cli(capsys, "summary", paths_a[0], fewer_samples), f"{fewer_samples}: settings differ",
                   f"n_samples {TINY_SETTINGS.n_samples} vs 12")

    fewer_problems = tmp_path / "eval_fewer.json"
    write_json_atomic(fewer_problems, report_from_flags(flags[:29]))
    one_error_line(*cli(capsys, "compare", "--a", *paths_a, "--b", fewer_problems),
                   f"{fewer_problems}: problem set differs", "1 of its problems missing")

    renamed = tmp_path / "eval_renamed.json"
    write_json_atomic(renamed, report_from_flags(flags, problem_texts=[f"Other {i}" for i in range(P)]))
    one_error_line(*cli(capsys, "summary", paths_a[0], renamed), f"{renamed}: problem set differs")

    other_dataset = tmp_path / "eval_aime25.json"
    write_json_atomic(other_dataset, report_from_flags(flags, dataset="math-ai/aime25"))
    one_error_line(*cli(capsys, "compare", "--a", paths_a[0], "--b", other_dataset), f"{other_dataset}: dataset")

    missing = tmp_path / "eval_missing.json"
    one_error_line(*cli(capsys, "compare", "--a", *paths_a, "--b", missing), f"error: {missing}: no such file")

    broken = tmp_path / "eval_broken.json"
    broken.write_text('{"settings": ')
    one_error_line(*cli(capsys, "summary", broken), f"{broken}: not valid JSON")

    not_report = tmp_path / "other.json"
    not_report.write_text('{"hello": 1}')
    one_error_line(*cli(capsys, "summary", not_report), f"{not_report}: not an evaluation report")

    short = report_from_flags(flags)
    short["problems"][2]["samples"].pop()
    write_json_atomic(tmp_path / "eval_short.json", short)
    one_error_line(*cli(capsys, "summary", tmp_path / "eval_short.json"), "problem 3 has 11 samples")

    edited = report_from_flags(flags)
    edited["metrics"][f"avg@{K}"] += 5
    write_json_atomic(tmp_path / "eval_edited.json", edited)
    one_error_line(*cli(capsys, "summary", tmp_path / "eval_edited.json"), "but its samples give")

    one_error_line(*cli(capsys, "compare", "--a", paths_a[0], "--b", paths_a[0]), "given more than once")
    one_error_line(*cli(capsys, "compare", "--a", *paths_a, "--b", *paths_b, "--bootstrap", "5"), "--bootstrap")
    assert not list(tmp_path.glob("*.out.json"))


def test_missing_file_from_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "opsd.analysis.stats", "summary", str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: {tmp_path / 'nope.json'}: no such file\n"


def test_a_reader_that_closed_the_output_early_gets_no_traceback(arms):
    """`python -m opsd.analysis.stats summary ... | head` after head exited: a quiet exit, no BrokenPipeError."""
    import os

    from opsd.cli import CLOSED_OUTPUT_STATUS

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "opsd.analysis.stats", "summary", *arms[2], "--bootstrap", "100"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (CLOSED_OUTPUT_STATUS, "")


# ---------------------------------------------------------------- command line end to end

def test_compare_end_to_end(arms, tmp_path, capsys):
    arm_a, arm_b, paths_a, paths_b = arms
    out_json = tmp_path / "cmp.out.json"
    status, out, err = cli(capsys, "compare", "--a", *paths_a, "--b", *paths_b, "--bootstrap", "2000",
                           "--seed", "3", "--json", out_json)
    assert status == 0 and err == ""
    result = json.loads(out_json.read_text())
    a, b = accuracy(arm_a), accuracy(arm_b)
    assert result["difference"] == pytest.approx(b.mean() - a.mean())
    assert result["arms"]["A"]["per_run"] == pytest.approx(list(a.mean(axis=1)))
    assert result["arms"]["B"]["sd"] == pytest.approx(b.mean(axis=1).std(ddof=1))
    order = sorted(range(P), key=problem_text)  # opsd.analysis.stats puts problems in (text, gold) order
    boot = bootstrap_difference(a[:, order], b[:, order], 2000, seed=3)
    welch = welch_t(a.mean(axis=1), b.mean(axis=1))
    assert result["bootstrap"]["ci"] == pytest.approx(boot["ci"])
    assert result["bootstrap"]["se"] == pytest.approx(boot["se"])
    for key in ("t", "df", "p"):
        assert result["run_level_test"][key] == pytest.approx(welch[key])
    assert result["per_problem"]["sign_flip_p"] == sign_flip_test(problem_scores(counts(arm_a), counts(arm_b)))
    assert result["metric"] == "avg@12" and result["num_problems"] == P
    lines = out.splitlines()
    assert lines[0] == f"verdict: {result['verdict']}"  # the sentence first, the numbers after
    assert lines[1] == f"  {run_stats.CHECKPOINTS_VS_ARMS}"
    assert lines[2].startswith("compare avg@12 | dataset HuggingFaceH4/aime_2024 | 30 problems x 12 samples")
    assert any(line.startswith("  Welch t on run means: t = ") for line in lines)
    assert "  bootstrap, runs + problems (paired), 2000 resamples, seed 3: 95% CI [" in out
    assert "with 3 vs 3 runs" in lines[0] and "In numbers: difference " in lines[0]


def test_compare_single_runs_and_assumed_sd(arms, capsys, tmp_path):
    _, _, paths_a, paths_b = arms
    status, out, _ = cli(capsys, "compare", "--a", paths_a[0], "--b", paths_b[0], "--bootstrap", "1000")
    assert status == 0
    assert "run-level test: not possible" in out and "sign-flip test p = " in out
    assert "1 vs 1 runs" in out.splitlines()[0] and "beyond run-to-run noise" not in out
    assert "bootstrap, problems only (paired; one run per arm)" in out
    status, out, _ = cli(capsys, "compare", "--a", paths_a[0], "--b", paths_b[0], "--run-sd", "1.48",
                         "--bootstrap", "1000")
    assert status == 0 and "assumed per-run sd of 1.48" in out
    status, out, _ = cli(capsys, "compare", "--a", *paths_a, "--b", paths_b[0], "--bootstrap", "1000")
    assert status == 0 and "t, single run vs the other arm's run-to-run sd: t = " in out
    assert "bootstrap, runs of A + problems (paired; B has one run)" in out


def test_identical_arms_end_to_end(arms, tmp_path, capsys):
    arm_a, _, paths_a, _ = arms
    copies = write_arm(tmp_path, "copy", arm_a)
    status, out, _ = cli(capsys, "compare", "--a", *paths_a, "--b", *copies, "--bootstrap", "1000")
    assert status == 0
    assert out.splitlines()[0].startswith("verdict: B scores the same as A on these 30 problems, within run-to-run "
                                          "noise with 3 vs 3 runs: no evidence that the arms differ. In numbers: "
                                          "difference +0.00 points, 95% CI [-")


def test_problem_order_does_not_matter(arms, tmp_path, capsys):
    paths_a = arms[2]
    report = json.loads(Path(paths_a[0]).read_text())
    report["problems"] = report["problems"][::-1]
    write_json_atomic(tmp_path / "eval_reversed.json", report)
    assert cli(capsys, "summary", paths_a[0], paths_a[1], "--json", tmp_path / "s1.out.json")[0] == 0
    reversed_first = tmp_path / "eval_reversed.json"
    assert cli(capsys, "summary", reversed_first, paths_a[1], "--json", tmp_path / "s2.out.json")[0] == 0
    one, two = (json.loads((tmp_path / f"s{i}.out.json").read_text()) for i in (1, 2))
    for key in ("mean", "sd", "sampling_only_sd"):
        assert one["across_runs"][key] == pytest.approx(two["across_runs"][key])
    assert one["across_runs"]["bootstrap"]["ci"] == pytest.approx(two["across_runs"]["bootstrap"]["ci"])


def test_summary_end_to_end(arms, tmp_path, capsys):
    arm_a, _, paths_a, _ = arms
    status, out, err = cli(capsys, "summary", paths_a[0], "--bootstrap", "1000", "--json", tmp_path / "one.out.json")
    assert status == 0 and err == ""
    single = json.loads((tmp_path / "one.out.json").read_text())
    assert single["across_runs"] is None
    assert single["runs"][0]["sampling_se"] == pytest.approx(sampling_se(counts(arm_a)[0], K))
    assert "one run cannot show training-seed noise" in out

    status, out, _ = cli(capsys, "summary", *paths_a, "--bootstrap", "1000", "--json", tmp_path / "three.out.json")
    assert status == 0
    three = json.loads((tmp_path / "three.out.json").read_text())
    means = accuracy(arm_a).mean(axis=1)
    assert three["across_runs"]["mean"] == pytest.approx(means.mean())
    assert three["across_runs"]["sd"] == pytest.approx(means.std(ddof=1))
    assert three["across_runs"]["ci"] == pytest.approx(describe(means)["ci"])
    assert "across runs: mean " in out and "(t, df 2)" in out
    assert "sampling se      re-evaluating the same checkpoint" in out


# ---------------------------------------------------------------- --plot

def test_plot_draws_the_printed_numbers(arms, tmp_path, capsys):
    """--plot draws exactly the numbers of the result (the same dict --json writes)."""
    from opsd.analysis import plots as run_plots

    _, _, paths_a, paths_b = arms
    png, out_json = tmp_path / "cmp.png", tmp_path / "cmp.out.json"
    status, out, err = cli(capsys, "compare", "--a", *paths_a, "--b", paths_b[0], "--bootstrap", "1000",
                           "--run-sd", "1.48", "--json", out_json, "--plot", png)
    assert status == 0 and err == "" and out.splitlines()[0].startswith("verdict: ")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    result = json.loads(out_json.read_text())
    (arm_panel, diff_panel), title = run_stats.interval_panels(result)
    a, b = result["arms"]["A"], result["arms"]["B"]
    assert [(r.estimate, r.ci, r.points) for r in arm_panel.rows] == [
        (a["mean"], tuple(a["ci"]), tuple(a["per_run"])), (b["mean"], None, tuple(b["per_run"]))]  # B: 1 run
    assert [(r.estimate, r.ci) for r in diff_panel.rows] == [
        (result["difference"], tuple(result["bootstrap"]["ci"])),
        (result["run_level_test"]["diff"], tuple(result["run_level_test"]["ci"])),
        (result["difference"], tuple(result["assumed_run_sd"]["ci"]))]
    assert diff_panel.zero_line and title.endswith(f"verdict: {result['verdict_sentence']}")
    drawn = run_plots.plot_intervals([arm_panel, diff_panel], tmp_path / "again.png", title)
    assert drawn == [r.label for r in (*arm_panel.rows, *diff_panel.rows)]

    status, _, err = cli(capsys, "summary", *paths_a, "--bootstrap", "1000", "--json", tmp_path / "s.out.json",
                         "--plot", tmp_path / "summary.png")
    assert status == 0 and err == "" and (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "s.out.json").read_text())
    (panel,), _ = run_stats.interval_panels(summary)
    across = summary["across_runs"]
    assert [(r.estimate, r.ci) for r in panel.rows] == [
        *((r["avg"], tuple(r["problems_ci"])) for r in summary["runs"]),
        (across["mean"], tuple(across["ci"])), (across["bootstrap"]["mean"], tuple(across["bootstrap"]["ci"]))]


def test_bad_plot_path_is_one_line_before_any_output(arms, tmp_path, capsys):
    _, _, paths_a, paths_b = arms
    for target, fragment in ((tmp_path / "cmp.jpg", "must be a .png file"),
                             (tmp_path / "no" / "cmp.png", "no such folder")):
        one_error_line(*cli(capsys, "compare", "--a", *paths_a, "--b", *paths_b, "--json", tmp_path / "c.out.json",
                            "--plot", target), f"error: {target}: ", fragment)
    assert not (tmp_path / "c.out.json").exists() and not list(tmp_path.rglob("*.png"))


def test_a_reused_problem_draw_gives_the_numbers_of_a_fresh_generator():
    """The bootstrap draws its problem weights once per (seed, problems, resamples) and reuses them
    (a grid bootstraps every run, arm and metric alike): every interval is what default_rng(seed)
    drawing from scratch gives."""
    from opsd.analysis import significance

    rng = np.random.default_rng(5)
    a, b = rng.random((3, 20)), rng.random((2, 20))
    bootstrap_difference(b, a, 400, seed=9)  # fills the cache for (9, 20, 400)
    bootstrap_mean(a, 400, seed=9)
    fresh = np.random.default_rng(9)
    weights = significance._problem_weights(fresh, 20, 400)
    draws = significance._resampled_means(fresh, b, weights) - significance._resampled_means(fresh, a, weights)
    assert bootstrap_difference(a, b, 400, seed=9)["ci"] == significance._percentile_ci(draws, 0.95)
    fresh = np.random.default_rng(9)
    weights = significance._problem_weights(fresh, 20, 400)
    assert bootstrap_mean(b, 400, seed=9)["ci"] == significance._percentile_ci(
        significance._resampled_means(fresh, b, weights), 0.95)
