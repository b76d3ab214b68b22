"""opsd/analysis/plots.py on fake run folders: a run's curves, runs and grid arms overlaid, the
numbers behind a grid arm's line and band, and bad input (one `error:` line, exit 2,
no PNG left behind)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.analysis import plot_common
from opsd.analysis import plots as run_plots
from opsd.run_log import KL_LINE_FIELDS

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OPSD_KEYS = [key for _, key in KL_LINE_FIELDS if key != "opsd/nll"]  # nll: the SFT loss only
OTHER_KEYS = ["loss", "learning_rate", "grad_norm", "completions/mean_length", "completions/max_length",
              "completions/truncated_ratio", "opsd/teacher_eos_logp", "opsd/student_eos_logp"]
GRPO_KEYS = ["grpo/reward_mean", "grpo/frac_reward_zero_std"]  # a GRPO run's panels (opsd.grpo.reward_stats)


def write_run(folder: Path, steps=6, keys=(*OTHER_KEYS, *OPSD_KEYS), scale=1.0, summary=True) -> Path:
    """A run folder whose metrics.jsonl looks like the trainer's: one record per step,
    then (as older runs wrote it) the end-of-run summary without per-step metrics. The
    i-th key has the value scale * (step + i / 10): `loss`, the first, is scale * step."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": s, "epoch": s / 10, **{k: scale * (s + i / 10) for i, k in enumerate(keys)}})
             for s in range(1, steps + 1)]
    if summary:
        lines.append(json.dumps({"step": steps, "train_runtime": 9.0, "train_loss": 0.1}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def assert_png(path: Path, min_bytes=5_000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > min_bytes, (path, len(data))
    from PIL import Image

    with Image.open(path) as image:
        assert image.width > 300 and image.height > 200


def no_pngs(folder: Path):
    return not [p for p in folder.rglob("*") if p.suffix == ".png" or p.name.endswith(".tmp")]


def test_importing_the_plots_does_not_import_matplotlib():
    code = "import sys; from opsd.analysis import plots; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_run_curves_draw_every_logged_metric(tmp_path):
    run = write_run(tmp_path / "run", keys=(*OTHER_KEYS, *OPSD_KEYS, *GRPO_KEYS))
    drawn = run_plots.plot_run_curves(run)
    assert_png(run / "curves.png")
    panel_keys = [k for _, _, keys in run_plots.CURVE_PANELS for k in keys]
    assert drawn == panel_keys  # every panel drawn, in order
    assert set(drawn) == set(OPSD_KEYS) | set(OTHER_KEYS) | set(GRPO_KEYS)  # ... and they are every metric of the file
    assert not list(run.glob(".*.tmp"))


def test_a_grpo_runs_curves_show_its_reward_zero_std_share_and_length(tmp_path):
    keys = ["loss", "learning_rate", "grad_norm", "completions/mean_length", "completions/max_length",
            "opsd/clip_ratio", "opsd/entropy", *GRPO_KEYS, "grpo/reward_std", "tokens/sampled"]
    run = write_run(tmp_path / "grpo", keys=keys)
    drawn = run_plots.plot_run_curves(run)
    assert drawn == ["loss", "completions/mean_length", "completions/max_length", "grpo/reward_mean",
                     "grpo/frac_reward_zero_std", "learning_rate", "grad_norm"]
    assert_png(run / "curves.png")


def test_run_curves_leave_out_what_the_run_did_not_log(tmp_path):
    sft = ["loss", "opsd/nll", "opsd/true_kl", "opsd/student_entropy", "learning_rate"]  # no clip metrics
    run = write_run(tmp_path / "sft", keys=sft)
    drawn = run_plots.plot_run_curves(run, tmp_path / "sft.png")
    assert drawn == ["loss", "opsd/true_kl", "opsd/student_entropy", "learning_rate"]
    assert_png(tmp_path / "sft.png")


def test_run_curves_of_chosen_metrics_by_label_or_key(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    status = run_plots.main(["curves", str(run), "--metric", "true_kl", "--metric", "opsd/clipped_teacher_mass",
                             "--metric", "learning_rate", "--out", str(tmp_path / "three.png")])
    assert status == 0 and capsys.readouterr().out == f"{tmp_path / 'three.png'}: 3 series\n"
    assert_png(tmp_path / "three.png")
    assert run_plots.plot_run_curves(run, tmp_path / "two.png", ["H_student", "loss"]) == \
        ["opsd/student_entropy", "loss"]


def test_overlay_of_two_runs(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "run")
    b = write_run(tmp_path / "b" / "run", steps=4, scale=2.0)
    out = tmp_path / "overlay.png"
    status = run_plots.main(["overlay", str(a), str(b), "--metric", "loss", "--metric", "true_kl", "--out", str(out)])
    assert status == 0, capsys.readouterr().err
    assert_png(out)
    drawn = run_plots.overlay_runs([a, b], out, ["loss", "true_kl"])
    # Both cells are named `run`: the labels are the shortest tails that tell them apart.
    assert drawn == [("loss", "a/run"), ("loss", "b/run"), ("opsd/true_kl", "a/run"), ("opsd/true_kl", "b/run")]
    curves = run_plots.run_curves([a, b], ["loss"])["loss"]
    assert curves[1].steps == (1, 2, 3, 4) and curves[1].values == (2.0, 4.0, 6.0, 8.0)


def test_overlay_skips_a_run_without_the_metric(tmp_path):
    a = write_run(tmp_path / "entry")
    sft = write_run(tmp_path / "sft", keys=["loss", "opsd/true_kl"])
    drawn = run_plots.overlay_runs([a, sft], tmp_path / "o.png", ["teacher_mass_removed", "loss"])
    assert drawn == [("opsd/clipped_teacher_mass", "entry"), ("loss", "entry"), ("loss", "sft")]
    # The default metrics that no run logged are left out (an SFT-only comparison has no clip).
    drawn = run_plots.overlay_runs([sft], tmp_path / "d.png")
    assert drawn == [("opsd/true_kl", "sft"), ("loss", "sft")]
    # A run keeps its colour in a panel where another run is missing.
    curves = run_plots.run_curves([a, sft], ["teacher_mass_removed", "loss"], required=False)
    assert [c.label for c in curves["loss"]] == ["entry", "sft"]
    assert run_plots.curve_colors(curves) == {"entry": "C0", "sft": "C1"}
    sft_first = {"opsd/true_kl": curves["loss"][1:], "loss": curves["loss"]}  # a first panel without `entry`
    assert run_plots.curve_colors(sft_first) == {"sft": "C0", "entry": "C1"}  # ... in both panels


def test_grid_arms_are_seed_means_with_a_range_band(tmp_path):
    grid = tmp_path / "grid"
    (grid / "base").mkdir(parents=True)  # an untrained arm: evaluated only, no curves
    for seed, scale in enumerate((1.0, 2.0, 6.0)):
        write_run(grid / "token" / f"seed-{seed}" / "run", steps=3, scale=scale)
    write_run(grid / "entry" / "seed-0" / "run", steps=3)
    curves = run_plots.grid_curves(grid, ["loss"])["loss"]
    assert [c.label for c in curves] == ["entry (1 seed)", "token (3 seeds)"]
    entry, token = curves
    assert entry.low is None and entry.values == (1.0, 2.0, 3.0)  # one seed: no band
    assert token.values == pytest.approx((3.0, 6.0, 9.0))  # mean of 1x, 2x, 6x the step
    assert token.low == (1.0, 2.0, 3.0) and token.high == (6.0, 12.0, 18.0)
    # The grid's own order (opsd/research/grid.py passes it), default output beside results.md.
    drawn = run_plots.overlay_grid(grid, metrics=["loss"], arms=["token", "entry", "base"])
    assert drawn == [("loss", "token (3 seeds)"), ("loss", "entry (1 seed)")]
    assert_png(grid / "curves.png")


def one_error_line(capsys, argv, *fragments):
    status = run_plots.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_input_is_one_line_exit_2_and_no_png(tmp_path, capsys):
    good = write_run(tmp_path / "good")
    one_error_line(capsys, ["curves", tmp_path / "missing"], f"{tmp_path / 'missing'}: no such folder")
    (tmp_path / "empty").mkdir()
    one_error_line(capsys, ["curves", tmp_path / "empty"], "metrics.jsonl: no such file")
    broken = write_run(tmp_path / "broken")
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 0.1\n')
    one_error_line(capsys, ["curves", broken], f"{broken / 'metrics.jsonl'}:8: not valid JSON")
    one_error_line(capsys, ["overlay", good, broken, "--out", tmp_path / "o.png"], "metrics.jsonl:8:")
    no_step = write_run(tmp_path / "no_step")
    (no_step / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n\n{"step": "2", "loss": 1}\n')
    one_error_line(capsys, ["curves", no_step], "metrics.jsonl:3: expected a JSON object with an integer 'step'")
    (no_step / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n[1, 2]\n')
    one_error_line(capsys, ["curves", no_step], "metrics.jsonl:2: not a JSON object")
    other = write_run(tmp_path / "other", keys=["loss"])
    one_error_line(capsys, ["overlay", good, other, "--metric", "nope", "--out", tmp_path / "o.png"],
                   "metric 'nope' is not in the metrics.jsonl of any of the 2 runs")  # absent in every run
    one_error_line(capsys, ["overlay", good, tmp_path / "good", "--out", tmp_path / "o.png"], "given more than once")
    one_error_line(capsys, ["overlay", good, "--metric", "no_such_metric", "--out", tmp_path / "o.png"],
                   "metric 'no_such_metric' is not in the metrics.jsonl of any of the 1 runs", "logged: ")
    one_error_line(capsys, ["curves", good, "--metric", "true_kl", "--metric", "typo"], "metric 'typo' is not in")
    one_error_line(capsys, ["overlay", good, "--out", tmp_path / "o.jpg"], "must be a .png file")
    one_error_line(capsys, ["overlay", good, "--out", tmp_path / "no" / "o.png"], "no such folder")
    one_error_line(capsys, ["overlay", good], "needs --out")
    one_error_line(capsys, ["overlay", "--grid", good], "not a opsd.research.grid folder")
    one_error_line(capsys, ["overlay", "--grid", tmp_path / "nogrid", "--out", tmp_path / "g.png"], "no such folder")
    assert no_pngs(tmp_path)


@pytest.fixture
def figures(monkeypatch):
    """The Figure objects the plots would save (rendered and written as usual)."""
    drawn = []
    real_save = plot_common.save_png
    monkeypatch.setattr(plot_common, "save_png", lambda fig, out: drawn.append(fig) or real_save(fig, out))
    return drawn


def step_ticks(ax) -> list[float]:
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


def test_every_axis_says_what_it_shows_and_steps_are_whole(tmp_path, figures):
    """y labels on every panel, integer step ticks (over 4 steps matplotlib alone ticks every 0.5
    step), a title naming what is plotted and which run or grid."""
    cell = write_run(tmp_path / "mini" / "token" / "seed-3" / "run", steps=4)
    run_plots.plot_run_curves(cell)
    (fig,) = figures
    assert fig.get_suptitle() == "training curves of run mini: arm token, seed 3"
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.get_xlabel() == "step"
        assert step_ticks(ax) and all(t == int(t) for t in step_ticks(ax))
    labels = {ax.get_title(): ax.get_ylabel() for ax in fig.axes}
    assert labels["true KL (teacher || student)"] == "true KL per token (nats)"
    assert all(t == int(t) for ax in figures[-1].axes for t in step_ticks(ax))

    write_run(tmp_path / "mini" / "entry" / "seed-3" / "run", steps=4)
    run_plots.overlay_grid(tmp_path / "mini")
    assert figures[-1].get_suptitle().startswith("training curves of grid mini: ")
    assert all(ax.get_ylabel() for ax in figures[-1].axes)

    checkpoints = [{"step": step, "checkpoint": f"checkpoint-{step}", "avg": 40.0 + step, "problems_ci": [38.0, 50.0]}
                   for step in (1, 2, 3, 4)]
    result = {"metric": "avg@8", "dataset": "tiny:7:16", "num_problems": 16, "samples_per_problem": 8,
              "checkpoints": checkpoints, "best": "checkpoint-4", "run_folder": str(tmp_path / "opsd-tiny")}
    run_plots.plot_sweep(result, tmp_path / "sweep.png")
    (ax,) = figures[-1].axes
    assert ax.get_ylabel() == "avg@8 accuracy (%)"
    assert ax.get_title() == "checkpoint sweep of run opsd-tiny on tiny:7:16: 16 problems x 8 samples"
    assert all(t == int(t) for t in step_ticks(ax))


def test_a_failed_write_leaves_no_partial_png(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot_common.os, "replace", full_disk)
    with pytest.raises(run_plots.PlotError, match="curves.png: cannot write it \\(No space left on device\\)"):
        run_plots.plot_run_curves(run)
    assert no_pngs(tmp_path)


def test_cli_in_a_real_process(tmp_path):
    run = write_run(tmp_path / "run")
    ok = subprocess.run([sys.executable, "-m", "opsd.analysis.plots", "curves", str(run)],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert_png(run / "curves.png")
    bad = subprocess.run([sys.executable, "-m", "opsd.analysis.plots", "curves", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr == f"error: {tmp_path / 'nope'}: no such folder\n"


def test_a_grids_figure_shows_accuracy_first_then_only_the_curves_that_move(tmp_path, figures):
    """The quickstart's picture: base against trained (results.json) in the first panel, then the
    default training curves, less a panel flat in every arm (teacher mass removed at 0 under the
    token clip); without results.json, the curves alone, as before."""
    grid = tmp_path / "quickstart-cpu"
    run = grid / "token_left" / "seed-10" / "run"
    run.mkdir(parents=True)
    removed = run_plots.LABEL_TO_KEY["teacher_mass_removed"]
    moving = [run_plots.LABEL_TO_KEY["true_kl"], run_plots.LABEL_TO_KEY["H_student"], "loss"]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, removed: 0.0, **{k: 1.0 / (s + i) for i, k in enumerate(moving)}}) + "\n"
        for s in range(1, 13)))
    drawn = run_plots.overlay_grid(grid, arms=["base", "token_left"])
    assert {key for key, _ in drawn} == set(moving)  # no results.json: the curves that move
    results = {"grid": {"eval_data": "tiny:7:40:amc_aime", "baseline": "base"}, "arms": {
        "base": {"trained": False, "runs": 1, "per_run": [45.62], "mean": 45.62, "metric": "avg@8"},
        "token_left": {"trained": True, "runs": 1, "per_run": [60.0], "mean": 60.0, "metric": "avg@8"}}}
    (grid / "results.json").write_text(json.dumps(results))
    drawn = run_plots.overlay_grid(grid, arms=["base", "token_left"])
    assert drawn[:2] == [("accuracy", "base"), ("accuracy", "token_left")]
    assert [key for key, _ in drawn[2:]] == [moving[0], moving[1], "loss"]  # OVERLAY_METRICS' order, less the flat one
    assert_png(grid / "curves.png")
    titles = [ax.get_title() for ax in figures[-1].axes]
    assert titles == ["accuracy on tiny:7:40:amc_aime (higher is better)", "true KL (teacher || student)",
                      "student entropy", "loss"]
    assert [label.get_text() for label in figures[-1].axes[0].get_yticklabels()] == [
        "token_left\n60.00", "base (untrained)\n45.62"]  # no difference in this results.json: no interval
    # Asked for by name, a flat metric is drawn all the same.
    assert ("teacher_mass_removed" in {run_plots.metric_label(k) for k, _ in run_plots.overlay_grid(
        grid, tmp_path / "chosen.png", metrics=["teacher_mass_removed"])})
