"""Which panels a curves.png draws, and what its words say. A run's figure leaves out a series
that carries no information for this run (all 0, constant, or a repeat of one drawn before it,
each within its stated tolerance), names it in the footer, and gives each panel a healthy-run
note; the drift metrics (completion length, truncated share, student entropy) are panels of
the run's and the grid's figures. A grid's accuracy bars carry the interval results.json
gives (the difference to the baseline's 95% CI, drawn from the baseline's mean), and its title
says what is drawn: dots and bands only where an arm has several seeds."""
import json
from pathlib import Path

import pytest

from opsd.analysis import plot_common, plot_curves, plot_overlays
from opsd.analysis import plots as run_plots

TRUE_KL, UNCLIPPED, MASS = "opsd/true_kl", "opsd/loss_unclipped", "opsd/clipped_teacher_mass"
ENTRY, TOKEN, ARGMAX = "opsd/clipped_entry_frac", "opsd/clipped_token_frac", "opsd/teacher_argmax_clipped_frac"
STUDENT_H, TEACHER_H = "opsd/student_entropy", "opsd/teacher_entropy"
LENGTH, TRUNCATED = "completions/mean_length", "completions/truncated_ratio"


def write_metrics(folder: Path, columns: dict[str, list[float]]) -> Path:
    """A run folder whose metrics.jsonl has one record per step, step s holding columns[key][s - 1]."""
    folder.mkdir(parents=True)
    steps = len(next(iter(columns.values())))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, **{k: v[s - 1] for k, v in columns.items()}}) + "\n" for s in range(1, steps + 1)))
    return folder


def falling(start: float, steps: int = 8) -> list[float]:
    return [start / s for s in range(1, steps + 1)]


@pytest.fixture
def figures(monkeypatch):
    drawn = []
    real_save = plot_common.save_png
    monkeypatch.setattr(plot_common, "save_png", lambda fig, out: drawn.append(fig) or real_save(fig, out))
    return drawn


def test_the_quickstart_runs_repeat_flat_line_and_zeros_are_left_out_and_named(tmp_path, figures):
    """Issue 60's nine panels: the divergence before the clip equal to the true KL, a constant
    learning rate, all-zero clip metrics: left out, each named with its value in the footer."""
    kl = falling(0.3)
    run = write_metrics(tmp_path / "run", {
        "loss": falling(0.25), TRUE_KL: kl, UNCLIPPED: [v * (1 + 5e-5) for v in kl],  # a repeat within 1e-4
        ENTRY: [0.0] * 8, TOKEN: falling(0.1), ARGMAX: [0.0] * 8, MASS: [0.0] * 8,
        STUDENT_H: falling(0.5), TEACHER_H: falling(0.4), LENGTH: falling(80.0), "completions/max_length": [128] * 8,
        TRUNCATED: [0.0] * 7 + [0.125], "learning_rate": [2e-4] * 8, "grad_norm": falling(2.0)})
    panels, left_out = plot_curves.run_panels(plot_curves.read_metrics(run))
    assert [(p.title, p.keys) for p in panels] == [
        ("loss", ("loss",)), ("true KL (teacher || student)", (TRUE_KL,)), ("clip shares", (TOKEN,)),
        ("entropy", (STUDENT_H, TEACHER_H)), ("completion length (tokens)", (LENGTH,)),
        ("truncated completions", (TRUNCATED,)), ("gradient norm", ("grad_norm",))]
    assert left_out == ["divergence before the clip: equals true KL (teacher || student)", "clip_entries: all 0",
                        "argmax_clipped: all 0", "teacher mass removed: all 0",
                        "completions/max_length: constant at 128", "learning rate: constant at 0.0002"]
    assert run_plots.plot_run_curves(run) == [k for p in panels for k in p.keys]
    (fig,) = figures
    footer = " ".join(fig.get_supxlabel().split())
    assert footer == "not drawn, no information for this run: " + "; ".join(left_out)
    notes = [text.get_text() for ax in fig.axes for text in ax.texts]
    assert notes == [plot_curves.HEALTHY[p.title] for p in panels] and all(notes)
    assert [ax.get_legend() is not None for ax in fig.axes] == [False, False, True, True, True, False, False]


