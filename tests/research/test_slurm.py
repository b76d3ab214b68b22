"""Grids and runs beyond one machine, against a real SLURM cluster (`.ci/slurm.sh up` starts a
single-node one; `pytest -m slurm` runs these alone):

- a grid through SLURM (submitit job arrays) gives the results of the local executor (its run of
  the same grid, in its GPU pool on fake GPU ids, is tests/research/test_grid.py's);
- a cell that SLURM preempts (submitit's USR2) checkpoints, is requeued and resumes; a cell whose
  training process is killed is resubmitted and resumes; both end with the uninterrupted cell's
  results; a cell that fails twice is reported with its log, and the table says it is missing;
- two SLURM tasks as two accelerate machines (CPU ranks over gloo): train_capped.sh runs the
  tiny preset across them, and the launch it uses gives one process's loss and gradients.

Without `sbatch` on PATH, or with no SLURM controller answering, every test here skips.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from test_ddp import one_process_step  # noqa: E402,F401  (a fixture: one process at twice the accumulation)


def _slurm_answers() -> str | None:
    """None when a SLURM cluster answers here, else why not."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no sbatch on PATH (`bash .ci/slurm.sh up` starts a single-node cluster, as root)"
    try:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no SLURM controller answers: {exc}"
    if state.returncode != 0 or not state.stdout.strip():
        return f"no SLURM controller answers: {state.stderr.strip()[:200]}"
    return None


NO_SLURM = _slurm_answers()
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))]

from grid_cases import CELLS, GRID  # noqa: E402  (conftest.py's local_grid: the local executor's run of GRID)


def grid_run(grid: dict, folder: Path, *flags, env=None, wait=True):
    """python -m research.grid on `grid` (written to folder/GRID.json) into folder/out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "GRID.json").write_text(json.dumps(grid))
    command = [sys.executable, "-m", "research.grid", str(folder / "GRID.json"), "--out", str(folder / "out"), *flags]
    run = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if not wait:
        return run
    output = run.communicate(timeout=1200)[0]
    return run.returncode, output


def finished(run) -> tuple[int, str]:
    output = run.communicate(timeout=1200)[0]
    return run.returncode, output


def outcome(cell: Path) -> dict:
    """What a cell's results are: its evaluation's per-sample verdicts and answers, and its
    training curve (losses, true KL, gradient norms)."""
    report = json.loads((cell / "eval.json").read_text())
    curve = []
    metrics = cell / "run" / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row:
                curve.append((row["step"], row["loss"], row.get("true_kl"), row.get("grad_norm")))
    return {"metrics": report["metrics"],
            "samples": [[(s["completion"], s["correct"]) for s in problem["samples"]]
                        for problem in report["problems"]],
            "curve": sorted(set(curve))}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _job_of(out: Path, cell: str) -> str:
    return json.loads((out / "slurm_jobs.json").read_text())[cell]


def _squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def _trainer_pids(cell: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", "--", f"--output_dir {cell / 'run'}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.xdist_group("grid")
def test_a_grid_on_slurm_gives_the_local_results_through_a_preemption_and_a_kill(tmp_path, local_grid):
    """GRID as one job array while the grid waits: entry/seed-1's training process is killed after
    its first checkpoint (the job fails; the grid resubmits it once; it resumes), and token/seed-0's
    job gets SLURM's preemption notice (submitit's USR2: the cell checkpoints at a step boundary,
    the job is requeued and resumes). Every cell still ends with the local executor's results."""
    _, local, local_run = local_grid
    assert local_run.returncode == 0, local_run.stdout[-3000:]
    waiting = grid_run(GRID, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0", "--poll", "2", "--time", "30",
                       wait=False)
    out = tmp_path / "out"
    killed, preempted = out / "entry" / "seed-1", out / "token" / "seed-0"  # the array's 2nd and 3rd cells
    _wait_for(lambda: (killed / "run" / "checkpoint-1").is_dir(), 900, "entry/seed-1's first checkpoint")
    pids = _trainer_pids(killed)
    assert pids, "entry/seed-1's training process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: (preempted / "run" / "checkpoint-1").is_dir(), 900, "token/seed-0's first checkpoint")
    job = _job_of(out, "token/seed-0")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what submitit's own tests send
    _wait_for(lambda: _squeue_state(job) == "PENDING", 300, "the requeue")
    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)  # SLURM holds it ~2 min
    status, log = finished(waiting)
    assert status == 0, log[-3000:]
    assert "submitted 4 cell(s) as job array" in log and "slurm: 4 of 4 cell(s) ended" in log
    assert "entry/seed-1: job" in log and "resubmitting it once: it resumes from its last checkpoint" in log
    job_logs = "".join(p.read_text() for p in (out / "slurm").rglob("*_log.*"))
    assert "Caught signal SIGUSR2" in job_logs and "token/seed-0: stopping at a step boundary" in job_logs
    for cell in (killed, preempted):
        train_log = (cell / "train.log").read_text()
        started = [line for line in train_log.splitlines() if line.startswith("$ ")]
        assert len(started) == 2 and "[OPSD] resuming from" in train_log  # trained twice, the second time resumed
    assert json.loads((out / "results.json").read_text()) == json.loads((local / "results.json").read_text())
    for name in CELLS:
        assert outcome(out / name) == outcome(local / name), name
        assert (out / name / "cell.json").read_text() == (local / name / "cell.json").read_text()


