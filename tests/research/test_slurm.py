"""Grids and runs beyond one machine, against a real SLURM cluster (`.ci/slurm.sh up` starts a
single-node one; `pytest -m slurm` runs these alone):

- a grid through SLURM, two cells a job (--cells-per-node 2, on fake GPU ids), gives the results
  of the local executor (its run of the same grid, in its GPU pool on the same fake ids, is
  tests/research/test_grid.py's); a job that SLURM preempts (submitit's USR2) checkpoints its
  cells, is requeued and resumes them; a cell whose training process is killed is resubmitted
  and resumes; the grid's output shows each running cell's node, step and log; a cell that fails
  twice is reported with its log, and the table says it is missing;
- `status` and `cancel` on held jobs: a cell cancelled while pending (no log) or running is
  reported cancelled and never resubmitted unless asked; sbatch's known refusals say what to do
  and leave no grid folder; a transient sbatch error is retried; arrays split at MaxArraySize;
  resubmissions stay inside --parallel; a job is bound to the CPUs it asked for and uses as many
  threads (these with sleep or held jobs, in seconds);
- two SLURM tasks as two accelerate machines (CPU ranks over gloo): train_capped.sh runs the
  tiny preset across them, and the launch it uses gives one process's loss and gradients;
- what a lab's cluster does (.ci/slurm.sh's cluster: JobRequeue=0, real preemption, a partition
  with a short MaxTime, one with a node that never comes up), with stand-in cells (slurm_fakes.py):
  a queued job runs the grid's snapshot and grid file as submitted; packs ask for their cells'
  memory; held and never-startable jobs end the wait; preempted and timed-out jobs are requeued
  (they ask --requeue) while they move, a refused requeue is said once; a stale lock names its
  array task; a resubmission excludes the failed node; an sbatch timeout that hid an accepted
  submission submits nothing twice; failures count across re-runs (--retry-failed); --parallel is
  one limit across arrays.

Without `sbatch` on PATH, or with no SLURM controller answering (asked for SLURM_WAIT_S), every
test here skips; with CI_REQUIRE_SLURM=1 (as .ci/run sets) they fail instead.
"""
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from test_ddp import one_process_step  # noqa: E402,F401  (a fixture: one process at twice the accumulation)

SLURM_WAIT_S = 20  # how long the import waits for a busy or starting controller before the skip


