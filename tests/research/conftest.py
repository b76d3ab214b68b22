"""The local executor's run of the shared grid, once per test session (worker): the tests that use
it are kept on one xdist worker (group "grid")."""
import json

import pytest
from grid_cases import FAKE_GPUS, GRID, run_grid


@pytest.fixture(scope="session")
def local_grid(tmp_path_factory):
    """GRID run by the local executor in its GPU pool, on two fake GPU ids (one cell each, two at
    a time): (grid file, grid folder, the run). tests/research/test_slurm.py compares SLURM's
    results with these."""
    folder = tmp_path_factory.mktemp("local-grid")
    grid_file = folder / "grid.json"
    grid_file.write_text(json.dumps(GRID))
    run = run_grid(grid_file, folder / "out", "--cells-per-gpu", "1", "--progress-every", "1",
                   env={"CUDA_VISIBLE_DEVICES": FAKE_GPUS})
    return grid_file, folder / "out", run
