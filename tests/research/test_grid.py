"""opsd/research/grid.py: arms x seeds on the tiny preset, paired seeds, resumable, one table."""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from grid_cases import CELLS, FAKE_GPUS, GRID, run_grid

import opsd.research.grid
from opsd.research import executors

REPO = Path(__file__).resolve().parents[2]

@pytest.mark.slow
@pytest.mark.xdist_group("grid")
def test_two_arms_two_seeds_end_to_end_and_resume(local_grid):
    grid_file, out, first = local_grid
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = json.loads((out / "results.json").read_text())
    assert set(table["arms"]) == {"entry", "token"} and all(a["runs"] == 2 for a in table["arms"].values())
    assert "verdict" in table["arms"]["token"] and "verdict" not in table["arms"]["entry"]
    assert table["missing"] == []
    assert table["grid"]["base_recipe"] == "shipped"
    assert table["grid"]["base_recipe_keys"] == {"lr_scheduler_type": "cosine"}
    assert "| token | 2 |" in (out / "results.md").read_text()
    assert ("Trained arms start from the shipped recipe (`recipe.env`: lr_scheduler_type=cosine), then the grid's "
            "recipe keys (learning_rate=0.0002, max_completion_length=24)") in (out / "results.md").read_text()
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the arms' curves, beside results.md
    assert f"; curves: {out / 'curves.png'}" in first.stdout
    # The output ends with each cell's FINAL line and the arm's verdict (what quickstart.sh shows).
    *finals, verdict = first.stdout.rstrip().splitlines()[-5:]
    assert [line.split(": FINAL avg@8 accuracy: ")[0] for line in finals] == [
        "entry/seed-0", "entry/seed-1", "token/seed-0", "token/seed-1"]
    assert verdict == f"token vs entry: {table['arms']['token']['verdict']}"
    for arm in ("entry", "token"):
        for seed in (0, 1):
            cell = out / arm / f"seed-{seed}"
            log = (cell / "train.log").read_text()
            assert f"--seed {seed} " in log  # the same seed in both arms: paired
            # The shipped recipe (recipe.env: cosine), then the grid's keys: the cell's metrics follow its schedule.
            assert (cell / "recipe.env").read_text() == (
                "lr_scheduler_type=cosine\nlearning_rate=0.0002\nmax_completion_length=24\n")
            metrics = (cell / "run" / "metrics.jsonl").read_text().splitlines()
            rates = [json.loads(line)["learning_rate"] for line in metrics if '"learning_rate"' in line]
            assert len(rates) == 4 and rates[0] == pytest.approx(2e-4) and rates == sorted(rates, reverse=True)
            assert rates[-1] < 0.5 * rates[0]
            assert json.loads((cell / "eval.json").read_text())["dataset"] == "tiny:5:2"
            assert sorted(p.name for p in (cell / "run").glob("checkpoint-*")) == [
                "checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]  # resumable from any step
    # Each cell records what its results depend on and where it ran (cell.json).
    recorded = json.loads((out / "token" / "seed-0" / "cell.json").read_text())
    assert recorded["processes"] == 1 and recorded["env"] == {"OPSD_CLIP_MODE": "token"}
    assert recorded["variables"]["OPSD_EVAL_PAGED_GIB"] == opsd.research.grid.EVAL_PAGED_GIB
    snapshot = out / ".code" / recorded["provenance"]["code"]  # the code every cell ran: a copy made at the start
    assert (snapshot / "opsd_train.py").is_file() and not (snapshot / "tests").exists()
    assert f" {snapshot / 'opsd_train.py'} " in (out / "token" / "seed-0" / "train.log").read_text()
    assert recorded["provenance"]["devices"] in ("unknown", "CPU")  # fake GPU ids: nvidia-smi names none
    # A running cell's progress reaches the grid's output, with its log's path.
    assert f"(log: {out / 'entry' / 'seed-0' / 'train.log'})" in first.stdout
    assert re.search(r"\] (entry|token)/seed-\d: (train|eval) \d+/\d+", first.stdout), first.stdout[-3000:]
    for arm in ("entry", "token"):  # each arm's variables reach only its own runs
        assert json.loads((out / arm / "seed-0" / "run" / "run_config.json").read_text())["OPSD_CLIP_MODE"] == arm
    # Every cell is done: a re-run trains and evaluates nothing, and gives the same table.
    again = run_grid(grid_file, out)
    assert again.returncode == 0 and "4 cells, 4 already done, 0 to run" in again.stdout
    assert again.stdout.splitlines()[-5:] == first.stdout.splitlines()[-5:]
    assert json.loads((out / "results.json").read_text()) == table


@pytest.mark.slow
@pytest.mark.xdist_group("grid")
def test_the_local_pool_puts_each_cell_on_its_own_gpu(local_grid):
    _, out, run = local_grid
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"GPU pool: 2 GPU(s) {FAKE_GPUS}, 1 a cell, 1 cell(s) a GPU: 2 cell(s) at a time" in run.stdout
    devices = {}
    for name in CELLS:
        first = (out / name / "train.log").read_text().splitlines()[0]
        assert first.startswith("$ CUDA_VISIBLE_DEVICES="), first
        devices[name] = first.split()[1].split("=")[1]
        assert f"{name}: train on GPU {devices[name]} ..." in run.stdout
        assert (out / name / "eval.log").read_text().startswith(f"$ CUDA_VISIBLE_DEVICES={devices[name]} ")
    assert set(devices.values()) == set(FAKE_GPUS.split(","))  # both GPUs used, one id per cell


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
    ({"arms": {"a": {}}, "base_recipe": "mine"}, "'base_recipe' must be one of 'shipped', 'released'"),
])
def test_bad_grid_files_are_one_line_errors(tmp_path, spec, message):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(spec))
    with pytest.raises(opsd.research.grid.GridError, match=message):
        opsd.research.grid.load_grid(str(grid_file))
    result = run_grid(grid_file, tmp_path / "out")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error:")