def test_each_rule_keeps_what_is_past_its_tolerance(tmp_path):
    """Just inside a tolerance a series goes, just past it it stays: a repeat within 1e-4 of the
    larger series' scale, a constant within 1e-3 of its largest value, zeros within 1e-12."""
    kl = falling(0.3)
    columns = {TRUE_KL: kl, UNCLIPPED: [v + 2e-4 * 0.3 for v in kl],  # 2e-4 of the scale: not a repeat
               "learning_rate": [2e-4, 2e-4 * (1 + 2e-3)] * 4,  # a 0.2% range: not constant
               "grad_norm": [1.0, 1.0 + 5e-4] * 4,  # a 0.05% range: constant
               MASS: [1e-13, 0.0] * 4, TOKEN: [1e-9, 0.0] * 4}  # below ZERO_ATOL: all 0; 1e-9: moves
    run = write_metrics(tmp_path / "run", columns)
    panels, left_out = plot_curves.run_panels(plot_curves.read_metrics(run))
    assert [k for p in panels for k in p.keys] == [TRUE_KL, UNCLIPPED, TOKEN, "learning_rate"]
    assert left_out == ["teacher mass removed: all 0", "gradient norm: constant at 1"]
    assert (plot_curves.ZERO_ATOL, plot_curves.FLAT_RTOL, plot_curves.REPEAT_RTOL) == (1e-12, 1e-3, 1e-4)


def test_one_step_is_not_constant_and_nothing_left_draws_everything(tmp_path):
    one = write_metrics(tmp_path / "one", {"loss": [0.5], "learning_rate": [2e-4], MASS: [0.0]})
    panels, left_out = plot_curves.run_panels(plot_curves.read_metrics(one))
    assert [p.keys for p in panels] == [("loss",), ("learning_rate",)] and left_out == ["teacher mass removed: all 0"]
    dull = write_metrics(tmp_path / "dull", {"loss": [0.0] * 3, "learning_rate": [2e-4] * 3})
    panels, left_out = plot_curves.run_panels(plot_curves.read_metrics(dull))
    assert [p.keys for p in panels] == [("loss",), ("learning_rate",)] and left_out == []
    # Asked for by name, a constant series is drawn, with its panel's note.
    assert run_plots.plot_run_curves(dull, tmp_path / "lr.png", ["learning_rate"]) == ["learning_rate"]


def test_the_drift_metrics_are_panels_of_the_run_and_the_grid(tmp_path, figures):
    """Mean completion length, truncated share and student entropy, as the trainer logs them
    (completions/* per step; opsd/student_entropy): drawn per run, and per arm in a grid."""
    for seed, scale in enumerate((1.0, 3.0)):
        write_metrics(tmp_path / "grid" / "opsd" / f"seed-{seed}" / "run",
                      {"loss": falling(scale), STUDENT_H: falling(0.5 * scale), LENGTH: falling(80.0 * scale),
                       TRUNCATED: falling(0.2 * scale)})
    drawn = run_plots.overlay_grid(tmp_path / "grid")
    assert [key for key, _ in drawn] == [STUDENT_H, LENGTH, TRUNCATED, "loss"]
    titles = [ax.get_title() for ax in figures[-1].axes]
    assert titles == ["student entropy", "mean completion length", "truncated completions", "loss"]
    assert [t.get_text() for ax in figures[-1].axes for t in ax.texts] == [
        plot_curves.HEALTHY["entropy"], plot_curves.HEALTHY["completion length (tokens)"],
        plot_curves.HEALTHY["truncated completions"], plot_curves.HEALTHY["loss"]]
    length = plot_overlays.grid_curves(tmp_path / "grid", [LENGTH])[LENGTH][0]
    assert length.values == pytest.approx([160.0 / s for s in range(1, 9)])  # the mean of 80/s and 240/s
    assert length.low == pytest.approx(falling(80.0)) and length.high == pytest.approx(falling(240.0))
    assert "band from the lowest to the highest seed" in figures[-1].get_suptitle()


