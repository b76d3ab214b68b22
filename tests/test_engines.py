"""The multi-GPU engines of train_capped.sh (OPSD_ACCELERATE_CONFIG): the shipped accelerate
configs go through accelerate's own loader and launcher, and what the training processes
would then be told is what OPSD relies on (docs: README, "More than one GPU").
How train_capped.sh passes them on is tested in test_scripts.py."""

import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from opsd.config import ACCELERATE_CONFIGS, CONFIGS_DIR, ConfigError, accelerate_config_path


def launcher_environment(path):
    """The environment `accelerate launch --config_file PATH --num_processes 2` gives each
    process, computed by accelerate's own code without starting anything."""
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(path), "--num_processes", "2", "--num_machines", "1", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_every_shipped_config_is_valid_for_accelerate(name):
    path = accelerate_config_path(name)
    config = load_config_from_file(path)  # refuses unknown top-level keys
    # Nested keys are copied onto the launcher's arguments, and an unknown one is silently kept
    # there: each must be an argument of `accelerate launch`.
    known = {action.dest for action in launch_command_parser()._actions}
    nested = [*config.fsdp_config, *config.deepspeed_config, *config.dynamo_config]
    assert nested and set(nested) <= known, set(nested) - known
    assert config.num_machines == 1 and config.num_processes == -1  # train_capped.sh passes the count
    env = launcher_environment(path)
    # The trainer's own settings decide precision (--bf16) and compilation (its decoder layers);
    # DeepSpeed's launcher leaves the dynamo variable unset, which accelerate reads as no.
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and env.get("ACCELERATE_DYNAMO_BACKEND", "NO") == "NO"


def test_ddp_is_plain_data_parallel():
    env = launcher_environment(accelerate_config_path("ddp"))
    assert "ACCELERATE_USE_FSDP" not in env and "ACCELERATE_USE_DEEPSPEED" not in env


def test_fsdp2_shards_per_layer_and_saves_a_full_state_dict(monkeypatch):
    env = launcher_environment(accelerate_config_path("fsdp2"))
    assert env["ACCELERATE_USE_FSDP"] == "true"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # what the trainer's Accelerator builds from it
    assert plugin.fsdp_version == 2
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"  # one unit per decoder layer
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # peft writes adapter_model.safetensors from it
    assert plugin.reshard_after_forward is True
    assert plugin.activation_checkpointing is False  # the trainer checkpoints; transformers refuses both
    assert plugin.cpu_ram_efficient_loading is False


@pytest.mark.parametrize("name, stage", [("zero2", "2"), ("zero3", "3")])
def test_deepspeed_stages(name, stage):
    env = launcher_environment(accelerate_config_path(name))
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == stage
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] \
        == "none"
    # Accumulation and clipping stay "auto": the trainer's values (train_capped.sh, the recipe).
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env and "ACCELERATE_GRADIENT_CLIPPING" not in env
    if stage == "3":
        # Saving gathers 16-bit weights, so that peft can write the adapter file.
        assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
        assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"


def test_names_paths_and_bad_values(tmp_path, monkeypatch):
    assert accelerate_config_path("") == accelerate_config_path("ddp") == f"{CONFIGS_DIR}/ddp.yaml"
    assert accelerate_config_path(" FSDP2 ") == f"{CONFIGS_DIR}/fsdp2.yaml"
    own = tmp_path / "mine.yml"
    own.write_text("distributed_type: MULTI_GPU\n")
    monkeypatch.chdir(tmp_path)
    assert accelerate_config_path("mine.yml") == str(own)  # relative to the caller's folder
    for bad, message in [("zero1", "is not allowed"), ("gone.yaml", "no such file"), ("mine", "is not allowed")]:
        with pytest.raises(ConfigError, match=message):
            accelerate_config_path(bad)


def test_cli_prints_the_file_or_one_error_line():
    cli = [sys.executable, "-m", "opsd.config", "accelerate-config"]
    repo = os.path.dirname(CONFIGS_DIR)
    ok = subprocess.run([*cli, "zero3"], capture_output=True, text=True, cwd=repo)
    assert ok.returncode == 0 and ok.stdout.strip() == f"{CONFIGS_DIR}/zero3.yaml"
    bad = subprocess.run([*cli, "fsdp"], capture_output=True, text=True, cwd=repo)
    assert bad.returncode == 2 and not bad.stdout
    assert bad.stderr.splitlines() == [
        "error: OPSD_ACCELERATE_CONFIG='fsdp' is not allowed; expected one of: ddp, fsdp2, zero2, zero3, or the path "
        "of an accelerate config file (.yaml, .yml or .json)"
    ]


def test_docs_name_every_engine_and_its_file():
    """The engines are declared once (opsd.config.ACCELERATE_CONFIGS); the README, the table of
    docs/MULTI_GPU.md, the script's help and the spec name the same ones."""
    root = CONFIGS_DIR.rsplit("/", 1)[0]
    readme = open(f"{root}/README.md", encoding="utf-8").read()
    guide = open(f"{root}/docs/MULTI_GPU.md", encoding="utf-8").read()
    header = open(f"{root}/train_capped.sh", encoding="utf-8").read().split("set -euo", 1)[0]
    spec = open(f"{root}/docs/SPEC.md", encoding="utf-8").read()
    names = list(ACCELERATE_CONFIGS)
    for name, (file, _) in ACCELERATE_CONFIGS.items():
        assert f"`{name}`" in readme, name
        assert f"| `{name}`" in guide and f"`configs/{file}`" in guide, name
    assert f"{names[0]} (default), {', '.join(names[1:])}" in header
    assert f"`{names[0]}` (default), " + ", ".join(f"`{n}`" for n in names[1:]) in spec