def test_shipped_grids_load():
    shipped = [p for p in (REPO / "grids").rglob("*.json") if "results" not in p.parts]
    assert len(shipped) > 10
    for path in shipped:
        grid = opsd.research.grid.load_grid(str(path))
        assert grid.arms and grid.baseline in {a.name for a in grid.arms}


def test_arms_start_from_the_shipped_recipe_unless_the_grid_names_the_released_one(tmp_path):
    """recipe.env's active keys (what train_capped.sh runs), then the grid's recipe, then the arm's; with
    "base_recipe": "released" nothing of recipe.env. The cell's identity holds the merged recipe."""
    spec = {"arms": {"a": {}, "b": {"recipe": {"lr_scheduler_type": "constant", "learning_rate": 1e-3}}},
            "recipe": {"learning_rate": 2e-4}}
    texts = {}
    for base in (None, "shipped", "released"):
        path = tmp_path / f"{base}.json"
        path.write_text(json.dumps(spec if base is None else {**spec, "base_recipe": base}))
        grid = opsd.research.grid.load_grid(str(path))
        texts[base] = [opsd.research.grid.recipe_text(grid, arm) for arm in grid.arms]
        cell = opsd.research.grid.cells(grid, tmp_path)[0]
        assert opsd.research.grid.cell_identity(grid, cell)["recipe"] == (
            {"learning_rate": 2e-4} if base == "released" else {"lr_scheduler_type": "cosine", "learning_rate": 2e-4})
    assert texts[None] == texts["shipped"] == ["lr_scheduler_type=cosine\nlearning_rate=0.0002\n",
                                               "lr_scheduler_type=constant\nlearning_rate=0.001\n"]
    assert texts["released"] == ["learning_rate=0.0002\n", "learning_rate=0.001\nlr_scheduler_type=constant\n"]


def test_committed_results_name_the_recipe_their_cells_ran():
    """Every grid with committed results ran before base recipes, on the released recipe (constant LR): its
    file says so, so that re-tabling its folder finds the same cells; the quickstart grids run the shipped one."""
    for path in (REPO / "grids").rglob("*.json"):
        if "results" in path.parts:
            continue
        grid = opsd.research.grid.load_grid(str(path))
        name = path.relative_to(REPO / "grids").as_posix()
        unrun = name.startswith(("quickstart_cpu.json", "quickstart_gpu.json", "grpo_tuned/data_size_3seeds",
                                 "grpo_tuned/wall_time", "grpo_tuned/lr_per_split", "long_runs"))
        assert grid.base_recipe == ("shipped" if unrun else "released"), name


