"""opsd/analysis/tokens.py: a run's cumulative sampled tokens (`tokens/sampled` of metrics.jsonl), a
grid's accuracy against them (`python -m opsd.analysis.stats tokens`), and its plot."""
import json

import pytest
from token_grid import CORRECT, STEPS, accuracy, write_grid, write_run

from opsd.analysis import plots as run_plots
from opsd.analysis import stats as run_stats
from opsd.analysis import tokens as run_tokens
from opsd.run_log import append_metrics


def test_the_reader_gives_the_value_logged_at_each_step(tmp_path):
    write_run(tmp_path / "run", 1000)
    by_step = run_tokens.read_sampled_tokens(tmp_path / "run")
    assert by_step == {1: 1000, 2: 2000, 3: 3000, 4: 4000}
    assert run_tokens.tokens_at(by_step, 2) == 2000  # checkpoint-2
    assert run_tokens.tokens_at(by_step, 9) is None  # a step never logged


def test_an_sft_run_reads_zero_and_an_older_run_reads_not_recorded(tmp_path):
    write_run(tmp_path / "sft", 0)
    assert run_tokens.read_sampled_tokens(tmp_path / "sft") == {1: 0, 2: 0, 3: 0, 4: 0}
    write_run(tmp_path / "old", None)
    assert run_tokens.read_sampled_tokens(tmp_path / "old") is None
    assert run_tokens.tokens_at(None, 4) is None
    assert run_tokens.read_sampled_tokens(tmp_path / "nothing") is None  # no metrics.jsonl at all
    assert run_tokens.format_tokens(None) == "not recorded"


def test_a_run_whose_first_step_lacks_the_key_is_not_recorded(tmp_path):
    """Resumed across the trainer's change: its counts would miss the first steps' tokens."""
    path = str(tmp_path / "metrics.jsonl")
    append_metrics(path, 1, {"loss": 1.0})
    append_metrics(path, 2, {"loss": 1.0, "tokens/sampled": 500})
    assert run_tokens.read_sampled_tokens(tmp_path) is None


@pytest.mark.parametrize("value", ["12", -1, 1.5, True])
def test_a_bad_value_is_one_line_naming_the_file_and_line(tmp_path, value):
    path = str(tmp_path / "metrics.jsonl")
    append_metrics(path, 1, {"tokens/sampled": 10})
    append_metrics(path, 2, {"tokens/sampled": value})
    with pytest.raises(run_tokens.TokensError, match=r"metrics.jsonl:2: tokens/sampled must be a whole number"):
        run_tokens.read_sampled_tokens(tmp_path)


@pytest.mark.parametrize("value, text", [(0, "0"), (980, "980"), (1234, "1.23 k"), (340_000, "340 k"),
                                         (999_600, "1 M"), (1_200_000, "1.2 M"), (2.5e9, "2.5 B")])
def test_token_counts_read_as_k_m_b(value, text):
    assert run_tokens.format_tokens(value) == text


def test_the_grid_table_means_tokens_and_accuracy_over_seeds_per_swept_step(tmp_path):
    table = run_stats.grid_table(write_grid(tmp_path / "grid", arms=("opsd", "sft", "old")))
    assert table["metric"] == "avg@8" and table["swept"]
    assert list(table["arms"]) == ["base", "old", "opsd", "sft"]  # no results.json: by name
    base = table["arms"]["base"]
    assert not base["trained"] and [(p["step"], p["sampled_tokens"]) for p in base["points"]] == [(0, 0)]
    opsd = table["arms"]["opsd"]
    assert opsd["seeds"] == [0, 1] and [p["step"] for p in opsd["points"]] == list(STEPS)
    last = opsd["points"][-1]
    assert last["sampled_tokens_per_seed"] == [4 * 1000, 4 * 3000] and last["sampled_tokens"] == 8000
    assert last["accuracy_per_seed"] == [accuracy(CORRECT["opsd"][s][4]) for s in (0, 1)]
    assert last["accuracy"] == pytest.approx(sum(last["accuracy_per_seed"]) / 2)
    assert opsd["points"][0]["sampled_tokens"] == 2 * (1000 + 3000) / 2
    assert run_tokens.samples_nothing(table["arms"]["sft"]) and not run_tokens.samples_nothing(opsd)
    old = table["arms"]["old"]
    assert [p["sampled_tokens"] for p in old["points"]] == [None, None]  # never a fake 0


