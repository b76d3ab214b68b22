"""opsd/analysis/evidence.py: TOST against scipy's t distribution written out by hand, tokens to
reach an accuracy against hand interpolation on the hand-made grid of token_grid.py, and the
`python -m opsd.analysis.stats equivalence / reach` command lines (bad input: one line, exit 2)."""
import json
import math

import numpy as np
import pytest
from scipy import stats as sp
from token_grid import CORRECT, TOKENS_PER_STEP, accuracy, write_grid

from opsd.analysis import evidence
from opsd.analysis import stats as run_stats


def hand_tost(a, b, margin, alpha):
    a, b = np.asarray(a, float), np.asarray(b, float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    d, se = b.mean() - a.mean(), math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    p_low = 1 - sp.t.cdf((d + margin) / se, df)  # H0: d <= -margin
    p_high = sp.t.cdf((d - margin) / se, df)  # H0: d >= +margin
    half = sp.t.ppf(1 - alpha, df) * se
    return d, se, df, p_low, p_high, (d - half, d + half)


@pytest.mark.parametrize("a, b, margin", [
    ([57.0, 56.1, 58.8], [58.5, 56.12, 53.94], 5.0),  # GRPO-like spread: not shown equivalent at 5
    ([50.0, 50.5, 49.8, 50.2], [50.1, 49.9, 50.4], 1.0),  # tight runs: equivalent at 1
    ([40.0, 42.0], [50.0, 52.0, 51.0], 3.0),  # clearly different
])
def test_tost_is_two_one_sided_welch_tests(a, b, margin):
    r = evidence.tost(a, b, margin, 0.05)
    d, se, df, p_low, p_high, ci = hand_tost(a, b, margin, 0.05)
    assert (r["diff"], r["se"], r["df"]) == pytest.approx((d, se, df), rel=1e-12)
    assert (r["p_low"], r["p_high"]) == pytest.approx((p_low, p_high), rel=1e-9, abs=1e-15)
    assert r["p"] == max(r["p_low"], r["p_high"]) and r["ci"] == pytest.approx(list(ci), rel=1e-12)
    # TOST at alpha is the (1 - 2 alpha) interval inside the margin
    assert r["equivalent"] == (-margin < ci[0] and ci[1] < margin)
    assert r["smallest_margin"] == pytest.approx(max(abs(ci[0]), abs(ci[1])))


def test_tost_verdicts():
    assert evidence.tost([50.0, 50.5, 49.8, 50.2], [50.1, 49.9, 50.4], 1.0)["equivalent"]
    assert not evidence.tost([57.0, 56.1, 58.8], [58.5, 56.12, 53.94], 2.0)["equivalent"]


@pytest.mark.parametrize("a, b, margin, message", [
    ([1.0], [1.0, 2.0], 1.0, "needs >= 2 runs an arm"),
    ([1.0, 1.0], [2.0, 2.0], 1.0, "neither arm's runs vary"),
    ([1.0, 2.0], [2.0, 3.0], 0.0, "--margin must be a number of points > 0, got 0.0"),
])
def test_tost_refuses_what_it_cannot_test(a, b, margin, message):
    with pytest.raises(evidence.EvidenceError, match=message):
        evidence.tost(a, b, margin)


def test_first_crossing_interpolates_linearly():
    assert evidence.first_crossing([0, 100, 200], [10.0, 30.0, 50.0], 40.0) == 150.0
    assert evidence.first_crossing([0, 100, 200], [10.0, 30.0, 50.0], 30.0) == 100.0
    assert evidence.first_crossing([100, 200], [45.0, 50.0], 40.0) == 100.0  # already there
    assert evidence.first_crossing([0, 100, 200, 300], [10.0, 45.0, 30.0, 60.0], 40.0) == pytest.approx(
        100 * 30 / 35)  # the first crossing, not the later one
    assert evidence.first_crossing([0, 100], [10.0, 30.0], 31.0) is None


def seed_crossing(arm, seed, target, origin):
    """Hand interpolation on token_grid's numbers (steps 2 and 4)."""
    per_step = TOKENS_PER_STEP[arm][seed]
    points = [(0.0, origin)] + [(per_step * s, accuracy(CORRECT[arm][seed][s])) for s in (2, 4)]
    for (t0, a0), (t1, a1) in zip(points, points[1:], strict=False):
        if a0 < target <= a1:
            return t0 + (target - a0) * (t1 - t0) / (a1 - a0)
    return None


def test_reach_on_a_grid(tmp_path):
    grid = write_grid(tmp_path / "grid")
    base = accuracy([1, 0, 1, 0])
    r = evidence.reach_table(run_stats.grid_table(grid), target=40.0, n_resamples=2000)
    assert r["origin"] == base and r["skipped"] == {"sft": "samples no tokens (reference solutions only)"}
    opsd = r["arms"]["opsd"]
    expected = [seed_crossing("opsd", s, 40.0, base) for s in (0, 1)]
    assert expected == pytest.approx([1800.0, 7680.0])
    assert list(opsd["per_seed"].values()) == pytest.approx(expected)
    assert opsd["mean"] == pytest.approx(sum(expected) / 2)
    # two seeds: the resampled means are 1800, 4740 or 7680; the 95% interval spans the extremes
    assert opsd["interval"] == pytest.approx(expected)


def test_a_seed_that_never_reaches_leaves_the_mean_and_the_upper_end_not_reached(tmp_path):
    grid = write_grid(tmp_path / "grid")
    result = evidence.reach_table(run_stats.grid_table(grid), target=65.0, arms=["opsd"], n_resamples=2000)
    r = result["arms"]["opsd"]
    assert r["per_seed"][0] == pytest.approx(seed_crossing("opsd", 0, 65.0, accuracy([1, 0, 1, 0])))
    assert r["per_seed"][1] is None and r["reached"] == 1 and r["mean"] is None
    assert r["interval"][0] == pytest.approx(r["per_seed"][0]) and r["interval"][1] is None
    text = evidence.format_reach(result)
    assert "| opsd | 1/2 | 3.7 k, not reached | not reached | [3.7 k, not reached] |" in text


def test_ratio_of_resampled_means():
    rng = np.random.default_rng(0)
    a = evidence.reach({0: [(100.0, 50.0)], 1: [(200.0, 50.0)]}, 40.0, 0.0, 1000, rng)
    b = evidence.reach({0: [(800.0, 50.0)], 1: [(1600.0, 50.0)]}, 40.0, 0.0, 1000, rng)
    assert a["mean"] == pytest.approx(120.0) and b["mean"] == pytest.approx(960.0)
    q = evidence.ratio(b, a)
    assert q["ratio"] == pytest.approx(8.0)
    # means: a in {80, 120, 160}, b in {640, 960, 1280}, each end with probability 1/4 in each arm
    assert q["interval"] == pytest.approx([640 / 160, 1280 / 80])


def test_equivalence_command_on_a_grid(tmp_path, capsys):
    grid = write_grid(tmp_path / "grid")
    out = tmp_path / "eq.json"
    assert run_stats.main(["equivalence", str(grid), "--a", "opsd@2", "--b", "sft", "--margin", "5",
                           "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    a = [accuracy(CORRECT["opsd"][s][2]) for s in (0, 1)]
    b = [accuracy(CORRECT["sft"][s][4]) for s in (0, 1)]
    assert result["a"]["accuracy_per_seed"] == a and result["b"]["accuracy_per_seed"] == b
    assert result["p"] == pytest.approx(max(hand_tost(a, b, 5.0, 0.05)[3:5]))
    assert "A = opsd @ step 2" in text and "B = sft @ step 4" in text and "verdict: not shown equivalent" in text


def test_reach_command_prints_the_table(tmp_path, capsys):
    grid = write_grid(tmp_path / "grid")
    assert run_stats.main(["reach", str(grid), "--target-arm", "sft", "--ratio-to", "opsd",
                           "--bootstrap", "500"]) == 0
    text = capsys.readouterr().out
    target = accuracy(CORRECT["sft"][0][4]) / 2 + accuracy(CORRECT["sft"][1][4]) / 2
    assert f"avg@8 {target:.2f} (sft's last point)" in text and "| opsd | 2/2 |" in text


@pytest.mark.parametrize("argv, message", [
    (["equivalence", "{grid}", "--a", "opsd", "--b", "nope", "--margin", "5"], "no arm 'nope' with finished cells"),
    (["equivalence", "{grid}", "--a", "opsd@3", "--b", "sft", "--margin", "5"],
     "arm opsd has no checkpoint at step 3 in every seed (steps: 2, 4)"),
    (["equivalence", "{grid}", "--a", "opsd", "--b", "sft", "--margin", "-1"], "--margin must be a number"),
    (["equivalence", "{missing}", "--a", "opsd", "--b", "sft", "--margin", "1"], "no such folder"),
    (["reach", "{grid}", "--target", "40", "--arms", "old"], "arm old seed 0 did not record tokens/sampled"),
    (["reach", "{grid}", "--target", "40", "--arms", "base"], "arm base is untrained"),
    (["reach", "{grid}", "--target", "40", "--bootstrap", "5"], "--bootstrap must be at least"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    grid = write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    argv = [a.format(grid=grid, missing=tmp_path / "none") for a in argv]
    assert run_stats.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