@pytest.mark.parametrize("whole", ["grpo_tuned/data_size_3seeds", "grpo_tuned/wall_time"])
def test_a_grid_split_into_parts_for_one_call_each_is_the_whole_grid(whole):
    """The parts (a folder of grid files beside the whole grid's file) run one GPU call each into the
    whole grid's folder (GRID_NAME, bench/learned_default_gpu.sh); the whole grid's file then
    tables them. Together the parts are exactly the whole's cells, with its settings; each part's
    baseline is one of its arms."""
    def cells(grid):
        return {(c.arm.name, c.seed): json.dumps(opsd.research.grid.cell_identity(grid, c), sort_keys=True)
                for c in opsd.research.grid.cells(grid, Path("/out"))}

    full = opsd.research.grid.load_grid(str(REPO / "grids" / f"{whole}.json"))
    parts = [opsd.research.grid.load_grid(str(p)) for p in sorted((REPO / "grids" / whole).glob("*.json"))]
    assert len(parts) >= 2
    joined = {}
    for part in parts:
        assert (part.preset, part.eval_data, part.eval_flags, part.budget, part.recipe, part.sweep_every) == (
            full.preset, full.eval_data, full.eval_flags, full.budget, full.recipe, full.sweep_every)
        assert part.baseline in {a.name for a in part.arms}
        for key, identity in cells(part).items():
            assert joined.setdefault(key, identity) == identity  # a cell in two parts (base) is the same cell
    assert joined == cells(full)


def test_the_data_size_axis_has_three_fresh_seeds_a_cell_on_a_fresh_eval_set():
    """grids/grpo_tuned/data_size_3seeds.json (issue 52 item 4): OPSD, SFT and the tuned GRPO at 64 to
    4,096 unique problems, and OPSD whose teacher reads the answer only (issue 59 item 6) at 4,096; seeds
    and eval set used by no other grid file."""
    grid = opsd.research.grid.load_grid(str(REPO / "grids" / "grpo_tuned" / "data_size_3seeds.json"))
    assert len(grid.seeds) >= 3
    trained = {a.name: a for a in grid.arms if a.train}
    assert set(trained) == {f"{m}_n{n}" for m in ("opsd", "sft", "grpo") for n in (64, 256, 1024, 4096)} | {
        "opsd_answer_n4096"}
    assert trained["opsd_answer_n4096"].env == {**trained["opsd_n4096"].env, "OPSD_TEACHER_CONTEXT": "answer"}
    for name, arm in trained.items():
        assert arm.flags[arm.flags.index("--dataset_name") + 1] == f"tiny:20260705:{name.split('_n')[1]}"
        if name.startswith("grpo"):
            assert arm.recipe == {"learning_rate": 0.0001, "max_grad_norm": 1.0}
            assert arm.flags[arm.flags.index("--num_generations") + 1] == "2"  # 16 prompts x 2: OPSD's tokens
    others = [opsd.research.grid.load_grid(str(p)) for p in (REPO / "grids").rglob("*.json")
              if "results" not in p.parts and "data_size_3seeds" not in str(p)]
    assert grid.eval_data.split(":")[1] not in {g.eval_data.split(":")[1] for g in others if g.eval_data}
    assert not any(set(grid.seeds) & set(g.seeds) for g in others if g.preset == "tiny")


