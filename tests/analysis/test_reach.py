"""`python -m opsd.analysis.stats reach` (opsd/analysis/evidence.py) on synthetic grids written with
the project's own writers (token_grid.py): the target fixed in advance, each seed's crossing against
hand interpolation, the spread labelled "seed range" (min-max) with 2-4 seeds and a 95% interval of
a hierarchical bootstrap over seeds and problems from 5 seeds (against the same resampling written
out with loops), a target no seed reaches, the ratio labels, and bad input as one line, exit 2."""
import json

import numpy as np
import pytest
from token_grid import BASE_CORRECT, CORRECT, TOKENS_PER_STEP, K, accuracy, report, write_grid, write_run

from opsd.analysis import evidence
from opsd.analysis import stats as run_stats
from opsd.evaluation.evaluate import write_json_atomic

STEPS = (2, 4)
BASE = accuracy(BASE_CORRECT)  # 6.25: the untrained arm, the curves' origin


def write_seed(cell, per_step, counts):
    """A swept cell as the grid leaves it: run/metrics.jsonl, eval/ reports per checkpoint, sweep.json, eval.json."""
    write_run(cell / "run", per_step)
    paths = []
    for step in STEPS:
        path = cell / "eval" / f"eval_run_checkpoint-{step}.json"
        write_json_atomic(path, report(counts[step], str(cell / "run" / f"checkpoint-{step}")))
        paths.append(path)
    write_json_atomic(cell / "eval.json", report(counts[STEPS[-1]], str(cell / "run" / "checkpoint-4")))
    result = run_stats.sweep_checkpoints(STEPS, [run_stats.load_run(p) for p in paths], 200, 0)
    write_json_atomic(cell / "sweep.json", result)


def seeds(n, start=0, slow=1):
    """n seeds: (tokens a step, {step: correct counts of the 4 problems}); seed i samples 1000 + 500 i
    tokens a step (x slow) and its accuracy rises from about 25 to 55-70 points, problem by problem unlike."""
    return [((1000 + 500 * i) * slow, {2: [1 + i % 3, 2, 3, 2 + i % 2], 4: [4 + i % 2, 5, 6 - i % 3, 3 + i % 4]})
            for i in range(start, start + n)]


def write_arms(out, arms):
    write_json_atomic(out / "base" / "eval.json", report(BASE_CORRECT, "base"))
    for name, rows in arms.items():
        for seed, (per_step, counts) in enumerate(rows):
            write_seed(out / name / f"seed-{seed}", per_step, counts)
    return out


def hand_crossing(per_step, counts, target, origin=BASE):
    points = [(0.0, origin)] + [(per_step * s, accuracy(counts[s])) for s in STEPS]
    for (t0, a0), (t1, a1) in zip(points, points[1:], strict=False):
        if a0 < target <= a1:
            return t0 + (target - a0) * (t1 - t0) / (a1 - a0)
    return None


def reach(grid, target, **kwargs):
    return evidence.reach_table(run_stats.grid_table(grid), target=target, grid_dir=grid, **kwargs)


def row(text, arm):
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {arm} |")]
    return line


def test_two_seeds_give_their_range_labelled_seed_range(tmp_path):
    grid = write_grid(tmp_path / "grid")  # opsd: 2 seeds; sft samples nothing
    r = reach(grid, 40.0, n_resamples=2000)
    assert r["origin"] == BASE and r["skipped"] == {"sft": "samples no tokens (reference solutions only)"}
    opsd = r["arms"]["opsd"]
    expected = [hand_crossing(TOKENS_PER_STEP["opsd"][s], CORRECT["opsd"][s], 40.0) for s in (0, 1)]
    assert expected == pytest.approx([1800.0, 7680.0])
    assert list(opsd["per_seed"].values()) == pytest.approx(expected)
    assert opsd["mean"] == pytest.approx(sum(expected) / 2)
    assert opsd["spread"] == {"kind": "seed range", "low": pytest.approx(1800.0), "high": pytest.approx(7680.0)}
    text = evidence.format_reach(r)
    assert row(text, "opsd") == "| opsd | 2/2 | 1.8 k, 7.68 k | 4.74 k | seed range [1.8 k, 7.68 k] |"
    assert "interval [" not in row(text, "opsd") and "(one seed)" not in text
    assert "| arm | seeds reaching | per seed | mean | spread over seeds |" in text
    assert "avg@8 40.00 (the target given)" in text


