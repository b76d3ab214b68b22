"""A research grid on a SLURM cluster: the cells as one job array through submitit, each job one
cell (`SlurmCell`), the grid waiting with progress, resubmitting a failed cell once.

research/grid.py calls `run_on_slurm`; what a cell is and how it runs is research/cell.py's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from opsd.run_folder import write_text_atomic
from research import executors
from research.cell import Cell, Grid, cells, load_grid, run_cell


class SlurmCell:
    """One cell as a SLURM job (submitit pickles this object and calls it on the node). When SLURM
    preempts the job or its time limit nears, submitit calls `checkpoint`: the training stops at a
    step boundary with a checkpoint (SIGTERM), and the requeued job resumes from it."""

    def __init__(self, grid_file: str, out: str, name: str, gpus_per_cell: int):
        self.grid_file, self.out, self.name, self.gpus_per_cell = grid_file, out, name, gpus_per_cell
        self._child = None

    def __getstate__(self):
        return {**self.__dict__, "_child": None}

    def __call__(self) -> str:
        grid = load_grid(self.grid_file)
        (cell,) = [c for c in cells(grid, Path(self.out)) if c.name == self.name]
        gpus = tuple(executors.visible_gpus()[:self.gpus_per_cell]) if self.gpus_per_cell else ()
        if len(gpus) < self.gpus_per_cell:
            raise RuntimeError(f"{self.name}: asked for {self.gpus_per_cell} GPU(s), the job sees {len(gpus)}")
        port = 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000  # cells of one node must not share one
        outcome = run_cell(grid, cell, lambda message: print(message, flush=True), gpus=gpus, port=port,
                           started=self._started)
        if outcome.startswith("failed"):
            raise RuntimeError(f"{self.name}: {outcome}")
        return outcome

    def _started(self, child) -> None:
        self._child = child

    def checkpoint(self, *args, **kwargs):
        import submitit

        child = self._child
        if child is not None and child.poll() is None:
            print(f"{self.name}: stopping at a step boundary with a checkpoint before the requeue", flush=True)
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=CHECKPOINT_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
        return submitit.helpers.DelayedSubmission(SlurmCell(self.grid_file, self.out, self.name, self.gpus_per_cell))


CHECKPOINT_WAIT_S = 100  # a capped step and a checkpoint save, well inside the signal's 120 s lead


def run_on_slurm(grid: Grid, grid_file: str, todo: list[Cell], out: Path, args, log) -> dict[str, str] | None:
    """Submit the cells not already queued as one job array; unless --no-wait, wait with progress
    and resubmit once each cell that failed. Returns {cell name: outcome}, or None (--no-wait)."""
    options = executors.SlurmOptions(
        partition=args.partition, time_min=args.time,
        gpus_per_cell=1 if args.gpus_per_cell is None else args.gpus_per_cell,
        cpus_per_cell=args.cpus_per_cell, mem_gb=args.mem_per_cell, account=args.account, qos=args.qos,
        sbatch=executors.parse_sbatch_options(args.sbatch), array_parallelism=args.parallel)
    copy = out / "grid.json"  # what the jobs read: the grid as submitted, whatever happens to GRID.json
    write_text_atomic(copy, Path(grid_file).read_text(encoding="utf-8"))
    jobs_file = out / "slurm_jobs.json"  # cell -> its last job id: a re-run waits for queued ones
    jobs = json.loads(jobs_file.read_text(encoding="utf-8")) if jobs_file.is_file() else {}
    watch = executors.SlurmWatch()
    queued = watch.queued([jobs[c.name] for c in todo if c.name in jobs])
    waiting = {c.name: jobs[c.name] for c in todo if jobs.get(c.name) in queued}
    if waiting:
        log(f"{len(waiting)} cell(s) still queued from an earlier submission: {', '.join(sorted(waiting))}")
    executor = executors.slurm_executor(out / "slurm", options, f"grid-{out.name}")

    def submit(names: list[str]) -> None:
        if not names:
            return
        try:
            with executor.batch():
                handles = {name: executor.submit(SlurmCell(str(copy), str(out), name, options.gpus_per_cell))
                           for name in names}
        except Exception as exc:  # submitit's FailedJobError, or sbatch missing: sbatch's own last word
            said = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise executors.ExecutorError(f"sbatch refused the job array: {said[-1] if said else exc}") from None
        for name, job in handles.items():
            jobs[name] = job.job_id
        write_text_atomic(jobs_file, json.dumps(jobs, indent=1) + "\n")
        kind = "job array" if len(names) > 1 else "job"
        log(f"submitted {len(names)} cell(s) as {kind} {next(iter(handles.values())).job_id.split('_')[0]}: "
            + ", ".join(f"{name} {handles[name].job_id}" for name in names))

    submit([c.name for c in todo if c.name not in waiting])
    if args.no_wait:
        log(f"not waiting (--no-wait): re-run the same command to collect the results and resubmit failed cells; "
            f"logs under {out / 'slurm'}")
        return None
    outcomes: dict[str, str] = {}
    tries = {name: 1 for name in jobs}
    pending = {c.name for c in todo}
    last = None
    failures = 0
    while pending:
        try:
            queued = watch.queued([jobs[name] for name in pending])
            failures = 0
        except (executors.ExecutorError, OSError, subprocess.SubprocessError) as exc:
            failures += 1  # a busy controller times out now and then: keep waiting, up to a point
            if failures >= SQUEUE_FAILURES:
                raise executors.ExecutorError(f"squeue failed {failures} times in a row: {exc}") from None
            log(f"squeue failed ({exc}); asking again in {args.poll:.0f} s")
            time.sleep(args.poll)
            continue
        for name in sorted(pending):
            if jobs[name] in queued:
                continue
            cell = next(c for c in todo if c.name == name)
            if cell.report.is_file():
                outcomes[name] = "done"
                log(f"{name}: done (job {jobs[name]})")
            elif _job_cancelled(out, jobs[name]):  # scancel: the user's word, not a failure to retry
                outcomes[name] = f"failed: cancelled ({_job_failure(out, jobs[name])}); re-run the grid to resubmit it"
            elif tries[name] < 2:
                log(f"{name}: job {jobs[name]} ended without results ({_job_failure(out, jobs[name])}); resubmitting "
                    "it once: it resumes from its last checkpoint")
                tries[name] += 1
                submit([name])
                continue
            else:
                outcomes[name] = f"failed twice: {_job_failure(out, jobs[name])}"
            pending.discard(name)
        states = sorted(queued.values())
        summary = ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states)))
        line = f"slurm: {len(outcomes)} of {len(todo)} cell(s) ended" + (f"; {summary}" if summary else "")
        if line != last:
            log(line)
            last = line
        if pending:
            time.sleep(args.poll)
    return outcomes


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
