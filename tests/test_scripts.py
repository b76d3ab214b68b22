"""The user-facing scripts, run as users run them: `train_capped.sh` and a
two-process `accelerate launch` (CPU / gloo stands in for several GPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lora_helpers import lora_checkpoint

ROOT = Path(__file__).resolve().parents[1]


# The script's plumbing on the tiny preset, with the small random model: a quarter of the
# learned model's cost per token (test_eval, test_grid and quickstart run the learned one).
TINY = {"OPSD_PRESET": "tiny", "OPSD_MODEL": "tiny-random"}


def run(cmd, env_extra, timeout=600, cwd=ROOT):
    env = {**os.environ, **env_extra}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in err[0]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny capped run, called as a user would from another folder: the recipe and
    OPSD_OUTPUT are relative to that folder."""
    caller = tmp_path_factory.mktemp("caller")
    # 16-token completions: the preset's budget of steps and batch at a quarter of its cost.
    (caller / "my.env").write_text("lr_scheduler_type=cosine\nmax_completion_length=16\n")
    cmd = ["bash", str(ROOT / "train_capped.sh"), "my.env"]
    result = run(cmd, {**TINY, "OPSD_OUTPUT": "runs/x"}, cwd=caller)
    assert result.returncode == 0, result.stderr[-3000:]
    return caller / "runs" / "x", result


@pytest.mark.slow
def test_train_capped_tiny_preset_end_to_end(tiny_run):
    out, result = tiny_run
    assert "8 steps x global batch 4 = 2 per device x 2 accumulation x 1 processes" in result.stdout
    assert (out / "checkpoint-8" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoint-4" / "adapter_model.safetensors").is_file()
    assert (out / "adapter_model.safetensors").is_file()  # final adapter at the top of the run folder
    assert not (ROOT / "runs").exists()  # relative to the caller, not to the repository
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # one record per step, no end-of-run duplicate
    assert result.stdout.count("[OPSD align]") == 1
    assert result.stdout.count("[OPSD kl]") == 8
    assert "{'loss'" not in result.stdout + result.stderr  # the step line is the only one per step
    assert "FutureWarning" not in result.stderr and "DeprecationWarning" not in result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("[OPSD] done:")]
    assert len(summary) == 1 and "8 steps" in summary[0] and str(out / "checkpoint-8") in summary[0]
    assert "last true_kl" in summary[0] and summary[0].endswith(f" | curves {out / 'curves.png'}")
    png = (out / "curves.png").read_bytes()  # drawn at the end of the run, beside metrics.jsonl
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_run_configuration_is_printed_and_stored(tiny_run):
    out, result = tiny_run
    config = json.loads((out / "run_config.json").read_text())
    assert config["lr_scheduler_type"] == "cosine"  # the recipe's one change from the released default
    assert "learning_rate" not in config  # unchanged recipe values are not listed
    assert config["OPSD_CLIP_MODE"] == "entry" and config["data_select"] == "none"
    assert config["train_rows"] > 0 and config["global_batch"] == 4 and config["max_steps"] == 8
    assert config["output_dir"] == str(out)
    for step in (4, 8):
        assert json.loads((out / f"checkpoint-{step}" / "run_config.json").read_text()) == config
    block = result.stdout.split("[OPSD] run configuration", 1)[1]
    for key, value in config.items():
        assert f"{key}" in block and str(value) in block
    assert not (out / ".staging").exists() and not (out / ".lock").exists()
    card = (out / "README.md").read_text()
    assert "None" not in card


def test_default_recipe_decays_the_learning_rate(tiny_run):
    """`bash train_capped.sh` uses recipe.env, whose one override is the cosine
    schedule: the rate falls every step (the released constant would not)."""
    out, _ = tiny_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["learning_rate"] for r in records if "learning_rate" in r]
    assert len(rates) == 8 and rates[0] <= 5e-6
    assert all(later < earlier for earlier, later in zip(rates, rates[1:], strict=False)), rates


def test_help_is_the_header_and_names_both_recipes():
    result = run(["bash", "train_capped.sh", "--help"], {})
    assert result.returncode == 0
    assert "default recipe.env: released recipe + cosine LR" in result.stdout
    assert "recipe.released.env      # the released recipe (constant LR)" in result.stdout
    assert "set -euo" not in result.stdout and not result.stdout.startswith("!")