@pytest.mark.parametrize("n", [3, 4])
def test_three_and_four_seeds_give_their_range_not_an_interval(tmp_path, n):
    grid = write_arms(tmp_path / "grid", {"opsd": seeds(n)})
    a = reach(grid, 40.0)["arms"]["opsd"]
    expected = [hand_crossing(per_step, counts, 40.0) for per_step, counts in seeds(n)]
    assert list(a["per_seed"].values()) == pytest.approx(expected)
    assert a["spread"] == {"kind": "seed range", "low": pytest.approx(min(expected)),
                           "high": pytest.approx(max(expected))}


def hand_hierarchical_interval(rows, target, n_resamples, seed):
    """The hierarchical bootstrap written out: draw the 4 problems (one draw), every checkpoint's and
    the origin's accuracy on them, each seed's first crossing, then draw the seeds; the mean, inf where a
    drawn seed does not reach. The draws come from the generator in the order reach_table takes them."""
    rng = np.random.default_rng(seed)
    problems = len(BASE_CORRECT)
    weights = rng.multinomial(problems, np.full(problems, 1 / problems), size=n_resamples)
    picks = rng.multinomial(len(rows), np.full(len(rows), 1 / len(rows)), size=n_resamples)
    means = []
    for w, pick in zip(weights, picks, strict=True):
        def acc(counts, w=w):
            return sum(wp * 100.0 * c / K for wp, c in zip(w, counts, strict=True)) / problems
        crossings = []
        for per_step, counts in rows:
            points = [(0.0, acc(BASE_CORRECT))] + [(per_step * s, acc(counts[s])) for s in STEPS]
            crossings.append(evidence.first_crossing([p[0] for p in points], [p[1] for p in points], target))
        drawn = [c for c, times in zip(crossings, pick, strict=True) for _ in range(times)]
        means.append(np.inf if None in drawn else sum(drawn) / len(drawn))
    return evidence.percentile_interval(np.array(means))


@pytest.mark.parametrize("n, target", [(5, 40.0), (6, 50.0)])
def test_five_seeds_and_more_give_a_hierarchical_bootstrap_interval(tmp_path, n, target):
    rows = seeds(n)
    grid = write_arms(tmp_path / "grid", {"opsd": rows})
    r = reach(grid, target, n_resamples=300, seed=3)
    a = r["arms"]["opsd"]
    expected = [hand_crossing(per_step, counts, target) for per_step, counts in rows]
    assert list(a["per_seed"].values()) == pytest.approx(expected)
    low, high = hand_hierarchical_interval(rows, target, 300, 3)
    assert a["spread"]["kind"] == "95% interval"
    assert (a["spread"]["low"], a["spread"]["high"]) == (pytest.approx(low), None if high == np.inf
                                                          else pytest.approx(high))
    if a["mean"] is not None:
        assert a["spread"]["low"] <= a["mean"]
    assert f"95% interval [{evidence.format_tokens(low)}," in row(evidence.format_reach(r), "opsd")


def test_problems_are_resampled_too(tmp_path):
    """Seeds with the same curve: a bootstrap over seeds alone would have no spread; resampling the
    problems (whose accuracies differ) gives one."""
    same = [seeds(1)[0]] * 5
    a = reach(write_arms(tmp_path / "grid", {"opsd": same}), 40.0, n_resamples=400)["arms"]["opsd"]
    assert len(set(a["per_seed"].values())) == 1
    assert a["spread"]["low"] < a["mean"] < a["spread"]["high"]


@pytest.mark.parametrize("n", [2, 5])
def test_a_target_no_seed_reaches(tmp_path, n):
    grid = write_arms(tmp_path / "grid", {"opsd": seeds(n)})
    r = reach(grid, 95.0, n_resamples=200)
    a = r["arms"]["opsd"]
    assert a["reached"] == 0 and a["mean"] is None and set(a["per_seed"].values()) == {None}
    assert (a["spread"]["low"], a["spread"]["high"]) == (None, None)
    kind = "seed range" if n < 5 else "95% interval"
    assert row(evidence.format_reach(r), "opsd") == (
        f"| opsd | 0/{n} | {', '.join(['not reached'] * n)} | not reached | {kind} [not reached, not reached] |")


def test_one_seed_is_said_only_for_one_seed(tmp_path):
    grid = write_arms(tmp_path / "grid", {"single": seeds(1), "pair": seeds(2)})
    text = evidence.format_reach(reach(grid, 40.0, ratio_to="pair"))
    assert row(text, "single") == "| single | 1/1 | 2.96 k | 2.96 k | - (one seed) | 0.86 | - (one seed) |"
    assert "(one seed)" not in row(text, "pair")