def results(arms: dict, baseline="base") -> dict:
    return {"grid": {"eval_data": "tiny:7:40", "baseline": baseline}, "arms": arms}


def arm(per_run, trained=True, difference=None, ci=None):
    entry = {"trained": trained, "runs": len(per_run), "per_run": per_run, "mean": sum(per_run) / len(per_run),
             "metric": "avg@8"}
    if ci is not None:
        entry.update(difference=difference, ci=ci)
    return entry


def grid_with(tmp_path, table: dict, seeds: int) -> Path:
    grid = tmp_path / "g"
    for seed in range(seeds):
        write_metrics(grid / "opsd" / f"seed-{seed}" / "run", {"loss": falling(1.0 + seed)})
    (grid / "results.json").write_text(json.dumps(table))
    return grid


def test_one_seed_bars_carry_the_results_interval_and_the_title_names_no_dots_or_band(tmp_path, figures):
    table = results({"base": arm([45.62], trained=False), "opsd": arm([60.0], difference=14.38, ci=[6.88, 22.5])})
    grid = grid_with(tmp_path, table, seeds=1)
    panel = plot_overlays.grid_accuracy(grid)
    opsd = panel.arms[1]
    assert (opsd.difference, opsd.ci, panel.baseline.arm) == (14.38, (6.88, 22.5), "base")
    assert panel.whisker(opsd) == pytest.approx((45.62 + 6.88, 45.62 + 22.5))  # from base's mean
    assert panel.whisker(panel.arms[0]) is None
    run_plots.overlay_grid(grid)
    fig = figures[-1]
    ax = fig.axes[0]
    whiskers = [line.get_xdata() for line in ax.get_lines() if line.get_marker() == "|"]
    assert [list(x) for x in whiskers] == [pytest.approx([52.5, 68.12])]
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [45.62]  # base's line
    assert [t.get_text() for t in ax.get_yticklabels()] == ["opsd\n60.00 (+14.38 [+6.88, +22.50])",
                                                            "base (untrained)\n45.62"]
    title = " ".join(fig.get_suptitle().split())
    assert title == ("grid g: bar: each arm's avg@8 (one run each), whisker: the 95% interval of its difference to "
                     "base, drawn from base's mean (dotted line); then the training curves, each arm's one run")
    assert "dot" not in title.replace("dotted", "") and "band" not in title


def test_several_seeds_have_dots_and_a_band_in_the_title(tmp_path, figures):
    table = results({"base": arm([40.0], trained=False),
                     "opsd": arm([50.0, 54.0, 58.0], difference=14.0, ci=[9.0, 19.0])})
    run_plots.overlay_grid(grid_with(tmp_path, table, seeds=3))
    title = " ".join(figures[-1].get_suptitle().split())
    assert title.startswith("grid g: bar: each arm's avg@8, the mean over its 3 seeds, dots: each seed's run, "
                            "whisker: the 95% interval of its difference to base")
    assert title.endswith("then the training curves, each arm's mean over its seeds, band from the lowest to the "
                          "highest seed")
    dots = [list(line.get_xdata()) for line in figures[-1].axes[0].get_lines() if line.get_marker() == "o"]
    assert dots == [[50.0, 54.0, 58.0]]


def test_the_teachers_length_preference_is_a_panel_of_opsd_runs(tmp_path):
    """Issue 58 item 3: OPSD's EOS log-probs of both roles (opsd.objective.EOS_STAT_KEYS) share one panel."""
    from opsd.objective import EOS_STAT_KEYS

    eos = tuple(f"opsd/{key}" for key in EOS_STAT_KEYS)
    run = write_metrics(tmp_path / "run", {"loss": falling(0.25), eos[0]: falling(-0.5), eos[1]: falling(-2.0)})
    panels, left_out = plot_curves.run_panels(plot_curves.read_metrics(run))
    assert [(p.title, p.keys) for p in panels] == [("loss", ("loss",)), ("ending here (EOS log-prob)", eos)]
    assert left_out == [] and plot_curves.HEALTHY["ending here (EOS log-prob)"].startswith("teacher above student")