def _slurm_answers(wait_s: float = SLURM_WAIT_S) -> str | None:
    """None when a SLURM cluster answers here, else why not. `sinfo` is asked again for up to
    `wait_s` seconds: one slow answer from a busy controller must not skip every test here."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no sbatch on PATH (`bash .ci/slurm.sh up` starts a single-node cluster, as root)"
    deadline = time.time() + wait_s
    while True:
        try:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
            why = None if state.returncode == 0 and state.stdout.strip() else state.stderr.strip()[:200]
        except (OSError, subprocess.SubprocessError) as exc:
            why = str(exc)
        if why is None:
            return None
        if time.time() >= deadline:
            return f"no SLURM controller answered for {wait_s:.0f} s: {why}"
        time.sleep(2)


NO_SLURM = _slurm_answers()
# CI (.ci/run) sets CI_REQUIRE_SLURM=1: there, no cluster is a failure of every test here, not a skip.
REQUIRED = os.environ.get("CI_REQUIRE_SLURM") == "1"
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(NO_SLURM is not None and not REQUIRED, reason=str(NO_SLURM))]
# The tests that mostly wait on the cluster share one xdist worker (group slurm-waits): while they
# wait, the other worker computes, instead of both workers waiting at once. The two that train for
# real are in the groups of the runs they compare with (grid, slurm-machines).


@pytest.fixture(autouse=True)
def _slurm_required_and_counted():
    """Fails a test that cannot reach the cluster under CI_REQUIRE_SLURM=1; appends the id of each
    test that ran to $CI_SLURM_TESTS_RAN (a file), which .ci/run counts."""
    if NO_SLURM is not None:
        pytest.fail(f"CI_REQUIRE_SLURM=1 but {NO_SLURM}")
    yield
    if os.environ.get("CI_SLURM_TESTS_RAN"):
        with open(os.environ["CI_SLURM_TESTS_RAN"], "a", encoding="utf-8") as ran:
            ran.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\n")


from grid_cases import CELLS, FAKE_GPUS, GRID  # noqa: E402  (conftest.py's local_grid: the local executor's run of GRID)


def grid_run(grid: dict, folder: Path, *flags, env=None, wait=True):
    """python -m opsd.research.grid on `grid` (written to folder/GRID.json) into folder/out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "GRID.json").write_text(json.dumps(grid))
    command = [sys.executable, "-m", "opsd.research.grid", str(folder / "GRID.json"), "--out", str(folder / "out"),
               *flags]
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
def test_a_grid_on_slurm_two_cells_a_node_gives_the_local_results_through_a_preemption_and_a_kill(
        tmp_path, local_grid):
    """GRID as two jobs of two cells (--cells-per-node 2: a job takes two GPUs, here the fake ids 3
    and 5 as in the local run, and runs its cells side by side in the local pool) while the grid
    waits: entry/seed-1's training process is killed after its first checkpoint (its job ends
    failed; the grid resubmits that cell alone; it resumes), and the job of the token cells gets
    SLURM's preemption notice (submitit's USR2: its running cells checkpoint at a step boundary,
    the job is requeued and resumes them). Every cell still ends with the local executor's results,
    and the grid's output shows each running cell's node, step and log."""
    _, local, local_run = local_grid
    assert local_run.returncode == 0, local_run.stdout[-3000:]
    waiting = grid_run(GRID, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "1", "--cells-per-node", "2",
                       "--cpus-per-cell", "1", "--sbatch", "gpus-per-node=0",  # CI's node has no GPUs to give
                       "--poll", "2", "--time", "30", env={"CUDA_VISIBLE_DEVICES": FAKE_GPUS}, wait=False)
    out = tmp_path / "out"
    killed, preempted = out / "entry" / "seed-1", out / "token" / "seed-0"  # in the 1st and 2nd job
    _wait_for(lambda: (killed / "run" / "checkpoint-1").is_dir(), 900, "entry/seed-1's first checkpoint")
    pids = _trainer_pids(killed)
    assert pids, "entry/seed-1's training process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: (preempted / "run" / "checkpoint-1").is_dir(), 900, "token/seed-0's first checkpoint")
    job = _job_of(out, "token/seed-0")
    assert job == _job_of(out, "token/seed-1")  # one job, two cells
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what submitit's own tests send
    _wait_for(lambda: _squeue_state(job) == "PENDING", 300, "the requeue")
    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)  # SLURM holds it ~2 min
    status, log = finished(waiting)
    assert status == 0, log[-3000:]
    assert "submitted 4 cell(s) as job array" in log and "(2 cells a job, one node each)" in log, log
    assert "slurm: 4 of 4 cell(s) ended" in log
    assert "entry/seed-1: job" in log and "resubmitting it once, excluding node " in log
    assert "submitted without excluding them" in log  # debug is a partition of one node
    assert "submitted 1 cell(s) as job" in log  # entry/seed-1 alone
    # while the grid waits, each running cell's progress: where it runs, its step, its log
    assert any(line.split("] ", 1)[-1].startswith(f"entry/seed-0: running on {socket.gethostname()} (job ")
               and "train.log" in line for line in log.splitlines()), log
    job_logs = "".join(p.read_text() for p in (out / "slurm").rglob("*_log.*"))
    assert "2 cell(s) on this node: entry/seed-0, entry/seed-1; GPUs 3,5 (1 a cell)" in job_logs
    assert "Caught signal SIGUSR2" in job_logs and "token/seed-0: stopping at a step boundary" in job_logs
    for cell in (killed, preempted):
        train_log = (cell / "train.log").read_text()
        started = [line for line in train_log.splitlines() if line.startswith("$ ")]
        assert len(started) == 2 and "[OPSD] resuming from" in train_log  # trained twice, the second time resumed
        assert all(line.startswith(("$ CUDA_VISIBLE_DEVICES=3 ", "$ CUDA_VISIBLE_DEVICES=5 ")) for line in started)
        provenance = json.loads((cell / "cell.json").read_text())["provenance"]
        code = provenance["code"]  # the queued jobs ran the grid's snapshot
        assert all(f" {out / '.code' / code / 'opsd_train.py'} " in line for line in started)
        assert provenance["slurm_job"] == _job_of(out, cell.relative_to(out).as_posix())  # as squeue names it
    def result(folder):  # each arm's wall time says how long its cells took here, not what they gave
        table = json.loads((folder / "results.json").read_text())
        assert all("wall_time" in arm for arm in table["arms"].values())
        return {**table, "arms": {name: {k: v for k, v in arm.items() if k != "wall_time"}
                                  for name, arm in table["arms"].items()}}

    assert result(out) == result(local)
    for name in CELLS:
        assert outcome(out / name) == outcome(local / name), name
        ours, theirs = (json.loads((folder / name / "cell.json").read_text()) for folder in (out, local))
        ours.pop("provenance", None), theirs.pop("provenance", None)  # where and when each ran
        assert ours == theirs, name


@pytest.mark.xdist_group("slurm-waits")
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


@pytest.mark.xdist_group("slurm-waits")
def test_a_job_array_sbatch_refuses_says_what_to_do_and_leaves_no_folder(tmp_path):
    """A refusal with a known cause says what to do: this cluster has no GPUs, and cells ask for 1 by
    default; an unknown partition lists the cluster's. Nothing is left of the grid folder."""
    status, log = grid_run(GRID, tmp_path, "--cluster", "slurm")  # --gpus-per-cell left at its default, 1
    assert status == 2, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: sbatch refused the job array: ") and "Invalid generic resource" in last, log
    assert "each cell asks for 1 GPU(s) (--gpus-per-cell, default 1)" in last and "use --gpus-per-cell 0" in last
    assert not (tmp_path / "out").exists()  # no half-made grid folder
    status, log = grid_run(GRID, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0", "--partition", "no-such")
    assert status == 2, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: sbatch refused the job array: ") and "partition" in last.lower(), log
    assert "--partition 'no-such' is not one of this cluster's (the partitions sinfo lists: debug*" in last, last
    assert "Traceback" not in log and not (tmp_path / "out").exists()


@pytest.mark.xdist_group("slurm-waits")
def test_jobs_a_killed_grid_submitted_but_did_not_record_are_not_submitted_twice(tmp_path):
    """A grid killed between sbatch and writing slurm_jobs.json leaves jobs no file lists; a re-run
    used to submit every cell again (two writers a cell). Now it refuses, naming them."""
    from opsd.research import slurm_grid

    out = tmp_path / "out"
    name = slurm_grid.job_name(out)
    stray = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--begin=now+1hour", "--wrap", "sleep 1"],
                           capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    try:
        status, log = grid_run(GRID, tmp_path, "--cluster", "slurm", "--gpus-per-cell", "0")
    finally:
        subprocess.run(["scancel", stray])
    assert status == 2, log
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"error: 1 job(s) named {name} are queued or running that ") and stray in last, last
    assert f"`scancel --name {name}`" in last
    assert not (out / "slurm_jobs.json").exists()  # nothing was submitted


