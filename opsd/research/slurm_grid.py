"""A research grid on a SLURM cluster: the cells as job arrays through submitit, each job one
cell (`SlurmCell`), the grid waiting with progress, resubmitting a failed cell once; and the
grid folder's `status` and `cancel` commands.

opsd/research/grid.py calls `run_on_slurm` and dispatches `python -m opsd.research.grid status|cancel DIR`
here; what a cell is and how it runs is opsd/research/cell.py's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from opsd.research import executors
from opsd.research.cell import SNAPSHOT_DIR, Cell, Grid, GridError, cells, load_grid, run_cell
from opsd.run_folder import write_text_atomic

JOBS_FILE = "slurm_jobs.json"  # cell -> its last job id: a re-run waits for queued ones
CANCELLED_FILE = "slurm_cancelled.json"  # cell -> the job id cancelled ("unsubmitted": never sent)
UNSUBMITTED = "unsubmitted"


def given_cpus(gpus_per_cell: int, environ=os.environ) -> tuple[int, int]:
    """(CPUs this job was given, threads a process of its cell should use). The CPUs: those the job
    is bound to (sched_getaffinity), at most its --cpus-per-task where the cluster does not bind;
    a cell's processes (one per GPU, one for a CPU cell) share them."""
    cpus = len(os.sched_getaffinity(0))
    asked = environ.get("SLURM_CPUS_PER_TASK", "")
    if asked.isdigit():
        cpus = min(cpus, int(asked))
    return cpus, max(1, cpus // max(1, gpus_per_cell))


def use_given_cpus(gpus_per_cell: int) -> tuple[list[int], int]:
    """Set this job's thread count (OMP_NUM_THREADS, which torch reads, for the cell's processes)
    to the CPUs it was given; returns (the CPUs it is bound to, the thread count)."""
    _cpus, threads = given_cpus(gpus_per_cell)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return sorted(os.sched_getaffinity(0)), threads


class SlurmCell:
    """One cell as a SLURM job (submitit pickles this object and calls it on the node). When SLURM
    preempts the job or its time limit nears, submitit calls `checkpoint`: the training stops at a
    step boundary with a checkpoint (SIGTERM to its ranks), and the requeued job resumes from it.
    `stalls`: the jobs before this one, in a row, that were stopped without the cell moving."""

    def __init__(self, grid_file: str, out: str, name: str, gpus_per_cell: int, code: str | None = None,
                 code_dir: str | None = None, stalls: int = 0):
        self.grid_file, self.out, self.name, self.gpus_per_cell = grid_file, out, name, gpus_per_cell
        self.code, self.code_dir = code, code_dir  # the grid's code snapshot (opsd.research.cell.snapshot_code)
        self.stalls = stalls
        self._child, self._mark = None, None

    def __getstate__(self):
        return {**self.__dict__, "_child": None, "_mark": None}

    def __call__(self) -> str:
        self._mark = progress_mark(Path(self.out) / self.name)
        _say_code(self.name, self.code_dir)
        grid = load_grid(self.grid_file)
        (cell,) = [c for c in cells(grid, Path(self.out)) if c.name == self.name]
        gpus = tuple(executors.visible_gpus()[:self.gpus_per_cell]) if self.gpus_per_cell else ()
        if len(gpus) < self.gpus_per_cell:
            raise RuntimeError(f"{self.name}: asked for {self.gpus_per_cell} GPU(s), the job sees {len(gpus)}")
        bound, threads = use_given_cpus(self.gpus_per_cell)
        print(f"{self.name}: CPUs {','.join(map(str, bound))} given, {threads} thread(s) a process", flush=True)
        # port None: run_cell takes a free one (bind to port 0) for a multi-GPU cell's rendezvous, not
        # a number derived from the job id, which could fall in the ephemeral range or on another cell's
        outcome = run_cell(grid, cell, lambda message: print(message, flush=True), gpus=gpus, port=None,
                           started=self._started, **_code_of(self))
        if outcome.startswith("failed"):
            raise RuntimeError(f"{self.name}: {outcome}")
        return outcome

    def _started(self, child) -> None:
        self._child = child

    def checkpoint(self, *args, **kwargs):
        import submitit

        _stop_for_requeue({self.name: self._child})
        stalls = _stalls(self.stalls, [self._mark], [progress_mark(Path(self.out) / self.name)], self.name)
        if stalls is None:
            return None  # submitit: not requeued; the job ends failed and the grid's tries apply
        return submitit.helpers.DelayedSubmission(
            SlurmCell(self.grid_file, self.out, self.name, self.gpus_per_cell, self.code, self.code_dir, stalls))


MAX_STALLS = 2  # jobs in a row stopped (time limit, preemption) without their cells moving: no more requeues


def progress_mark(folder: Path) -> tuple:
    """How far a cell has got: its newest checkpoint's step, the bytes of its partial evaluation,
    its evaluation reports (a stop that changes none of these made no progress)."""
    steps = [int(p.name.split("-")[1]) for p in (folder / "run").glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    partial = sum(p.stat().st_size for p in (folder / "eval").glob("*.partial.jsonl"))
    return max(steps, default=0), partial, len(list((folder / "eval").glob("eval_*.json")))


def _stalls(before: int, marks: list, now: list, names: str) -> int | None:
    """The stalled jobs in a row once this one stops: 0 when a cell moved since it started. None
    (do not requeue) at MAX_STALLS: a job that can never reach a step boundary and its checkpoint
    inside --time would be requeued forever."""
    if any(mark is None or mark != new for mark, new in zip(marks, now, strict=True)):
        return 0
    if before + 1 >= MAX_STALLS:
        print(f"{names}: {before + 1} jobs in a row stopped without a new checkpoint or evaluated sample: not "
              "requeued (a step and its checkpoint may not fit in --time: raise it)", flush=True)
        return None
    return before + 1


def _say_code(names: str, code_dir: str | None) -> None:
    """Where this job's code comes from: the grid's snapshot (the job's working folder, first on the import path)."""
    import opsd

    print(f"{names}: the grid's code {code_dir or '(the checkout)'}; opsd imported from "
          f"{Path(opsd.__file__).resolve().parent}", flush=True)


def _code_of(job) -> dict:
    """run_cell's code arguments from a job: the snapshot the grid made when it submitted it (a job
    pickled by an older version has none: the checkout)."""
    code_dir = getattr(job, "code_dir", None)
    return {"code": getattr(job, "code", None), **({"code_dir": Path(code_dir)} if code_dir else {})}


def _stop_for_requeue(children: dict) -> None:
    """SIGTERM to each running child's trainers (a training stops at its step boundary with a
    checkpoint), then wait for the children together, at most CHECKPOINT_WAIT_S; what is left then
    is killed."""
    running = {name: child for name, child in children.items() if child is not None and child.poll() is None}
    for name, child in running.items():
        print(f"{name}: stopping at a step boundary with a checkpoint before the requeue", flush=True)
        for pid in stop_targets(child):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + CHECKPOINT_WAIT_S
    for child in running.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            kill_tree(child.pid)


def stop_targets(child) -> list[int]:
    """Where a stop signal goes: a multi-process cell's ranks (its launcher's children), not the
    launcher, which once signalled SIGKILLs its ranks after its grace: 30 s on torch 2.11, the GPU
    stack's pin, whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT says. Told directly, the ranks take the time
    their step and checkpoint need (up to CHECKPOINT_WAIT_S) and then end, and the launcher with
    them. A one-process cell (or a launcher with no rank yet): the child itself."""
    command = child.args if isinstance(child.args, (list, tuple)) else [child.args]
    if "accelerate.commands.launch" in map(str, command):
        ranks = _children(child.pid)
        if ranks:
            return ranks
    return [child.pid]


def _children(pid: int) -> list[int]:
    """The processes `pid` started (/proc/PID/task/*/children), none once it is gone."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through /proc/PID/task/*/children): a
    multi-GPU cell's ranks run in sessions of their own, so killing the launcher's group misses them."""
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (read before the kill: orphans are re-parented)."""
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SlurmPack:
    """Several cells in one SLURM job, on one node (--cells-per-node): the job takes their GPUs (or
    CPUs) and runs them side by side in the local pool (opsd/research/executors.py run_pooled, each cell
    its own GPUs, as on one machine). A preemption or the time limit stops every running cell with a
    checkpoint and requeues the job; the requeued job runs the cells not done yet, each resuming."""

    def __init__(self, grid_file: str, out: str, names: list[str], gpus_per_cell: int, cells_per_node: int,
                 code: str | None = None, code_dir: str | None = None, stalls: int = 0):
        self.grid_file, self.out, self.names, self.gpus_per_cell = grid_file, out, list(names), gpus_per_cell
        self.code, self.code_dir = code, code_dir  # the grid's code snapshot (opsd.research.cell.snapshot_code)
        self.cells_per_node = cells_per_node  # what the job was sized for (its cells): a cell's share of its CPUs
        self.stalls = stalls
        self._children: dict = {}
        self._stopping, self._marks = False, None

    def __getstate__(self):
        return {**self.__dict__, "_children": {}, "_stopping": False, "_marks": None}

    def __call__(self) -> str:
        self._marks = [progress_mark(Path(self.out) / name) for name in self.names]
        _say_code(", ".join(self.names), self.code_dir)
        grid = load_grid(self.grid_file)
        todo = [c for c in cells(grid, Path(self.out)) if c.name in self.names]
        per = self.gpus_per_cell
        visible = executors.visible_gpus()
        if len(visible) < per:
            raise RuntimeError(f"{', '.join(self.names)}: asked for {per} GPU(s) a cell, the job sees {len(visible)}")
        slots = executors.gpu_slots(visible, per, 1) if per else []
        cpus, _ = given_cpus(per)
        # a cell's share of the job's CPUs, also when fewer cells are left (a resubmission): the
        # thread count, which floating-point sums depend on, is the same wherever a cell runs
        threads = max(1, cpus // (self.cells_per_node * max(1, per)))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        print(f"{len(todo)} cell(s) on this node: {', '.join(self.names)}; GPUs {','.join(visible[:len(todo) * per])}"
              f" ({per} a cell); {cpus} CPUs, {threads} thread(s) a process", flush=True)

        def one(cell, _index, slot):
            if self._stopping:
                return "failed: the job is being requeued"
            try:
                return run_cell(grid, cell, lambda message: print(message, flush=True),
                                gpus=slot if per else (), port=None, started=lambda child: self._started(cell, child),
                                **_code_of(self))
            except Exception as exc:  # noqa: BLE001  (one cell's error is its failure, not its neighbours')
                return f"failed: {type(exc).__name__}: {exc}"

        outcomes = executors.run_pooled(todo, one, slots, len(todo))
        failed = [f"{cell.name}: {outcome}" for cell, outcome in zip(todo, outcomes, strict=True)
                  if outcome.startswith("failed")]
        if failed:
            raise RuntimeError("; ".join(failed))
        return "done"

    def _started(self, cell, child) -> None:
        if self._stopping:  # a step that starts while the job is being requeued does not run
            child.kill()
        self._children[cell.name] = child

    def checkpoint(self, *args, **kwargs):
        import submitit

        self._stopping = True
        _stop_for_requeue(dict(self._children))
        now = [progress_mark(Path(self.out) / name) for name in self.names]
        stalls = _stalls(self.stalls, self._marks or [None] * len(now), now, ", ".join(self.names))
        if stalls is None:
            return None  # submitit: not requeued; the job ends failed and the grid's tries apply
        return submitit.helpers.DelayedSubmission(
            SlurmPack(self.grid_file, self.out, self.names, self.gpus_per_cell, self.cells_per_node, self.code,
                      self.code_dir, stalls))


CHECKPOINT_WAIT_S = 100  # a capped step and a checkpoint save, well inside the signal's 120 s lead


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _options(args) -> executors.SlurmOptions:
    gpus = 1 if args.gpus_per_cell is None else args.gpus_per_cell
    cpus = args.cpus_per_cell
    if cpus is None:
        cpus = executors.default_cpus_per_cell(args.partition, gpus)
    return executors.SlurmOptions(
        partition=args.partition, time_min=args.time, gpus_per_cell=gpus, cpus_per_cell=cpus,  # a cell's
        mem_gb=args.mem_per_cell, account=args.account, qos=args.qos,
        sbatch=executors.parse_sbatch_options(args.sbatch), array_parallelism=args.parallel)


# sbatch's words for a controller that is busy or restarting, not for a refusal: asked again.
TRANSIENT_SBATCH = re.compile(r"socket timed out|unable to contact slurm controller|temporarily unavailable|"
                              r"try again|connection refused|slurm_receive_msg|communication connection failure",
                              re.IGNORECASE)


def job_name(out: Path) -> str:
    """The SLURM job name of a grid folder's jobs: its name and a hash of its path, so that two grid
    folders of one name elsewhere are told apart."""
    return f"grid-{out.name}-{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:6]}"


def orphan_jobs(out: Path, jobs: dict, run=subprocess.run) -> list[str]:
    """This folder's jobs (by job name) that SLURM holds but slurm_jobs.json does not list: submitted
    by a grid that ended before it recorded them. Submitting again would run their cells twice."""
    try:
        listing = run(["squeue", "--noheader", "--array", "--name", job_name(out), "--format=%i"],
                      capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    known = {job.split("_")[0] for job in jobs.values()}
    return sorted(job for job in listing.stdout.split() if job.split("_")[0] not in known)


def run_on_slurm(grid: Grid, grid_file: str, todo: list[Cell], out: Path, args, log, code: str | None = None,
                 code_dir: Path | None = None) -> dict[str, str] | None:
    """Submit the cells not already queued as job arrays (split at the cluster's MaxArraySize);
    unless --no-wait, wait with progress, resubmitting once each cell that failed (excluding the node
    it failed on), inside the --parallel limit. A cancelled cell (`cancel`, scancel) is never
    resubmitted by the waiting grid, nor by a re-run unless --resubmit-cancelled; a cell that failed
    twice (slurm_tries.json) only with --retry-failed. Returns {cell name: outcome}, or None (--no-wait)."""
    options = _options(args)
    jobs_file = out / JOBS_FILE
    fresh = not jobs_file.is_file() and not any(out.glob("*/cell.json")) and not any(out.glob("*/*/cell.json"))
    jobs = _read_json(jobs_file)
    watch = executors.SlurmWatch()
    known = watch.states([jobs[c.name] for c in todo if c.name in jobs])
    waiting = {c.name: jobs[c.name] for c in todo if c.name in jobs and jobs[c.name] in known
               and not known[jobs[c.name]].ended}
    if waiting:
        log(f"{len(waiting)} cell(s) still queued from an earlier submission: {', '.join(sorted(waiting))}")
    outcomes, cancelled = _cancelled_before(todo, out, jobs, waiting, known, args, log)
    tries = Tries(out)
    outcomes.update(_failed_before(todo, out, jobs, {**waiting, **dict.fromkeys(cancelled)}, known, outcomes, tries,
                                   args, log))
    copy = out / "grid.json"  # the grid as last submitted, for `status`
    write_text_atomic(copy, Path(grid_file).read_text(encoding="utf-8"))
    frozen = _freeze_grid(out, copy)  # what the jobs read: never rewritten, whatever a re-run writes
    if stray := orphan_jobs(out, jobs):  # a grid killed between sbatch and writing slurm_jobs.json
        raise executors.ExecutorError(
            f"{len(stray)} job(s) named {job_name(out)} are queued or running that {jobs_file} does not list "
            f"({', '.join(stray[:4])}{', ...' if len(stray) > 4 else ''}; a grid stopped while it submitted?): "
            f"`scancel --name {job_name(out)}`, or wait for them to end, then re-run")
    submitter = _Submitter(out, options, args, jobs, tries, log, frozen, code, code_dir)
    backlog = [c.name for c in todo if c.name not in waiting and c.name not in outcomes]
    try:
        free = len(backlog) if not args.parallel else max(0, args.parallel - len(waiting))  # cells, not jobs
        submitter.submit_retrying(backlog[:free])
        backlog = backlog[free:]
    except executors.ExecutorError:
        if fresh:  # nothing ran: leave no half-made grid folder behind
            _remove_fresh_folder(out)
        raise
    if args.no_wait:
        held = (f"; {len(backlog)} cell(s) wait for a --parallel slot: re-running the same command submits them "
                "as cells end" if backlog else "")
        log(f"not waiting (--no-wait): re-run the same command to collect the results and resubmit failed cells"
            f"{held}; `python -m opsd.research.grid status {out}` shows each cell; logs under {out / 'slurm'}")
        return None
    return _wait(todo, out, args, log, jobs, outcomes, backlog, watch, submitter, tries)


def _cancelled_before(todo, out, jobs, waiting, known, args, log) -> tuple[dict[str, str], list[str]]:
    """Outcomes of the cells whose last job was cancelled (none with --resubmit-cancelled, which
    resubmits them), and those cells."""
    marks_file = out / CANCELLED_FILE
    marks = _read_json(marks_file)
    was_cancelled = [c.name for c in todo if c.name not in waiting
                     and _cancelled(out, c.name, jobs.get(c.name), marks, known.get(jobs.get(c.name)))]
    if was_cancelled and getattr(args, "resubmit_cancelled", False):
        log(f"resubmitting {len(was_cancelled)} cancelled cell(s) (--resubmit-cancelled): {', '.join(was_cancelled)}")
        for name in was_cancelled:
            marks.pop(name, None)
        write_text_atomic(marks_file, json.dumps(marks, indent=1) + "\n")
        return {}, was_cancelled
    return {name: f"cancelled (job {jobs.get(name, UNSUBMITTED)}); re-run with --resubmit-cancelled"
            for name in was_cancelled}, was_cancelled


def _failed_before(todo, out, jobs, skip, known, outcomes, tries, args, log) -> dict[str, str]:
    """A re-run counts the failures of the jobs that ended while no grid waited (slurm_tries.json
    keeps them), and reports the cells that failed MAX_TRIES times instead of submitting them again,
    unless --retry-failed (which starts their count afresh)."""
    for cell in todo:
        job = jobs.get(cell.name)
        if cell.name in skip or cell.name in outcomes or job is None or tries.recorded(cell.name, job):
            continue
        if _requeue_refused(out, job) is None:  # a job stopped for a requeue SLURM refused did not fail
            tries.record(cell.name, job, _job_node(out, job, known.get(job)))
    spent = [c.name for c in todo if c.name not in skip and c.name not in outcomes
             and tries.count(c.name) >= MAX_TRIES]
    if spent and getattr(args, "retry_failed", False):
        log(f"resubmitting {len(spent)} failed cell(s) (--retry-failed): {', '.join(spent)}")
        tries.reset(spent)
        return {}
    return {name: f"failed {tries.count(name)} times, not resubmitted (last: job {jobs[name]}: "
                  f"{_job_failure(out, jobs[name])}); re-run with --retry-failed to submit it again" for name in spent}


def _freeze_grid(out: Path, grid_file: Path) -> Path:
    """The grid file as submitted, under a name of its content's hash (out/slurm/grids/): a job that
    waits in the queue reads this, not grid.json, which a re-run with another grid rewrites."""
    text = grid_file.read_text(encoding="utf-8")
    frozen = out / "slurm" / "grids" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not frozen.is_file():
        frozen.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(frozen, text)
    return frozen


TRIES_FILE = "slurm_tries.json"  # cell -> its jobs that ended without results: kept across re-runs
MAX_TRIES = 2  # a cell's failed jobs before the grid stops resubmitting it (--retry-failed: again)


class Tries:
    """slurm_tries.json: {cell: [{"job": id, "node": host}, ...]}, each cell's jobs that ended
    without results (cancels and refused requeues aside), kept across re-runs: a loop around the
    grid does not resubmit a deterministic failure forever, and a resubmission excludes the nodes
    its cell failed on."""

    def __init__(self, out: Path):
        self.path = out / TRIES_FILE
        self.failed: dict[str, list[dict]] = _read_json(self.path)

    def count(self, name: str) -> int:
        return len(self.failed.get(name, []))

    def recorded(self, name: str, job: str) -> bool:
        return any(entry["job"] == job for entry in self.failed.get(name, []))

    def nodes(self, name: str) -> tuple[str, ...]:
        return tuple(sorted({entry["node"] for entry in self.failed.get(name, []) if entry.get("node")}))

    def record(self, name: str, job: str, node: str) -> None:
        if not self.recorded(name, job):
            self.failed.setdefault(name, []).append({"job": job, "node": node})
            self._write()

    def reset(self, names: list[str]) -> None:
        for name in names:
            self.failed.pop(name, None)
        self._write()

    def _write(self) -> None:
        write_text_atomic(self.path, json.dumps(self.failed, indent=1) + "\n")


class _Submitter:
    """Submits cells: in jobs of --cells-per-node cells (a pack sized to the cells it holds), arrays of
    at most MaxArraySize jobs, each excluding the nodes its cells failed on; records the job ids in
    slurm_jobs.json. An sbatch that times out may have been accepted: its job name is looked up in
    squeue before anything is submitted again."""

    def __init__(self, out, options, args, jobs, tries, log, frozen, code, code_dir):
        self.out, self.options, self.args, self.jobs, self.tries, self.log = out, options, args, jobs, tries, log
        self.frozen, self.code, self.code_dir = str(frozen), code, code_dir and str(code_dir)
        self.per_node = getattr(args, "cells_per_node", None) or 1  # cells a job: one, or a node's pack
        self.array_limit = executors.max_array_size() or 1000
        self._executors: dict = {}
        self._no_exclude: set = set()  # node sets sbatch refused to exclude (a partition of those nodes only)

    def executor(self, size: int, exclude: tuple[str, ...]):
        """The executor of jobs of `size` cells: size x a cell's GPUs, CPUs and memory."""
        if (size, exclude) not in self._executors:
            o = self.options
            options = dataclasses.replace(o, cpus_per_cell=o.cpus_per_cell and o.cpus_per_cell * size,
                                          mem_gb=o.mem_gb and o.mem_gb * size, exclude=exclude)
            self._executors[size, exclude] = executors.slurm_executor(
                self.out / "slurm", options, job_name(self.out), gpus_per_job=o.gpus_per_cell * size,
                code_dir=self.code_dir and Path(self.code_dir))
        return self._executors[size, exclude]

    def job_for(self, group: list[str]):
        if self.per_node == 1:
            return SlurmCell(self.frozen, str(self.out), group[0], self.options.gpus_per_cell, self.code, self.code_dir)
        return SlurmPack(self.frozen, str(self.out), group, self.options.gpus_per_cell, len(group), self.code,
                         self.code_dir)

    def submit(self, names: list[str]) -> None:
        """The cells in jobs of at most `per_node` cells, grouped by the nodes they exclude and by size,
        at most MaxArraySize jobs an array (a job alone: no array)."""
        by_exclude: dict[tuple, list[str]] = {}
        for name in names:
            by_exclude.setdefault(self.tries.nodes(name), []).append(name)
        for exclude, same in by_exclude.items():
            groups = [same[i:i + self.per_node] for i in range(0, len(same), self.per_node)]
            for size in sorted({len(g) for g in groups}, reverse=True):
                sized = [g for g in groups if len(g) == size]
                for first in range(0, len(sized), self.array_limit):
                    self._submit_chunk(sized[first:first + self.array_limit], size, exclude)

    def _submit_chunk(self, chunk: list[list[str]], size: int, exclude: tuple[str, ...]) -> None:
        if exclude in self._no_exclude:
            exclude = ()
        executor = self.executor(size, exclude)
        pickles = set((self.out / "slurm").glob("*.pkl"))
        try:
            with executor.batch():
                handles = [(group, executor.submit(self.job_for(group))) for group in chunk]
            submitted = [(group, handle.job_id) for group, handle in handles]
        except Exception as exc:  # submitit's FailedJobError, or sbatch missing: sbatch's own word
            message = str(exc).strip()
            if TRANSIENT_SBATCH.search(message):
                submitted = self._accepted_anyway(chunk, pickles, message.splitlines()[-1] if message else "")
            elif exclude:  # a partition of no other node: submitted without excluding them, said once
                self._no_exclude.add(exclude)
                self.log(f"sbatch refused to exclude node(s) {','.join(exclude)} "
                         f"({executors.sbatch_refusal(message, self.options)}): submitted without excluding them")
                return self._submit_chunk(chunk, size, ())
            else:
                raise executors.ExecutorError(
                    f"sbatch refused the job array: {executors.sbatch_refusal(message, self.options)}") from None
        for group, job_id in submitted:
            for name in group:
                self.jobs[name] = job_id
        write_text_atomic(self.out / JOBS_FILE, json.dumps(self.jobs, indent=1) + "\n")
        kind = "job array" if len(chunk) > 1 else "job"
        packed = f" ({size} cells a job, one node each)" if self.per_node > 1 else ""
        excluding = f", excluding node(s) {','.join(exclude)} where they failed" if exclude else ""
        listed = ", ".join(f"{name} {job_id}" for group, job_id in submitted for name in group)
        self.log(f"submitted {sum(len(g) for g, _ in submitted)} cell(s) as {kind} {submitted[0][1].split('_')[0]}"
                 f"{packed}{excluding}: {listed}")

    def _accepted_anyway(self, chunk: list[list[str]], pickles: set, said: str) -> list:
        """After an sbatch that timed out: the job(s) of this grid's name that SLURM accepted all the
        same, taken over (their pickles, which submitit had not moved yet, put where each job reads
        them) when they are this chunk; cancelled when they cannot be. TransientSbatchError when
        nothing is left to take over: submit again."""
        new = sorted(set((self.out / "slurm").glob("*.pkl")) - pickles)
        stray = orphan_jobs(self.out, self.jobs)
        taken = _take_over(self.out, stray, chunk, new) if stray else None
        if taken is None:
            for pickle in new:
                pickle.unlink(missing_ok=True)
            if stray:
                subprocess.run(["scancel", *sorted({job.split("_")[0] for job in stray})], capture_output=True,
                               timeout=120)
                self.log(f"sbatch timed out, but SLURM had accepted {', '.join(stray)} (named {job_name(self.out)}), "
                         "which the grid cannot take over: cancelled them; submitting again")
            raise TransientSbatchError(said)
        self.log(f"sbatch timed out ({said}), but SLURM had accepted the submission (its job name is in squeue): "
                 "taken over, not submitted again")
        return taken

    def submit_retrying(self, names: list[str]) -> None:
        before = dict(self.jobs)
        for attempt in range(1, SBATCH_TRIES + 1):
            try:
                return self.submit([n for n in names if self.jobs.get(n) == before.get(n)])  # not those already out
            except TransientSbatchError as exc:
                if attempt == SBATCH_TRIES:
                    raise executors.ExecutorError(f"sbatch failed {attempt} times in a row: {exc}") from None
                wait = min(SBATCH_RETRY_S, self.args.poll)
                self.log(f"sbatch failed ({exc}); trying again in {wait:.0f} s")
                time.sleep(wait)


def _take_over(out: Path, stray: list[str], chunk: list[list[str]], pickles: list[Path]) -> list | None:
    """[(cells, job id)] of an accepted job array (or job) that is `chunk`, each task's pickle moved to
    where its job reads it (a job waits 60 s for it); None when the jobs or pickles do not match."""
    import submitit
    from submitit.core.utils import DelayedSubmission

    arrays = {job.split("_")[0] for job in stray}
    if len(arrays) != 1 or len(stray) != len(chunk) or len(pickles) != len(chunk):
        return None
    (array,) = arrays
    ids = [array] if len(chunk) == 1 and "_" not in stray[0] else [f"{array}_{i}" for i in range(len(chunk))]
    if sorted(ids) != sorted(stray):
        return None
    by_cells = {}
    for pickle in pickles:
        function = DelayedSubmission.load(pickle).function
        names = getattr(function, "names", None) or [getattr(function, "name", None)]
        by_cells[tuple(names)] = pickle
    if sorted(by_cells) != sorted(tuple(group) for group in chunk):
        return None
    for group, job_id in zip(chunk, ids, strict=True):
        submitit.SlurmJob(folder=out / "slurm" / "%j", job_id=job_id).paths.move_temporary_file(
            by_cells[tuple(group)], "submitted_pickle")
    return list(zip(chunk, ids, strict=True))


class TransientSbatchError(Exception):
    """sbatch could not reach the controller (not a refusal): asked again."""


SBATCH_TRIES = 5  # a submission's tries when sbatch cannot reach the controller
SBATCH_RETRY_S = 10.0


def _remove_fresh_folder(out: Path) -> None:
    """What this grid wrote into a folder it found empty, when its first submission was refused."""
    import shutil

    for name in ("grid.json", ".grid.lock"):
        (out / name).unlink(missing_ok=True)
    for folder in ("slurm", SNAPSHOT_DIR):  # the job logs' folder; the code snapshot the jobs would have run
        shutil.rmtree(out / folder, ignore_errors=True)
    try:
        out.rmdir()
    except OSError:  # something else is there: left as it is
        pass


def _cancelled(out: Path, name: str, job_id: str | None, marks: dict, state) -> bool:
    """Whether the cell's last job was cancelled: marked by `cancel`, listed CANCELLED by squeue
    (or sacct), gone from the queue without having started (an array task cancelled while pending
    leaves squeue at once, with no log: no other end leaves a job unstarted), or its error log ends
    with SLURM's 'CANCELLED AT' line without another cause."""
    if name in marks and marks[name] in (job_id, UNSUBMITTED):
        return True
    if job_id is None:
        return False
    if state is not None:
        return state.state == "CANCELLED"
    log = _job_log(out, job_id)
    if not log.is_file() and not log.with_suffix(".out").is_file():
        return True
    return _job_cancelled(out, job_id)


# A job being requeued (at its time limit, preempted) can show an ended state, or none, for a moment
# under a busy controller: an end without results counts once still seen this many seconds later.
ENDED_CONFIRM_S = 5


def _unconfirmed_end(ended_since: dict, job: str) -> bool:
    """Whether `job`'s end without results is still to be confirmed (noting when it was first seen):
    True until it has been seen for ENDED_CONFIRM_S."""
    return time.monotonic() - ended_since.setdefault(job, time.monotonic()) < ENDED_CONFIRM_S


def _wait(todo, out, args, log, jobs, outcomes, backlog, watch, submitter, tries) -> dict[str, str]:
    pending = {c.name for c in todo} - set(outcomes)
    by_name = {c.name: c for c in todo}
    last, failures, said, refusal_said = None, 0, {}, False
    ended_since: dict[str, float] = {}  # job -> when first seen ended without results
    while pending:
        marks = _read_json(out / CANCELLED_FILE)  # `cancel` may have written it since
        try:
            if backlog:
                queued = watch.queued([jobs[n] for n in pending if n in jobs and n not in backlog])
                active = sum(1 for n in pending if n not in backlog and jobs.get(n) in queued)  # cells, not jobs
                free = max(0, args.parallel - active) if args.parallel else len(backlog)
                now = [n for n in backlog[:free] if not _cancelled(out, n, jobs.get(n), marks, None)]
                before = dict(jobs)
                try:
                    if now:
                        submitter.submit(now)
                finally:  # what went out leaves the backlog, also when a later array of it failed
                    backlog = [n for n in backlog if not (n in now and jobs.get(n) != before.get(n))]
            states = watch.states([jobs[n] for n in pending if n in jobs and n not in backlog])
            failures = 0
        except (executors.ExecutorError, OSError, subprocess.SubprocessError, TransientSbatchError) as exc:
            if isinstance(exc, executors.ExecutorError) and str(exc).startswith("sbatch refused"):
                raise
            failures += 1  # a busy controller times out now and then: keep waiting, up to a point
            if failures >= SQUEUE_FAILURES:
                raise executors.ExecutorError(f"squeue or sbatch failed {failures} times in a row: {exc}") from None
            log(f"squeue or sbatch failed ({exc}); asking again in {args.poll:.0f} s")
            time.sleep(args.poll)
            continue
        for name in sorted(pending):
            job = jobs.get(name) if name not in backlog else None
            state = states.get(job) if job else None
            cell = by_name[name]
            if name in backlog:
                if name in marks and marks[name] in (jobs.get(name), UNSUBMITTED):
                    outcomes[name] = "cancelled before it was (re)submitted; re-run with --resubmit-cancelled"
                    backlog.remove(name)
                    pending.discard(name)
                continue
            marked = marks.get(name) == job  # `cancel`: whether or not squeue shows the job ended yet
            if state is not None and not state.ended and not marked:
                ended_since.pop(job, None)
                if (stuck := never_starts(job, state)) is not None:  # held, or a limit that never clears
                    outcomes[name] = f"failed: {stuck}"  # the grid's last lines say it, one a cell
                    pending.discard(name)
                elif state.state == "RUNNING":
                    _say_progress(cell, job, state, said, log)
                continue
            if cell.report.is_file():
                outcomes[name] = "done"
                log(f"{name}: done (job {job})")
            elif not marked and _unconfirmed_end(ended_since, job):
                continue
            elif marked or _cancelled(out, name, job, marks, state):  # the user's word, not a failure to retry
                _mark_cancelled(out, {name: job})
                outcomes[name] = f"cancelled (job {job}); re-run with --resubmit-cancelled to run it again"
            elif (refused := _requeue_refused(out, job)) is not None:  # stopped with a checkpoint: no failure
                if not refusal_said:
                    refusal_said = True
                    log(f"SLURM refused to requeue job {job} from inside it ({refused}): on this cluster a cell that "
                        "reaches --time or is preempted ends there, and the grid resubmits it (it resumes from its "
                        "checkpoint; not counted as a failure)")
                log(f"{name}: job {job} stopped with a checkpoint; resubmitting it")
                backlog.append(name)
                continue
            else:
                node = _job_node(out, job, state)
                tries.record(name, job, node)
                if tries.count(name) < MAX_TRIES:
                    seen = state.state if state is not None else "no longer listed by squeue"
                    log(f"{name}: job {job} ended without results ({seen}; {_job_failure(out, job)}); resubmitting it "
                        "once"
                        + (f", excluding node {node}" if node else "") + ": it resumes from its last checkpoint")
                    backlog.append(name)
                    continue
                outcomes[name] = f"failed twice: {_job_failure(out, job)}"
            pending.discard(name)
        counts = [states[jobs[n]].state for n in pending  # a count of cells (a node's pack is one job)
                  if n not in backlog and jobs.get(n) in states and not states[jobs[n]].ended]
        counts += ["waiting for a --parallel slot"] * len(backlog)
        summary = ", ".join(f"{counts.count(s)} {s.lower()}" for s in sorted(set(counts)))
        line = f"slurm: {len(outcomes)} of {len(todo)} cell(s) ended" + (f"; {summary}" if summary else "")
        if line != last:
            log(line)
            last = line
        watched = {jobs[n] for n in pending if n in jobs and n not in backlog}
        ended_since = {job: t for job, t in ended_since.items() if job in watched}
        if pending:
            time.sleep(min(args.poll, 1) if ended_since else args.poll)
    return outcomes


# Why a pending job waits that clears only by someone's hand: holds, and limits the job is above
# for good (a partition's MaxTime, a per-job maximum of its account or QOS). squeue's %r words.
HELD = {"JobHeldUser": "held by its user", "JobHeldAdmin": "held by an administrator (or root)",
        "job requeued in held state": "requeued and held (REQUEUE_HOLD: `scontrol requeuehold`, or after launch "
                                      "failures)",
        "launch failed requeued held": "requeued and held after its launch failed (REQUEUE_HOLD)"}
NEVER_CLEARS = re.compile(r"^(PartitionTimeLimit|PartitionNodeLimit|InvalidAccount|InvalidQOS|BadConstraints|"
                          r"DependencyNeverSatisfied|(Assoc|QOS)Max\w*PerJob\w*)$")


def never_starts(job: str, state, run=subprocess.run) -> str | None:
    """One line for a pending job that will not start by itself (held, SPECIAL_EXIT, or a limit
    that never clears): its reason and what to do; None for a job that will start in time."""
    release = f"`scontrol release {job}`, then re-run the grid to wait for it"
    if state.state == "SPECIAL_EXIT":
        return (f"job {job} is held in SPECIAL_EXIT (requeued by an epilog or an administrator): see "
                f"`scontrol show job {job}`, then {release}")
    if state.reason in HELD:
        where = f" on {state.node}" if state.node else ""
        check = f"check its node{where} (`scontrol show job {job}`), then " if "launch" in state.reason else ""
        return f"job {job} will not start: {HELD[state.reason]} ({state.reason}); {check}{release}"
    if not NEVER_CLEARS.match(state.reason or ""):
        return None
    fix = "`python -m opsd.research.grid cancel DIR`, then re-run with --resubmit-cancelled and "
    if state.reason == "PartitionTimeLimit":
        partition, limit = _partition_time_limit(job, run)
        return (f"job {job} will not start: its --time is above partition {partition}'s time limit ({limit}, "
                f"PartitionTimeLimit); {fix}--time at most that, or another --partition")
    return (f"job {job} will not start: it asks for more than {state.reason} allows; {fix}options within that "
            "limit (`scontrol show job` and your site's limits say which)")


def _partition_time_limit(job: str, run=subprocess.run) -> tuple[str, str]:
    """(the job's partition, its MaxTime as sinfo writes it), '?' where SLURM does not say."""
    try:
        partition = run(["squeue", "--noheader", "--jobs", job, "--format=%P"], capture_output=True, text=True,
                        timeout=60).stdout.strip() or "?"
        limit = run(["sinfo", "--noheader", "--partition", partition, "--format=%l"], capture_output=True, text=True,
                    timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "?", "?"
    return partition, (limit[0] if limit else "?")


def _requeue_refused(out: Path, job: str) -> str | None:
    """What the job's log says when submitit's requeue from inside the job failed (`scontrol
    requeue` refused, or no scontrol on the node): scontrol's own error line; None otherwise."""
    log_path = _job_log(out, job)
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    if "No such file or directory: 'scontrol'" in text:
        return "no scontrol on the node"
    if "['scontrol', 'requeue'" not in text:
        return None
    said = [line.strip() for line in text.splitlines() if "scontrol" in line.lower() and "error" in line.lower()
            and "CalledProcessError" not in line and "['scontrol'" not in line]
    return f"`scontrol requeue`: {said[-1][:200]}" if said else "`scontrol requeue` failed"


def _job_node(out: Path, job: str, state) -> str:
    """The node a job ran on: squeue's, else the host submitit's log names; '' when unknown."""
    if state is not None and state.node:
        return state.node
    log_path = _job_log(out, job)
    found = re.search(r"JobEnvironment\(job_id=[^,]*, hostname=([^,)\s]+)",
                      log_path.read_text(errors="replace") if log_path.is_file() else "")
    return found.group(1) if found else ""


def _say_progress(cell: Cell, job: str, state, said: dict, log) -> None:
    """A running cell's line when its progress changed: where it runs and its step from its log."""
    line = f"{cell.name}: running on {state.node or '?'} (job {job})" + _progress(cell)
    if said.get(cell.name) != line:
        said[cell.name] = line
        log(line)


def _progress(cell: Cell) -> str:
    """'; train 3/8, about 0:12 left (log PATH)' from the newest of the cell's logs, or ''."""
    from opsd.research.cell import log_progress  # the local pool's progress reader, the same words

    logs = [p for p in (cell.folder / "train.log", cell.folder / "eval.log") if p.is_file()]
    if not logs:
        return ""
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    step = log_progress(newest)
    return f"; {newest.stem} {step} (log {newest})" if step else f"; {newest.stem} starting (log {newest})"


def _mark_cancelled(out: Path, cancelled: dict[str, str]) -> None:
    marks = _read_json(out / CANCELLED_FILE)
    marks.update(cancelled)
    write_text_atomic(out / CANCELLED_FILE, json.dumps(marks, indent=1) + "\n")


# --------------------------------------------------------------------------
# python -m opsd.research.grid status DIR / cancel DIR
# --------------------------------------------------------------------------

def _grid_cells(out: Path) -> list[Cell]:
    """The grid folder's cells: those of the grid it was submitted with (grid.json), else of the
    cell.json files it holds (a grid run here)."""
    if (out / "grid.json").is_file():
        return cells(load_grid(str(out / "grid.json")), out)
    from opsd.research.cell import Arm

    found = []
    for path in sorted(out.glob("*/cell.json")) + sorted(out.glob("*/seed-*/cell.json")):
        identity = json.loads(path.read_text(encoding="utf-8"))
        found.append(Cell(Arm(identity["arm"], train=identity.get("seed") is not None), identity.get("seed"),
                          path.parent))
    return found


def _local_runner(cell: Cell) -> str | None:
    """'HOST (PID N)' of the live process that holds the cell's lock (opsd.research.cell.run_cell: a grid
    running here), None when no live process holds it."""
    from opsd.run_folder import RunFolderError, RunLock

    lock = RunLock(str(cell.folder))
    owner = lock._owner()
    if owner is None:
        return None
    try:
        lock.check()  # RunFolderError: a live process holds it
    except RunFolderError:
        return f"{owner[1]} (PID {owner[0]})"
    return None


def cell_states(out: Path, watch=None) -> list[tuple[str, str, str]]:
    """[(cell, its state word, the rest of its line)]: done, running, pending, cancelled, failed,
    not started (or, without a SLURM job, not finished)."""
    jobs, marks = _read_json(out / JOBS_FILE), _read_json(out / CANCELLED_FILE)
    tries = Tries(out)
    found = _grid_cells(out)
    states = (watch or executors.SlurmWatch()).states([jobs[c.name] for c in found if c.name in jobs]) if jobs else {}
    rows = []
    for cell in found:
        job = jobs.get(cell.name)
        state = states.get(job) if job else None
        nodes = tries.nodes(cell.name)
        excluding = (f"; resubmitted excluding node(s) {','.join(nodes)}, where job(s) "
                     f"{', '.join(e['job'] for e in tries.failed[cell.name] if e.get('node'))} failed" if nodes else "")
        if cell.report.is_file():
            rows.append((cell.name, "done", f"{cell.report}"))
        elif _cancelled(out, cell.name, job, marks, state):
            rows.append((cell.name, "cancelled", (f"job {job}" if job else "never submitted")
                         + "; resubmit: re-run the grid with --resubmit-cancelled"))
        elif state is not None and state.state in ("RUNNING", "COMPLETING"):
            rows.append((cell.name, "running", f"on {state.node or '?'} (job {job}){_progress(cell)}{excluding}"))
        elif state is not None and not state.ended and (stuck := never_starts(job, state)) is not None:
            rows.append((cell.name, "held", stuck))
        elif state is not None and not state.ended:
            reason = f", {state.reason}" if state.reason else ""
            rows.append((cell.name, state.state.lower(), f"job {job}{reason}{excluding}"))
        elif job is not None:
            ended = state.state if state is not None else "ended"
            again = (f"; failed {tries.count(cell.name)} times: re-run the grid with --retry-failed to submit it again"
                     if tries.count(cell.name) >= MAX_TRIES else "")
            rows.append((cell.name, "failed", f"job {job} {ended} without results: {_job_failure(out, job)}{again}"))
        elif (runner := _local_runner(cell)) is not None:
            rows.append((cell.name, "running", f"on {runner}{_progress(cell)}"))
        elif (cell.folder / "train.log").is_file() or (cell.folder / "eval.log").is_file():
            rows.append((cell.name, "not finished", f"no SLURM job{_progress(cell)}"))
        else:
            rows.append((cell.name, "not started", ""))
    return rows


def status(out: Path) -> int:
    rows = cell_states(out)
    words = [word for _, word, _ in rows]
    print(f"{out}: {len(rows)} cell(s): " + ", ".join(f"{words.count(w)} {w}" for w in dict.fromkeys(words)))
    for name, word, rest in rows:
        print(f"{name}: {word}" + (f" {rest}" if rest and word == 'running' else f" ({rest})" if rest else ""))
    return 0


def cancel(out: Path) -> int:
    """scancel every job of the grid that SLURM still holds and mark its cell cancelled (and the
    cells not submitted yet), so that a waiting grid stops and a re-run does not resubmit them."""
    jobs = _read_json(out / JOBS_FILE)
    found = _grid_cells(out)
    queued = executors.SlurmWatch().queued([jobs[c.name] for c in found if c.name in jobs])
    live = {c.name: jobs[c.name] for c in found if jobs.get(c.name) in queued}
    if live:
        done = subprocess.run(["scancel", *sorted(set(live.values()))], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise executors.ExecutorError(f"scancel failed: {done.stderr.strip() or done.returncode}")
    # Every unfinished cell, also one whose job ended (a waiting grid may be about to resubmit it)
    # or that was never submitted (waiting for a --parallel slot).
    rest = {c.name: jobs.get(c.name, UNSUBMITTED) for c in found if c.name not in live and not c.report.is_file()}
    _mark_cancelled(out, {**live, **rest})
    listed = ": " + ", ".join(f"{n} {j}" for n, j in sorted(live.items())) if live else ""
    print(f"cancelled {len(live)} job(s){listed}" + (f"; {len(rest)} more unfinished cell(s) marked cancelled"
                                                       if rest else ""))
    print("a grid waiting for them stops at its next check; re-run the grid with --resubmit-cancelled "
          "to run them again")
    return 0


COMMANDS = ("status", "cancel")


def command(argv: list[str], prog: str = "python -m opsd.research.grid") -> int:
    """`python -m opsd.research.grid status DIR` / `cancel DIR` (`prog`: the grid command's name, `opsd grid`)."""
    import argparse

    name = argv[0]
    parser = argparse.ArgumentParser(prog=f"{prog} {name}", description=(
        "each cell of a grid folder: done / running where / pending / failed (with its log) / cancelled"
        if name == "status" else
        "scancel the grid's jobs and mark their cells cancelled (a waiting grid stops; a re-run resubmits them "
        "only with --resubmit-cancelled)"))
    parser.add_argument("out", metavar="DIR", help="the grid folder (--out of the grid)")
    args = parser.parse_args(argv[1:])
    out = Path(args.out).resolve()
    try:
        if not out.is_dir():
            raise GridError(f"{args.out}: no such grid folder")
        if not (out / "grid.json").is_file() and not (out / JOBS_FILE).is_file() and not _grid_cells(out):
            raise GridError(f"{args.out}: not a grid folder (no grid.json, {JOBS_FILE} or cell folders)")
        if name == "cancel" and not (out / JOBS_FILE).is_file():
            raise GridError(f"{args.out}: no SLURM jobs to cancel (no {JOBS_FILE}: a grid run here stops with Ctrl-C)")
        return status(out) if name == "status" else cancel(out)
    except (GridError, executors.ExecutorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


SQUEUE_FAILURES = 10  # consecutive failed queue reads before the wait gives up


def _job_log(out: Path, job_id: str) -> Path:
    """A job's error log, where submitit's sbatch script sends it (an array task's id is 'A_T')."""
    return out / "slurm" / job_id / f"{job_id}_0_log.err"


def _job_cancelled(out: Path, job_id: str) -> bool:
    """Whether scancel (or an admin) ended the job: SLURM's last 'CANCELLED AT' line in its error
    log gives no other cause ('DUE TO JOB REQUEUE', 'DUE TO TIME LIMIT', ... are not cancels)."""
    log_path = _job_log(out, job_id)
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    lines = [line for line in text.splitlines() if "CANCELLED AT" in line]
    return bool(lines) and "DUE TO" not in lines[-1]


def _job_failure(out: Path, job_id: str) -> str:
    """What a job left about its end, with its log's path: the cell's own failure line (it names the
    cell's train.log or eval.log) when it got that far, else the log's last line (killed, ...)."""
    log_path = _job_log(out, job_id)
    lines = [line.strip() for line in (log_path.read_text(errors="replace").splitlines() if log_path.is_file() else [])
             if line.strip()]
    ours = [line.split(": ", 2)[-1] for line in lines if line.startswith("RuntimeError: ")]
    return f"{(ours or lines or ['no error log'])[-1][:300]}; log {log_path}"
