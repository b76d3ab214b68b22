"""run_folder: the lock, run_config.json comparison, metrics truncation and the
output-folder checks (stdlib only, no model)."""
import json
import os
import subprocess
import sys

import pytest

from opsd import run_folder as run_folder
from opsd.run_folder import RunFolderError, RunLock


def test_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    lock = tmp_path / run_folder.LOCK_FILE
    host = os.uname().nodename
    lock.write_text(f"{os.getppid()} {host}\n")  # the parent (pytest's runner) is alive
    with pytest.raises(RunFolderError, match=rf"in use by another run \(PID {os.getppid()} "):
        RunLock(str(tmp_path)).acquire()
    with pytest.raises(RunFolderError):
        RunLock(str(tmp_path)).check()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(f"{int(dead.stdout)} {host}\n")  # that process has exited: a stale lock
    with RunLock(str(tmp_path)) as taken:
        assert taken.held and lock.read_text().split()[0] == str(os.getpid())
    assert not lock.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left


def test_lock_of_another_host_is_respected(tmp_path):
    (tmp_path / run_folder.LOCK_FILE).write_text("1 some-other-host\n")
    with pytest.raises(RunFolderError, match="some-other-host"):
        RunLock(str(tmp_path)).acquire()


def test_a_slurm_jobs_lock_is_its_own_and_stale_once_the_job_left_the_queue(tmp_path, monkeypatch):
    """A lock taken inside SLURM job 777 on another node: job 777's other machines pass it (they
    check the folder while machine 0 trains); another job respects it while squeue lists 777,
    and takes it over once 777 has left the queue (a cell resubmitted to another node)."""
    lock = tmp_path / run_folder.LOCK_FILE
    lock.write_text("4242 node-a 777\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    RunLock(str(tmp_path)).check()  # this job's own lock
    monkeypatch.setenv("SLURM_JOB_ID", "778")
    squeue.write_text("#!/bin/sh\necho 777\n")  # 777 still queued or running
    squeue.chmod(0o755)
    with pytest.raises(RunFolderError, match=r"in use by another run \(PID 4242 on node-a"):
        RunLock(str(tmp_path)).check()
    squeue.write_text("#!/bin/sh\nexit 0\n")  # 777 has left the queue: a stale lock
    with RunLock(str(tmp_path)) as taken:
        assert taken.held and lock.read_text().split() == [str(os.getpid()), os.uname().nodename, "778"]
    squeue.unlink()  # no SLURM to ask: another host's lock stays respected
    monkeypatch.setenv("PATH", str(bin_dir))
    lock.write_text("4242 node-a 777\n")
    with pytest.raises(RunFolderError):
        RunLock(str(tmp_path)).check()


def test_config_conflicts_ignore_the_budget_split_and_max_steps():
    recorded = {"model": "tiny", "OPSD_CLIP_MODE": "entry", "max_steps": 8, "num_processes": 1,
                "gradient_accumulation_steps": 2, "output_dir": "/a", "beta": 0.5}
    same = {**recorded, "max_steps": 100, "num_processes": 2, "gradient_accumulation_steps": 1, "output_dir": "/b"}
    assert run_folder.config_conflicts(recorded, same) == []
    other = {k: v for k, v in recorded.items() if k != "beta"} | {"OPSD_CLIP_MODE": "token"}
    assert run_folder.config_conflicts(recorded, other) == ["OPSD_CLIP_MODE", "beta"]


def test_truncate_metrics_keeps_steps_up_to_the_resumed_one(tmp_path):
    path = tmp_path / run_folder.METRICS_FILE
    lines = [json.dumps({"step": s, "loss": 0.1}) for s in (1, 2, 3, 4, 5, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 7, "lo')  # a torn last line
    run_folder.truncate_metrics(str(tmp_path), 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    run_folder.truncate_metrics(str(tmp_path), 0)
    assert path.read_text() == ""


def test_check_writable(tmp_path):
    run_folder.check_writable(str(tmp_path / "new" / "deeper"))  # can be created
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        run_folder.check_writable(str(tmp_path / "f"))
    with pytest.raises(RunFolderError, match="cannot be created"):
        run_folder.check_writable(str(tmp_path / "f" / "run"))


def test_unreadable_run_config_is_a_one_line_error(tmp_path):
    (tmp_path / run_folder.CONFIG_FILE).write_text("{not json")
    with pytest.raises(RunFolderError) as caught:
        run_folder.read_config(str(tmp_path))
    assert "\n" not in str(caught.value) and "another OPSD_OUTPUT" in str(caught.value)


def test_checkpoints_need_a_trainer_state(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-12").mkdir()  # no trainer state: not a complete checkpoint
    (tmp_path / "checkpoint-x").mkdir()
    assert run_folder.last_checkpoint(str(tmp_path)) == (3, str(tmp_path / "checkpoint-3"))
    (tmp_path / run_folder.STAGING_DIR).mkdir()
    assert run_folder.remove_staging(str(tmp_path)) is False  # empty: nothing to report
    assert not (tmp_path / run_folder.STAGING_DIR).exists()