def _grid_cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opsd.research.grid", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _status(out: Path) -> dict[str, str]:
    """{cell: its status line} from `python -m opsd.research.grid status`."""
    shown = _grid_cli("status", out)
    assert shown.returncode == 0, shown.stderr
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in shown.stdout.splitlines()[1:]}


@pytest.mark.xdist_group("slurm-waits")
def test_status_and_cancel_of_pending_and_running_cells_and_cancels_are_final(tmp_path):
    """Four cells held in the queue (begin in an hour), submitted through an sbatch that first fails
    as a busy controller does (retried). A waiting grid: one task scancelled while pending (it
    leaves no log) is reported cancelled, not resubmitted; one released to run is shown running on
    this node; `cancel` stops the rest, the waiting grid ends; a re-run resubmits nothing, and
    --resubmit-cancelled does."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text(f"""#!/bin/bash
if [ ! -e {shim}/failed-once ]; then touch {shim}/failed-once
  echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1; fi
exec {shutil.which("sbatch")} "$@"
""")
    (shim / "sbatch").chmod(0o755)
    held = ("--cluster", "slurm", "--gpus-per-cell", "0", "--sbatch", "begin=now+3600", "--poll", "1")
    status, log = grid_run(GRID, tmp_path, *held, "--no-wait", env={"PATH": f"{shim}:{os.environ['PATH']}"})
    assert status == 0 and "sbatch failed (" in log and "Socket timed out" in log, log
    assert "submitted 4 cell(s) as job array" in log, log
    out = tmp_path / "out"

    def with_reasons():  # squeue gives a held job its reason at the controller's next scheduling pass (None before)
        shown = _status(out)
        return shown if all("BeginTime" in line for line in shown.values()) else None

    shown = _wait_for(with_reasons, 60, "the held jobs' reason (BeginTime)")
    assert all(line.startswith("pending (job ") and "BeginTime" in line for line in shown.values()), shown
    waiting = grid_run(GRID, tmp_path, *held, wait=False)
    subprocess.run(["scancel", _job_of(out, "token/seed-1")], check=True)  # scancel by hand, while pending
    running = _job_of(out, "entry/seed-0")
    subprocess.run(["scontrol", "update", f"jobid={running}", "starttime=now"], check=True)
    _wait_for(lambda: _squeue_state(running) == "RUNNING", 120, "entry/seed-0 running")
    shown = _status(out)
    assert shown["token/seed-1"].startswith("cancelled (job "), shown  # no log: squeue's CANCELLED says it
    assert not list((out / "slurm").glob(f"{_job_of(out, 'token/seed-1')}/*.err"))
    assert shown["entry/seed-0"].startswith(f"running on {socket.gethostname()} (job {running})"), shown
    cancelled = _grid_cli("cancel", out)
    assert cancelled.returncode == 0 and "cancelled 3 job(s)" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    status, log = finished(waiting)
    assert status == 1, log[-3000:]
    assert "submitted" not in log and "resubmitting" not in log, log  # never resubmitted
    for name in CELLS:
        assert f"{name}: cancelled (job " in log, log
    assert all(line.startswith("cancelled (job ") for line in _status(out).values()), _status(out)
    status, log = grid_run(GRID, tmp_path, *held)  # the same command again: still cancelled
    assert status == 1 and "submitted" not in log and log.count(": cancelled (job ") == 4, log
    status, log = grid_run(GRID, tmp_path, *held, "--no-wait", "--resubmit-cancelled")
    assert status == 0 and "resubmitting 4 cancelled cell(s)" in log and "submitted 4 cell(s)" in log, log
    assert all(line.startswith("pending (job ") for line in _status(out).values())
    assert _grid_cli("cancel", out).returncode == 0


@pytest.mark.xdist_group("slurm-waits")
def test_arrays_split_at_the_clusters_max_array_size(tmp_path, monkeypatch):
    """MaxArraySize is read from the cluster; a grid larger than it goes out as several arrays."""
    from opsd.research import executors, grid

    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    assert f"MaxArraySize            = {executors.max_array_size()}" in config
    monkeypatch.setattr(executors, "max_array_size", lambda: 3)
    (tmp_path / "GRID.json").write_text(json.dumps(GRID))
    out = tmp_path / "out"
    assert grid.main([str(tmp_path / "GRID.json"), "--out", str(out), "--cluster", "slurm", "--gpus-per-cell", "0",
                      "--sbatch", "begin=now+3600", "--no-wait"]) == 0
    arrays = {job.split("_")[0] for job in json.loads((out / "slurm_jobs.json").read_text()).values()}
    assert len(arrays) == 2  # 3 cells, then 1
    assert _grid_cli("cancel", out).returncode == 0


def _fake_cell(record: Path):
    """A stand-in for SlurmCell (what the grid submits for a cell): a job that writes when it
    starts and ends, sleeps 2 s, and fails (so that the grid resubmits it once)."""
    def make(_grid_file, _out, name, _gpus, *_code):  # _code: the snapshot's version and folder
        script = (f"echo start {name} $(date +%s.%N) >> {record}; sleep 2; "
                  f"echo end {name} $(date +%s.%N) >> {record}; exit 3")
        return functools.partial(subprocess.run, ["bash", "-c", script], check=True)
    return make


@pytest.mark.xdist_group("slurm-waits")
def test_resubmissions_stay_inside_the_parallel_limit(tmp_path, monkeypatch, capsys):
    """--parallel 1 on two cells whose jobs fail: each is resubmitted once, and no two of the four
    jobs ever run at once (a resubmission used to go out beside the array, past its %1)."""
    from opsd.research import grid, slurm_grid

    record = tmp_path / "record"
    monkeypatch.setattr(slurm_grid, "SlurmCell", _fake_cell(record))
    two = {**GRID, "seeds": [0]}
    (tmp_path / "GRID.json").write_text(json.dumps(two))
    status = grid.main([str(tmp_path / "GRID.json"), "--out", str(tmp_path / "out"), "--cluster", "slurm",
                        "--gpus-per-cell", "0", "--parallel", "1", "--poll", "1"])
    log = capsys.readouterr().out
    assert status == 1 and log.count("resubmitting it once") == 2 and log.count("failed twice") == 2, log
    events = [line.split() for line in record.read_text().splitlines()]
    assert [e[0] for e in events] == ["start", "end"] * 4, events  # one job at a time
    assert [e[1] for e in events].count("entry/seed-0") == 4


@pytest.mark.xdist_group("slurm-waits")
def test_a_cell_sees_the_cpus_it_asked_for_and_uses_as_many_threads(tmp_path):
    """The job's step (submitit's srun) is bound to the CPUs the cell asked for (CI's cluster binds
    with task/affinity), and the cell's thread count is theirs."""
    from opsd.research import executors, slurm_grid

    node_cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True).stdout.split()[0])
    for cpus in sorted({1, min(2, node_cpus)}):
        options = executors.SlurmOptions(gpus_per_cell=0, cpus_per_cell=cpus, time_min=5)
        job = executors.slurm_executor(tmp_path / f"cpus-{cpus}", options, "cpus").submit(slurm_grid.use_given_cpus, 0)
        bound, threads = job.result()
        assert len(bound) == cpus and threads == cpus, (cpus, bound, threads)
        assert "SRUN_CPUS_PER_TASK" in Path(job.paths.submission_file).read_text()


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


