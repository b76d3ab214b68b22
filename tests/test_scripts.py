"""The user-facing scripts, run as users run them: `train_capped.sh` and a
two-process `accelerate launch` (CPU / gloo stands in for several GPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env_extra, timeout=600):
    env = {**os.environ, **env_extra}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("capped") / "run"
    result = run(["bash", "train_capped.sh"], {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_train_capped_tiny_preset_end_to_end(tiny_run):
    out, result = tiny_run
    assert "8 steps x global batch 4 = 2 per device x 2 accumulation x 1 processes" in result.stdout
    assert (out / "checkpoint-8" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoint-4" / "adapter_model.safetensors").is_file()
    assert (out / "adapter_model.safetensors").is_file()  # final adapter at the top of the run folder
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[:8] == list(range(1, 9))
    assert result.stdout.count("[OPSD align]") == 1
    assert result.stdout.count("[OPSD kl]") == 8


def test_default_recipe_decays_the_learning_rate(tiny_run):
    """`bash train_capped.sh` uses recipe.env, whose one override is the cosine
    schedule: the rate falls every step (the released constant would not)."""
    out, _ = tiny_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["learning_rate"] for r in records if "learning_rate" in r]
    assert len(rates) == 8 and rates[0] <= 5e-6
    assert all(later < earlier for earlier, later in zip(rates, rates[1:])), rates


def test_help_is_the_header_and_names_both_recipes():
    result = run(["bash", "train_capped.sh", "--help"], {})
    assert result.returncode == 0
    assert "default recipe.env: released recipe + cosine LR" in result.stdout
    assert "recipe.released.env      # the released recipe (constant LR)" in result.stdout
    assert "set -euo" not in result.stdout and not result.stdout.startswith("!")


def test_train_capped_resumes_a_finished_run_without_new_steps(tiny_run):
    out, _ = tiny_run
    before = (out / "metrics.jsonl").read_text().count("opsd/true_kl")
    result = run(["bash", "train_capped.sh"], {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-8'}" in result.stdout
    assert "already reached max_steps=8" in result.stdout
    assert (out / "metrics.jsonl").read_text().count("opsd/true_kl") == before
    assert not (out / "checkpoint-9").exists()


def test_train_capped_rejects_a_bad_recipe_before_loading(tmp_path):
    recipe = tmp_path / "bad.env"
    recipe.write_text("learning_rate=5e-6\nmax_completion_length=8192\n")
    out = tmp_path / "out"
    result = run(["bash", "train_capped.sh", str(recipe)], {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(out)})
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and f"{recipe}:2:" in err[0]
    assert not out.exists()


def test_recipe_budget_knob_is_warned_and_ignored(tmp_path):
    recipe = tmp_path / "knob.env"
    recipe.write_text("max_steps=3\nper_device_train_batch_size=64\n")
    result = run([sys.executable, "opsd_config.py", "check", str(recipe)], {})
    assert result.returncode == 0
    assert "max_steps" in result.stderr and "per_device_train_batch_size" in result.stderr
    assert "max_steps" not in result.stdout


@pytest.fixture
def fake_gpu_host(tmp_path):
    """PATH with a fake `nvidia-smi -L` (FAKE_GPUS GPUs) and a fake `accelerate` that
    prints the GPUs and arguments it would have been launched with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/usr/bin/env bash\nfor ((i = 0; i < ${FAKE_GPUS:-4}; i++)); do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done\n')
    (bin_dir / "accelerate").write_text(
        '#!/usr/bin/env bash\necho "launch CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} $*"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OPSD_USE_VLLM": "1"}


def launch(env, **extra):
    result = subprocess.run(["bash", "train_capped.sh"], cwd=ROOT, env={**env, **extra},
                            capture_output=True, text=True, timeout=120)
    line = next((l for l in result.stdout.splitlines() if l.startswith("launch ")), "")
    return result, line


@pytest.mark.parametrize("extra, gpus, processes", [
    ({"FAKE_GPUS": "5"}, "1,2,3,4", 4),                                    # the server's GPU 0 excluded
    ({"FAKE_GPUS": "3", "OPSD_VLLM_SERVER_GPU": "1"}, "0,2", 2),
    ({"CUDA_VISIBLE_DEVICES": "4,5,6", "OPSD_VLLM_SERVER_GPU": "5", "OPSD_PER_DEVICE_BATCH": "8"}, "4,6", 2),
    ({"FAKE_GPUS": "8", "OPSD_VLLM_SERVER_GPU": "0, 7", "OPSD_NUM_PROCESSES": "4"}, "1,2,3,4,5,6", 4),
])
def test_server_mode_keeps_training_off_the_server_gpu(fake_gpu_host, extra, gpus, processes):
    result, line = launch(fake_gpu_host, OPSD_VLLM_MODE="server", **extra)
    assert result.returncode == 0, result.stderr
    assert line.startswith(f"launch CUDA_VISIBLE_DEVICES={gpus} launch --num_processes {processes} ")
    assert "--vllm_mode server" in line


def test_colocate_and_remote_server_use_every_gpu(fake_gpu_host):
    for mode in ({"OPSD_VLLM_MODE": "colocate"}, {"OPSD_VLLM_MODE": "server", "OPSD_VLLM_SERVER_GPU": "none"}):
        result, line = launch(fake_gpu_host, FAKE_GPUS="4", **mode)
        assert result.returncode == 0, result.stderr
        assert line.startswith("launch CUDA_VISIBLE_DEVICES=unset launch --num_processes 4 "), line


@pytest.mark.parametrize("extra, fragment", [
    ({"CUDA_VISIBLE_DEVICES": "0"}, "no training GPU: 0 GPUs left once OPSD_VLLM_SERVER_GPU=0 is excluded (visible: 0)"),
    ({"FAKE_GPUS": "4", "OPSD_NUM_PROCESSES": "4"},
     "OPSD_NUM_PROCESSES=4 but 3 GPUs left once OPSD_VLLM_SERVER_GPU=0 is excluded (visible: 0 1 2 3)"),
])
def test_server_mode_without_enough_training_gpus_is_one_line(fake_gpu_host, extra, fragment):
    result, line = launch(fake_gpu_host, OPSD_VLLM_MODE="server", **extra)
    assert result.returncode == 2 and not line
    (message,) = result.stderr.splitlines()
    assert message.startswith(f"error: OPSD_VLLM_MODE=server: {fragment}")


def test_two_process_launch(tmp_path):
    """Data-parallel training through accelerate: gathers, barriers and the atomic
    checkpoint rename all run with two ranks (gloo on CPU stands in for NCCL)."""
    out = tmp_path / "ddp"
    cmd = [
        "accelerate", "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "opsd_train.py", "--preset", "tiny", "--output_dir", str(out), "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--save_steps", "1", "--report_to", "none", "--max_completion_length", "8",
    ]  # fmt: skip
    result = run(cmd, {})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert result.stdout.count("[OPSD align]") == 1  # printed by the main process only
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["opsd/true_kl"] > 0