def fake(mean, seeds, draws=None):
    return {"mean": mean, "seeds": seeds, "draws": None if draws is None else np.array(draws, dtype=float)}


@pytest.mark.parametrize("b, a, label, no_interval", [
    (fake(None, 2), fake(None, 2), "neither reached", "under 5 seeds"),  # inf / inf: not "(one seed)"
    (fake(None, 1), fake(None, 3), "neither reached", "one seed"),
    (fake(None, 3), fake(100.0, 3), "not reached", "under 5 seeds"),
    (fake(100.0, 3), fake(None, 3), "0 (the reference arm not reached)", "under 5 seeds"),
    (fake(300.0, 5, [300, np.inf]), fake(100.0, 5, [100, np.inf]), "3.00", "neither reached in some resamples"),
])
def test_ratio_labels(b, a, label, no_interval):
    q = evidence.ratio(b, a)
    assert (q["label"], q["interval"], q["no_interval"]) == (label, None, no_interval)


def test_ratio_interval_of_paired_resampled_means():
    q = evidence.ratio(fake(400.0, 5, [300, 400, 500, np.inf]), fake(100.0, 6, [100, 100, 250, 100]))
    assert q["ratio"] == pytest.approx(4.0) and q["label"] == "4.00"
    assert q["interval"] == [pytest.approx(2.0), None]  # resample by resample: 3, 4, 2, inf (not reached)


def test_ratio_rows_in_the_table(tmp_path):
    grid = write_arms(tmp_path / "grid", {"opsd": seeds(2), "grpo": seeds(2, slow=4)})
    text = evidence.format_reach(reach(grid, 95.0, ratio_to="opsd"))
    assert row(text, "grpo").endswith("| neither reached | - (under 5 seeds) |")
    assert row(text, "opsd").endswith("| 1 | - |")
    text = evidence.format_reach(reach(grid, 40.0, ratio_to="opsd"))
    assert row(text, "grpo").endswith("| 4.00 | - (under 5 seeds) |")  # same curves, 4 times the tokens


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    """Every problem is at >= 37.5 points at step 4 in every seed: a target of 30 is reached in every
    resample, so the ratio of grpo (twice opsd's tokens, same curves) has an interval around 2."""
    grid = write_arms(tmp_path / "grid", {"opsd": seeds(5), "grpo": seeds(5, slow=2)})
    out = tmp_path / "reach.json"
    assert run_stats.main(["reach", str(grid), "--target", "30", "--ratio-to", "opsd", "--bootstrap", "500",
                           "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["target"] == 30.0 and "target_arm" not in result
    q = result["arms"]["grpo"]["ratio_to"]
    assert q["ratio"] == pytest.approx(2.0) and q["no_interval"] is None
    low, high = q["interval"]
    assert low < 2.0 < high  # the seeds are drawn independently in each arm
    assert f"| 2.00 | [{low:.2f}, {high:.2f}] |" in row(text, "grpo")
    assert row(text, "grpo").startswith("| grpo | 5/5 |") and "95% interval [" in row(text, "grpo")


@pytest.mark.parametrize("argv, message", [
    (["reach", "{grid}", "--target-arm", "opsd"],
     "--target-arm opsd: removed; a target read off an arm's own results moves with them. Give the accuracy you "
     "fixed in advance: --target ACCURACY"),
    (["reach", "{grid}"], "--target ACCURACY is required"),
    (["reach", "{grid}", "--target", "5"], "--target 5: the untrained arm base is already at 6.25"),
    (["reach", "{grid}", "--target", "150"], "--target must be an accuracy in points"),
    (["reach", "{grid}", "--target", "40", "--arms", "old"], "arm old seed 0 did not record tokens/sampled"),
    (["reach", "{grid}", "--target", "40", "--arms", "base"], "arm base is untrained"),
    (["reach", "{grid}", "--target", "40", "--bootstrap", "5"], "--bootstrap must be at least"),
    (["reach", "{grid}", "--target", "40", "--arms", "many"], "eval_run_checkpoint-2.json: no such file"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    grid = write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    write_arms(grid, {"many": seeds(5)})
    (grid / "many" / "seed-3" / "eval" / "eval_run_checkpoint-2.json").unlink()  # a 5-seed arm's report gone
    assert run_stats.main([a.format(grid=grid) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
