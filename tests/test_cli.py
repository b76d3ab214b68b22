"""The training command line (opsd_train.py): what each flag, OPSD_* variable, recipe line and
preset sets, their precedence (docs/SPEC.md §6), and the one-line errors that stop a bad
command before anything loads. The trainer's behaviour is tests/test_trainer.py's."""
import pytest
from test_trainer import _fake_tracker, _without_report_to, tiny_argv

import opsd_train
from data_collator import prompt_builder
from opsd import train_config
from opsd.tiny_default import build_qwen3_tokenizer

SWITCHES = [
    ("OPSD_CLIP_MODE", "token", "clip_mode"),
    ("OPSD_PAD_SIDE", "left", "pad_side"),
    ("OPSD_TEACHER_CONTEXT", "cot", "teacher_context"),
    ("OPSD_TEACHER_CONTEXT", "answer", "teacher_context"),
    ("OPSD_TEACHER_CONTEXT", "none", "teacher_context"),
    ("OPSD_STUDENT_PROMPT", "eval", "student_prompt"),
]


@pytest.fixture(scope="module")
def default_parse(tmp_path_factory):
    return opsd_train.parse(tiny_argv(tmp_path_factory.mktemp("p"), 1), env={})


def _config_diff(a, b):
    da, db = a.to_dict(), b.to_dict()
    return {k for k in da if da[k] != db[k]} - {"output_dir", "logging_dir"}


@pytest.mark.parametrize("var,value,attr", SWITCHES)
def test_each_switch_changes_its_field_and_nothing_else(var, value, attr, default_parse, tmp_path):
    _, base_cfg, base_data = default_parse
    _, cfg, data = opsd_train.parse(tiny_argv(tmp_path, 1), env={var: value})
    assert getattr(cfg, attr) == value
    assert _config_diff(base_cfg, cfg) == {attr}
    assert data.to_list() == base_data.to_list()


def test_prompt_switches_change_only_their_role(default_parse, tmp_path):
    _, base_cfg, data = default_parse
    tok = build_qwen3_tokenizer()
    row = data[0]
    base = prompt_builder(tok, base_cfg)
    _, eval_cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1), env={"OPSD_STUDENT_PROMPT": "eval"})
    _, cot_cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1), env={"OPSD_TEACHER_CONTEXT": "cot"})
    student_eval, teacher_cot = prompt_builder(tok, eval_cfg), prompt_builder(tok, cot_cfg)
    assert student_eval.student_prompt_ids(row) != base.student_prompt_ids(row)
    assert student_eval.teacher_prompt_ids(row) == base.teacher_prompt_ids(row)
    assert teacher_cot.teacher_prompt_ids(row) != base.teacher_prompt_ids(row)
    assert teacher_cot.student_prompt_ids(row) == base.student_prompt_ids(row)


def test_reason_first_without_a_context_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPSD_TEACHER_CONTEXT", "none")
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, "--reason_first", "true")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: reason_first needs a reference to analyse; teacher_context=none has none"
    assert not (tmp_path / "out").exists()


def test_data_select_switch_changes_only_the_data(default_parse, tmp_path):
    _, base_cfg, base_data = default_parse
    _, cfg, data = opsd_train.parse(tiny_argv(tmp_path, 1), env={"OPSD_DATA_SELECT": "nomath"})
    assert _config_diff(base_cfg, cfg) == set()
    assert 0 < len(data) < len(base_data)
    assert "math" not in set(data["source"])


