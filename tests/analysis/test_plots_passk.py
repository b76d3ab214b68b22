"""pass@k against k (passk.png) and pass@1 / pass@n over steps (steps.png) from evaluation
reports (issue 58 items 2 and 4): the points are the reports' own numbers (checked against a
hand computation of the unbiased estimator), an arm's line is the mean over its seeds, each
seed's run is drawn faint; a grid draws passk.png beside curves.png (the quickstart's grid
too) and, when it sweeps, steps.png; bad input is one error line, exit 2, no PNG."""
import json
import math
import shutil
from pathlib import Path

import pytest

import opsd.research.grid
from opsd.analysis import plot_common, plot_passk
from opsd.analysis import plots as run_plots
from opsd.evaluation.metrics import problem_summary, summarize

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVAL_SET = "tiny:7:4"


def write_report(path: Path, counts, n: int = 8, dataset: str = EVAL_SET) -> Path:
    """An evaluation report as opsd.evaluation writes it: problem i has counts[i] correct samples
    of n, and `metrics` is opsd.evaluation.metrics.summarize's (pass@1..pass@n)."""
    problems = []
    for i, c in enumerate(counts):
        samples = [{"answer": str(i) if j < c else "x", "correct": j < c, "truncated": False, "num_tokens": 10}
                   for j in range(n)]
        problems.append({"problem": f"problem {i}", "gold": str(i), "samples": samples, **problem_summary(samples)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": {"n_samples": n}, "dataset": dataset, "checkpoint": str(path.parent),
                                "problems": problems, "metrics": summarize(problems, n)}))
    return path


def hand_pass_at_k(counts, n: int, k: int) -> float:
    """The unbiased estimator in percent, written out: 1 - C(n - c, k) / C(n, k), mean over problems."""
    return 100.0 * sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)


BASE, SEED_0, SEED_1 = [2, 1, 0, 0], [8, 4, 0, 1], [6, 2, 1, 0]


def small_grid(root: Path) -> Path:
    """base evaluated once, opsd over two seeds, sft over one."""
    grid = root / "grid"
    write_report(grid / "base" / "eval.json", BASE)
    write_report(grid / "opsd" / "seed-0" / "eval.json", SEED_0)
    write_report(grid / "opsd" / "seed-1" / "eval.json", SEED_1)
    write_report(grid / "sft" / "seed-0" / "eval.json", [8, 8, 0, 0])
    return grid


@pytest.fixture
def figures(monkeypatch):
    drawn = []
    real_save = plot_common.save_png
    monkeypatch.setattr(plot_common, "save_png", lambda fig, out: drawn.append(fig) or real_save(fig, out))
    return drawn


def test_the_points_are_the_reports_pass_at_k_and_the_arm_is_their_mean(tmp_path):
    grid = small_grid(tmp_path)
    reports, untrained = plot_passk.grid_reports(grid, ["base", "opsd", "sft"])
    data = plot_passk.pass_figure(reports, "grid", untrained)
    assert (data.dataset, data.n, [a.arm for a in data.arms]) == (EVAL_SET, 8, ["base", "opsd", "sft"])
    base, opsd, _ = data.arms
    assert not base.trained and opsd.trained and [r.label for r in opsd.runs] == ["seed 0", "seed 1"]
    for run, counts in zip(opsd.runs, (SEED_0, SEED_1), strict=True):
        report = json.loads(Path(run.path).read_text())["metrics"]
        assert run.values == tuple(report[f"pass@{k}"] for k in range(1, 9))  # the report's own numbers
        assert run.values == pytest.approx([hand_pass_at_k(counts, 8, k) for k in range(1, 9)])
    assert opsd.runs[0].values[0] == pytest.approx(100 * (1 + 0.5 + 0 + 1 / 8) / 4)  # pass@1 = avg@8
    assert opsd.runs[0].values[-1] == 75.0  # pass@8: 3 of 4 problems solved at least once
    assert opsd.mean == pytest.approx([(a + b) / 2 for a, b in zip(opsd.runs[0].values, opsd.runs[1].values,
                                                                    strict=True)])
    assert base.mean == pytest.approx([hand_pass_at_k(BASE, 8, k) for k in range(1, 9)])