def test_the_cpu_quickstart_trains_and_evaluates_one_family_on_disjoint_problems():
    """grids/quickstart_cpu.json (README, OPSD_EXPERIMENTS.md): token clip + left padding,
    12 x 16, trained on one family's train split, evaluated on 40 problems of its eval split."""
    from opsd.data import load_eval_dataset, load_train_dataset

    grid = opsd.research.grid.load_grid(str(REPO / "grids" / "quickstart_cpu.json"))
    (arm,) = [a for a in grid.arms if a.train]
    assert grid.preset == "tiny" and grid.baseline == "base" and grid.seeds == (10,)
    assert arm.env == {"OPSD_CLIP_MODE": "token", "OPSD_PAD_SIDE": "left"}
    assert grid.budget == {"max_steps": 12, "global_batch": 16, "per_device_batch": 16}
    train_name = arm.flags[arm.flags.index("--dataset_name") + 1]
    assert train_name.endswith(":amc_aime") and grid.eval_data == "tiny:7:40:amc_aime"
    train = load_train_dataset(train_name)
    held_out = load_eval_dataset(grid.eval_data)
    assert set(train["source"]) == {"amc_aime"} and len(held_out) == 40
    assert not {r["problem"] for r in held_out} & set(train["problem"])


def test_grid_curves_follow_the_grid_and_never_fail_it(tmp_path, capsys):
    """The arms' curves in the grid's order (untrained arms have none); a grid without a
    trained cell gets one warning line instead of a figure."""
    Arm = opsd.research.grid.Arm
    arms = (Arm("base", train=False), Arm("token"), Arm("entry"))
    grid = opsd.research.grid.Grid(arms=arms, seeds=(0, 1), eval_data=None, preset="tiny",
                              budget=opsd.research.grid.BUDGET_DEFAULT, recipe={}, baseline="base")
    out = tmp_path / "grid"
    assert opsd.research.grid.draw_curves(grid, out) is None
    assert capsys.readouterr().err.startswith(f"warning: grid curves not drawn: {out}: no such folder")
    for cell in opsd.research.grid.cells(grid, out):
        if cell.arm.train:
            (cell.folder / "run").mkdir(parents=True)
            (cell.folder / "run" / "metrics.jsonl").write_text(
                "".join(f'{{"step": {s}, "loss": {s * (cell.seed + 1)}, "opsd/true_kl": 0.1}}\n' for s in (1, 2)))
    assert opsd.research.grid.draw_curves(grid, out) == out / "curves.png"
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from opsd.analysis import plots as run_plots

    curves = run_plots.grid_curves(out, ["loss"], [arm.name for arm in grid.arms])["loss"]
    assert [c.label for c in curves] == ["token (2 seeds)", "entry (2 seeds)"]
    assert curves[0].values == (1.5, 3.0) and curves[0].low == (1.0, 2.0) and curves[0].high == (2.0, 4.0)


def test_eval_flags_reach_every_cells_evaluation(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "eval_data": "tiny:5:2", "seeds": [3],
                                     "eval_flags": ["--backend", "transformers", "--batch-size", "4"],
                                     "arms": {"base": {"train": False}, "a": {}}}))
    grid = opsd.research.grid.load_grid(str(grid_file))
    for cell in opsd.research.grid.cells(grid, tmp_path / "out"):
        command = opsd.research.grid.eval_command(grid, cell)
        assert command[-4:] == ["--backend", "transformers", "--batch-size", "4"]


