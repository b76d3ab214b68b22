"""Where a grid's cells run: a pool of this machine's GPUs, or a SLURM cluster through submitit.

- `gpu_slots` + `run_pooled`: each cell gets its own GPU(s) (its CUDA_VISIBLE_DEVICES), K cells a
  GPU for small models; a cell waits for a free slot. Without GPUs, N cells at a time on this
  machine, as before GPUs were known to the grid.
- `slurm_executor` + `SlurmWatch`: one job array for the cells (submitit writes and submits the
  sbatch script; a job that SLURM preempts or times out checkpoints and requeues itself through
  submitit's checkpoint hook), and the jobs' states read from `squeue` (a finished job has left it),
  which works whether or not the cluster keeps accounting (`sacct`).

Nothing here knows what a cell is: opsd/research/grid.py and opsd/research/slurm_grid.py pass callables and names.
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
    cpus_per_cell: int | None = None  # None: the cluster's default (sbatch's 1 CPU)
    mem_gb: float | None = None
    account: str | None = None
    qos: str | None = None
    sbatch: dict = field(default_factory=dict)  # more sbatch options, name -> value
    array_parallelism: int | None = None  # None: no limit (not submitit's default of 256)
    signal_delay_s: int = 120  # the checkpoint signal comes this long before the time limit
    exclude: tuple[str, ...] = ()  # nodes the jobs must not run on (sbatch --exclude)


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


CPUS_PER_GPU_FALLBACK = 8  # a GPU cell's CPUs per GPU when `sinfo` does not say what a node has


def default_cpus_per_cell(partition: str | None, gpus_per_cell: int, run=subprocess.run) -> int | None:
    """CPUs a cell asks for when --cpus-per-cell is not given: a GPU cell gets its share of a node,
    the node's CPUs over its GPUs (the smallest share among the partition's GPU nodes, from
    `sinfo`; CPUS_PER_GPU_FALLBACK a GPU when sinfo lists none) times its GPUs. A CPU cell: None
    (the cluster's default, 1 CPU on most), which --cpus-per-cell raises."""
    import re

    if not gpus_per_cell:
        return None
    command = ["sinfo", "--noheader", "--Node", "--format=%c %G"] + (["--partition", partition] if partition else [])
    try:
        listing = run(command, capture_output=True, text=True, timeout=60)
        lines = listing.stdout.splitlines() if listing.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        lines = []
    shares = []
    for line in lines:
        cpus, _, gres = line.partition(" ")
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[^:(,\s]+)?:(\d+)", gres))
        if cpus.isdigit() and gpus:
            shares.append(int(cpus) // gpus)
    return max(1, min(shares) if shares else CPUS_PER_GPU_FALLBACK) * gpus_per_cell


def max_array_size(run=subprocess.run) -> int | None:
    """The cluster's MaxArraySize (`scontrol show config`): a job array holds at most this many
    tasks (indices 0 .. MaxArraySize - 1); None when scontrol does not say."""
    try:
        config = run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in config.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return None


# submitit's requeues of a job at its time limit (max_num_timeout): as many as it takes, since a job
# is requeued only while its cell moves (opsd.research.slurm_grid.SlurmCell.checkpoint stops a stalled one)
MAX_REQUEUES = 10_000
NO_ARRAY_LIMIT = 1_000_000  # array_parallelism without --parallel: `%` = the array's size (submitit's default: 256)


def slurm_executor(folder: Path, options: SlurmOptions, job_name: str, gpus_per_job: int | None = None,
                   code_dir: Path | None = None):
    """A submitit executor for one job array of cells; its logs under `folder`/<job id>.
    gpus_per_job: the GPUs each job asks for (default: the cell's, one cell a job). code_dir: the
    grid's code snapshot, which the job runs from (its working folder, first on the import path), so that
    it unpickles and runs the snapshot's code, not the checkout's as it is when the job starts."""
    import shlex

    import submitit

    executor = submitit.SlurmExecutor(folder=str(folder / "%j"), max_num_timeout=MAX_REQUEUES)
    # srun does not pass the job's --cpus-per-task on to its step on every SLURM version (22.05
    # to 23.02 read only SRUN_CPUS_PER_TASK): set, the cell's step gets the CPUs the job was given.
    setup = ['if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi']
    if code_dir is not None:
        quoted = shlex.quote(str(code_dir))
        # `python -m submitit...` puts its working folder first on the import path, before the installed
        # (editable) checkout: the snapshot's opsd is the one the job unpickles, as a local cell's is.
        setup += [f"cd {quoted}"]
    parameters = {"job_name": job_name, "time": options.time_min, "ntasks_per_node": 1, "nodes": 1,
                  "signal_delay_s": options.signal_delay_s, "setup": setup,
                  "array_parallelism": options.array_parallelism or NO_ARRAY_LIMIT}
    gpus = options.gpus_per_cell if gpus_per_job is None else gpus_per_job
    if gpus:
        parameters["gpus_per_node"] = gpus
    optional = {"partition": options.partition, "cpus_per_task": options.cpus_per_cell,
                "mem": None if options.mem_gb is None else f"{int(options.mem_gb * 1024)}M",
                "account": options.account, "qos": options.qos}
    parameters.update({key: value for key, value in optional.items() if value is not None})
    extra = dict(options.sbatch)
    exclude = ",".join(filter(None, [extra.pop("exclude", ""), *options.exclude]))
    if exclude:
        parameters["exclude"] = exclude
    for key in list(extra):
        if key in submitit.SlurmExecutor._valid_parameters():
            parameters[key] = extra.pop(key)
    # --requeue: a preempted job goes back to the queue (and submitit's requeue at the time limit is
    # allowed) also where the cluster's JobRequeue=0 would cancel it
    parameters["additional_parameters"] = {"requeue": True, **extra}
    executor.update_parameters(**parameters)
    return executor


def sbatch_refusal(message: str, options: SlurmOptions, run=subprocess.run) -> str:
    """sbatch's last word on a refused submission, with what to do when the cause is a known one."""
    said = [line.strip() for line in message.splitlines() if line.strip()]
    last = said[-1] if said else message.strip() or "no message"
    lowered = message.lower()
    if "invalid generic resource" in lowered and options.gpus_per_cell:
        return (f"{last}: each cell asks for {options.gpus_per_cell} GPU(s) (--gpus-per-cell, default 1), and "
                "this cluster or partition offers no GPUs that way; for CPU cells use --gpus-per-cell 0")
    if "invalid partition" in lowered:
        try:
            listing = run(["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=60)
            partitions = [p.strip() for p in listing.stdout.split() if p.strip()]
        except (OSError, subprocess.SubprocessError):
            partitions = []
        known = f"the partitions sinfo lists: {', '.join(partitions)}" if partitions else "see `sinfo` for them"
        return f"{last}: --partition {options.partition!r} is not one of this cluster's ({known}; * is the default)"
    return last


# The states a job has once it has ended for good (squeue keeps it listed for MinJobAge, then drops it).
ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"})


@dataclass(frozen=True)
class JobState:
    state: str  # SLURM's: PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ...
    node: str = ""  # where it runs or ran ("" while pending)
    reason: str = ""  # why it waits (Priority, Resources, BeginTime, ...)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


class SlurmWatch:
    """The states of submitted jobs, from `squeue --states=all` (one call for all of them), which
    lists ended jobs too for MinJobAge (300 s by default) after they end; for jobs it no longer
    lists, from `sacct` where the cluster keeps accounting. A job neither lists is unknown."""

    def __init__(self, run=subprocess.run):
        self._run = run
        self._sacct = shutil.which("sacct") is not None

    def states(self, job_ids: list[str]) -> dict[str, JobState]:
        """{job id: its state} of the jobs among `job_ids` that squeue or sacct still know."""
        if not job_ids:
            return {}
        arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
        listing = self._run(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T|%N|%r",
                             "--jobs", ",".join(arrays)], capture_output=True, text=True, timeout=60)
        if listing.returncode != 0 and "Invalid job id" not in listing.stderr:
            raise ExecutorError(f"squeue failed: {listing.stderr.strip() or listing.returncode}")
        found = {}
        for line in listing.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 4:
                found[parts[0]] = JobState(parts[1], parts[2], "" if parts[3] == "None" else parts[3])
        missing = [job_id for job_id in job_ids if job_id not in found]
        if missing and self._sacct:
            found.update(self._accounted(missing))
        return {job_id: found[job_id] for job_id in job_ids if job_id in found}

    def _accounted(self, job_ids: list[str]) -> dict[str, JobState]:
        try:
            listing = self._run(["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State,NodeList",
                                 "--jobs", ",".join(job_ids)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return {}
        if listing.returncode != 0:  # "Slurm accounting storage is disabled": ask no more
            self._sacct = False
            return {}
        found = {}
        for line in listing.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[1]:
                found[parts[0]] = JobState(parts[1].split()[0], "" if parts[2] == "None assigned" else parts[2])
        return found

    def queued(self, job_ids: list[str]) -> dict[str, str]:
        """{job id: state} of the jobs among `job_ids` that SLURM still holds (pending, running,
        requeued, completing, ...)."""
        return {job_id: s.state for job_id, s in self.states(job_ids).items() if not s.ended}