def test_the_figure_draws_the_means_with_each_seed_faint_on_a_log2_k_axis(tmp_path, figures, capsys):
    grid = small_grid(tmp_path)
    assert run_plots.main(["passk", str(grid)]) == 0
    assert capsys.readouterr().out == f"{grid / 'passk.png'}: 3 series\n"
    assert (grid / "passk.png").read_bytes()[:8] == PNG_SIGNATURE
    (ax,) = figures[-1].axes
    data = plot_passk.pass_figure(*_grid(grid))  # arms by name without results.json
    means = [line for line in ax.get_lines() if line.get_linewidth() == 1.8]
    faint = [line for line in ax.get_lines() if line.get_alpha() == 0.3]
    assert [line.get_label() for line in means] == ["base (untrained)", "opsd (2 seeds)", "sft (1 seed)"]
    assert [list(line.get_ydata()) for line in means] == [pytest.approx(a.mean) for a in data.arms]
    assert [list(line.get_ydata()) for line in faint] == [list(r.values) for r in data.arms[1].runs]  # opsd's 2
    assert means[0].get_linestyle() == ":" and means[1].get_linestyle() == "-"
    assert list(means[1].get_xdata()) == list(range(1, 9)) and ax.get_xscale() == "log"
    assert [t for t in ax.get_xticks() if 1 <= t <= 8] == [1, 2, 4, 8]
    assert "faint: each seed's run" in ax.get_title()
    # One run per arm: nothing faint, and the title says none.
    for extra in ("opsd/seed-1", "base"):
        shutil.rmtree(grid / extra)
    run_plots.plot_grid_passk(grid)
    assert "faint" not in figures[-1].axes[0].get_title()
    assert not [line for line in figures[-1].axes[0].get_lines() if line.get_alpha() == 0.3]


def _grid(grid):
    reports, untrained = plot_passk.grid_reports(grid)
    return reports, grid.name, untrained