def test_train_capped_resumes_a_finished_run_without_new_steps(tiny_run):
    out, _ = tiny_run
    before = (out / "metrics.jsonl").read_text()
    result = run(["bash", "train_capped.sh", str(out.parent.parent / "my.env")],
                 {**TINY, "OPSD_OUTPUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"is finished: its last checkpoint {out / 'checkpoint-8'} reached max_steps=8" in result.stdout
    assert (out / "metrics.jsonl").read_text() == before
    assert not (out / "checkpoint-9").exists()


def test_resume_into_a_run_of_another_configuration_is_refused(tiny_run):
    out, _ = tiny_run
    env = {**TINY, "OPSD_OUTPUT": str(out), "OPSD_CLIP_MODE": "token"}
    result = run(["bash", "train_capped.sh", str(out.parent.parent / "my.env")], env)
    assert_one_line_error(result, "OPSD_CLIP_MODE", "'entry' -> 'token'", "another OPSD_OUTPUT")
    assert "[OPSD] budget" not in result.stdout  # refused before accelerate starts


@pytest.mark.parametrize("env, fragments", [
    ({"OPSD_CLIP_MODE": "foo"}, ["OPSD_CLIP_MODE='foo'"]),
    ({"OPSD_REPORT_TO": "mlflow"}, ["OPSD_REPORT_TO='mlflow' is not allowed", "tensorboard, wandb, trackio, all"]),
    ({"OPSD_PRESET": "huge"}, ["OPSD_PRESET='huge'"]),
    ({"OPSD_MODEL": "./no-such-model"}, ["model ./no-such-model: no such folder"]),  # the preset does not hide it
    ({"OPSD_DATA": "rows.jsonl"}, ["train file rows.jsonl", "solution"]),  # relative to the caller
    ({"OPSD_OUTPUT": "a-file"}, ["a-file is a file"]),
    ({"OPSD_OUTPUT": "a-file/run"}, ["cannot be created", "is a file"]),
    ({"OPSD_TOKEN_MEAN_ROWS": "two"}, ["must be positive integers, got 'two'"]),
    ({"OPSD_TOKEN_MEAN_ROWS": "3"}, ["token_mean_rows=3: must be a positive divisor of per_device_train_batch_size=2"]),
], ids=["switch", "report-to", "preset", "model", "data", "output-file", "output-under-file", "token-mean-rows-text",
        "token-mean-rows-divisor"])
def test_train_capped_bad_input_is_one_line_before_launch(tmp_path, env, fragments):
    (tmp_path / "rows.jsonl").write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    (tmp_path / "a-file").write_text("not a folder\n")
    result = run(["bash", str(ROOT / "train_capped.sh")], {"OPSD_PRESET": "tiny", **env}, cwd=tmp_path)
    assert_one_line_error(result, *fragments)
    assert "[OPSD] budget" not in result.stdout


def test_train_capped_rejects_a_bad_recipe_before_loading(tmp_path):
    recipe = tmp_path / "bad.env"
    recipe.write_text("learning_rate=5e-6\nmax_completion_length=8192\n")
    out = tmp_path / "out"
    result = run(["bash", "train_capped.sh", str(recipe)], {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(out)})
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and f"{recipe}:2:" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_train_capped_stops_on_sigterm_with_a_checkpoint(tmp_path):
    """Preemption of the script itself: SIGTERM to train_capped.sh's process stops the run at a step
    boundary with a checkpoint and a non-zero status, without a launcher traceback."""
    import signal

    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "train_capped.sh")], cwd=tmp_path, text=True,
                            env={**os.environ, **TINY, "OPSD_OUTPUT": str(out)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if "[OPSD kl] step=1" in line:
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout and "Traceback" not in stderr
    step = run_folder_last(out)
    assert step is not None and (out / f"checkpoint-{step}" / "adapter_model.safetensors").is_file()
    assert not (out / ".lock").exists()


def test_help_all_starts_with_the_opsd_settings_variables_and_precedence():
    result = run([sys.executable, "opsd_train.py", "--help-all"], {})
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    assert text.startswith("usage: python opsd_train.py")
    inherited = text.index("Inherited flags")
    head = text[:inherited]
    assert "Precedence" in head.split("OPSD settings:")[0]
    for fragment in ("--clip_mode", "--jsd_token_clip", "--recipe", "OPSD_CLIP_MODE", "OPSD_DATA_SELECT",
                     "command-line flags"):
        assert fragment in " ".join(head.split()), fragment  # the text wraps to the terminal
    assert "--per_device_train_batch_size" in text[inherited:]


@pytest.mark.parametrize("columns", [80, 100])
def test_help_wraps_every_line_to_the_terminal_width(columns):
    """Our flags' help (from the config fields' metadata), the variables and argparse's inherited
    flags, their long choice lists included, fit the terminal, as argparse's own help does."""
    result = run([sys.executable, "opsd_train.py", "--help-all"], {"COLUMNS": str(columns)})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert all(len(line) <= columns for line in lines), max(lines, key=len)
    assert "  --clip_mode (default 'entry')" in lines  # the flag on its line, the help indented below
    assert "--optim {adamw_torch, adamw_torch_fused," in result.stdout  # choices wrap after their commas


def test_recipe_budget_knob_is_warned_and_ignored(tmp_path):
    recipe = tmp_path / "knob.env"
    recipe.write_text("max_steps=3\nper_device_train_batch_size=64\n")
    result = run([sys.executable, "-m", "opsd.config", "check", str(recipe)], {})
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
        '#!/usr/bin/env bash\n'
        'for ((i = 0; i < ${FAKE_GPUS:-4}; i++)); do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done\n')
    (bin_dir / "accelerate").write_text(
        '#!/usr/bin/env bash\necho "launch CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} $*"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    # The script validates everything (`opsd_train.py --check_only`, which needs vllm for
    # these runs) before it launches: a `python` that answers the check and passes the rest on.
    # A training run without the launcher (one process) is recorded like accelerate's.
    (bin_dir / "python").write_text(
        '#!/usr/bin/env bash\nif [[ " $* " == *" --check_only "* ]]; then echo "check $*"; exit 0; fi\n'
        'if [[ " $* " == *"/opsd_train.py "* ]]; then '
        'echo "train CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} $*"; '
        'exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OPSD_USE_VLLM": "1"}


def launch(env, **extra):
    """train_capped.sh on the fake host: the result and the line of the launch (accelerate's, or
    `train ...` for one process started without it)."""
    result = subprocess.run(["bash", "train_capped.sh"], cwd=ROOT, env={**env, **extra},
                            capture_output=True, text=True, timeout=120)
    line = next((out for out in result.stdout.splitlines() if out.startswith(("launch ", "train "))), "")
    return result, line


DDP_CONFIG = ROOT / "configs" / "ddp.yaml"


@pytest.mark.parametrize("extra, gpus, processes", [
    ({"FAKE_GPUS": "5"}, "1,2,3,4", 4),                                    # the server's GPU 0 excluded
    ({"FAKE_GPUS": "3", "OPSD_VLLM_SERVER_GPU": "1"}, "0,2", 2),
    ({"CUDA_VISIBLE_DEVICES": "4,5,6", "OPSD_VLLM_SERVER_GPU": "5", "OPSD_PER_DEVICE_BATCH": "8"}, "4,6", 2),
    ({"FAKE_GPUS": "8", "OPSD_VLLM_SERVER_GPU": "0, 7", "OPSD_NUM_PROCESSES": "4"}, "1,2,3,4", 4),  # the first 4 left
])
def test_server_mode_keeps_training_off_the_server_gpu(fake_gpu_host, extra, gpus, processes):
    result, line = launch(fake_gpu_host, OPSD_VLLM_MODE="server", **extra)
    assert result.returncode == 0, result.stderr
    assert line.startswith(f"launch CUDA_VISIBLE_DEVICES={gpus} launch --config_file {DDP_CONFIG} "
                           f"--num_processes {processes} ")
    assert "--vllm_mode server" in line
    assert f"--check_only --world_size {processes} " in result.stdout  # validated for that launch first


def test_token_mean_rows_reaches_the_trainer(fake_gpu_host):
    """OPSD_PER_DEVICE_BATCH=16 OPSD_TOKEN_MEAN_ROWS=4: 16 rows a forward, accumulation 2, the
    token mean over groups of 4 (the default's loss); unset, no flag (the micro-batch)."""
    result, line = launch(fake_gpu_host, FAKE_GPUS="1", OPSD_PER_DEVICE_BATCH="16", OPSD_TOKEN_MEAN_ROWS="4")
    assert result.returncode == 0, result.stderr
    assert "--per_device_train_batch_size 16 --gradient_accumulation_steps 2 " in line
    assert line.endswith(" --token_mean_rows 4"), line
    result, line = launch(fake_gpu_host, FAKE_GPUS="1")
    assert result.returncode == 0 and line and "--token_mean_rows" not in line


def test_colocate_and_remote_server_use_every_gpu(fake_gpu_host):
    for mode in ({"OPSD_VLLM_MODE": "colocate"}, {"OPSD_VLLM_MODE": "server", "OPSD_VLLM_SERVER_GPU": "none"}):
        result, line = launch(fake_gpu_host, FAKE_GPUS="4", **mode)
        assert result.returncode == 0, result.stderr
        assert line.startswith(f"launch CUDA_VISIBLE_DEVICES=unset launch --config_file {DDP_CONFIG} "
                               "--num_processes 4 "), line


@pytest.mark.parametrize("extra, line_start", [
    # One process on a multi-GPU host: no launcher, and one GPU visible (never nn.DataParallel).
    ({"OPSD_NUM_PROCESSES": "1"}, "train CUDA_VISIBLE_DEVICES=0 "),
    ({"OPSD_NUM_PROCESSES": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, "train CUDA_VISIBLE_DEVICES=2 "),
    ({"OPSD_PRESET": "tiny"}, "train CUDA_VISIBLE_DEVICES=0 "),
    # N processes below the visible GPUs: the first N.
    ({"OPSD_NUM_PROCESSES": "2"},
     f"launch CUDA_VISIBLE_DEVICES=0,1 launch --config_file {DDP_CONFIG} --num_processes 2 "),
    ({"OPSD_NUM_PROCESSES": "2", "CUDA_VISIBLE_DEVICES": "3,1,2"},
     f"launch CUDA_VISIBLE_DEVICES=3,1 launch --config_file {DDP_CONFIG} --num_processes 2 "),
], ids=["one", "one-of-visible", "tiny-preset", "two-of-four", "two-of-visible"])
def test_fewer_processes_than_gpus_use_the_first_ones(fake_gpu_host, extra, line_start):
    result, line = launch(fake_gpu_host, FAKE_GPUS="4", **extra)
    assert result.returncode == 0, result.stderr
    assert line.startswith(line_start), line
    processes = extra.get("OPSD_NUM_PROCESSES", "1")
    assert f"--check_only --world_size {processes} " in result.stdout


def test_more_processes_than_gpus_is_one_line_before_launch(fake_gpu_host):
    result, line = launch(fake_gpu_host, FAKE_GPUS="2", OPSD_NUM_PROCESSES="4")
    assert result.returncode == 2 and not line and "check " not in result.stdout
    assert result.stderr.splitlines() == ["error: OPSD_NUM_PROCESSES=4 but 2 GPUs are visible (0 1)"]


@pytest.mark.parametrize("name, file", [
    ("ddp", "ddp.yaml"), ("fsdp2", "fsdp2.yaml"), ("zero2", "zero2.yaml"), ("ZeRO3", "zero3.yaml"),
    ("configs/fsdp2.yaml", "fsdp2.yaml"),  # a path, relative to the caller's folder
])
def test_engine_is_passed_to_accelerate_as_its_config_file(fake_gpu_host, name, file):
    result, line = launch(fake_gpu_host, FAKE_GPUS="2", OPSD_ACCELERATE_CONFIG=name)
    assert result.returncode == 0, result.stderr
    assert line.startswith(f"launch CUDA_VISIBLE_DEVICES=unset launch --config_file {ROOT / 'configs' / file} "
                           "--num_processes 2 --num_machines 1 "), line


def test_sharded_engine_with_one_process_goes_through_the_launcher(fake_gpu_host):
    result, line = launch(fake_gpu_host, FAKE_GPUS="1", OPSD_ACCELERATE_CONFIG="zero3")
    assert result.returncode == 0, result.stderr
    assert line.startswith(f"launch CUDA_VISIBLE_DEVICES=unset launch --config_file {ROOT / 'configs' / 'zero3.yaml'} "
                           "--num_processes 1 "), line


@pytest.mark.parametrize("value, fragment", [
    ("zero4", "OPSD_ACCELERATE_CONFIG='zero4' is not allowed; expected one of: ddp, fsdp2, zero2, zero3, or the path"),
    ("missing.yaml", "OPSD_ACCELERATE_CONFIG='missing.yaml': no such file"),
])
def test_bad_engine_is_one_line_before_anything_runs(fake_gpu_host, value, fragment):
    result, line = launch(fake_gpu_host, FAKE_GPUS="2", OPSD_ACCELERATE_CONFIG=value)
    assert result.returncode == 2 and not line and "check " not in result.stdout
    (message,) = result.stderr.splitlines()
    assert message.startswith(f"error: {fragment}")


def test_the_tracker_is_the_variables_not_the_scripts(fake_gpu_host):
    """train_capped.sh hard-codes no --report_to: OPSD_REPORT_TO reaches opsd_train.py
    through the environment, where the check and the run read it (test_cli.py)."""
    result, line = launch(fake_gpu_host, FAKE_GPUS="4", OPSD_REPORT_TO="wandb")
    assert result.returncode == 0, result.stderr
    assert line.startswith("launch ") and "--report_to" not in line and "--report_to" not in result.stdout


@pytest.mark.parametrize("extra, fragment", [
    ({"CUDA_VISIBLE_DEVICES": "0"},
     "no training GPU: 0 GPUs left once OPSD_VLLM_SERVER_GPU=0 is excluded (visible: 0)"),
    ({"FAKE_GPUS": "4", "OPSD_NUM_PROCESSES": "4"},
     "OPSD_NUM_PROCESSES=4 but 3 GPUs left once OPSD_VLLM_SERVER_GPU=0 is excluded (visible: 0 1 2 3)"),
])
def test_server_mode_without_enough_training_gpus_is_one_line(fake_gpu_host, extra, fragment):
    result, line = launch(fake_gpu_host, OPSD_VLLM_MODE="server", **extra)
    assert result.returncode == 2 and not line
    (message,) = result.stderr.splitlines()
    assert message.startswith(f"error: OPSD_VLLM_MODE=server: {fragment}")


def test_the_own_engine_is_the_default_even_with_vllm_importable(fake_gpu_host, tmp_path):
    """With vllm importable (a fake package) and OPSD_USE_VLLM unset, training samples with the
    own engine and says why in one line; OPSD_USE_VLLM=1 passes vLLM's flags."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    env = {key: value for key, value in fake_gpu_host.items() if key != "OPSD_USE_VLLM"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    assert subprocess.run(["python", "-c", "import vllm"], env=env).returncode == 0
    result, line = launch(env, FAKE_GPUS="1")
    assert result.returncode == 0, result.stderr
    assert line.startswith("train ") and "--use_vllm" not in line
    (engine,) = [out for out in result.stdout.splitlines() if out.startswith("[OPSD] rollouts:")]
    assert engine == ("[OPSD] rollouts: own engine (default on GPUs: 4.1 s a step and 16 GiB against vLLM "
                      "colocate's 5.1 s and 51 GiB at Qwen3-1.7B, one call, BENCHMARKS.md; OPSD_USE_VLLM=1 for vLLM)")
    result, line = launch(env, FAKE_GPUS="1", OPSD_USE_VLLM="1")
    assert result.returncode == 0, result.stderr
    assert line.endswith(" --use_vllm true --vllm_mode colocate"), line
    assert "[OPSD] rollouts: vLLM colocate (OPSD_USE_VLLM=1)" in result.stdout.splitlines()


@pytest.mark.parametrize("extra, engine, flags", [
    ({"OPSD_USE_VLLM": "0"}, "own engine (OPSD_USE_VLLM=0)", None),
    ({"OPSD_VLLM_MODE": "server", "OPSD_VLLM_SERVER_GPU": "none"}, "vLLM server (OPSD_VLLM_MODE=server)",
     "--use_vllm true --vllm_mode server"),  # the mode alone asks for vLLM
    ({"OPSD_USE_VLLM": "1", "OPSD_PRESET": "tiny"}, "own engine (the tiny preset never uses vLLM)", None),
], ids=["off", "server-mode", "tiny"])
def test_the_engine_line_names_the_variable_that_chose_it(fake_gpu_host, extra, engine, flags):
    env = {key: value for key, value in fake_gpu_host.items() if key != "OPSD_USE_VLLM"}
    result, line = launch(env, FAKE_GPUS="1", **extra)
    assert result.returncode == 0, result.stderr
    assert f"[OPSD] rollouts: {engine}" in result.stdout.splitlines()
    assert (flags in line) if flags else ("--use_vllm" not in line and line)


def test_without_a_gpu_the_own_engine_is_used(fake_gpu_host):
    env = {key: value for key, value in fake_gpu_host.items() if key != "OPSD_USE_VLLM"}
    result, line = launch(env, FAKE_GPUS="0")
    assert result.returncode == 0, result.stderr
    assert "[OPSD] rollouts: own engine (no GPU visible)" in result.stdout.splitlines()
    assert line.startswith("train ") and "--use_vllm" not in line


@pytest.mark.parametrize("extra, fragment", [
    ({"OPSD_USE_VLLM": "yes"}, "OPSD_USE_VLLM='yes' is not allowed; expected 0 (the own engine, default) or 1 (vLLM)"),
    ({"OPSD_USE_VLLM": "true", "OPSD_PRESET": "tiny"}, "OPSD_USE_VLLM='true' is not allowed"),
    ({"OPSD_VLLM_MODE": "remote"}, "OPSD_VLLM_MODE='remote' is not allowed; expected colocate or server"),
    ({"OPSD_USE_VLLM": "0", "OPSD_VLLM_MODE": "server"},
     "OPSD_VLLM_MODE=server asks for vLLM rollouts but OPSD_USE_VLLM=0"),
], ids=["word", "tiny", "mode", "contradiction"])
def test_bad_vllm_choice_is_one_line_before_anything_runs(fake_gpu_host, extra, fragment):
    result, line = launch(fake_gpu_host, FAKE_GPUS="1", **extra)
    assert result.returncode == 2 and not line and "check " not in result.stdout
    (message,) = result.stderr.splitlines()
    assert message.startswith(f"error: {fragment}")


@pytest.mark.slow
def test_two_process_launch(tmp_path):
    """Data-parallel training of the CLI: gathers, barriers and the atomic checkpoint rename
    all run with two ranks (gloo on CPU stands in for NCCL). torchrun starts the ranks and
    accelerate joins them, as `accelerate launch` does on GPUs; `accelerate launch --cpu
    --num_processes 2` would start one process (several CPU ranks need mpirun there)."""
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "opsd_train.py", "--preset", "tiny", "--output_dir", str(out), "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--save_steps", "1", "--report_to", "none", "--max_completion_length", "8",
    ]  # fmt: skip
    result = run(cmd, {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "run_config.json").read_text())["num_processes"] == 2
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert not (out / ".staging").exists()
    assert result.stdout.count("[OPSD align]") == 1  # printed by the main process only
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["opsd/true_kl"] > 0


def _train_cmd(out, steps, save_steps):
    return [
        sys.executable, str(ROOT / "opsd_train.py"), "--preset", "tiny", "--model_name_or_path", "tiny-random",
        "--output_dir", str(out),
        "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--save_steps", str(save_steps), "--report_to", "none", "--max_completion_length", "8",
    ]  # fmt: skip


def _start(cmd, env_extra=None):
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env_extra or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _read_until(proc, fragment):
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if fragment in line:
            return "".join(seen)
    raise AssertionError(f"{fragment!r} never printed:\n" + "".join(seen)[-3000:])


@pytest.mark.slow
def test_faults_signal_stop_concurrent_run_kill_during_save(tmp_path):
    """One run folder through the faults a cluster job meets, each run a real process:
    SIGTERM mid-run (a checkpoint at the step boundary, exit 143); a resumed run killed
    with SIGKILL inside a checkpoint write, while a second run into the same folder is
    refused by the lock; then a re-run removes the partial save, takes over the stale
    lock, resumes from the last complete checkpoint and ends with one record per step."""
    import signal

    out = tmp_path / "run"
    first = _start(_train_cmd(out, 4, save_steps=100))  # no periodic save: only the signal writes one
    _read_until(first, "[OPSD kl] step=1")
    first.send_signal(signal.SIGTERM)
    rest = first.communicate(timeout=300)[0]
    assert first.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert "stopped by SIGTERM" in rest
    stopped_at = run_folder_last(out)
    assert stopped_at in (1, 2, 3)

    killed = _start(_train_cmd(out, 4, save_steps=1), {"OPSD_TEST_PAUSE_IN_SAVE": "120"})
    head = _read_until(killed, "[OPSD test] pausing")
    assert f"resuming from {out / f'checkpoint-{stopped_at}'}" in head
    assert (out / ".lock").read_text().split()[0] == str(killed.pid)
    second = run(_train_cmd(out, 4, save_steps=1), {})
    assert_one_line_error(second, f"in use by another run (PID {killed.pid}")
    killed.kill()
    killed.wait(timeout=60)
    partial = list((out / ".staging").iterdir())  # the checkpoint being written when the kill came
    assert len(partial) == 1 and partial[0].name.startswith("checkpoint-")
    assert not (out / partial[0].name).exists() and run_folder_last(out) == stopped_at

    final = run(_train_cmd(out, 4, save_steps=1), {})
    assert final.returncode == 0, final.stderr[-3000:]
    assert "removed the partial checkpoint" in final.stdout
    assert f"resuming from {out / f'checkpoint-{stopped_at}'}" in final.stdout
    assert (out / "checkpoint-4" / "adapter_model.safetensors").is_file()
    assert not (out / ".staging").exists() and not (out / ".lock").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def run_folder_last(out):
    steps = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")]
    return max(steps) if steps else None


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for folder in ("bench", "checks")
                                           for p in (ROOT / folder).glob("*.sh")), ids=str)
def test_the_gpu_scripts_parse(script):
    """bench/*.sh and checks/*.sh run mostly on the GPU machine, where a syntax error
    costs a whole call: `bash -n` here (usage is in each script's header)."""
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = (ROOT / script).read_text()
    assert text.startswith(("#!/usr/bin/env bash\n# ", "# Sourced by")), text[:60]


def test_dev_eval_checks_its_argument_before_printing_anything(tmp_path):
    """A path that is missing, a file, or a folder that is neither a checkpoint nor a run folder is
    one error line that says which, with nothing printed before it (no '[eval] ... evaluating on the
    default' line; issue 60 item 7); relative paths are the caller's."""
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "empty").mkdir()
    cases = {
        "notackpt": f"error: checkpoint folder not found: {tmp_path / 'notackpt'}",
        "notes.txt": f"error: {tmp_path / 'notes.txt'} is a file, not a checkpoint folder (holding "
                     "adapter_config.json) or a run folder (holding checkpoint-N folders)",
        "empty": f"error: {tmp_path / 'empty'} is neither a LoRA checkpoint (no adapter_config.json) nor a run "
                 "folder (no checkpoint-N folder)",
    }
    for argument, message in cases.items():
        result = run(["bash", str(ROOT / "dev_eval.sh"), argument], {"OPSD_EVAL_OUT": str(tmp_path / "out")},
                     timeout=120, cwd=tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n"), argument
    assert not (tmp_path / "out").exists()


def test_quickstart_ends_with_the_trained_checkpoint_and_a_loading_command_that_runs(tmp_path):
    """After the grid (here a stand-in `python` that runs nothing, on a machine without CUDA), the
    quickstart prints the trained arm's last checkpoint and a two-line command that loads it, which
    runs as printed, from any folder, without a warning (issue 60 item 8)."""
    out = tmp_path / "qs"
    run_folder = out / "token_left" / "seed-10" / "run"
    for step in (4, 9):
        (run_folder / f"checkpoint-{step}").mkdir(parents=True)
    checkpoint = run_folder / "checkpoint-12"  # the newest by step, not by name
    base = lora_checkpoint(checkpoint)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(
        '#!/usr/bin/env bash\ncase "$*" in\n  "-m opsd.config check-env") exit 0 ;;\n'
        '  "-c import sys, torch"*) exit 1 ;;\n  "-m opsd.research.grid grids/quickstart_cpu.json --out "*) exit 0 ;;\n'
        'esac\necho "unexpected: python $*" >&2; exit 3\n')
    (bin_dir / "python").chmod(0o755)
    result = run(["bash", str(ROOT / "quickstart.sh"), "--skip-install"],
                 {"OPSD_OUTPUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    command = [
        "python -W ignore::FutureWarning -c 'from peft import AutoPeftModelForCausalLM",
        f'model = AutoPeftModelForCausalLM.from_pretrained("{checkpoint}"); '
        'print(type(model).__name__, "on", model.peft_config["default"].base_model_name_or_path)\'']
    assert lines[-4:] == [
        f"[quickstart] trained checkpoint (token clip + left padding): {checkpoint}",
        "[quickstart] load it (its README.md, the model card, has a snippet that also generates):", *command]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    loaded = subprocess.run(["bash", "-c", "\n".join(command)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout == f"PeftModelForCausalLM on {base}\n"
    assert "warn" not in loaded.stderr.lower(), loaded.stderr
