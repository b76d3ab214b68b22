"""A grid's results beyond pass@1 (issue 58 items 1 and 4, issue 59 item 4): pass@1, pass@n, maj@n
and distinct answers per arm against the baseline, the sentence when pass@1 and pass@n disagree,
swept grids' pass@1 / pass@n per step, best step, last against best and the collapse watch, and the
grid file's `margin` (TOST) and `compare_to` (reference arms). Grid folders are built by hand (eval
reports as opsd.evaluation writes them); no training runs."""
import importlib.util
import json
from pathlib import Path

import pytest

import opsd.research.grid
from opsd.analysis.reports import load_run
from opsd.analysis.stats import sweep_checkpoints
from opsd.evaluation.evaluate import write_json_atomic
from opsd.research.cell import GridError, load_grid
from opsd.run_log import COLLAPSE_FIELD, append_metrics

REPO = Path(__file__).resolve().parents[2]
Arm, Grid = opsd.research.grid.Arm, opsd.research.grid.Grid


def _token_grid():
    """tests/analysis/token_grid.py: the hand-built grid folder the analysis tests share."""
    spec = importlib.util.spec_from_file_location("token_grid", REPO / "tests" / "analysis" / "token_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TG = _token_grid()  # 8 samples a problem, 4 problems; wrong samples answer "0", right ones the gold


def grid_of(names, seeds=(0, 1), **kwargs) -> Grid:
    arms = tuple(Arm(name, train=name != "base") for name in names)
    return Grid(arms=arms, seeds=seeds, eval_data=None, preset="tiny", baseline="base",
                budget={**opsd.research.grid.BUDGET_DEFAULT, "max_steps": 4}, recipe={}, **kwargs)


def test_rerunning_a_finished_grid_remakes_its_results_with_every_metric(tmp_path, capsys):
    """Every cell done (eval.json), nothing to train: `python -m opsd.research.grid GRID --out DIR`
    writes results.md / results.json with pass@1, pass@n, maj@n and distinct answers per arm, each
    against the baseline with its interval, from the cells' reports (hand values below)."""
    out = TG.write_grid(tmp_path / "grid", arms=("opsd", "sft"))
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "seeds": [0, 1], "baseline": "base", "sweep_every": 2,
                                     "budget": {"max_steps": 4},
                                     "arms": {"base": {"train": False}, "opsd": {}, "sft": {}}}))
    assert opsd.research.grid.main([str(grid_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 cells, 5 already done, 0 to run" in printed
    table = json.loads((out / "results.json").read_text())
    base, arms = table["arms"]["base"]["metrics"], table["arms"]
    # base: 1, 0, 1, 0 of 8 correct, the rest answer "0": pass@8 half the problems; the vote "0" always
    # wins (wrong); 2 answers where one sample is right, 1 where none is
    assert {m: base[m]["mean"] for m in base} == pytest.approx(
        {"pass@1": 100 * 2 / 32, "pass@8": 50.0, "maj@8": 0.0, "distinct": 1.5})
    # sft's last step: 2, 2, 2, 2 (seed 0) and 2, 2, 2, 4 (seed 1) correct of 8: the vote is right only
    # where 4 right answers tie 4 wrong ones and the right one came first (seed 1, problem 3)
    sft = arms["sft"]["metrics"]
    assert sft["maj@8"]["per_run"] == [0.0, 25.0] and sft["pass@8"]["per_run"] == [100.0, 100.0]
    assert sft["pass@1"]["per_run"] == arms["sft"]["per_run"] and sft["pass@1"]["mean"] == arms["sft"]["mean"]
    assert sft["distinct"]["mean"] == 2.0
    assert sft["pass@8"]["difference"] == pytest.approx(50.0) and sft["maj@8"]["difference"] == pytest.approx(12.5)
    for name in ("pass@1", "pass@8", "maj@8", "distinct"):
        assert sft[name]["ci"][0] <= sft[name]["difference"] <= sft[name]["ci"][1]
        assert set(sft[name]) >= {"unit", "mean", "per_run", "difference", "ci", "run_level_p"}
    assert sft["pass@1"]["run_level_p"] == pytest.approx(float(arms["sft"]["statistics"].split("p = ")[1]), rel=1e-2)
    text = (out / "results.md").read_text()
    assert "| arm | pass@1 | pass@8 | maj@8 | distinct answers a problem |" in text
    low, high = sft["pass@8"]["ci"]
    assert (f"| sft | {sft['pass@1']['mean']:.2f} (+21.88 [{sft['pass@1']['ci'][0]:+.2f}, "
            f"{sft['pass@1']['ci'][1]:+.2f}], p {sft['pass@1']['run_level_p']:.3g}) | 100.00 (+50.00 "
            f"[{low:+.2f}, {high:+.2f}], p -) | 12.50 (+12.50 [") in text
    assert "| base | 6.25 | 50.00 | 0.00 | 1.50 |" in text
    # swept: pass@1 and pass@8 at each step, means over the seeds
    assert arms["opsd"]["per_step_pass"] == {"pass@1": {"2": 37.5, "4": pytest.approx(65.625)},
                                             "pass@8": {"2": 100.0, "4": 100.0}}
    assert "| step | opsd pass@1 | opsd pass@8 | sft pass@1 | sft pass@8 |" in text
    assert ("- opsd: the best step by pass@1 is the last, 4 (65.62); collapse watch did not fire (seed 0, seed 1)"
            in text)


def write_cell(cell: Path, counts_by_step: dict, collapse_at: int | None = None, answers=None) -> None:
    """A swept cell: metrics.jsonl (the collapse watch's field at `collapse_at`), one report per
    checkpoint, its sweep.json and its eval.json (the last checkpoint's)."""
    steps = sorted(counts_by_step)
    for step in range(1, steps[-1] + 1):
        append_metrics(str(cell / "run" / "metrics.jsonl"), step,
                       {"loss": 1.0, **({COLLAPSE_FIELD: 1} if step == collapse_at else {})})
    paths = []
    for step in steps:
        path = cell / "eval" / f"eval_run_checkpoint-{step}.json"
        write_json_atomic(path, TG.report(counts_by_step[step], str(cell / "run" / f"checkpoint-{step}")))
        paths.append(path)
    write_json_atomic(cell / "sweep.json", sweep_checkpoints(steps, [load_run(p) for p in paths], 200, 0))
    write_json_atomic(cell / "eval.json", json.loads(paths[-1].read_text()))


def test_a_swept_arm_gives_its_best_step_the_last_against_it_and_where_the_collapse_watch_fired(tmp_path):
    out = tmp_path / "grid"
    write_json_atomic(out / "base" / "eval.json", TG.report(TG.BASE_CORRECT, "base"))
    write_cell(out / "opsd" / "seed-0", {2: [6, 6, 6, 6], 4: [4, 5, 4, 4]}, collapse_at=3)
    write_cell(out / "opsd" / "seed-1", {2: [6, 6, 5, 6], 4: [4, 4, 4, 5]})
    grid = grid_of(("base", "opsd"), sweep_every=2)
    table = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))
    arm = table["arms"]["opsd"]
    best, last = 100 * (24 + 23) / 64, 100 * (17 + 17) / 64
    assert arm["per_step_pass"]["pass@1"] == pytest.approx({"2": best, "4": last})
    assert arm["best_step"] == 2 and arm["collapse_warning"] == {"0": 3, "1": None}
    versus = arm["last_vs_best"]
    assert (versus["best_step"], versus["last_step"]) == (2, 4) and versus["difference"] == pytest.approx(last - best)
    low, high = versus["ci"]
    assert low <= last - best <= high < 0
    line = next(line for line in opsd.research.grid.markdown(table).splitlines() if line.startswith("- opsd: "))
    assert line.startswith(f"- opsd: best step 2 (pass@1 {best:.2f}); the last, step 4 ({last:.2f}), minus the best: "
                           f"{last - best:+.2f} points, 95% CI [{low:+.2f}, {high:+.2f}], run-level p ")
    assert line.endswith("(the best is picked on these problems: optimistic); collapse watch fired seed 0 at step 3, "
                         "not in seed 1")


# Three seeds where pass@1 rises against base but pass@8 falls: every problem has 1 right answer of
# 8 in base (pass@8 100), while the trained seeds answer half the problems all right and the other
# half all with one wrong answer.
PROBLEMS = 20


def collapsed(right: int) -> list[int]:
    return [8] * right + [0] * (PROBLEMS - right)


def write_flat_grid(out: Path, arms: dict) -> None:
    """base/eval.json (1 of 8 right on every problem) and ARM/seed-N/eval.json from per-seed counts."""
    write_json_atomic(out / "base" / "eval.json", TG.report([1] * PROBLEMS, "base"))
    for name, seeds in arms.items():
        for seed, counts in enumerate(seeds):
            write_json_atomic(out / name / f"seed-{seed}" / "eval.json",
                              TG.report(counts, f"{name}/seed-{seed}/run/checkpoint-4"))


def test_the_verdict_says_when_pass_at_1_gains_and_pass_at_n_loses(tmp_path):
    out = tmp_path / "grid"
    write_flat_grid(out, {"opsd": [collapsed(10), collapsed(10), collapsed(11)]})
    grid = grid_of(("base", "opsd"), seeds=(0, 1, 2))
    cells = opsd.research.grid.cells(grid, out)
    table = opsd.research.grid.results(grid, out, cells)
    arm = table["arms"]["opsd"]
    low, high = arm["metrics"]["pass@8"]["ci"]
    sentence = (f"pass@1 and pass@8 disagree: opsd gains at pass@1 but loses at pass@8 "
                f"({arm['metrics']['pass@8']['difference']:+.2f} points, 95% CI [{low:+.2f}, {high:+.2f}])")
    assert arm["disagreement"] == sentence and high < 0
    assert arm["metrics"]["pass@8"]["difference"] == pytest.approx(100 * 31 / 60 - 100)
    # the pass@1 verdict as before, the sentence after it, then the numbers
    assert arm["verdict_sentence"].startswith("opsd is 39.17 points above base on these 20 problems, beyond "
                                              "run-to-run noise with 1 vs 3 runs: the arms differ")
    assert arm["verdict"] == f"{arm['verdict_sentence']}. {sentence}. In numbers: {arm['statistics']}"
    assert opsd.research.grid.final_lines(cells, table)[-1] == f"opsd vs base: {arm['verdict']}"
    assert f"| {arm['verdict_sentence']}. {sentence} |" in opsd.research.grid.markdown(table)
    # pass@1 and pass@8 agree (neither shown here): no sentence
    same = tmp_path / "same"
    write_flat_grid(same, {"opsd": [[2] * PROBLEMS, [2] * PROBLEMS, [3] * PROBLEMS]})
    table = opsd.research.grid.results(grid, same, opsd.research.grid.cells(grid, same))
    assert "disagreement" not in table["arms"]["opsd"] and "pass@8 disagree" not in table["arms"]["opsd"]["verdict"]


def test_margin_and_compare_to(tmp_path):
    """compare_to: a second table and results.json entry, every arm against the reference arm; margin:
    TOST beside each difference test, in the verdict's words."""
    out = tmp_path / "grid"
    write_flat_grid(out, {"opsd": [collapsed(10), collapsed(10), collapsed(11)],
                          "sft": [collapsed(10), collapsed(11), collapsed(10)]})
    grid = grid_of(("base", "opsd", "sft"), seeds=(0, 1, 2), margin=10.0, compare_to=("opsd",))
    cells = opsd.research.grid.cells(grid, out)
    table = opsd.research.grid.results(grid, out, cells)
    assert (table["grid"]["margin"], table["grid"]["compare_to"]) == (10.0, ["opsd"])
    versus = table["compare_to"]["opsd"]
    assert set(versus) == {"sft"}  # not the baseline: its row is opsd's of the first table, sign flipped
    sft = versus["sft"]
    assert sft["difference"] == pytest.approx(0.0) and sft["equivalence"]["equivalent"]
    assert sft["equivalence"]["tost"]["p"] < 0.05
    tost_p = sft["equivalence"]["tost"]["p"]
    assert sft["verdict_words"] == (f"{sft['verdict_sentence']}. Against the margin of 10 points stated before the "
                                    f"run: shown equivalent within 10 points (TOST p = {tost_p:.3g})")
    # against base (one run): shown different, and no TOST (it needs two runs an arm)
    opsd_vs_base = table["arms"]["opsd"]["equivalence"]
    assert opsd_vs_base["words"] == ("Against the margin of 10 points stated before the run: shown different (no "
                                     "equivalence test: TOST needs >= 2 runs an arm (Welch t), got 1 and 3)")
    text = opsd.research.grid.markdown(table)
    assert "Equivalence margin 10 points on pass@1, stated in the grid file before the run" in text
    assert "| arm | against | pass@1 | pass@8 | maj@8 | distinct answers a problem | verdict |" in text
    row = next(line for line in text.splitlines() if line.startswith("| sft | opsd | "))
    assert row.startswith("| sft | opsd | 51.67 (+0.00 [") and row.endswith(f"| {sft['verdict_words']} |")
    assert not any(line.startswith("| base | opsd |") for line in text.splitlines())
    final = opsd.research.grid.final_lines(cells, table)
    assert final[-1] == f"sft vs opsd: {sft['verdict']}" and not any(f.startswith("base vs opsd") for f in final)
    # a margin too small for three runs: neither shown
    tight_grid = grid_of(("base", "opsd", "sft"), seeds=(0, 1, 2), margin=2.0, compare_to=("opsd",))
    tight = opsd.research.grid.results(tight_grid, out, opsd.research.grid.cells(tight_grid, out))
    assert tight["compare_to"]["opsd"]["sft"]["equivalence"]["words"].startswith(
        "Against the margin of 2 points stated before the run: neither shown different nor shown equivalent within "
        "2 points (TOST p = ")
    plain_grid = grid_of(("base", "opsd", "sft"), seeds=(0, 1, 2))
    plain = opsd.research.grid.results(plain_grid, out, opsd.research.grid.cells(plain_grid, out))
    assert plain["compare_to"] == {}
    assert "equivalence" not in plain["arms"]["sft"] and "equivalent" not in plain["arms"]["sft"]["verdict"]


@pytest.mark.parametrize("key, value, expected", [
    ("margin", 0, "'margin' must be a number of points > 0 (the equivalence margin on the pass@1 scale), got 0"),
    ("margin", "3", "'margin' must be a number of points > 0 (the equivalence margin on the pass@1 scale), got '3'"),
    ("margin", True, "'margin' must be a number of points > 0 (the equivalence margin on the pass@1 scale), got True"),
    ("compare_to", "opsd", "'compare_to' must be a list of arm names, got 'opsd'"),
    ("compare_to", ["grpo"], "compare_to 'grpo' is not an arm (base, opsd, sft)"),
    ("compare_to", ["base"], "compare_to 'base' is the baseline, which every arm is compared with already"),
    ("compare_to", ["opsd", "opsd"], "compare_to names 'opsd' twice"),
])
def test_margin_and_compare_to_are_checked_when_the_grid_is_read(tmp_path, capsys, key, value, expected):
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"preset": "tiny", key: value,
                                "arms": {"base": {"train": False}, "opsd": {}, "sft": {}}}))
    with pytest.raises(GridError) as error:
        load_grid(str(path))
    assert str(error.value) == f"{path}: {expected}"
    assert opsd.research.grid.main([str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {path}: {expected}\n"
    path.write_text(json.dumps({"preset": "tiny", "margin": 2.5, "compare_to": ["opsd"],
                                "arms": {"base": {"train": False}, "opsd": {}, "sft": {}}}))
    assert (load_grid(str(path)).margin, load_grid(str(path)).compare_to) == (2.5, ("opsd",))


def test_reports_without_answers_keep_their_pass_at_k(tmp_path):
    """A report whose samples have no `answer` (an old one) gives pass@1 and pass@n; maj@n and distinct
    answers are left out for it ("-" in results.md), the grid's results stand."""
    out = tmp_path / "grid"
    write_flat_grid(out, {"opsd": [collapsed(10), collapsed(10), collapsed(11)]})
    report = json.loads((out / "base" / "eval.json").read_text())
    for problem in report["problems"]:
        for sample in problem["samples"]:
            del sample["answer"]
    write_json_atomic(out / "base" / "eval.json", report)
    grid = grid_of(("base", "opsd"), seeds=(0, 1, 2))
    table = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))
    assert list(table["arms"]["base"]["metrics"]) == ["pass@1", "pass@8"]
    opsd_metrics = table["arms"]["opsd"]["metrics"]
    assert "difference" in opsd_metrics["pass@8"] and "difference" not in opsd_metrics["maj@8"]
    assert "| base | 12.50 | 100.00 | - | - |" in opsd.research.grid.markdown(table)


