"""research/grid.py: arms x seeds on the tiny preset, paired seeds, resumable, one table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from research import grid as opsd_grid

REPO = Path(__file__).resolve().parents[2]

GRID = {
    "preset": "tiny",
    "eval_data": "tiny:5:2",
    "seeds": [0, 1],
    "budget": {"max_steps": 1, "global_batch": 2, "per_device_batch": 2},
    "recipe": {"learning_rate": 2e-4},
    "baseline": "entry",
    "arms": {"entry": {}, "token": {"env": {"OPSD_CLIP_MODE": "token"}}},
}


def _run(grid_file, out, *extra):
    return subprocess.run([sys.executable, "-m", "research.grid", str(grid_file), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=900)


@pytest.mark.slow
def test_two_arms_two_seeds_end_to_end_and_resume(tmp_path):
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps(GRID))
    out = tmp_path / "grid"
    first = _run(grid_file, out, "--parallel", "2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = json.loads((out / "results.json").read_text())
    assert set(table["arms"]) == {"entry", "token"} and all(a["runs"] == 2 for a in table["arms"].values())
    assert "verdict" in table["arms"]["token"] and "verdict" not in table["arms"]["entry"]
    assert "| token | 2 |" in (out / "results.md").read_text()
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the arms' curves, beside results.md
    assert f"; curves: {out / 'curves.png'}" in first.stdout
    for arm in ("entry", "token"):
        for seed in (0, 1):
            cell = out / arm / f"seed-{seed}"
            log = (cell / "train.log").read_text()
            assert f"--seed {seed} " in log  # the same seed in both arms: paired
            assert (cell / "recipe.env").read_text() == "learning_rate=0.0002\n"
            assert json.loads((cell / "eval.json").read_text())["dataset"] == "tiny:5:2"
    for arm in ("entry", "token"):  # each arm's variables reach only its own runs
        assert json.loads((out / arm / "seed-0" / "run" / "run_config.json").read_text())["OPSD_CLIP_MODE"] == arm
    # Every cell is done: a re-run trains and evaluates nothing, and gives the same table.
    again = _run(grid_file, out)
    assert again.returncode == 0 and "4 cells, 4 already done, 0 to run" in again.stdout
    assert json.loads((out / "results.json").read_text()) == table


@pytest.mark.parametrize("spec, message", [
    ({"arms": {}}, "'arms' must be a non-empty object"),
    ({"arms": {"a": {"env": {"OPSD_NOPE": "1"}}}}, "OPSD_NOPE is not an OPSD switch"),
    ({"arms": {"a": {"recipe": {"no_such_key": 1}}}}, "arm 'a'"),
    ({"arms": {"a": {}}, "seeds": [1, 1]}, "duplicate"),
    ({"arms": {"a": {}}, "budget": {"global_batch": 32, "per_device_batch": 5}}, "not a multiple"),
    ({"arms": {"a": {}}, "baseline": "b"}, "baseline 'b' is not an arm"),
    ({"arms": {"a": {}}, "colour": 1}, "unknown key 'colour'"),
    ({"arms": {"a": {}}, "eval_flags": "--backend vllm"}, "'eval_flags' must be a list of strings"),
    ({"arms": {"a": {}}, "eval_flags": ["--backend", "sglang"]}, "eval_flags"),
    ({"arms": {"a": {}}, "sweep_every": 0}, "'sweep_every' must be"),
    ({"arms": {"a": {}}, "sweep_every": 500}, "'sweep_every' must be"),
])
def test_bad_grid_files_are_one_line_errors(tmp_path, spec, message):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(spec))
    with pytest.raises(opsd_grid.GridError, match=message):
        opsd_grid.load_grid(str(grid_file))
    result = _run(grid_file, tmp_path / "out")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error:")


def test_shipped_grids_load():
    for path in (REPO / "grids").glob("*.json"):
        grid = opsd_grid.load_grid(str(path))
        assert grid.arms and grid.baseline in {a.name for a in grid.arms}


def test_grid_curves_follow_the_grid_and_never_fail_it(tmp_path, capsys):
    """The arms' curves in the grid's order (untrained arms have none); a grid without a
    trained cell gets one warning line instead of a figure."""
    grid = opsd_grid.Grid(arms=(opsd_grid.Arm("base", train=False), opsd_grid.Arm("token"), opsd_grid.Arm("entry")),
                          seeds=(0, 1), eval_data=None, preset="tiny", budget=opsd_grid.BUDGET_DEFAULT, recipe={},
                          baseline="base")
    out = tmp_path / "grid"
    assert opsd_grid.draw_curves(grid, out) is None
    assert capsys.readouterr().err.startswith(f"warning: grid curves not drawn: {out}: no such folder")
    for cell in opsd_grid.cells(grid, out):
        if cell.arm.train:
            (cell.folder / "run").mkdir(parents=True)
            (cell.folder / "run" / "metrics.jsonl").write_text(
                "".join(f'{{"step": {s}, "loss": {s * (cell.seed + 1)}, "opsd/true_kl": 0.1}}\n' for s in (1, 2)))
    assert opsd_grid.draw_curves(grid, out) == out / "curves.png"
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from analysis import plots as run_plots

    curves = run_plots.grid_curves(out, ["loss"], [arm.name for arm in grid.arms])["loss"]
    assert [c.label for c in curves] == ["token (2 seeds)", "entry (2 seeds)"]
    assert curves[0].values == (1.5, 3.0) and curves[0].low == (1.0, 2.0) and curves[0].high == (2.0, 4.0)


def test_eval_flags_reach_every_cells_evaluation(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "eval_data": "tiny:5:2", "seeds": [3],
                                     "eval_flags": ["--backend", "transformers", "--batch-size", "4"],
                                     "arms": {"base": {"train": False}, "a": {}}}))
    grid = opsd_grid.load_grid(str(grid_file))
    for cell in opsd_grid.cells(grid, tmp_path / "out"):
        command = opsd_grid.eval_command(grid, cell)
        assert command[-4:] == ["--backend", "transformers", "--batch-size", "4"]


@pytest.mark.slow
def test_a_swept_grid_evaluates_every_checkpoint_and_tables_accuracy_per_step(tmp_path):
    """sweep_every: each trained cell saves every N steps, evaluates every checkpoint
    (checkpoint_sweep), keeps its last checkpoint's report as the cell's, and results.md /
    results.json give each arm's mean accuracy per step."""
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({**GRID, "seeds": [0], "sweep_every": 1,
                                     "budget": {"max_steps": 2, "global_batch": 2, "per_device_batch": 2},
                                     "arms": {"base": {"train": False}, "token": {"env": {"OPSD_CLIP_MODE": "token"}}},
                                     "baseline": "base"}))
    out = tmp_path / "grid"
    result = _run(grid_file, out)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    cell = out / "token" / "seed-0"
    assert sorted(p.name for p in (cell / "run").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in (cell / "eval").glob("eval_*.json")) == [
        "eval_run_checkpoint-1.json", "eval_run_checkpoint-2.json"]
    assert (cell / "eval.json").read_bytes() == (cell / "eval" / "eval_run_checkpoint-2.json").read_bytes()
    sweep = json.loads((cell / "sweep.json").read_text())
    assert [row["step"] for row in sweep["checkpoints"]] == [1, 2]
    table = json.loads((out / "results.json").read_text())
    per_step = table["arms"]["token"]["per_step"]
    assert per_step == {str(row["step"]): row["avg"] for row in sweep["checkpoints"]}  # one seed: its own values
    assert "per_step" not in table["arms"]["base"]
    text = (out / "results.md").read_text()
    assert "| step | token |" in text and f"| 2 | {per_step['2']:.2f} |" in text
