"""opsd/analysis/evidence.py: TOST against scipy's t distribution written out by hand, the
piecewise-linear first crossing, and the `python -m opsd.analysis.stats equivalence` command line
(bad input: one line, exit 2). `reach`: tests/analysis/test_reach.py."""
import json
import math

import numpy as np
import pytest
from scipy import stats as sp
from token_grid import CORRECT, accuracy, write_grid

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


@pytest.mark.parametrize("argv, message", [
    (["equivalence", "{grid}", "--a", "opsd", "--b", "nope", "--margin", "5"], "no arm 'nope' with finished cells"),
    (["equivalence", "{grid}", "--a", "opsd@3", "--b", "sft", "--margin", "5"],
     "arm opsd has no checkpoint at step 3 in every seed (steps: 2, 4)"),
    (["equivalence", "{grid}", "--a", "opsd", "--b", "sft", "--margin", "-1"], "--margin must be a number"),
    (["equivalence", "{missing}", "--a", "opsd", "--b", "sft", "--margin", "1"], "no such folder"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    grid = write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    argv = [a.format(grid=grid, missing=tmp_path / "none") for a in argv]
    assert run_stats.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
