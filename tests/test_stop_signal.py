"""A stop on a signal keeps its checkpoint with several processes, as a cluster sends it.

SLURM's `--signal=TERM@...` (and its time limit) signals every process of the job step: under
`accelerate launch` the ranks get a SIGTERM directly and one more from the launcher (torchrun's
agent forwards its own to each rank), which then waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT before a
SIGKILL. Both signals must be one request: stop at a step boundary with a checkpoint, from which
a re-run resumes to exactly the uninterrupted run. Two CPU ranks over gloo stand in for GPUs.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_scripts import fake_gpu_host  # noqa: F401  (a fixture)
from test_scripts import launch as launch_capped

from opsd_train import _StopRequest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
CPU_RANKS = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}


def test_a_repeated_sigterm_is_one_request_and_a_second_ctrl_c_stops_at_once(capfd):
    """In one process: SIGTERMs, however many, ask for the stop; the first Ctrl-C asks too and gives
    the signals back to the handlers from before, so the next one acts at once (the launcher turns a
    second Ctrl-C into a SIGTERM to each rank)."""
    before = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))
    try:
        with _StopRequest() as stop:
            for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), signum)
            assert stop.signum == signal.SIGTERM and before == []
            os.kill(os.getpid(), signal.SIGTERM)  # after a Ctrl-C: the handler from before
            assert before == [signal.SIGTERM]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        with _StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    stopping = "received: stopping after this step with a checkpoint"
    assert capfd.readouterr().out.splitlines() == [f"[OPSD] SIGTERM {stopping} (a second Ctrl-C stops at once)",
                                                   f"[OPSD] SIGINT {stopping} (Ctrl-C again stops at once)",
                                                   f"[OPSD] SIGINT {stopping} (Ctrl-C again stops at once)"]


def test_sigusr1_the_ranks_own_stop_signal_is_a_request_as_sigterm_is():
    """SIGUSR1 (slurm/train_capped.sbatch's --signal, which the launcher ignores) asks for the same
    stop; without a handler it would end the process."""
    code = ("import os, signal\nfrom opsd_train import _StopRequest\n"
            "with _StopRequest() as stop:\n    os.kill(os.getpid(), signal.SIGUSR1)\nprint(stop.signum)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == [
        "[OPSD] SIGUSR1 received: stopping after this step with a checkpoint (a second Ctrl-C stops at once)",
        str(int(signal.SIGUSR1))]


def test_train_capped_starts_the_launcher_with_sigusr1_ignored(fake_gpu_host):  # noqa: F811
    """A SLURM signal reaches every process of the step: the launcher must not die of SIGUSR1 (its
    default action) nor pass it on as a TERM; the ranks take it as their stop request."""
    accelerate = Path(fake_gpu_host["PATH"].split(":")[0]) / "accelerate"
    accelerate.write_text('#!/usr/bin/env bash\nmask=$(awk \'/^SigIgn/ {print $2}\' /proc/$$/status)\n'
                          'echo "launch usr1-ignored=$(( 0x$mask >> 9 & 1 )) $*"\n')
    result, line = launch_capped(fake_gpu_host, FAKE_GPUS="2")
    assert result.returncode == 0, result.stderr
    assert line.startswith("launch usr1-ignored=1 "), line


def test_a_stop_request_with_stdout_gone_is_still_one(monkeypatch):
    """Its line cannot be written (the reader of stdout is gone): the request holds, no exception."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as gone:
        monkeypatch.setattr(sys, "stdout", gone)
        with _StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM


def test_a_grid_cells_launcher_waits_for_the_checkpoint_within_slurms_wait(tmp_path, monkeypatch):
    """A 2-GPU grid cell trains under accelerate launch with the launcher's grace set (not torch's
    30 s), and shorter than SlurmCell.checkpoint's wait, which then kills the launcher."""
    from opsd.research import cell as research_cell
    from opsd.research import slurm_grid

    class Launched(Exception):
        pass

    real_run, real_popen, seen = subprocess.run, subprocess.Popen, {}

    def record(real):
        def call(command, *args, **kwargs):
            if "accelerate.commands.launch" in command:
                seen.update(kwargs["env"])
                raise Launched
            return real(command, *args, **kwargs)
        return call

    monkeypatch.setattr(subprocess, "run", record(real_run))
    monkeypatch.setattr(subprocess, "Popen", record(real_popen))
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "seeds": [0], "arms": {"entry": {}},
                                     "budget": {"max_steps": 4, "global_batch": 4, "per_device_batch": 2}}))
    grid = research_cell.load_grid(str(grid_file))
    (cell,) = research_cell.cells(grid, tmp_path / "out")
    with pytest.raises(Launched):
        research_cell.run_cell(grid, cell, print, gpus=("0", "1"), port=29555)
    grace = int(seen["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 30 < grace < slurm_grid.CHECKPOINT_WAIT_S


def launch(out: Path) -> list[str]:
    """The 2-process launch train_capped.sh builds (accelerate launch, the DDP config, a free port)
    on the tiny preset's small random model; no periodic checkpoint, so only the signal writes one."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "ddp.yaml"),
            "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0",
            str(ROOT / "opsd_train.py"), "--preset", "tiny", "--model_name_or_path", "tiny-random",
            "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--save_steps", "100", "--logging_steps", "1",
            "--report_to", "none", "--max_completion_length", "8"]


def start(out: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(launch(out), cwd=ROOT, env={**os.environ, **CPU_RANKS, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def per_step(out: Path) -> dict[int, tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


@pytest.mark.slow
def test_sigterm_to_every_process_and_the_launcher_checkpoints_and_resumes_exactly(tmp_path):
    reference = start(tmp_path / "reference")  # the uninterrupted run, beside the stopped one
    stopped = start(tmp_path / "run")
    seen = []
    for line in stopped.stdout:
        seen.append(line)
        if "[OPSD kl] step=1 " in line:
            break
    ranks = children(stopped.pid)
    assert len(ranks) == 2, "".join(seen)[-3000:]
    # As SLURM does: every process of the step, the launcher too. The ranks first, and the launcher
    # once both took theirs, so that its forwarded SIGTERM is each rank's second one for sure.
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    for line in stopped.stdout:
        seen.append(line)
        if sum("SIGTERM received: stopping after this step" in line for line in seen) == 2:
            break
    os.kill(stopped.pid, signal.SIGTERM)
    log = "".join(seen) + stopped.communicate(timeout=300)[0]
    assert "SIGKILL" not in log and "exitcode  : -" not in log, log[-3000:]  # no rank killed
    checkpoints = [int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*")]
    assert len(checkpoints) == 1 and 2 <= checkpoints[0] < STEPS, log[-3000:]
    assert f"stopped by SIGTERM at step {checkpoints[0]}; checkpoint " in log
    assert not (tmp_path / "run" / ".lock").exists() and not (tmp_path / "run" / ".staging").exists()

    resumed = subprocess.run(launch(tmp_path / "run"), cwd=ROOT, env={**os.environ, **CPU_RANKS},
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resuming from {tmp_path / 'run' / f'checkpoint-{checkpoints[0]}'}" in resumed.stdout
    assert reference.communicate(timeout=300)[0] and reference.returncode == 0
    expected = per_step(tmp_path / "reference")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert per_step(tmp_path / "run") == expected  # losses and gradient norms, step by step
    weights = [load_file(tmp_path / name / "adapter_model.safetensors") for name in ("reference", "run")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


@pytest.mark.slow
def test_a_grid_cells_stop_goes_to_its_ranks_so_the_launchers_grace_does_not_bound_it(tmp_path):
    """SlurmCell.checkpoint's stop of a 2-process cell (before a requeue): the ranks get the SIGTERM
    themselves and the launcher none, so its grace, which torch 2.11 fixes at 30 s whatever
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT says, does not bound the step and checkpoint. Here that grace is
    1 s: told instead, the launcher would kill the ranks before their checkpoint. (Once one rank
    has exited after the checkpoint, the launcher stops the other with that grace: it may end a
    rank still tearing down, which loses nothing.)"""
    from opsd.research import slurm_grid

    stopped = start(tmp_path / "run", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    seen = []
    for line in stopped.stdout:
        seen.append(line)
        if "[OPSD kl] step=1 " in line:
            break
    assert sorted(slurm_grid.stop_targets(stopped)) == sorted(children(stopped.pid)), "".join(seen)[-3000:]
    slurm_grid._stop_for_requeue({"cell": stopped})
    log = "".join(seen) + stopped.communicate(timeout=300)[0]
    assert log.count("SIGTERM received: stopping after this step") == 2, log[-3000:]  # each rank, once
    checkpoints = [int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*")]
    assert len(checkpoints) == 1 and 2 <= checkpoints[0] <= STEPS, log[-3000:]
    assert f"stopped by SIGTERM at step {checkpoints[0]}; checkpoint " in log