def test_reports_named_per_arm_on_the_command_line(tmp_path, capsys):
    a = [write_report(tmp_path / f"a{i}.json", counts) for i, counts in enumerate((SEED_0, SEED_1))]
    b = write_report(tmp_path / "b.json", BASE)
    out = tmp_path / "mine.png"
    assert run_plots.main(["passk", "--arm", "sft", *map(str, a), "--arm", "base", str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}: 2 series\n" and out.read_bytes()[:8] == PNG_SIGNATURE


def test_the_quickstart_grid_draws_passk_beside_curves(tmp_path, capsys):
    """The quickstart's grid file (grids/quickstart_cpu.json): every cell already evaluated, the grid
    re-made from its cells draws passk.png and names it in its results line; no sweep, no steps.png."""
    out = tmp_path / "quickstart-cpu"
    write_report(out / "base" / "eval.json", BASE, dataset="tiny:7:40:amc_aime")
    write_report(out / "token_left" / "seed-10" / "eval.json", SEED_0, dataset="tiny:7:40:amc_aime")
    run = out / "token_left" / "seed-10" / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {1 / s}}}\n' for s in range(1, 13)))
    assert opsd.research.grid.main([str(ROOT / "grids" / "quickstart_cpu.json"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results_line = next(line for line in printed.splitlines() if "] results: " in line)
    assert results_line.endswith(f"; curves: {out / 'curves.png'}; pass@k: {out / 'passk.png'}")
    assert (out / "passk.png").read_bytes()[:8] == PNG_SIGNATURE and not (out / "steps.png").exists()
    data = plot_passk.pass_figure(*plot_passk.grid_reports(out, ["base", "token_left"]))
    assert data.arms[1].mean == pytest.approx([hand_pass_at_k(SEED_0, 8, k) for k in range(1, 9)])


def swept_grid(root: Path, moved: bool = False) -> Path:
    """A grid with sweep_every: opsd's two seeds evaluated at steps 4 and 8 (each cell's sweep.json
    lists its reports in CELL/eval/), base once. `moved`: sweep.json names the reports where
    they were before the grid folder moved."""
    grid = root / "swept"
    write_report(grid / "base" / "eval.json", BASE)
    for seed, per_step in enumerate(({4: SEED_1, 8: SEED_0}, {4: BASE, 8: SEED_1, 12: SEED_0})):
        cell = grid / "opsd" / f"seed-{seed}"
        rows = []
        for step, counts in per_step.items():
            report = write_report(cell / "eval" / f"eval_run_checkpoint-{step}.json", counts)
            where = Path("/gone/elsewhere") / report.name if moved else report
            rows.append({"step": step, "checkpoint": f"checkpoint-{step}", "file": str(where), "avg": 0.0})
        shutil.copyfile(report, cell / "eval.json")
        (cell / "sweep.json").write_text(json.dumps({"metric": "avg@8", "checkpoints": rows}))
    return grid


@pytest.mark.parametrize("moved", [False, True])
def test_steps_are_each_checkpoints_pass_1_and_pass_n_mean_over_seeds(tmp_path, figures, moved):
    grid = swept_grid(tmp_path, moved)
    data = plot_passk.steps_data(grid)
    (opsd,) = data.arms
    assert data.baselines == ((("base", hand_pass_at_k(BASE, 8, 1), hand_pass_at_k(BASE, 8, 8))),)
    assert [s.steps for s in opsd.seeds] == [(4, 8), (4, 8, 12)] and opsd.steps == (4, 8)  # steps both seeds have
    assert opsd.seeds[1].first == pytest.approx([hand_pass_at_k(c, 8, 1) for c in (BASE, SEED_1, SEED_0)])
    assert opsd.first == pytest.approx([(hand_pass_at_k(SEED_1, 8, 1) + hand_pass_at_k(BASE, 8, 1)) / 2,
                                        (hand_pass_at_k(SEED_0, 8, 1) + hand_pass_at_k(SEED_1, 8, 1)) / 2])
    assert opsd.last == pytest.approx([(hand_pass_at_k(SEED_1, 8, 8) + hand_pass_at_k(BASE, 8, 8)) / 2,
                                       (hand_pass_at_k(SEED_0, 8, 8) + hand_pass_at_k(SEED_1, 8, 8)) / 2])
    assert run_plots.plot_steps(grid) == ["opsd", "base"]
    assert (grid / "steps.png").read_bytes()[:8] == PNG_SIGNATURE
    left, right = figures[-1].axes
    assert (left.get_title(), right.get_title()) == ("pass@1 per checkpoint", "pass@8 per checkpoint")
    mean = next(line for line in right.get_lines() if line.get_linewidth() == 1.8)
    assert list(mean.get_xdata()) == [4, 8] and list(mean.get_ydata()) == pytest.approx(opsd.last)


def test_a_swept_grid_draws_steps_png(tmp_path, capsys):
    grid = swept_grid(tmp_path)
    spec = opsd.research.grid.Grid(arms=(opsd.research.grid.Arm("base", train=False), opsd.research.grid.Arm("opsd")),
                                   seeds=(0, 1), eval_data=EVAL_SET, preset="tiny",
                                   budget=opsd.research.grid.BUDGET_DEFAULT, recipe={}, baseline="base", sweep_every=4)
    assert opsd.research.grid.draw_steps(spec, grid) == grid / "steps.png"
    assert opsd.research.grid.draw_passk(spec, grid) == grid / "passk.png"
    unswept = opsd.research.grid.Grid(**{**spec.__dict__, "sweep_every": None})
    assert opsd.research.grid.draw_steps(unswept, grid) is None
    (grid / "steps.png").unlink()
    shutil.rmtree(grid / "opsd")
    assert opsd.research.grid.draw_steps(spec, grid) is None  # cannot be drawn: one warning, the grid goes on
    assert capsys.readouterr().err == (f"warning: pass@k over steps plot not drawn: {grid}: no ARM/seed-N/sweep.json "
                                       "in it (a grid sweeps its checkpoints with 'sweep_every'; or no swept cell has "
                                       "finished yet)\n")


def no_pngs(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.suffix == ".png" or p.name.endswith(".tmp")]


def test_bad_input_is_one_error_line_exit_2_and_no_png(tmp_path, capsys):
    grid = small_grid(tmp_path)

    def error(argv, line):
        assert run_plots.main([str(a) for a in argv]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", line + "\n")

    error(["passk", tmp_path / "nope"], f"error: {tmp_path / 'nope'}: no such folder")
    (tmp_path / "empty").mkdir()
    error(["passk", tmp_path / "empty"], f"error: {tmp_path / 'empty'}: no ARM/eval.json or ARM/seed-N/eval.json in "
                                         "it (not a opsd.research.grid folder, or no cell has been evaluated yet)")
    report = grid / "sft" / "seed-0" / "eval.json"
    data = json.loads(report.read_text())
    del data["metrics"]["pass@3"]
    report.write_text(json.dumps(data))
    error(["passk", grid], f"error: {report}: metrics has no number 'pass@3' (k = 8: pass@1..pass@8 expected)")
    report.write_text(json.dumps({"problems": []}))
    error(["passk", grid], f"error: {report}: no 'metrics' with its sample count 'k' (not an evaluation report of "
                           "opsd.evaluation)")
    report.write_text('{"metrics": ')
    error(["passk", grid], f"error: {report}: not readable JSON (Expecting value: line 1 column 13 (char 12))")
    write_report(report, [1, 2, 3, 4], n=4)
    error(["passk", grid], f"error: {report}: {EVAL_SET} with n = 4, but {grid / 'base' / 'eval.json'}: {EVAL_SET} "
                           "with n = 8; pass@k compares reports of one eval set and one n")
    write_report(report, [1, 2, 3, 4], dataset="tiny:9:4")
    error(["passk", grid], f"error: {report}: tiny:9:4 with n = 8, but {grid / 'base' / 'eval.json'}: {EVAL_SET} "
                           "with n = 8; pass@k compares reports of one eval set and one n")
    good = grid / "base" / "eval.json"
    error(["passk"], "error: passk needs GRID_DIR or --arm NAME REPORT.json ...")
    error(["passk", grid, "--arm", "a", good, "--out", tmp_path / "x.png"], "error: give either GRID_DIR or --arm, "
                                                                           "not both")
    error(["passk", "--arm", "a", good], "error: passk of --arm reports needs --out FILE.png")
    error(["passk", "--arm", "a", "--out", tmp_path / "x.png"], "error: --arm a: no report (--arm NAME REPORT.json "
                                                               "[REPORT.json ...])")
    error(["passk", "--arm", "a", good, "--arm", "a", good, "--out", tmp_path / "x.png"], "error: --arm a: given twice")
    error(["passk", "--arm", "a", tmp_path / "no.json", "--out", tmp_path / "x.png"],
          f"error: {tmp_path / 'no.json'}: no such file (an evaluation report of opsd.evaluation)")
    error(["passk", "--arm", "a", good, "--out", tmp_path / "x.jpg"], f"error: {tmp_path / 'x.jpg'}: the output must "
                                                                     "be a .png file")
    error(["steps", grid], f"error: {grid}: no ARM/seed-N/sweep.json in it (a grid sweeps its checkpoints with "
                           "'sweep_every'; or no swept cell has finished yet)")
    swept = swept_grid(tmp_path)
    sweep = swept / "opsd" / "seed-0" / "sweep.json"
    sweep.write_text(json.dumps({"checkpoints": [{"step": "4", "file": "x.json"}]}))
    error(["steps", swept], f"error: {sweep}: no 'checkpoints' list of rows with an integer 'step' and a report 'file'")
    assert no_pngs(tmp_path)
