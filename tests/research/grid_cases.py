"""The grid the grid tests share (tests/research/test_grid.py, test_slurm.py) and the local
executor's run of it (the `local_grid` fixture, tests/research/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GRID = {
    "preset": "tiny",
    "eval_data": "tiny:5:2",
    "seeds": [0, 1],
    "budget": {"max_steps": 4, "global_batch": 2, "per_device_batch": 2},  # a checkpoint every step
    # 24-token rollouts (the tiny preset's 64 make a CPU step twice as long): what the grid tests check
    # (cells, resumes, SLURM against local) does not depend on how long the completions are
    "recipe": {"learning_rate": 2e-4, "max_completion_length": 24},
    "baseline": "entry",
    "arms": {"entry": {}, "token": {"env": {"OPSD_CLIP_MODE": "token"}}},
}
CELLS = [f"{arm}/seed-{seed}" for arm in GRID["arms"] for seed in GRID["seeds"]]
FAKE_GPUS = "3,5"  # CUDA_VISIBLE_DEVICES of the grid: two GPU ids, each cell's own (on a CPU, still the CPU)


def run_grid(grid_file, out, *extra, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opsd.research.grid", str(grid_file), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=900, env={**os.environ, **(env or {})})