# --------------------------------------------------------------------------
# What a lab's cluster does that a plain one-node cluster does not (issue 61): each with jobs of
# seconds. The cells of these grids are stand-ins (slurm_fakes.py): a bash script a job.
# --------------------------------------------------------------------------

FAKES = Path(__file__).resolve().parent
ONE = {**GRID, "seeds": [0], "arms": {"entry": {}}}  # one cell: entry/seed-0


def fake_grid(grid: dict, folder: Path, script: str, *flags, env=None, wait=True):
    """The grid of `grid` on SLURM (CPU cells, --poll 1) whose cells' jobs run `script` (slurm_fakes.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "GRID.json").write_text(json.dumps(grid))
    command = [sys.executable, "-m", "slurm_fakes", script, str(folder / "GRID.json"), "--out", str(folder / "out"),
               "--cluster", "slurm", "--gpus-per-cell", "0", "--poll", "1", *flags]
    paths = os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")]))
    run = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONPATH": paths, **(env or {})})
    return finished(run, 300) if wait else run


def finished(run, timeout: float = 1200) -> tuple[int, str]:  # noqa: F811  (a timeout of the caller's)
    output = run.communicate(timeout=timeout)[0]
    return run.returncode, output


def _scontrol_job(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def runs_then_done(runs: int) -> str:
    """A cell's job that counts its runs in $CELL/runs and waits to be stopped, until its run `runs` ends the cell."""
    return (f"echo run >> $CELL/runs; if [ $(wc -l < $CELL/runs) -ge {runs} ]; then echo {{}} > $CELL/eval.json; "
            "else sleep 120; fi")


def _runs(out: Path, cell: str) -> int:
    record = out / cell / "runs"
    return len(record.read_text().splitlines()) if record.is_file() else 0


