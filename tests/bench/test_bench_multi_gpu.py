"""bench/multi_gpu.sh without GPUs: its arguments, the commands it plans (--dry-run), that
they are valid commands of the trainer, and the report it builds from the arms' logs.
The measurement itself needs a 2-GPU machine (README, "More than one GPU")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import multi_gpu_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "multi_gpu.sh"


def bench(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def plan(out, *args):
    result = bench(out, "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (out / "plan.txt").read_text().splitlines() == lines
    return {line.split(":", 1)[0].removeprefix("[plan] "): line.split(": ", 1)[1].split() for line in lines}


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_dry_run_plans_one_gpu_ddp_and_fsdp2_on_the_capped_budget(tmp_path):
    arms = plan(tmp_path)
    assert list(arms) == ["single", "ddp", "fsdp2"]
    single, ddp, fsdp2 = arms.values()
    assert "CUDA_VISIBLE_DEVICES=0" in single and "accelerate" not in single
    for cmd, config in ((ddp, "ddp.yaml"), (fsdp2, "fsdp2.yaml")):
        assert "CUDA_VISIBLE_DEVICES=0,1" in cmd and cmd[cmd.index("accelerate"):cmd.index("accelerate") + 2] == [
            "accelerate", "launch"]
        assert flag(cmd, "--config_file") == str(ROOT / "configs" / config) and flag(cmd, "--num_processes") == "2"
    # Global batch 32 = 4 per device x accumulation x processes, as train_capped.sh splits it.
    assert [flag(cmd, "--gradient_accumulation_steps") for cmd in (single, ddp, fsdp2)] == ["8", "4", "4"]
    for cmd in arms.values():
        assert "TORCH_LOGS=recompiles" in cmd
        assert (flag(cmd, "--max_steps"), flag(cmd, "--max_completion_length")) == ("8", "1024")
        assert flag(cmd, "--per_device_train_batch_size") == "4" and flag(cmd, "--recipe") == str(ROOT / "recipe.env")
    other = plan(tmp_path, "--arms", "ddp, zero3", "--steps", "12", "--completion", "256")
    assert list(other) == ["ddp", "zero3"] and flag(other["zero3"], "--config_file").endswith("configs/zero3.yaml")
    assert (flag(other["ddp"], "--max_steps"), flag(other["ddp"], "--max_completion_length")) == ("12", "256")


@pytest.mark.slow
def test_planned_arguments_are_valid_trainer_arguments(tmp_path):
    """The single arm's flags, on the embedded model, pass the trainer's own validation."""
    single = plan(tmp_path, "--arms", "single")["single"]
    args = single[single.index(str(ROOT / "opsd_train.py")) + 1:]
    args[args.index("--model_name_or_path") + 1] = "tiny"
    args[args.index("--output_dir") + 1] = str(tmp_path / "run")
    result = subprocess.run([sys.executable, str(ROOT / "opsd_train.py"), "--check_only", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    ([], "error: OUT_DIR is missing"),
    (["{out}", "--steps", "5"], "error: --steps must be an integer >= 8, got '5'"),
    (["{out}", "--completion", "0"], "error: --completion must be an integer in [1, 4096], got '0'"),
    (["{out}", "--arms", "single,fsdp1"], "error: --arms: 'fsdp1' is not an arm; expected single or an engine: ddp, "
                                          "fsdp2, zero2, zero3"),
    (["{out}", "--arms", "ddp,ddp"], "error: --arms names ddp twice"),
    (["{out}", "--frobnicate"], "error: unknown option --frobnicate"),
    (["{out}", "{out}2"], "error: one OUT_DIR only"),
    (["{out}", "--arms", "single,ddp"], "error: arm ddp needs 2 GPU(s), nvidia-smi lists 1"),  # before any work
])
def test_bad_arguments_are_one_line(tmp_path, args, message):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    result = bench(*(a.format(out=out) for a in args), env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == 2 and not result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith(message)
    assert not (out / "single").exists()


def _arm(out, name, processes, step_times, mem_mib, losses, recompiles=0, rc=0):
    folder = out / name
    folder.mkdir(parents=True)
    t, lines = 0.0, []
    for step, dt in enumerate(step_times, start=1):
        t += dt
        # as a real log has it: tqdm redraws its bar with carriage returns, the log line follows one
        lines.append(f"{t:9.2f}  50%|#####  |\r 62%|###### |\r"
                     f"[OPSD kl] step={step} loss={losses[step - 1]} true_kl=0.5")
    lines += [f"{t:9.2f} V0101 [0/1] [__recompiles] Recompiling function forward in layer.py"] * recompiles
    (folder / "train.log").write_text("\n".join(lines) + "\n")
    (folder / "gpu_mem.csv").write_text("".join(f"{i}, {m}\n" for i, series in enumerate(mem_mib) for m in series))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": loss, "opsd/true_kl": 0.5}) + "\n" for s, loss in enumerate(losses, start=1)))
    (folder / "run_config.json").write_text(json.dumps(
        {"num_processes": processes, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8 // processes}))
    (folder / "rc").write_text(f"{rc}\n")


def test_report_reads_the_arms_logs(tmp_path, capsys):
    # single: step 1 at 100 s, then 60, 9, 9.5, 9.2, 9.4, 9.1, 9.3 -> steady (steps 4..8) median 9.3
    _arm(tmp_path, "single", 1, [100, 60, 9, 9.5, 9.2, 9.4, 9.1, 9.3], [[1000, 30000, 20480]],
         [0.1, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03], recompiles=3)
    _arm(tmp_path, "ddp", 2, [120, 50, 5, 5.2, 5.1, 5.0, 5.3, 5.4], [[2048, 25600], [1024, 26624]],
         [0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], rc=0)
    assert multi_gpu_report.main(["report", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert (tmp_path / "table.md").read_text().strip() == table.strip()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| single") or line.startswith("| ddp")}
    assert rows["single"][:6] == ["1 x 4 x 8", "0", "8", "100.0", "9.30 (n=5)", "0: 29.3"]
    assert rows["single"][6] == "3"
    assert rows["ddp"][:6] == ["2 x 4 x 4", "0", "8", "120.0", "5.20 (n=5)", "0: 25.0, 1: 26.0"]
    assert "| 8 | 0.03 | 0.1 | 0.5 | 0.5 |" in table  # the last step of both arms, side by side
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [arm["arm"] for arm in summary] == ["single", "ddp"]


def test_stamp_prefixes_seconds_since_start():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu_report.py"), "stamp"],
                            input="a\n[OPSD kl] step=1 loss=1\n", capture_output=True, text=True)
    first, second = result.stdout.splitlines()
    assert first.split(None, 1)[1] == "a" and float(first.split()[0]) >= 0
    assert multi_gpu_report.STEP_LINE.search(second).group(2) == "1"