@pytest.mark.slow
def test_a_swept_grid_evaluates_every_checkpoint_and_tables_accuracy_per_step(tmp_path):
    """sweep_every: each trained cell saves every N steps, evaluates every checkpoint
    (checkpoint_sweep), keeps its last checkpoint's report as the cell's, and results.md /
    results.json give each arm's mean accuracy per step. The arms are the method's comparison
    (base, OPSD, SFT, GRPO): each trained arm's sampled tokens, from its own metrics.jsonl, sit
    beside its accuracy, and accuracy_vs_tokens.png is drawn."""
    grid_file = tmp_path / "grid.json"
    arms = {"base": {"train": False}, "token": {"env": {"OPSD_CLIP_MODE": "token"}},
            "sft": {"flags": ["--loss_type", "sft"]},
            "grpo": {"flags": ["--loss_type", "grpo", "--num_generations", "2"]}}
    grid_file.write_text(json.dumps({**GRID, "seeds": [0], "sweep_every": 1,
                                     "budget": {"max_steps": 2, "global_batch": 2, "per_device_batch": 2},
                                     "arms": arms, "baseline": "base"}))
    out = tmp_path / "grid"
    result = run_grid(grid_file, out)
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
    assert "| step | token | sft | grpo |" in text and f"| 2 | {per_step['2']:.2f} |" in text
    metrics = {arm: [json.loads(line) for line in (out / arm / "seed-0" / "run" / "metrics.jsonl").open()]
               for arm in ("token", "sft", "grpo")}
    for arm in ("token", "grpo"):  # the tokens the run sampled, as its own log counts them
        assert table["arms"][arm]["sampled_tokens"] == metrics[arm][-1]["tokens/sampled"] > 0
    assert table["arms"]["sft"]["sampled_tokens"] == 0 and "grpo/reward_mean" in metrics["grpo"][-1]
    assert (out / "accuracy_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _token_grid():
    """tests/analysis/token_grid.py (the hand-built grid folder the analysis tests share)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("token_grid", REPO / "tests" / "analysis" / "token_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_give_each_arms_sampled_tokens_next_to_its_accuracy(tmp_path, capsys):
    """results.json / results.md: each arm's mean sampled tokens at the last checkpoint (per run and per
    swept step in results.json), - for the untrained arm, 0 for SFT, not recorded for an older run; a
    swept grid draws accuracy_vs_tokens.png."""
    token_grid = _token_grid()
    arms = tuple(opsd.research.grid.Arm(name, train=name != "base") for name in ("base", "opsd", "sft", "old"))
    grid = opsd.research.grid.Grid(arms=arms, seeds=(0, 1), eval_data=None, preset="tiny", baseline="base",
                              budget={**opsd.research.grid.BUDGET_DEFAULT, "max_steps": 4}, recipe={}, sweep_every=2)
    out = token_grid.write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    table = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))
    a = table["arms"]
    assert a["opsd"]["sampled_tokens_per_run"] == [4000, 12000] and a["opsd"]["sampled_tokens"] == 8000
    assert a["opsd"]["per_step_sampled_tokens"] == {"2": 4000, "4": 8000}
    assert a["sft"]["sampled_tokens"] == 0 and a["sft"]["sampled_tokens_per_run"] == [0, 0]
    assert a["old"]["sampled_tokens"] is None and a["old"]["sampled_tokens_per_run"] == [None]
    assert a["base"]["sampled_tokens"] == 0 and not a["base"]["trained"]
    text = opsd.research.grid.markdown(table)
    assert "| mean | sampled tokens | forward + backward tokens | vs base (95% CI) |" in text
    first_table = text.split("\n\n")[2]  # the arms' table (the metrics' tables below it have arm rows too)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in first_table.splitlines() if line.startswith("| ")}
    assert rows["| opsd"][4] == "8 k" and rows["| opsd"][3] == f"{a['opsd']['mean']:.2f}"
    assert rows["| sft"][4] == "0" and rows["| old"][4] == "not recorded" and rows["| base"][4] == "-"
    assert opsd.research.grid.draw_accuracy_vs_tokens(grid, out) == out / "accuracy_vs_tokens.png"
    assert (out / "accuracy_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert opsd.research.grid.draw_accuracy_vs_tokens(opsd.research.grid.Grid(**{**grid.__dict__, "sweep_every": None}),
                                                 out) is None
    assert capsys.readouterr().err == ""


def test_a_cell_records_each_steps_wall_time_and_results_report_it(tmp_path, monkeypatch):
    """run_cell writes each step's wall time to the cell's timing.json (resumed or not, and how many
    cells shared its GPU); results.json / results.md give each arm's per run and whether the GPU was
    the cell's alone (issue 52 item 3: cost next to tokens)."""
    from opsd.research import cell as grid_cell

    token_grid = _token_grid()
    arms = tuple(opsd.research.grid.Arm(name, train=name != "base") for name in ("base", "opsd", "sft"))
    grid = opsd.research.grid.Grid(arms=arms, seeds=(0, 1), eval_data=None, preset="tiny", baseline="base",
                              budget={**opsd.research.grid.BUDGET_DEFAULT, "max_steps": 4}, recipe={})
    out = token_grid.write_grid(tmp_path / "grid", arms=("opsd", "sft"), sweep=False)
    # One real run_cell, its training and evaluation swapped for quick commands: the second writes the report.
    cell = opsd.research.grid.Cell(arms[1], 5, out / "opsd" / "seed-5")
    (cell.folder / "run" / "checkpoint-2").mkdir(parents=True)  # an interrupted training: it resumes
    report = cell.folder / "eval" / "eval_x.json"
    monkeypatch.setattr(grid_cell, "train_command", lambda *a, **k: [sys.executable, "-c", "import time; "
                                                                     "time.sleep(0.3)"])
    monkeypatch.setattr(grid_cell, "eval_command", lambda *a, **k: [
        sys.executable, "-c", f"import os, shutil; os.makedirs({str(report.parent)!r}); "
                              f"shutil.copyfile({str(out / 'opsd' / 'seed-0' / 'eval.json')!r}, {str(report)!r})"])
    assert grid_cell.run_cell(grid, cell, lambda m: None, gpus=("0",), cells_per_gpu=1) == "done"
    timing = json.loads((cell.folder / "timing.json").read_text())
    assert timing["train_s"] >= 0.3 and timing["train_resumed"] and not timing["eval_resumed"]
    assert timing["cells_per_gpu"] == 1 and timing["eval_s"] >= 0
    import shutil

    shutil.rmtree(cell.folder)
    for name, train_s, sharing in (("opsd/seed-0", 100, 1), ("opsd/seed-1", 120, 1), ("sft/seed-0", 30, 1)):
        (out / name / "timing.json").write_text(json.dumps({"train_s": train_s, "train_resumed": False, "eval_s": 40,
                                                             "eval_resumed": False, "cells_per_gpu": sharing}))
    (out / "base" / "timing.json").write_text(json.dumps({"eval_s": 35, "eval_resumed": False, "cells_per_gpu": 1}))
    table = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))
    a = table["arms"]
    on_opsd, on_sft, on_base = (a[name]["wall_time"] for name in ("opsd", "sft", "base"))
    assert on_opsd["train_s_per_run"] == [100, 120] and on_opsd["train_s"] == 110 and on_opsd["eval_s"] == 40
    assert on_sft["train_s_per_run"] == [30, None] and on_sft["train_s"] == 30  # seed 1 recorded none
    assert on_base["train_s"] is None and on_base["eval_s"] == 35
    text = opsd.research.grid.markdown(table)
    assert "| opsd | 100, 120 | 40, 40 | 150 | 1 |" in text and "| sft | 30, - | 40, - | 70 | 1 |" in text
    assert "| base | - | 35 | 35 | 1 |" in text and "One cell a GPU (`--cells-per-gpu 1`)" in text
    (out / "sft" / "seed-0" / "timing.json").write_text(json.dumps(
        {"train_s": 30, "train_resumed": True, "eval_s": 40, "cells_per_gpu": 8}))
    text = opsd.research.grid.markdown(opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out)))
    assert "| sft | 30, - | 40, - | 70 (resumed: a part) | 8 |" in text
    assert "Cells shared a GPU (up to 8 a GPU" in text and "One cell a GPU" not in text
    for name in ("opsd", "sft", "base"):  # cells without timing.json (older grids): no wall-time table
        for path in (out / name).rglob("timing.json"):
            path.unlink()
    grids = opsd.research.grid
    assert "Wall time" not in grids.markdown(grids.results(grid, out, grids.cells(grid, out)))