def test_opsd_report_to_reaches_the_training_arguments(tmp_path, monkeypatch, capsys):
    """OPSD_REPORT_TO (default none) sets report_to; a --report_to flag wins and says so;
    the choice is recorded in the run configuration but not compared on resume."""
    from opsd import run_folder as run_folder

    argv = _without_report_to(tiny_argv(tmp_path, 1))
    script_args, cfg, data = opsd_train.parse(argv, env={})
    assert cfg.report_to == [] and opsd_train.run_identity(script_args, cfg, data)["report_to"] == "none"
    _fake_tracker(monkeypatch, "wandb")
    script_args, cfg, data = opsd_train.parse(argv, env={"OPSD_REPORT_TO": " WandB "})
    assert cfg.report_to == ["wandb"] and opsd_train.run_identity(script_args, cfg, data)["report_to"] == "wandb"
    assert "report_to" in run_folder.NOT_COMPARED
    _, cfg, _ = opsd_train.parse(argv + ["--report_to", "none"], env={"OPSD_REPORT_TO": "wandb"})
    assert cfg.report_to == []
    assert "note: --report_to none (command line) wins over OPSD_REPORT_TO=wandb" in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"OPSD_REPORT_TO": "tensorbored"},
     "error: OPSD_REPORT_TO='tensorbored' is not allowed; expected one of: none, tensorboard, wandb, trackio, all"),
    ({"OPSD_REPORT_TO": "trackio"},
     "error: report_to trackio: the trackio package is not installed (pip install trackio)"),
], ids=["bad-value", "not-installed"])
def test_bad_or_missing_tracker_is_one_line_before_loading(tmp_path, monkeypatch, capsys, env, message):
    from transformers import integrations

    monkeypatch.setattr(integrations, "is_trackio_available", lambda: False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert opsd_train.main(_without_report_to(tiny_argv(tmp_path / "out", 1))) == 2
    assert capsys.readouterr().err == message + "\n"
    assert not (tmp_path / "out").exists()


def test_bad_switch_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPSD_CLIP_MODE", "sideways")
    assert opsd_train.main(tiny_argv(tmp_path, 1)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "OPSD_CLIP_MODE" in err and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--top_k_loss", "-1", "top_k_loss=-1 is out of range; must be >= 0 (0 disables)"),
    ("--ema_decay", "1.0", "ema_decay=1.0 is out of range; must be in [0, 1)"),
    ("--lora_r", "0", "lora_r=0 is out of range; must be >= 1"),
])
def test_flags_are_held_to_the_recipe_ranges(tmp_path, capsys, flag, value, message):
    """A range is declared once (opsd.config.Recipe) and checked for flags as for recipe lines."""
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, flag, value)) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_recipe_values_reach_the_trainer_config(tmp_path, capsys):
    recipe = tmp_path / "recipe.env"
    recipe.write_text(
        "learning_rate=3e-4\nlr_scheduler_type=cosine\nwarmup_ratio=0.1\nmax_grad_norm=0.5\n"
        "lora_r=8\nlora_alpha=16\nbeta=0.5\njsd_token_clip=0.2\ntemperature=0.7\ntop_p=0.9\ntop_k=5\n"
        "max_completion_length=16\nfixed_teacher=false\nuse_ema_teacher=true\nema_decay=0.9\n"
        "top_k_loss=7\nteacher_thinking=true\nmax_steps=999  # budget knob: warned, ignored\n"
    )
    script_args, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--recipe", str(recipe)), env={})
    err = capsys.readouterr().err
    assert "max_steps" in err
    assert cfg.max_steps == 1
    # tiny_argv sets --learning_rate 1e-2: the command line wins over the recipe, and says so
    assert "--learning_rate 1e-2 (command line) wins over learning_rate=0.0003 from the recipe" in err
    assert cfg.learning_rate == 1e-2 and str(cfg.lr_scheduler_type.value) == "cosine"
    assert cfg.warmup_steps == 0.1 and cfg.max_grad_norm == 0.5  # transformers 5: a float < 1 is a ratio
    assert (cfg.beta, cfg.jsd_token_clip, cfg.temperature, cfg.top_p, cfg.top_k) == (0.5, 0.2, 0.7, 0.9, 5)
    assert cfg.max_completion_length == 16 and cfg.top_k_loss == 7 and cfg.teacher_thinking
    assert (cfg.fixed_teacher, cfg.use_ema_teacher, cfg.ema_decay) == (False, True, 0.9)
    lora = opsd_train.lora_config(script_args)
    assert (lora.r, lora.lora_alpha) == (8, 16)


def test_precedence_command_line_over_variable_over_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.env"
    recipe.write_text("beta=0.5\ntemperature=0.7\nmax_completion_length=16\n")
    argv = tiny_argv(tmp_path, 1, "--recipe", str(recipe), "--beta", "0.25", "--clip_mode", "entry",
                     "--max_completion_length", "8")
    _, cfg, _ = opsd_train.parse(argv, env={"OPSD_CLIP_MODE": "token", "OPSD_PAD_SIDE": "left"})
    err = capsys.readouterr().err
    assert (cfg.beta, cfg.clip_mode, cfg.max_completion_length) == (0.25, "entry", 8)  # command line
    assert cfg.pad_side == "left" and cfg.temperature == 0.7  # variable, recipe
    assert "--beta 0.25 (command line) wins over beta=0.5 from the recipe" in err
    assert "--clip_mode entry (command line) wins over OPSD_CLIP_MODE=token" in err
    _, shorter, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--recipe", str(recipe)), env={})
    assert shorter.max_completion_length == 16  # the recipe's value beats the tiny preset's 64


def test_tiny_preset_values_are_defaults_the_user_overrides(tmp_path, capsys):
    """The preset's values stand where nothing else sets the key; a recipe key, an OPSD_*
    variable or a flag beats them."""
    preset = opsd_train.TINY_PRESET
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1), env={})
    for key, value in preset.items():
        assert getattr(cfg, key) == value, key
    unchanged = tmp_path / "unchanged.env"
    unchanged.write_text("beta=0.5\n")  # leaves max_completion_length at its released 1024
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--recipe", str(unchanged)), env={})
    assert cfg.max_completion_length == preset["max_completion_length"]
    longer = tmp_path / "longer.env"
    longer.write_text("max_completion_length=128\n")
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--recipe", str(longer)), env={})
    assert cfg.max_completion_length == 128
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--max_completion_length", "100",
                                           "--max_teacher_prompt_length", "600", "--compile_loss", "true",
                                           "--rollout_cache_implementation", "static"), env={})
    assert (cfg.max_completion_length, cfg.max_teacher_prompt_length) == (100, 600)
    assert cfg.compile_loss is True and cfg.rollout_cache_implementation == "static"


