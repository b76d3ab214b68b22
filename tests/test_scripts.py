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