# --------------------------------------------------------------------------
# Where the cells run: the pool, the executors' options, their errors
# --------------------------------------------------------------------------

def test_gpu_slots_spread_cells_over_the_gpus_before_sharing_one():
    assert executors.gpu_slots(["0", "1", "2"], 1, 2) == [("0",), ("1",), ("2",), ("0",), ("1",), ("2",)]
    assert executors.gpu_slots(["0", "1", "2", "3", "4"], 2, 1) == [("0", "1"), ("2", "3")]  # GPU 4 idles
    assert executors.gpu_slots(["0", "1"], 0, 1) == []  # CPU cells
    with pytest.raises(executors.ExecutorError, match="--gpus-per-cell 3: this machine has 2 GPU"):
        executors.gpu_slots(["0", "1"], 3, 1)


def test_visible_gpus_come_from_cuda_visible_devices_else_nvidia_smi(tmp_path):
    assert executors.visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 6"}) == ["4", "6"]
    assert executors.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))
        assert executors.visible_gpus({}) == ["0", "1"]


def test_the_pool_runs_every_cell_and_never_more_than_k_on_a_gpu():
    import threading

    running, most, lock = {}, {}, threading.Lock()

    def run(task, index, slot):
        with lock:
            for gpu in slot:
                running[gpu] = running.get(gpu, 0) + 1
                most[gpu] = max(most.get(gpu, 0), running[gpu])
        time.sleep(0.02)
        with lock:
            for gpu in slot:
                running[gpu] -= 1
        return (task, slot)

    slots = executors.gpu_slots(["0", "1"], 1, 2)
    outcomes = executors.run_pooled(list(range(20)), run, slots, None)
    assert [task for task, _ in outcomes] == list(range(20))  # every task, in order
    assert most == {"0": 2, "1": 2}  # both GPUs used, two cells each at most
    most.clear()
    outcomes = executors.run_pooled(list(range(6)), run, slots, 1)  # --parallel 1: one at a time
    assert max(most.values()) == 1 and len(outcomes) == 6
    assert executors.run_pooled([1, 2], lambda task, index, slot: (index, slot), [], 2) == [(None, None)] * 2