@pytest.mark.xdist_group("slurm-waits")
def test_a_waiting_job_runs_the_snapshots_code_and_the_grid_file_it_was_submitted_with(tmp_path):
    """A job held in the queue while its checkout is edited and its grid folder's grid.json is
    rewritten (as a re-run with another grid does) runs the code and grid of its submission: it
    imports opsd from the grid's snapshot (its working folder, first on the import path), not from the
    checkout it was submitted from, and reads a grid file frozen at submission."""
    checkout = tmp_path / "checkout"  # a copy of the repository, its own git checkout
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=checkout, check=True)
    subprocess.run([*git, "add", "-A"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=checkout, check=True)
    grid = {**ONE, "arms": {"broken": {"flags": ["--learning_rate", "nope"]}}, "baseline": "broken",  # fails at once
            "budget": {"max_steps": 1, "global_batch": 2, "per_device_batch": 2}}
    (tmp_path / "GRID.json").write_text(json.dumps(grid))
    out = tmp_path / "out"
    submitted = subprocess.run(
        [sys.executable, "-m", "opsd.research.grid", str(tmp_path / "GRID.json"), "--out", str(out), "--cluster",
         "slurm", "--gpus-per-cell", "0", "--sbatch", "begin=now+3600", "--no-wait"],
        cwd=checkout, capture_output=True, text=True, timeout=300)  # the checkout's opsd, as its user runs it
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = _job_of(out, "broken/seed-0")
    edited = checkout / "opsd" / "research" / "slurm_grid.py"
    call = "    def __call__(self) -> str:\n"
    edited.write_text(edited.read_text().replace(call, call + "        print('EDITED CHECKOUT')\n", 1))
    (out / "grid.json").write_text(json.dumps({**grid, "budget": {**grid["budget"], "max_steps": 2}}))
    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
    try:
        _wait_for(lambda: (out / "broken" / "seed-0" / "cell.json").is_file(), 300, "the job to start its cell")
    finally:
        subprocess.run(["scancel", job])
    logs = "".join(p.read_text() for p in (out / "slurm" / job).glob("*_log.*"))
    assert "EDITED CHECKOUT" not in logs, logs[-3000:]
    said = next(line for line in logs.splitlines() if line.startswith("broken/seed-0: the grid's code "))
    code_dir, imported = said.removeprefix("broken/seed-0: the grid's code ").split("; opsd imported from ")
    assert imported == str(Path(code_dir).resolve() / "opsd") and not code_dir.startswith(str(checkout)), said
    identity = json.loads((out / "broken" / "seed-0" / "cell.json").read_text())
    assert identity["budget"]["max_steps"] == 1  # the grid as submitted, not the rewritten grid.json


@pytest.mark.xdist_group("slurm-waits")
def test_a_node_pack_asks_for_its_cells_memory_and_a_partial_pack_for_its_own_cells(tmp_path):
    """--cells-per-node 2 with 1 CPU and 0.5 GB a cell: a job of two cells asks for 2 CPUs and 1 GB
    (each cell's memory, not one cell's for both), the third cell's job for 1 CPU and 512 MB (and
    a GPU cell's pack for its own cells' GPUs, not N x G)."""
    from opsd.research import executors, slurm_grid

    three = {**ONE, "seeds": [0, 1, 2]}
    status, log = fake_grid(three, tmp_path, "true", "--cells-per-node", "2", "--cpus-per-cell", "1",
                            "--mem-per-cell", "0.5", "--sbatch", "begin=now+3600", "--no-wait")
    assert status == 0, log
    out = tmp_path / "out"
    pair, alone = _job_of(out, "entry/seed-0"), _job_of(out, "entry/seed-2")
    assert pair == _job_of(out, "entry/seed-1") and pair != alone
    asked = {job: _scontrol_job(job) for job in (pair, alone)}
    assert (asked[pair]["NumCPUs"], asked[pair]["MinMemoryNode"]) == ("2", "1G"), asked[pair]
    assert (asked[alone]["NumCPUs"], asked[alone]["MinMemoryNode"]) == ("1", "512M"), asked[alone]
    assert "(2 cells a job, one node each)" in log and "(1 cells a job, one node each)" in log, log
    assert _grid_cli("cancel", out).returncode == 0
    options = executors.SlurmOptions(gpus_per_cell=2, cpus_per_cell=8, mem_gb=40)  # what GPU cells would ask
    args = type("Args", (), {"cells_per_node": 4, "poll": 1})()
    submitter = slurm_grid._Submitter(tmp_path / "gpu", options, args, {}, slurm_grid.Tries(tmp_path), print,
                                      tmp_path / "grid.json", None, None)
    for cells_in_job in (4, 1):
        parameters = submitter.executor(cells_in_job, ()).parameters
        assert (parameters["gpus_per_node"], parameters["cpus_per_task"], parameters["mem"]) == \
               (2 * cells_in_job, 8 * cells_in_job, f"{40 * 1024 * cells_in_job}M")


@pytest.mark.xdist_group("slurm-waits")
def test_jobs_that_never_start_by_themselves_end_the_wait_with_what_to_do(tmp_path):
    """A partition whose MaxTime (1 min) is below --time: the jobs pend for PartitionTimeLimit for
    ever. Held jobs (by the user, by an admin, requeued held, SPECIAL_EXIT) likewise. The waiting
    grid ends (exit 1) with one line a cell: why, and what to do; `status` says the same."""
    status, log = finished(fake_grid(ONE, tmp_path / "short", "true", "--partition", "short", "--time", "5",
                                     wait=False), 120)
    assert status == 1, log
    line = next(line for line in log.splitlines() if "entry/seed-0: failed: job " in line)
    assert "its --time is above partition short's time limit (1:00, PartitionTimeLimit)" in line, line
    assert "--time at most that, or another --partition" in line
    assert _grid_cli("cancel", tmp_path / "short" / "out").returncode == 0

    four = {**ONE, "seeds": [0, 1, 2, 3]}
    held = ("--sbatch", "begin=now+3600")
    status, log = fake_grid(four, tmp_path / "held", "echo run >> $CELL/runs; sleep 60", *held, "--no-wait")
    assert status == 0, log
    out = tmp_path / "held" / "out"
    jobs = [_job_of(out, f"entry/seed-{seed}") for seed in range(4)]
    subprocess.run(["scontrol", "uhold", jobs[0]], check=True)
    subprocess.run(["scontrol", "hold", jobs[1]], check=True)  # as root: an admin's hold
    for job in jobs[2:]:
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
    for seed in (2, 3):
        _wait_for(lambda s=seed: _runs(out, f"entry/seed-{s}"), 300, f"entry/seed-{seed} running")
    subprocess.run(["scontrol", "requeuehold", jobs[2]], check=True)
    subprocess.run(["scontrol", "requeuehold", "state=SpecialExit", jobs[3]], check=True)
    try:
        status, log = finished(fake_grid(four, tmp_path / "held", "true", *held, wait=False), 300)
        shown = _status(out)
    finally:
        subprocess.run(["scancel", *jobs])
    assert status == 1, log
    said = {name: line.split(f"] {name}: failed: ", 1)[1] for line in log.splitlines()
            for name in (f"entry/seed-{seed}" for seed in range(4)) if f"] {name}: failed: " in line}
    assert said["entry/seed-0"] == (f"job {jobs[0]} will not start: held by its user (JobHeldUser); "
                                     f"`scontrol release {jobs[0]}`, then re-run the grid to wait for it"), said
    assert "held by an administrator (or root) (JobHeldAdmin)" in said["entry/seed-1"]
    assert "requeued and held" in said["entry/seed-2"] and f"`scontrol release {jobs[2]}`" in said["entry/seed-2"]
    assert said["entry/seed-3"].startswith(f"job {jobs[3]} is held in SPECIAL_EXIT"), said
    assert all(shown[name].startswith("held (job ") for name in said), shown


@pytest.mark.xdist_group("slurm-waits")
def test_a_preempted_job_is_requeued_on_a_cluster_that_requeues_only_when_asked(tmp_path):
    """CI's cluster has JobRequeue=0 and PreemptType=preempt/partition_prio: a job of the high
    partition preempts the grid's job in the low one (they contend for the node's one `preemptee`).
    The grid's jobs ask for --requeue: the preempted job goes back to the queue under the same id
    and runs the cell again, instead of ending PREEMPTED (a failure, a try spent)."""
    script = runs_then_done(2)
    waiting = fake_grid(ONE, tmp_path, script, "--partition", "low", "--sbatch", "gres=preemptee:1", wait=False)
    out = tmp_path / "out"
    _wait_for(lambda: _runs(out, "entry/seed-0") == 1, 300, "the cell's first run")
    job = _job_of(out, "entry/seed-0")
    high = subprocess.run(["sbatch", "--parsable", "--partition=high", "--gres=preemptee:1", "--output=/dev/null",
                           "--wrap", "sleep 1"],
                          capture_output=True, text=True, check=True).stdout.strip()
    try:
        _wait_for(lambda: _squeue_state(job) == "PENDING", 300, "the preempted job back in the queue")
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)  # SLURM waits ~2 min
        status, log = finished(waiting, 300)
    finally:
        subprocess.run(["scancel", high, job])
    assert status == 0, log
    assert f"entry/seed-0: done (job {job})" in log and "resubmitting" not in log, log
    assert _runs(out, "entry/seed-0") == 2
    assert "DUE TO PREEMPTION" in (out / "slurm" / job / f"{job}_0_log.err").read_text()