def test_a_yaml_config_sits_below_the_preset_and_the_recipe_and_the_command_line_above_all(tmp_path, capsys):
    """default < YAML --config < tiny preset < recipe < OPSD_* < command line (docs/SPEC.md §6)."""
    yaml = tmp_path / "config.yaml"
    yaml.write_text("max_grad_norm: 0.7\nmax_completion_length: 32\nbeta: 0.5\n")
    recipe = tmp_path / "recipe.env"
    recipe.write_text("max_grad_norm=0.3\n")
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--config", str(yaml)), env={})
    assert (cfg.max_grad_norm, cfg.beta) == (0.7, 0.5)  # the YAML file over the defaults
    assert cfg.max_completion_length == opsd_train.TINY_PRESET["max_completion_length"]  # the preset over the YAML
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--config", str(yaml), "--recipe", str(recipe)), env={})
    # the recipe over the YAML file: a recipe file sets every recipe key (an unchanged one to its released value)
    assert cfg.max_grad_norm == 0.3 and cfg.beta == 0.0
    _, cfg, _ = opsd_train.parse(tiny_argv(tmp_path, 1, "--config", str(yaml), "--recipe", str(recipe),
                                           "--max_grad_norm", "0.2"), env={})
    assert cfg.max_grad_norm == 0.2


def test_preset_recipe_and_report_to_reach_the_config_typed_not_as_flag_text(tmp_path, monkeypatch):
    """One path: the parser sees exactly the user's command line; the preset, the recipe and
    OPSD_REPORT_TO reach it as typed defaults, never rendered into flags and parsed again."""
    from trl import TrlParser

    seen = []
    real = TrlParser.parse_args_and_config

    def spy(self, args=None, *rest, **kwargs):
        seen.append(list(args))
        return real(self, args, *rest, **kwargs)

    monkeypatch.setattr(TrlParser, "parse_args_and_config", spy)
    recipe = tmp_path / "recipe.env"
    recipe.write_text("max_grad_norm=0.3\nlr_scheduler_type=cosine\n")
    argv = tiny_argv(tmp_path, 1, "--recipe", str(recipe))
    script_args, cfg, _ = opsd_train.parse(argv, env={"OPSD_REPORT_TO": "none"})
    assert seen == [argv]
    layers = opsd_train.layered_defaults("tiny", opsd_train.parse_recipe(str(recipe))[0], 1, "none")
    assert layers["max_grad_norm"] == 0.3 and isinstance(layers["max_grad_norm"], float)
    assert layers["compile_layers"] is False and layers["model_name_or_path"] == "tiny"
    assert cfg.max_grad_norm == 0.3 and cfg.lr_scheduler_type == "cosine" and cfg.report_to == []


def test_vllm_rollouts_refuse_a_temperature_vllm_rejects(tmp_path, capsys):
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, "--use_vllm", "true", "--temperature", "2.5")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: temperature=2.5: vLLM rollouts need a temperature in [0.01, 2.0]"
    assert not (tmp_path / "out").exists()


def test_bad_recipe_fails_before_loading(tmp_path, capsys):
    recipe = tmp_path / "recipe.env"
    recipe.write_text("beta=0\nlearning_rat=1e-5\n")
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, "--recipe", str(recipe))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and ":2:" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_one_process_seeing_several_gpus_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Started without a launcher on a multi-GPU host (simulated), transformers would wrap the
    model in nn.DataParallel: refused before any model loads, also in train_capped.sh's check."""
    monkeypatch.setattr(train_config.OPSDConfig, "n_gpu", property(lambda self: 4))
    for extra in ([], ["--check_only", "--world_size", "1"]):
        assert opsd_train.main(tiny_argv(tmp_path / "out", 1) + extra) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.startswith("error: 4 GPUs are visible to one process") and "CUDA_VISIBLE_DEVICES=0" in err
    assert not (tmp_path / "out").exists()
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1) + ["--check_only", "--world_size", "4"]) == 0


@pytest.mark.parametrize("flags", [["--vllm_kv_cache_gib", "2"],
                                   ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_kv_cache_gib", "2"],
                                   ["--use_vllm", "true", "--vllm_kv_cache_gib", "0"]])
def test_a_fixed_vllm_kv_cache_is_for_colocated_vllm_only(tmp_path, capsys, flags):
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: vllm_kv_cache_gib=") and "colocate" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_use_vllm_with_a_vllm_outside_the_range_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.21.0" if name == "vllm" else real(name))
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, "--use_vllm", "true")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --use_vllm true: vLLM 0.21.0 is outside the supported range") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_use_vllm_without_vllm_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    assert opsd_train.main(tiny_argv(tmp_path / "out", 1, "--use_vllm", "true")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "vllm" in err.lower()
    assert not (tmp_path / "out").exists()


def test_bad_dataset_fails_before_loading(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    out = tmp_path / "out"
    assert opsd_train.main(tiny_argv(out, 1, "--dataset_name", str(data))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert "rows.jsonl" in err and "solution" in err
    assert not out.exists()