def test_a_multi_gpu_cell_trains_as_that_many_ddp_processes_with_the_grids_global_batch(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps({**GRID, "budget": {"max_steps": 100, "global_batch": 32, "per_device_batch": 4}}))
    grid = opsd.research.grid.load_grid(str(grid_file))
    cell = opsd.research.grid.cells(grid, tmp_path / "out")[0]
    command = opsd.research.grid.train_command(grid, cell, processes=2, port=29501)
    assert command[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert command[command.index("--num_processes") + 1] == "2" and "--main_process_port" in command
    assert command[command.index("--gradient_accumulation_steps") + 1] == "4"  # 32 = 4 x 4 x 2
    assert command[command.index("--save_steps") + 1] == "25"  # a checkpoint every quarter: resumable


def test_slurm_options_reach_the_job_arrays_sbatch_script(tmp_path, monkeypatch):
    import submitit

    # submitit's executor refuses to be built where `srun` is missing; the script's text needs no cluster.
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    options = executors.SlurmOptions(partition="gpu", time_min=90, gpus_per_cell=2, cpus_per_cell=16, mem_gb=64,
                                     account="lab", qos="high", array_parallelism=3,
                                     sbatch=executors.parse_sbatch_options(["constraint=h100", "exclude=node7",
                                                                            "--mail-type=END"]))
    executor = executors.slurm_executor(tmp_path, options, "grid-x")
    script = executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")
    for line in ("--partition=gpu", "--time=90", "--gpus-per-node=2", "--cpus-per-task=16", "--mem=65536M",
                 "--account=lab", "--qos=high", "--constraint=h100", "--exclude=node7", "--mail-type=END",
                 "--job-name=grid-x", "--signal=USR2@120"):
        assert f"#SBATCH {line}" in script, line
    assert "PYTHONPATH" not in script  # the job imports the packages as installed (pip install -e .)
    with pytest.raises(executors.ExecutorError, match="expected NAME=VALUE"):
        executors.parse_sbatch_options(["constraint"])


def _error_line(result) -> str:
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-1000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr


@pytest.mark.parametrize("flags, env, message", [
    (["--partition", "gpu"], {}, "--partition is a SLURM option: add --cluster slurm"),
    (["--no-wait"], {}, "--no-wait is a SLURM option"),
    (["--cluster", "slurm", "--cells-per-gpu", "2"], {}, "--cells-per-gpu is for this machine's GPU pool"),
    (["--gpus-per-cell", "4"], {"CUDA_VISIBLE_DEVICES": "0,1"}, "--gpus-per-cell 4: this machine has 2 GPU(s) (0,1)"),
    (["--gpus-per-cell", "1"], {"CUDA_VISIBLE_DEVICES": ""}, "--gpus-per-cell 1: this machine has no GPU visible"),
    (["--gpus-per-cell", "2", "--cells-per-gpu", "2"], {"CUDA_VISIBLE_DEVICES": "0,1"}, "it must be 1"),
    (["--parallel", "0"], {}, "--parallel must be >= 1"),
])
def test_bad_executor_options_are_one_line_errors_before_anything_runs(tmp_path, flags, env, message):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(GRID))
    assert message in _error_line(run_grid(grid_file, tmp_path / "out", *flags, env=env))
    assert not (tmp_path / "out").exists()