@pytest.mark.xdist_group("slurm-waits")
def test_a_cell_is_requeued_at_every_time_limit_while_it_moves(tmp_path):
    """submitit's notice of the time limit (USR2) four times: each time the job checkpoints and is
    requeued under its id (it asks --requeue, which CI's JobRequeue=0 does not give by default), past
    submitit's old cap of 3 requeues; the fifth run ends the cell, with no resubmission and no try
    spent: a cell longer than 2 x --time needs no re-run by hand."""
    script = runs_then_done(5)
    waiting = fake_grid(ONE, tmp_path, script, "--time", "5", wait=False)
    out = tmp_path / "out"
    try:
        for run in range(1, 5):
            _wait_for(lambda r=run: _runs(out, "entry/seed-0") == r, 300, f"run {run}")
            job = _job_of(out, "entry/seed-0")
            _wait_for(lambda j=job: _squeue_state(j) == "RUNNING", 300, "the job running")
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
            _wait_for(lambda j=job: _squeue_state(j) == "PENDING", 300, "the requeue")
            subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
        status, log = finished(waiting, 300)
    finally:
        subprocess.run(["scancel", "--name", slurm_grid_job_name(out)])
    assert status == 0, log
    assert f"entry/seed-0: done (job {job})" in log and "resubmitting" not in log and "submitted 1" in log, log
    assert _runs(out, "entry/seed-0") == 5
    assert not (out / "slurm_tries.json").exists() or json.loads((out / "slurm_tries.json").read_text()) == {}


def slurm_grid_job_name(out: Path) -> str:
    from opsd.research import slurm_grid

    return slurm_grid.job_name(out)