@pytest.mark.xdist_group("slurm-errors")
def test_no_wait_then_the_same_command_collects_and_a_cell_failing_twice_is_reported(tmp_path):
    grid = {**GRID, "seeds": [0], "arms": {"entry": {}, "broken": {"flags": ["--learning_rate", "nope"]}},
            "budget": {"max_steps": 1, "global_batch": 2, "per_device_batch": 2}}
    status, log = grid_run(grid, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0", "--no-wait")
    assert status == 0 and "submitted 2 cell(s) as job array" in log and "not waiting (--no-wait)" in log, log
    assert not (tmp_path / "out" / "results.json").exists()
    status, log = grid_run(grid, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0", "--poll", "2")
    assert status == 1, log[-3000:]
    assert "still queued from an earlier submission" in log  # waited for, not submitted again
    failure = next(line for line in log.splitlines() if "broken/seed-0: failed twice" in line)
    assert "failed: train exited 2 (see " in failure and "train.log" in failure  # the cell's own log
    assert str(tmp_path / "out" / "slurm") in failure  # and the job's
    results = (tmp_path / "out" / "results.md").read_text()
    assert "Missing cells (no results yet, not in the table): broken/seed-0" in results
    assert json.loads((tmp_path / "out" / "results.json").read_text())["missing"] == ["broken/seed-0"]
    assert "| entry | 1 |" in results


@pytest.mark.xdist_group("slurm-errors")
def test_a_job_array_sbatch_refuses_is_one_line_before_anything_runs(tmp_path):
    status, log = grid_run(GRID, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0", "--partition", "no-such")
    assert status == 2, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: sbatch refused the job array: ") and "partition" in last.lower(), log
    assert "Traceback" not in log and not any((tmp_path / "out").glob("*/seed-*/run"))


def _srun_two_machines(command: str, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    """Two SLURM tasks on this node, each one accelerate machine (CPU ranks over gloo)."""
    return subprocess.run(["srun", "--nodes=1", "--ntasks=2", "--overlap", "bash", "-c", command],
                          cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)


@pytest.mark.xdist_group("slurm-machines")
def test_train_capped_runs_across_two_slurm_tasks_as_two_machines(tmp_path):
    out = tmp_path / "run"
    two = _srun_two_machines("bash train_capped.sh recipe.env", {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(out)})
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    log = two.stdout + two.stderr
    for rank in (0, 1):
        assert f"[OPSD] SLURM: machine {rank} of 2, main process on " in log
    assert log.count("8 steps x global batch 4 = 2 per device x 1 accumulation x 2 processes") == 2
    assert (out / "checkpoint-8" / "adapter_model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 9))  # one writer: the main process of machine 0


@pytest.mark.xdist_group("slurm-machines")
def test_two_slurm_machines_give_one_process_loss_and_gradients(tmp_path, one_process_step):  # noqa: F811
    """train_capped.sh's launch across machines (accelerate launch --num_machines 2 --machine_rank
    $SLURM_PROCID --main_process_ip <first node>) on test_ddp's deterministic step: the loss and
    LoRA gradients of one process with twice the accumulation."""
    import torch
    from test_ddp import ACCUMULATION, PER_DEVICE, STEP, assert_same_optimisation

    out = tmp_path / "two.pt"
    launch = ("accelerate launch --config_file configs/ddp.yaml --num_processes 2 --num_machines 2 "
              "--machine_rank $SLURM_PROCID "
              "--main_process_ip $(scontrol show hostnames $SLURM_STEP_NODELIST | head -n 1) "
              f"--main_process_port $((29500 + SLURM_JOB_ID % 2000)) {STEP} {out} {PER_DEVICE} {ACCUMULATION}")
    two = _srun_two_machines(launch, {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    ranks = {**torch.load(out), "checkpoint": out.with_suffix("") / "checkpoint-1"}
    assert_same_optimisation(one_process_step(), ranks)
