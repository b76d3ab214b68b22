"""Where a grid's cells run: a pool of this machine's GPUs, or a SLURM cluster through submitit.

- `gpu_slots` + `run_pooled`: each cell gets its own GPU(s) (its CUDA_VISIBLE_DEVICES), K cells a
  GPU for small models; a cell waits for a free slot. Without GPUs, N cells at a time on this
  machine, as before GPUs were known to the grid.
- `slurm_executor` + `SlurmWatch`: one job array for the cells (submitit writes and submits the
  sbatch script; a job that SLURM preempts or times out checkpoints and requeues itself through
  submitit's checkpoint hook), and the jobs' states read from `squeue` (a finished job has left it),
  which works whether or not the cluster keeps accounting (`sacct`).

Nothing here knows what a cell is: research/grid.py and research/slurm_grid.py pass callables and names.
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


class ExecutorError(Exception):
    """A bad executor option or a missing cluster tool; one line, exit 2."""


# --------------------------------------------------------------------------
# This machine: a GPU pool
# --------------------------------------------------------------------------

def visible_gpus(environ=os.environ) -> list[str]:
    """The GPU ids a process here may use: CUDA_VISIBLE_DEVICES when set (empty: none), else every
    GPU `nvidia-smi -L` lists, else none."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [gpu.strip() for gpu in environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[0].split()[1] for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick), for one multi-process cell's
    rendezvous: fixed ports collide between two grids on one node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def gpu_slots(gpus: list[str], gpus_per_cell: int, cells_per_gpu: int) -> list[tuple[str, ...]]:
    """The pool's slots, each the GPU ids of one running cell. Every GPU's first slot comes before
    any GPU's second, so that a grid smaller than the pool spreads over the GPUs."""
    if gpus_per_cell < 0 or cells_per_gpu < 1:
        raise ExecutorError(f"--gpus-per-cell must be >= 0 and --cells-per-gpu >= 1, "
                            f"got {gpus_per_cell} and {cells_per_gpu}")
    if gpus_per_cell == 0:
        return []
    if gpus_per_cell > len(gpus):
        raise ExecutorError(f"--gpus-per-cell {gpus_per_cell}: this machine has {len(gpus)} GPU(s) "
                            f"({','.join(gpus) or 'none visible'})")
    if gpus_per_cell > 1 and cells_per_gpu > 1:
        raise ExecutorError(f"--cells-per-gpu {cells_per_gpu} shares a GPU between cells of one GPU each; "
                            f"with --gpus-per-cell {gpus_per_cell} it must be 1")
    groups = [tuple(gpus[i:i + gpus_per_cell]) for i in range(0, len(gpus) - gpus_per_cell + 1, gpus_per_cell)]
    return [group for _ in range(cells_per_gpu) for group in groups]


def run_pooled(tasks: list, run, slots: list[tuple[str, ...]], parallel: int | None) -> list:
    """run(task, slot_index, gpus) for every task, at most `parallel` at once, each holding a slot
    (its GPUs) while it runs; without slots, `parallel` tasks at once with gpus None (the machine as
    it is). Returns the outcomes in the tasks' order."""
    if not slots:
        with ThreadPoolExecutor(max_workers=parallel or 1) as pool:
            return list(pool.map(lambda task: run(task, None, None), tasks))
    free: queue.Queue = queue.Queue()
    for index, slot in enumerate(slots):
        free.put((index, slot))

    def in_a_slot(task):
        index, slot = free.get()
        try:
            return run(task, index, slot)
        finally:
            free.put((index, slot))

    workers = min(len(slots), parallel) if parallel else len(slots)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(in_a_slot, tasks))


# --------------------------------------------------------------------------
# A SLURM cluster, through submitit
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    time_min: int = 240
    gpus_per_cell: int = 1
    cpus_per_cell: int | None = None
    mem_gb: float | None = None
    account: str | None = None
    qos: str | None = None
    sbatch: dict = field(default_factory=dict)  # more sbatch options, name -> value
    array_parallelism: int | None = None
    signal_delay_s: int = 120  # the checkpoint signal comes this long before the time limit


def parse_sbatch_options(pairs: list[str]) -> dict:
    """`--sbatch KEY=VALUE` pairs (sbatch's long option names without --) -> {key: value}."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ExecutorError(f"--sbatch {pair!r}: expected NAME=VALUE, e.g. --sbatch constraint=h100")
        options[key.replace("-", "_")] = value
    return options


def check_slurm_tools() -> None:
    """Before anything is submitted: sbatch and squeue on PATH, submitit importable."""
    for tool in ("sbatch", "squeue"):
        if shutil.which(tool) is None:
            raise ExecutorError(f"--cluster slurm: no `{tool}` on PATH (run the grid on a SLURM login node)")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ExecutorError("--cluster slurm needs submitit: pip install submitit") from None


def slurm_executor(folder: Path, options: SlurmOptions, job_name: str):
    """A submitit executor for one job array of cells; its logs under `folder`/<job id>."""
    import submitit

    executor = submitit.SlurmExecutor(folder=str(folder / "%j"), max_num_timeout=3)
    parameters = dict(
        job_name=job_name, time=options.time_min, ntasks_per_node=1, nodes=1,
        signal_delay_s=options.signal_delay_s,  # the job imports the packages as installed (pip install -e .)
    )
    if options.gpus_per_cell:
        parameters["gpus_per_node"] = options.gpus_per_cell
    optional = {"partition": options.partition, "cpus_per_task": options.cpus_per_cell,
                "mem": None if options.mem_gb is None else f"{int(options.mem_gb * 1024)}M",
                "account": options.account, "qos": options.qos, "array_parallelism": options.array_parallelism}
    parameters.update({key: value for key, value in optional.items() if value is not None})
    extra = dict(options.sbatch)
    for key in list(extra):
        if key in submitit.SlurmExecutor._valid_parameters():
            parameters[key] = extra.pop(key)
    if extra:
        parameters["additional_parameters"] = extra
    executor.update_parameters(**parameters)
    return executor


class SlurmWatch:
    """The states of submitted jobs, from `squeue` (one call for all of them). A job that is no
    longer listed has ended; whether it left a result is submitit's to say."""

    def __init__(self, run=subprocess.run):
        self._run = run

    def queued(self, job_ids: list[str]) -> dict[str, str]:
        """{job id: state} of the jobs among `job_ids` that SLURM still holds (pending, running,
        requeued, completing, ...)."""
        if not job_ids:
            return {}
        arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
        listing = self._run(["squeue", "--noheader", "--array", "--format=%i %T", "--jobs", ",".join(arrays)],
                            capture_output=True, text=True, timeout=60)
        if listing.returncode != 0 and "Invalid job id" not in listing.stderr:
            raise ExecutorError(f"squeue failed: {listing.stderr.strip() or listing.returncode}")
        states = dict(line.split(None, 1) for line in listing.stdout.splitlines() if line.strip())
        return {job_id: states[job_id].strip() for job_id in job_ids if job_id in states}