def test_gpus_that_do_not_divide_the_batch_are_one_line(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(GRID))  # global batch 2 = 2 per device: no room for 2 processes
    line = _error_line(run_grid(grid_file, tmp_path / "out", "--gpus-per-cell", "2",
                                env={"CUDA_VISIBLE_DEVICES": "0,1"}))
    assert "2 GPUs a cell: global_batch 2 is not a multiple of per_device_batch 2 x 2 processes" in line


def test_slurm_without_sbatch_or_without_submitit_is_one_line(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(GRID))
    bare = tmp_path / "bare"
    bare.mkdir()
    line = _error_line(run_grid(grid_file, tmp_path / "out", "--cluster", "slurm", env={"PATH": str(bare)}))
    assert "--cluster slurm: no `sbatch` on PATH" in line
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("sbatch", "squeue"):
        (tools / tool).write_text("#!/bin/sh\nexit 1\n")
        (tools / tool).chmod(0o755)
    shadow = tmp_path / "shadow" / "submitit"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named submitit')\n")
    line = _error_line(run_grid(grid_file, tmp_path / "out", "--cluster", "slurm",
                            env={"PATH": f"{tools}:{os.environ['PATH']}",
                                 "PYTHONPATH": f"{shadow.parent}:{REPO}"}))
    assert "--cluster slurm needs submitit: pip install submitit" in line
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_grids_cells_is_refused(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(GRID))
    grid = opsd.research.grid.load_grid(str(grid_file))
    out = tmp_path / "out"
    cell = opsd.research.grid.cells(grid, out)[1]  # entry/seed-1
    cell.folder.mkdir(parents=True)
    other = {**opsd.research.grid.cell_identity(grid, cell), "recipe": {"learning_rate": 1e-3}}
    (cell.folder / "cell.json").write_text(json.dumps(other))
    line = _error_line(run_grid(grid_file, out))
    assert f"{cell.folder} holds a cell of other settings (recipe.learning_rate: 0.001 there, 0.0002 now)" in line
    assert "use another --out" in line
    assert sorted(p.name for p in cell.folder.iterdir()) == ["cell.json"]  # nothing ran or was written
    # The same cell (its identity unchanged) is accepted: a re-run, or a grid with more arms or seeds.
    (cell.folder / "cell.json").write_text(json.dumps(opsd.research.grid.cell_identity(grid, cell)))
    opsd.research.grid.check_cell_identity(grid, cell)


def test_a_cancelled_job_is_told_from_a_requeued_or_timed_out_one(tmp_path):
    def log(job, text):
        folder = tmp_path / "slurm" / job
        folder.mkdir(parents=True)
        (folder / f"{job}_0_log.err").write_text(text)

    log("1_0", "slurmstepd: error: *** JOB 1 ON vm CANCELLED AT 2026-12-04T12:29:30 ***\n")
    log("2_0", "*** JOB 2 ON vm CANCELLED AT 2026-12-04T12:29:30 DUE TO JOB REQUEUE ***\nlater output\n")
    log("3", "*** JOB 3 ON vm CANCELLED AT 2026-12-04T12:29:30 DUE TO TIME LIMIT ***\n")
    log("4", "RuntimeError: a/seed-0: failed: train exited 1 (see x/train.log)\n")
    assert [opsd.research.grid._job_cancelled(tmp_path, job) for job in ("1_0", "2_0", "3", "4", "5")] == [
        True, False, False, False, False]