def test_results_only_tables_the_finished_cells_and_runs_none(tmp_path, capsys):
    """--results-only: a grid with unfinished cells (still running elsewhere, or brought back in part from
    another machine) is tabled from its finished cells; no cell is trained or evaluated, the unfinished
    ones are listed missing, and the exit status is 0."""
    out = TG.write_grid(tmp_path / "grid", arms=("opsd",))
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "seeds": [0, 1, 2], "baseline": "base",
                                     "budget": {"max_steps": 4},
                                     "arms": {"base": {"train": False}, "opsd": {}, "sft": {}}}))
    assert opsd.research.grid.main([str(grid_file), "--out", str(out), "--results-only"]) == 0
    printed = capsys.readouterr().out
    assert "7 cells, 3 already done, 4 to run" in printed
    assert "--results-only: the 4 unfinished cell(s) stay as they are; the table holds the finished ones" in printed
    table = json.loads((out / "results.json").read_text())
    assert table["missing"] == ["opsd/seed-2", "sft/seed-0", "sft/seed-1", "sft/seed-2"]
    assert table["arms"]["opsd"]["runs"] == 2 and table["arms"]["sft"]["runs"] == 0
    assert not (out / "sft").exists() and not (out / "opsd" / "seed-2").exists()  # nothing ran


def test_with_one_run_a_side_the_disagreement_speaks_of_the_checkpoint(tmp_path):
    """One run an arm: no run-level test, so (as the verdict) the sentence says what the trained
    checkpoint does, not what the arm does (the CPU quickstart's case)."""
    out = tmp_path / "grid"
    write_flat_grid(out, {"opsd": [collapsed(10)]})
    grid = grid_of(("base", "opsd"), seeds=(0,))
    table = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))
    arm = table["arms"]["opsd"]
    assert arm["disagreement"].startswith("pass@1 and pass@8 disagree: opsd's checkpoint gains at pass@1 but loses "
                                          "at pass@8 (")