def test_without_a_sweep_the_grid_table_has_the_last_checkpoint(tmp_path):
    table = run_stats.grid_table(write_grid(tmp_path / "grid", sweep=False))
    assert not table["swept"]
    points = table["arms"]["opsd"]["points"]
    assert [(p["step"], p["sampled_tokens"]) for p in points] == [(4, 8000)]


def test_stats_tokens_prints_step_tokens_accuracy_per_arm(tmp_path, capsys):
    grid = write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    status = run_stats.main(["tokens", str(grid), "--json", str(tmp_path / "t.json"),
                             "--plot", str(tmp_path / "t.png")])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "| step | sampled tokens | avg@8 |" in out
    opsd = out.split("## opsd (2 seeds)")[1].split("##")[0]
    mean_2 = (accuracy(CORRECT["opsd"][0][2]) + accuracy(CORRECT["opsd"][1][2])) / 2
    assert f"| 2 | 4 k | {mean_2:.2f} |" in opsd and "| 4 | 8 k |" in opsd
    assert "| 4 | 0 |" in out.split("## sft")[1]
    assert "| 4 | not recorded |" in out.split("## old")[1].split("##")[0]
    assert "| - | - |" in out.split("## base (untrained)")[1].split("##")[0]
    assert json.loads((tmp_path / "t.json").read_text())["arms"]["opsd"]["points"][1]["sampled_tokens"] == 8000
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_tokens_of_a_missing_grid_is_one_error_line(tmp_path, capsys):
    assert run_stats.main(["tokens", str(tmp_path / "nope")]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and err.startswith("error: ") and "no such folder" in err


def test_the_plot_draws_curves_on_a_tokens_axis_with_reference_lines(tmp_path):
    table = run_stats.grid_table(write_grid(tmp_path / "grid", arms=("opsd", "sft", "old")))
    fig, drawn = run_plots.accuracy_vs_tokens_figure(table)
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("sampled tokens") and ax.get_ylabel() == "avg@8 (%)"
    assert drawn == ["opsd", "base", "sft"]  # old: not recorded, not drawn (the title says so)
    assert "not drawn (sampled tokens not recorded): old" in ax.get_title().replace("\n", " ")
    curve, base, sft = ax.get_lines()
    assert list(curve.get_xdata()) == [4000, 8000]
    assert list(curve.get_ydata()) == pytest.approx([p["accuracy"] for p in table["arms"]["opsd"]["points"]])
    assert len(ax.collections) == 1  # the seeds' band of opsd
    assert base.get_linestyle() == ":" and list(base.get_ydata()) == [accuracy([1, 0, 1, 0])] * 2
    sft_last = (accuracy(CORRECT["sft"][0][4]) + accuracy(CORRECT["sft"][1][4])) / 2
    assert sft.get_linestyle() == "--" and sft.get_ydata()[0] == pytest.approx(sft_last)
    labels = ax.get_legend_handles_labels()[1]
    assert any(label.startswith("sft: samples no tokens") for label in labels)
    assert ax.xaxis.get_major_formatter()(8000, 0) == "8 k"
    out = tmp_path / "grid" / run_plots.ACCURACY_VS_TOKENS_FILE
    assert run_plots.plot_accuracy_vs_tokens(run_stats.grid_table(tmp_path / "grid"), out) == drawn
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_grid_whose_runs_recorded_no_tokens_is_not_drawn(tmp_path):
    write_grid(tmp_path / "grid", arms=("old",))
    with pytest.raises(run_plots.PlotError, match="no trained arm recorded its sampled tokens"):
        run_plots.plot_accuracy_vs_tokens(run_stats.grid_table(tmp_path / "grid"),
                                          tmp_path / "grid" / run_plots.ACCURACY_VS_TOKENS_FILE)
    assert not (tmp_path / "grid" / run_plots.ACCURACY_VS_TOKENS_FILE).exists()
