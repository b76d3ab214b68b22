"""A grid on SLURM whose cells are stand-ins, for the SLURM tests that are about jobs, not training
(tests/research/test_slurm.py): `python -m slurm_fakes SCRIPT GRID_ARGS...` (tests/research on
PYTHONPATH, which the jobs inherit) runs `python -m opsd.research.grid GRID_ARGS...` with each
cell's job running the bash SCRIPT instead of the cell (CELL: the cell's folder, NAME: its name,
JOB: the job's id). The script marks a cell done by writing $CELL/eval.json; the grid's results
(tables, plots) are not made: the output ends with the cells' outcomes. FAKE_MAX_ARRAY_SIZE set:
the cluster's MaxArraySize as the grid sees it.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path


class FakeCell:
    """Runs the script as the cell's job; checkpointable as SlurmCell is (submitit requeues it at
    its USR2 and runs it again)."""

    def __init__(self, out: str, name: str, script: str):
        self.out, self.name, self.script = out, name, script

    def __call__(self) -> str:
        folder = Path(self.out) / self.name
        folder.mkdir(parents=True, exist_ok=True)
        job = os.environ.get("SLURM_ARRAY_JOB_ID", "") + "_" + os.environ.get("SLURM_ARRAY_TASK_ID", "") \
            if os.environ.get("SLURM_ARRAY_TASK_ID") else os.environ.get("SLURM_JOB_ID", "")
        # as a cell's processes do (opsd.research.cell.run_cell): SLURM's USR2 reaches every process of
        # the step, and is submitit's notice to the job alone
        subprocess.run(["bash", "-c", self.script], check=True, preexec_fn=_ignore_usr2,
                       env={**os.environ, "CELL": str(folder), "NAME": self.name, "JOB": job})
        return "done"

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(FakeCell(self.out, self.name, self.script))


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def main(argv: list[str]) -> int:
    from slurm_fakes import FakeCell as Picklable  # this module by its name, not __main__: the job imports it

    from opsd.research import grid, slurm_grid

    script = argv[0]
    if os.environ.get("FAKE_MAX_ARRAY_SIZE"):  # a cluster whose arrays hold this many jobs
        slurm_grid.executors.max_array_size = lambda: int(os.environ["FAKE_MAX_ARRAY_SIZE"])
    slurm_grid.SlurmCell = lambda _grid_file, out, name, *_rest: Picklable(out, name, script)
    grid.results = lambda _grid, _out, cells: {"arms": {}, "missing": [c.name for c in cells if not c.report.is_file()]}
    grid.markdown = lambda _table: ""
    grid.draw_curves = grid.draw_accuracy_vs_tokens = lambda *_args: None
    grid.final_lines = lambda *_args: []
    return grid.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
