"""opsd.research.grid's compute column: each arm's forward + backward tokens at the last checkpoint
(`tokens/forward`, `tokens/backward` of each seed's metrics.jsonl, mean over the seeds) in
results.json and results.md, beside its sampled tokens, on the hand-made grid of
tests/analysis/token_grid.py."""
import importlib.util
from pathlib import Path

import opsd.research.grid
from opsd.analysis.tokens import read_pass_tokens
from opsd.run_log import append_metrics

REPO = Path(__file__).resolve().parents[2]
# Forward and backward tokens a step, per arm and seed (the old arm logs neither: an older run).
PASSES = {"opsd": {0: (5000, 2000), 1: (7000, 3000)}, "sft": {0: (900, 400), 1: (1100, 500)}}


def token_grid():
    spec = importlib.util.spec_from_file_location("token_grid", REPO / "tests" / "analysis" / "token_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_passes(run: Path, sampled_per_step, forward: int, backward: int, steps: int = 4) -> None:
    (run / "metrics.jsonl").unlink()
    for step in range(1, steps + 1):
        append_metrics(str(run / "metrics.jsonl"), step, {"loss": 1.0 / step, "tokens/sampled": sampled_per_step * step,
                                                          "tokens/forward": forward * step,
                                                          "tokens/backward": backward * step})


def test_results_give_each_arms_forward_and_backward_tokens(tmp_path):
    grid_files = token_grid()
    out = grid_files.write_grid(tmp_path / "grid", arms=("opsd", "sft", "old"))
    for arm, seeds in PASSES.items():
        for seed, (forward, backward) in seeds.items():
            write_passes(out / arm / f"seed-{seed}" / "run", grid_files.TOKENS_PER_STEP[arm][seed], forward, backward)
    assert read_pass_tokens(out / "opsd" / "seed-1" / "run") == ({1: 7000, 2: 14000, 3: 21000, 4: 28000},
                                                                {1: 3000, 2: 6000, 3: 9000, 4: 12000})
    assert read_pass_tokens(out / "old" / "seed-0" / "run") == (None, None)
    arms = tuple(opsd.research.grid.Arm(name, train=name != "base") for name in ("base", "opsd", "sft", "old"))
    grid = opsd.research.grid.Grid(arms=arms, seeds=(0, 1), eval_data=None, preset="tiny", baseline="base",
                              budget={**opsd.research.grid.BUDGET_DEFAULT, "max_steps": 4}, recipe={}, sweep_every=2)
    a = opsd.research.grid.results(grid, out, opsd.research.grid.cells(grid, out))["arms"]
    assert a["opsd"]["forward_tokens_per_run"] == [20000, 28000] and a["opsd"]["forward_tokens"] == 24000
    assert a["opsd"]["backward_tokens_per_run"] == [8000, 12000] and a["opsd"]["backward_tokens"] == 10000
    assert a["sft"]["forward_tokens"] == 4000 and a["sft"]["backward_tokens"] == 1800
    assert a["old"]["forward_tokens"] is None and a["old"]["forward_tokens_per_run"] == [None]
    text = opsd.research.grid.markdown({"grid": {"eval_data": None, "budget": {}, "seeds": [0, 1], "baseline": "base"},
                                   "arms": a})
    first_table = text.split("\n\n")[2]  # the arms' table (the metrics' tables below it have arm rows too)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in first_table.splitlines() if line.startswith("| ")}
    assert rows["| arm"][5] == "forward + backward tokens"
    assert rows["| opsd"][5] == "24 k + 10 k" and rows["| sft"][5] == "4 k + 1.8 k"
    assert rows["| old"][5] == "not recorded" and rows["| base"][5] == "-"
    assert "Forward + backward tokens: the compute of training" in text
