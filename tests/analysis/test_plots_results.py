"""opsd/analysis/plots.py `results`: a grid's results.json drawn without its run folders. The
points are the JSON's numbers (each arm's mean x and mean accuracy, each seed's run at its own
x and accuracy), read apart from the drawing; unique training problems come from the arm's
--dataset_name, the learning rate from its recipe or the grid's; bad input is one error line,
exit 2, no PNG."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from one_line_errors import assert_only_an_error_line, one_line_message

from opsd.analysis import plots as run_plots

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def arm(per_run, sampled=None, forward=None, recipe=None, flags=(), trained=True):
    entry = {"trained": trained, "recipe": recipe or {}, "env": {}, "flags": list(flags), "runs": len(per_run),
             "per_run": per_run, "mean": sum(per_run) / len(per_run), "metric": "avg@8"}
    if sampled is not None:
        entry.update(sampled_tokens=sum(sampled) / len(sampled), sampled_tokens_per_run=sampled)
    if forward is not None:
        entry.update(forward_tokens=sum(forward) / len(forward), forward_tokens_per_run=forward)
    return entry


def results_table() -> dict:
    """A results.json as opsd.research.grid writes it: a base, OPSD and SFT at two data sizes,
    GRPO at two learning rates."""
    data = ("--dataset_name", "tiny:5:64")
    return {"grid": {"eval_data": "tiny:7:100", "preset": "tiny", "seeds": [0, 1],
                     "recipe": {"learning_rate": 0.0002}, "baseline": "base"},
            "arms": {
                "base": {"trained": False, "recipe": {}, "env": {}, "flags": [], "runs": 1, "per_run": [30.0],
                         "mean": 30.0, "metric": "avg@8", "sampled_tokens": 0, "sampled_tokens_per_run": [0]},
                "opsd_n64": arm([40.0, 42.0], [100, 110], [600, 660], flags=data),
                "opsd_n4096": arm([50.0, 54.0], [120, 130], [700, 720], flags=("--dataset_name", "tiny:5:4096")),
                "sft_n64": arm([44.0, 45.0], [0, 0], [500, 500], flags=("--loss_type", "sft", *data)),
                "sft_n4096": arm([56.0, 57.0], [0, 0], [520, 530],
                                 flags=("--loss_type", "sft", "--dataset_name=tiny:5")),
                "grpo_lr1e-4": arm([35.0, 39.0], [200, 210], [400, 420], recipe={"learning_rate": 0.0001,
                                                                                   "max_grad_norm": 1.0}, flags=data),
            },
            "missing": [], "bootstrap_resamples": 10}


def write_results(folder: Path, table=None, name="grid.json") -> Path:
    path = folder / name
    path.write_text(json.dumps(table or results_table()))
    return path


def by_arm(figure):
    return {p.arm: p for p in figure.points}


def test_token_points_are_the_means_and_each_seeds_run():
    figure = run_plots.results_points(results_table(), "sampled_tokens", name="g")
    points = by_arm(figure)
    assert list(points) == ["opsd_n64", "opsd_n4096", "sft_n64", "sft_n4096", "grpo_lr1e-4"]
    assert (points["opsd_n64"].x, points["opsd_n64"].accuracy) == (105.0, 41.0)
    assert points["opsd_n64"].runs == ((100.0, 40.0), (110.0, 42.0))  # run i: its own tokens and accuracy
    assert points["sft_n64"].runs == ((0.0, 44.0), (0.0, 45.0))  # SFT samples nothing
    assert figure.baselines == (("base", 30.0),)  # the untrained arm: a line, not a point
    assert {p.group for p in figure.points} == set(points)  # tokens: every arm its own dot
    forward = by_arm(run_plots.results_points(results_table(), "forward_tokens"))
    assert forward["grpo_lr1e-4"].x == 410.0 and forward["grpo_lr1e-4"].runs == ((400.0, 35.0), (420.0, 39.0))
    assert figure.metric == "avg@8" and figure.eval_data == "tiny:7:100"


def test_unique_problems_come_from_the_dataset_name_and_group_by_prefix():
    figure = run_plots.results_points(results_table(), "unique_problems")
    points = by_arm(figure)
    assert {a: p.x for a, p in points.items()} == {"opsd_n64": 64, "opsd_n4096": 4096, "sft_n64": 64,
                                                   "sft_n4096": 4096, "grpo_lr1e-4": 64}  # tiny:5 is 4,096 rows
    assert points["opsd_n4096"].runs == ((4096.0, 50.0), (4096.0, 54.0))  # every seed trained on the same rows
    assert {a: p.group for a, p in points.items()} == {"opsd_n64": "opsd", "opsd_n4096": "opsd", "sft_n64": "sft",
                                                       "sft_n4096": "sft", "grpo_lr1e-4": "grpo"}
    # legend labels: the groups of several arms, with the recipe keys that set them apart
    assert figure.group_labels == {"opsd": "opsd (learning_rate 0.0002)", "sft": "sft (learning_rate 0.0002)"}
    table = results_table()
    table["arms"]["opsd_n64"]["flags"] = []  # the tiny preset's data: `tiny`, 4,096 rows
    assert by_arm(run_plots.results_points(table, "unique_problems"))["opsd_n64"].x == 4096


def test_learning_rate_is_the_arms_recipe_else_the_grids_and_group_is_a_regex():
    figure = run_plots.results_points(results_table(), "learning_rate", group=r"(sft|opsd)_n(\d+)")
    points = by_arm(figure)
    assert points["grpo_lr1e-4"].x == 0.0001 and points["opsd_n64"].x == 0.0002
    assert points["opsd_n64"].group == "opsd_64" and points["grpo_lr1e-4"].group == "grpo_lr1e-4"  # no match: alone
    matched = by_arm(run_plots.results_points(results_table(), "learning_rate", group="n4096"))
    assert matched["sft_n4096"].group == "n4096" and matched["sft_n64"].group == "sft_n64"


def test_an_arm_without_the_field_is_left_out_and_named():
    table = results_table()
    del table["arms"]["opsd_n64"]["sampled_tokens"]
    table["arms"]["sft_n64"]["sampled_tokens_per_run"] = [0]  # not one per run: the mean x for each
    figure = run_plots.results_points(table, "sampled_tokens")
    assert "opsd_n64" not in by_arm(figure) and figure.left_out == ("opsd_n64 (sampled_tokens not recorded)",)
    assert by_arm(figure)["sft_n64"].runs == ((0.0, 44.0), (0.0, 45.0))


def test_the_drawing_writes_a_png_beside_the_json(tmp_path, capsys):
    path = write_results(tmp_path)
    assert run_plots.main(["results", str(path)]) == 0
    png = tmp_path / "grid_sampled_tokens.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 5_000
    assert capsys.readouterr().out == f"{png}: 6 series\n"  # 5 arms and the base line
    out = tmp_path / "size.png"
    assert run_plots.main(["results", str(path), "--x", "unique_problems", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    fig, drawn = run_plots.results_figure(run_plots.results_points(results_table(), "unique_problems"))
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_xlabel().startswith("unique training problems")
    assert ax.get_ylabel() == "avg@8 accuracy (%)"
    assert {line.get_label() for line in ax.get_lines()} >= {"opsd (learning_rate 0.0002)", "base (untrained): 30.00"}
    assert sorted(drawn) == sorted([*results_table()["arms"]])


def test_bad_input_is_one_error_line_exit_2_and_no_png(tmp_path):
    def refused(*argv, fragments):
        result = subprocess.run([sys.executable, "-m", "opsd.analysis.plots", "results", *map(str, argv)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert_only_an_error_line(result, *fragments)

    refused(tmp_path / "nope.json", fragments=[f"{tmp_path / 'nope.json'}: no such file"])
    (tmp_path / "bad.json").write_text("{")
    refused(tmp_path / "bad.json", fragments=["bad.json: not readable JSON"])
    (tmp_path / "noarms.json").write_text("{}")
    refused(tmp_path / "noarms.json", fragments=["no 'arms' in it"])
    table = results_table()
    for entry in table["arms"].values():
        entry.pop("forward_tokens", None)
    refused(write_results(tmp_path, table), "--x", "forward_tokens",
            fragments=["no trained arm has 'forward_tokens'", "fields of an arm: "])
    table = results_table()
    table["arms"]["opsd_n64"]["flags"] = ["--dataset_name", "siyanzhao/Openthoughts_math_30k_opsd"]
    refused(write_results(tmp_path, table), "--x", "unique_problems",
            fragments=["arm opsd_n64: its unique training problems are not known"])
    refused(write_results(tmp_path), "--group", "(", fragments=["--group '(': not a regular expression"])
    refused(write_results(tmp_path), "--out", tmp_path / "x.jpg", fragments=["must be a .png file"])
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*.tmp"))
    message = one_line_message(run_plots.PlotError, run_plots.results_points, results_table(), "steps")
    assert message.startswith("--x steps: expected one of sampled_tokens, ")


@pytest.mark.parametrize("name", ["grpo_tuned_token_splits", "grpo_tuned_data_size", "grpo_tuned_lr"])
def test_the_committed_results_read(name):
    """The copies in grids/results/ read as the tables say (their means, one dot per seed)."""
    table = run_plots.read_results(ROOT / "grids" / "results" / f"{name}.json")
    x = {"grpo_tuned_token_splits": "sampled_tokens", "grpo_tuned_data_size": "unique_problems",
         "grpo_tuned_lr": "learning_rate"}[name]
    figure = run_plots.results_points(table, x)
    for point in figure.points:
        entry = table["arms"][point.arm]
        assert point.accuracy == entry["mean"] and [a for _, a in point.runs] == entry["per_run"]
    assert not figure.left_out and len(figure.points) == len(table["arms"]) - 1  # all but base