@pytest.mark.xdist_group("slurm-waits")
def test_a_cluster_that_refuses_a_jobs_own_requeue_is_said_once_and_its_cells_resubmitted(tmp_path):
    """Compute nodes whose `scontrol requeue` fails (here a shim on the jobs' PATH): two cells'
    jobs get submitit's USR2, checkpoint, and cannot requeue themselves. The grid says so once and
    resubmits both cells (they resume) without counting a failure."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "scontrol").write_text(f"""#!/bin/bash
if [ "$1" = requeue ]; then echo "scontrol: error: Requested operation is presently disabled for job $2" >&2; exit 1; fi
exec {shutil.which("scontrol")} "$@"
""")
    (shim / "scontrol").chmod(0o755)
    two = {**ONE, "seeds": [0, 1]}
    script = runs_then_done(2)
    waiting = fake_grid(two, tmp_path, script, env={"PATH": f"{shim}:{os.environ['PATH']}"}, wait=False)
    out = tmp_path / "out"
    try:
        for seed in (0, 1):
            _wait_for(lambda s=seed: _runs(out, f"entry/seed-{s}") == 1, 300, f"entry/seed-{seed} running")
            subprocess.run(["scancel", "--signal=USR2", _job_of(out, f"entry/seed-{seed}")], check=True)
        status, log = finished(waiting, 300)
    finally:
        subprocess.run(["scancel", "--name", slurm_grid_job_name(out)])
    assert status == 0, log
    assert log.count("SLURM refused to requeue job ") == 1, log
    refusal = next(line for line in log.splitlines() if "SLURM refused to requeue job " in line)
    assert "`scontrol requeue`: scontrol: error: Requested operation is presently disabled" in refusal, refusal
    assert log.count("stopped with a checkpoint; resubmitting it") == 2 and "ended without results" not in log
    assert all(_runs(out, f"entry/seed-{seed}") == 2 for seed in (0, 1))
    assert json.loads((out / "slurm_tries.json").read_text()) == {} if (out / "slurm_tries.json").exists() else True


@pytest.mark.xdist_group("slurm-waits")
def test_a_stale_lock_of_an_arrays_first_task_names_that_task_and_only_it_keeps_it(tmp_path):
    """The task of an array whose SLURM_JOB_ID is the array's id takes a run folder's lock and
    ends without releasing it (killed) while its sibling still runs. The lock names the task
    (`<array>_<task>`), and a runner on another host finds it stale: squeue is asked about that task
    only, not the array, which lists the running sibling."""
    from opsd.run_folder import RunLock

    folder = tmp_path / "run"
    folder.mkdir()
    script = (f'if [ "$SLURM_JOB_ID" = "$SLURM_ARRAY_JOB_ID" ]; then {sys.executable} -c '
              f'"import os; from opsd.run_folder import RunLock; RunLock({str(folder)!r}).acquire(); os._exit(0)"; '
              "else sleep 60; fi")
    array = subprocess.run(["sbatch", "--parsable", "--array=0-1", f"--output={tmp_path}/%A_%a.out", "--wrap", script],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    try:
        _wait_for(lambda: (folder / ".lock").is_file(), 300, "the task's lock")
        pid, host, job = (folder / ".lock").read_text().split()
        assert job in (f"{array}_0", f"{array}_1"), job
        sibling = f"{array}_1" if job.endswith("_0") else f"{array}_0"
        _wait_for(lambda: _squeue_state(job) == "" and _squeue_state(sibling) == "RUNNING", 300,
                  "the lock's task gone, its sibling running")
        (folder / ".lock").write_text(f"{pid} another-host {job}\n")  # a runner elsewhere: only squeue can tell
        RunLock(str(folder)).check()  # stale: no error
    finally:
        subprocess.run(["scancel", array])


@pytest.mark.xdist_group("slurm-waits")
def test_a_resubmission_excludes_the_node_its_cell_failed_on_and_status_says_so(tmp_path):
    """A cell whose job fails on this node is resubmitted with --exclude=<node> (in CI's partition
    twonodes, whose second node never comes up, the resubmission waits instead of being refused as in
    a partition of one node: see the next test); the grid's output and `status` say which node is
    excluded and which job failed there."""
    host = socket.gethostname()
    script = "if [ ! -e $CELL/failed ]; then touch $CELL/failed; exit 3; fi; echo {} > $CELL/eval.json"
    waiting = fake_grid(ONE, tmp_path, script, "--partition", "twonodes", wait=False)
    out = tmp_path / "out"
    try:
        first = _wait_for(lambda: (out / "slurm_jobs.json").is_file() and _job_of(out, "entry/seed-0"), 300, "a job")
        second = _wait_for(lambda: _job_of(out, "entry/seed-0") != first and _job_of(out, "entry/seed-0"), 300,
                           "the resubmission")
        assert _scontrol_job(second)["ExcNodeList"] == host
        shown = _wait_for(lambda: _status(out)["entry/seed-0"] if "ReqNodeNotAvail" in _status(out)["entry/seed-0"]
                          else None, 120, "the resubmission pending for its node")
        assert shown.startswith(f"pending (job {second}, ReqNodeNotAvail") and \
               f"; resubmitted excluding node(s) {host}, where job(s) {first} failed)" in shown, shown
    finally:
        subprocess.run(["scancel", "--name", slurm_grid_job_name(out)])
    status, log = finished(waiting, 300)
    assert f"entry/seed-0: job {first} ended without results (" in log
    assert f"resubmitting it once, excluding node {host}: it resumes" in log, log
    assert f"excluding node(s) {host} where they failed: entry/seed-0 {second}" in log, log


@pytest.mark.xdist_group("slurm-waits")
def test_an_sbatch_that_times_out_after_slurm_accepted_it_is_not_submitted_again(tmp_path):
    """sbatch accepts the array, then says "Socket timed out" (a busy controller's answer lost):
    the grid finds its job name in squeue, takes those jobs over (their pickles put where they read
    them) and submits nothing more; each cell runs once."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text(f"""#!/bin/bash
{shutil.which("sbatch")} "$@" > /dev/null || exit $?
if [ ! -e {shim}/timed-out ]; then touch {shim}/timed-out
  echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1; fi
""")
    (shim / "sbatch").chmod(0o755)
    two = {**ONE, "seeds": [0, 1]}
    status, log = fake_grid(two, tmp_path, "echo run >> $CELL/runs; echo {} > $CELL/eval.json",
                            env={"PATH": f"{shim}:{os.environ['PATH']}"})
    out = tmp_path / "out"
    assert status == 0, log
    assert "but SLURM had accepted the submission (its job name is in squeue): taken over" in log, log
    assert "trying again" not in log and log.count("submitted 2 cell(s)") == 1, log
    arrays = subprocess.run(["squeue", "--noheader", "--states=all", "--name", slurm_grid_job_name(out),
                             "--format=%F"], capture_output=True, text=True).stdout.split()
    assert len(set(arrays)) == 1, arrays  # one array, accepted once
    assert all(_runs(out, f"entry/seed-{seed}") == 1 for seed in (0, 1))


@pytest.mark.xdist_group("slurm-waits")
def test_failures_are_counted_across_re_runs_and_retry_failed_resubmits_on_purpose(tmp_path):
    """A cell that fails every time: the first grid runs it twice and reports it; the same command
    again submits nothing (slurm_tries.json keeps its two failures; a loop around the grid does not
    resubmit it for ever) and says how to; --retry-failed submits it again, twice."""
    fails = "echo run >> $CELL/runs; exit 3"
    status, log = fake_grid(ONE, tmp_path, fails)
    assert status == 1 and "entry/seed-0: failed twice: " in log, log
    host = socket.gethostname()  # the partition has no other node: the resubmission cannot exclude it
    assert f"sbatch refused to exclude node(s) {host} (sbatch: error: Batch job submission failed: Requested node " \
           "configuration is not available): submitted without excluding them" in log, log
    out = tmp_path / "out"
    assert len(json.loads((out / "slurm_tries.json").read_text())["entry/seed-0"]) == 2
    status, log = fake_grid(ONE, tmp_path, fails)
    assert status == 1 and "submitted 1 cell" not in log, log
    assert "entry/seed-0: failed 2 times, not resubmitted (last: job " in log
    assert "re-run with --retry-failed to submit it again" in log
    assert "--retry-failed to submit it again" in _status(out)["entry/seed-0"]
    status, log = fake_grid(ONE, tmp_path, fails, "--retry-failed")
    assert status == 1 and "resubmitting 1 failed cell(s) (--retry-failed): entry/seed-0" in log, log
    assert "entry/seed-0: failed twice: " in log and _runs(out, "entry/seed-0") == 4


@pytest.mark.xdist_group("slurm-waits")
def test_parallel_is_one_limit_across_the_grids_arrays_and_unset_means_none(tmp_path):
    """--parallel 2 on four cells split into arrays of one job (MaxArraySize 1): with --no-wait
    only two go out (each array's %2 would let all four run); the same command without it submits
    the rest as those end; no more than two ever run at once. Without --parallel an array of 300
    jobs has no limit (submitit's default would be %256)."""
    four = {**ONE, "seeds": [0, 1, 2, 3]}
    record = tmp_path / "record"
    script = (f"echo start $(date +%s.%N) >> {record}; sleep 3; echo end $(date +%s.%N) >> {record}; "
              "echo {} > $CELL/eval.json")
    split = {"FAKE_MAX_ARRAY_SIZE": "1"}
    status, log = fake_grid(four, tmp_path, script, "--parallel", "2", "--no-wait", env=split)
    assert status == 0 and log.count("submitted 1 cell(s) as job ") == 2, log
    assert "2 cell(s) wait for a --parallel slot: re-running the same command submits them" in log
    status, log = fake_grid(four, tmp_path, script, "--parallel", "2", env=split)
    assert status == 0 and log.count("submitted 1 cell(s) as job ") == 2, log
    running, most = 0, 0
    events = sorted((float(line.split()[1]), line.split()[0]) for line in record.read_text().splitlines())
    for _, word in events:
        running += 1 if word == "start" else -1
        most = max(most, running)
    assert len(events) == 8 and most <= 2, events

    many = {**ONE, "seeds": list(range(300))}
    status, log = fake_grid(many, tmp_path / "many", "true", "--sbatch", "begin=now+3600", "--no-wait")
    try:
        assert status == 0, log
        array = _job_of(tmp_path / "many" / "out", "entry/seed-0").split("_")[0]
        assert _scontrol_job(f"{array}_0")["ArrayTaskThrottle"] == "300"  # sbatch --array=0-299%300
    finally:
        subprocess.run(["scancel", "--name", slurm_grid_job_name(tmp_path / "many" / "out")])
