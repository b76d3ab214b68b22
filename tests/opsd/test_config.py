"""opsd.config: environment switches, recipe parsing and the `check` CLI."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.config import BUDGET_KNOBS, ConfigError, Recipe, RecipeError, Switches, check_env, parse_recipe

ROOT = Path(__file__).resolve().parents[2]

RELEASED = {
    "learning_rate": 5e-6, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
    "max_grad_norm": 0.1, "lora_r": 64, "lora_alpha": 128, "beta": 0.0,
    "jsd_token_clip": 0.05, "temperature": 1.1, "top_p": 0.95, "top_k": 20, "lmbda": 1.0,
    "max_completion_length": 1024, "fixed_teacher": True, "use_ema_teacher": False,
    "ema_decay": 0.999, "reason_first": False, "teacher_thinking": False,
    "top_k_loss": 0, "use_tinker_loss": False, "num_generations": 8,
}

# every key set to a non-default value: (text in the file, parsed value)
EVERY_KEY = {
    "learning_rate": ("1e-5", 1e-5), "lr_scheduler_type": ("cosine", "cosine"),
    "warmup_ratio": ("0.1", 0.1), "max_grad_norm": ("1.0", 1.0), "lora_r": ("16", 16),
    "lora_alpha": ("32", 32), "beta": ("0.5", 0.5), "jsd_token_clip": ("0.1", 0.1),
    "temperature": ("0.7", 0.7), "top_p": ("1", 1.0), "top_k": ("0", 0), "lmbda": ("0.5", 0.5),
    "max_completion_length": ("4096", 4096), "fixed_teacher": ("false", False),
    "use_ema_teacher": ("true", True), "ema_decay": ("0.99", 0.99), "reason_first": ("true", True),
    "teacher_thinking": ("true", True), "top_k_loss": ("64", 64), "use_tinker_loss": ("true", True),
    "num_generations": ("4", 4),
}


def write(tmp_path, text, name="recipe.env"):
    path = tmp_path / name
    path.write_text(text)
    return path


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "opsd.config", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)


# -- recipe: values ---------------------------------------------------------

def test_recipe_fields_are_the_whitelist_with_released_defaults():
    assert dataclasses.asdict(Recipe()) == RELEASED
    for name, value in RELEASED.items():
        assert type(getattr(Recipe(), name)) is type(value), name


def test_empty_file_gives_defaults(tmp_path):
    recipe, warnings = parse_recipe(write(tmp_path, "# nothing set\n\n"))
    assert recipe == Recipe() and warnings == []


def test_every_key_is_parsed_with_its_type(tmp_path):
    text = "".join(f"{key}={raw}\n" for key, (raw, _) in EVERY_KEY.items())
    recipe, warnings = parse_recipe(write(tmp_path, text))
    assert warnings == []
    for key, (_, expected) in EVERY_KEY.items():
        value = getattr(recipe, key)
        assert value == expected and type(value) is type(expected), key


def test_comments_blank_lines_whitespace_quotes_and_export(tmp_path):
    text = (
        "# the released recipe, tweaked\n"
        "\n"
        "   learning_rate = 2e-6   # trailing comment\n"
        "\tbeta=\"0.25\"\n"
        "export lr_scheduler_type='linear'\n"
        "export  lora_r = \"8\"  # export, spaces and quotes together\n"
        "   \n"
    )
    recipe, warnings = parse_recipe(write(tmp_path, text))
    assert (recipe.learning_rate, recipe.beta, recipe.lr_scheduler_type, recipe.lora_r) == (2e-6, 0.25, "linear", 8)
    assert warnings == []


@pytest.mark.parametrize("raw, expected", [
    ("true", True), ("TRUE", True), ("True", True), ("1", True),
    ("false", False), ("FALSE", False), ("False", False), ("0", False),
])
def test_boolean_spellings(tmp_path, raw, expected):
    recipe, _ = parse_recipe(write(tmp_path, f"reason_first={raw}\n"))
    assert recipe.reason_first is expected


@pytest.mark.parametrize("value", ["0.01", "2", "1.1"])
def test_temperatures_vllm_samples_with_are_accepted(tmp_path, value):
    recipe, _ = parse_recipe(write(tmp_path, f"temperature={value}\n"))
    assert recipe.temperature == float(value)


def test_jsd_token_clip_none_disables(tmp_path):
    recipe, _ = parse_recipe(write(tmp_path, "jsd_token_clip=none\n"))
    assert recipe.jsd_token_clip == 0.0


def test_ema_teacher_with_fixed_teacher_off(tmp_path):
    recipe, _ = parse_recipe(write(tmp_path, "fixed_teacher=false\nuse_ema_teacher=true\n"))
    assert (recipe.fixed_teacher, recipe.use_ema_teacher) == (False, True)


def test_as_lines_round_trips(tmp_path):
    text = "".join(f"{key}={raw}\n" for key, (raw, _) in EVERY_KEY.items())
    recipe, _ = parse_recipe(write(tmp_path, text))
    again, _ = parse_recipe(write(tmp_path, "\n".join(recipe.as_lines()), name="again.env"))
    assert again == recipe


# -- the shipped recipe files -------------------------------------------------

# What each shipped file changes from the released recipe (the Recipe defaults).
SHIPPED = {"recipe.env": {"lr_scheduler_type": "cosine"}, "recipe.released.env": {}}


@pytest.mark.parametrize("name, overrides", SHIPPED.items())
def test_shipped_recipe_files(name, overrides):
    recipe, warnings = parse_recipe(ROOT / name)
    assert warnings == []
    assert recipe == dataclasses.replace(Recipe(), **overrides)


@pytest.mark.parametrize("name, overrides", SHIPPED.items())
def test_shipped_recipe_files_list_every_key_at_its_released_default(tmp_path, name, overrides):
    """Uncommenting every `# key=value` line must change nothing but the active
    overrides: each key is listed exactly once (a second one is a duplicate-key
    error) and every commented value is the released default."""
    fields = {f.name for f in dataclasses.fields(Recipe)}
    listed, lines = [], []
    for line in (ROOT / name).read_text().splitlines():
        match = re.match(r"#?\s*(\w+)=", line)
        if match and match.group(1) in fields:
            listed.append(match.group(1))
            line = line.lstrip("#").strip()
        lines.append(line)
    assert sorted(listed) == sorted(fields)
    recipe, _ = parse_recipe(write(tmp_path, "\n".join(lines) + "\n"))
    assert recipe == dataclasses.replace(Recipe(), **overrides)


# -- recipe: budget knobs ---------------------------------------------------

def test_budget_knobs_warn_with_line_and_are_ignored(tmp_path):
    text = "beta=0.5\n" + "".join(f"{knob}=7\n" for knob in BUDGET_KNOBS)
    path = write(tmp_path, text)
    recipe, warnings = parse_recipe(path)
    assert recipe == dataclasses.replace(Recipe(), beta=0.5)
    assert len(warnings) == len(BUDGET_KNOBS)
    for line, (knob, warning) in enumerate(zip(BUDGET_KNOBS, warnings, strict=False), start=2):
        assert warning.startswith(f"{path}:{line}: {knob} ")
        assert "ignored" in warning and "\n" not in warning


# -- recipe: errors -----------------------------------------------------------

ERRORS = [
    # (file text, line named in the message, fragment of the message)
    ("beta=0\nlearnin_rate=1e-5\n", 2, "unknown key 'learnin_rate' (did you mean learning_rate?)"),
    ("beta=0\n\nthis is not a setting\n", 3, "expected KEY=VALUE"),
    ("=5\n", 1, "expected KEY=VALUE"),
    ("beta=0\nbeta=0.5\n", 2, "duplicate key beta (first set on line 1)"),
    ("lora_r=sixty\n", 1, "not an integer"),
    ("lora_r=64.0\n", 1, "not an integer"),
    ("learning_rate=fast\n", 1, "not a finite number"),
    ("learning_rate=nan\n", 1, "not a finite number"),
    ("fixed_teacher=yes\n", 1, "not a boolean"),
    ("lr_scheduler_type=cosine_annealing\n", 1, "not a scheduler"),
    ("beta=\n", 1, "not a finite number"),
    ("max_completion_length=4097\n", 1, "out of range"),
    ("max_completion_length=0\n", 1, "out of range"),
    ("learning_rate=0\n", 1, "out of range"),
    ("learning_rate=-1e-5\n", 1, "out of range"),
    ("jsd_token_clip=-0.1\n", 1, "out of range"),
    ("beta=1.5\n", 1, "out of range"),
    ("beta=-0.1\n", 1, "out of range"),
    ("temperature=0\n", 1, "out of range"),
    ("temperature=2.5\n", 1, "temperature=2.5 is out of range; must be in [0.01, 2.0], the range vLLM samples with"),
    ("temperature=0.005\n", 1, "out of range"),
    ("top_p=0\n", 1, "out of range"),
    ("top_p=1.01\n", 1, "out of range"),
    ("lmbda=2\n", 1, "out of range"),
    ("ema_decay=1\n", 1, "out of range"),
    ("ema_decay=-0.5\n", 1, "out of range"),
    ("lora_r=0\n", 1, "out of range"),
    ("warmup_ratio=1.5\n", 1, "out of range"),
    ("max_grad_norm=-1\n", 1, "out of range"),
    ("top_k_loss=-1\n", 1, "out of range"),
    ("fixed_teacher=true\n# both on\nuse_ema_teacher=true\n", 3, "mutually exclusive"),
    ("use_ema_teacher=true\nbeta=0\nfixed_teacher=1\n", 3, "mutually exclusive"),
    ("# fixed_teacher is on by default\nuse_ema_teacher=true\n", 2, "mutually exclusive"),
]


@pytest.mark.parametrize("text, line, fragment", ERRORS)
def test_recipe_errors_name_the_line(tmp_path, text, line, fragment):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as caught:
        parse_recipe(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: ")
    assert fragment in message
    assert "\n" not in message
    assert caught.value.line == line


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        parse_recipe(tmp_path / "absent.env")


# -- CLI ------------------------------------------------------------------------

def test_cli_check_prints_recipe_and_warnings(tmp_path):
    path = write(tmp_path, "beta=0.5\nmax_steps=10\n")
    result = run_cli("check", str(path))
    assert result.returncode == 0
    expected = dataclasses.replace(Recipe(), beta=0.5).as_lines()
    assert result.stdout.splitlines() == expected
    assert "beta=0.5" in expected and "fixed_teacher=true" in expected
    assert result.stderr.splitlines() == [
        f"warning: {path}:2: max_steps is a budget knob fixed by train_capped.sh; ignored"]


@pytest.mark.parametrize("text, line, fragment", [ERRORS[0], ERRORS[3], ERRORS[11], ERRORS[30]])
def test_cli_check_errors_exit_2_with_one_line(tmp_path, text, line, fragment):
    path = write(tmp_path, text)
    result = run_cli("check", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:{line}: ") and fragment in lines[0]


def test_cli_switches(tmp_path):
    ok = run_cli("switches", env={"OPSD_PAD_SIDE": "left"})
    assert ok.returncode == 0 and "OPSD_PAD_SIDE=left" in ok.stdout.splitlines()
    bad = run_cli("switches", env={"OPSD_PAD_SIDE": "middle"})
    assert bad.returncode == 2 and bad.stderr.startswith("error: OPSD_PAD_SIDE=")


def test_report_to_variable():
    from opsd.config import REPORT_TO_VALUES, read_report_to

    assert read_report_to({}) is None and read_report_to({"OPSD_REPORT_TO": "  "}) is None  # the config's default
    assert REPORT_TO_VALUES[0] == "none"
    for value in REPORT_TO_VALUES:
        assert read_report_to({"OPSD_REPORT_TO": f" {value.upper()} "}) == value
    with pytest.raises(ConfigError, match="OPSD_REPORT_TO='comet_ml' is not allowed; expected one of: none, "):
        read_report_to({"OPSD_REPORT_TO": "comet_ml"})
    ok = run_cli("switches", env={"OPSD_REPORT_TO": "TensorBoard"})
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "OPSD_REPORT_TO=tensorboard"
    bad = run_cli("switches", env={"OPSD_REPORT_TO": "x"})
    assert bad.returncode == 2 and bad.stderr.startswith("error: OPSD_REPORT_TO='x'")


# -- switches ---------------------------------------------------------------------

def test_switch_defaults():
    assert Switches.from_env({}) == Switches("entry", "right", "solution", "paper", "none")


@pytest.mark.parametrize("var, field, values", [
    ("OPSD_CLIP_MODE", "clip_mode", ["entry", "token"]),
    ("OPSD_PAD_SIDE", "pad_side", ["right", "left"]),
    ("OPSD_TEACHER_CONTEXT", "teacher_context", ["solution", "cot", "both", "shuffled", "answer", "none"]),
    ("OPSD_STUDENT_PROMPT", "student_prompt", ["paper", "eval"]),
    ("OPSD_DATA_SELECT", "data_select", ["none", "nomath", "hard"]),
])
def test_each_switch_value(var, field, values):
    for value in values:
        switches = Switches.from_env({var: value})
        assert getattr(switches, field) == value
        assert switches.as_env()[var] == value
    assert getattr(Switches.from_env({var: f" {values[-1].upper()} "}), field) == values[-1]
    assert getattr(Switches.from_env({var: ""}), field) == values[0]  # empty = unset
    with pytest.raises(ConfigError) as caught:
        Switches.from_env({var: "bogus"})
    message = str(caught.value)
    assert var in message and "'bogus'" in message and ", ".join(values) in message and "\n" not in message


@pytest.mark.parametrize("raw, canonical", [
    ("nomath,hard", "nomath,hard"), ("hard,nomath", "nomath,hard"), (" Hard , NOMATH ", "nomath,hard"),
])
def test_data_select_combination_is_canonical(raw, canonical):
    switches = Switches.from_env({"OPSD_DATA_SELECT": raw})
    assert switches.data_select == canonical and switches.as_env()["OPSD_DATA_SELECT"] == canonical


@pytest.mark.parametrize("raw", ["hard,hard", "nomath,bogus", "none,nomath", ",hard"])
def test_bad_data_select_combination_is_one_line(raw):
    with pytest.raises(ConfigError) as caught:
        Switches.from_env({"OPSD_DATA_SELECT": raw})
    message = str(caught.value)
    assert message.startswith(f"OPSD_DATA_SELECT={raw!r} is not allowed (") and "\n" not in message


def test_switches_read_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("OPSD_CLIP_MODE", "token")
    assert Switches.from_env().clip_mode == "token"


def test_one_value_parsers_match_the_recipe_and_switch_rules():
    from opsd.config import parse_recipe_value, parse_switch_value

    assert parse_recipe_value("beta", " 0.5 ") == 0.5 and parse_recipe_value("jsd_token_clip", "none") == 0.0
    assert parse_recipe_value("top_k_loss", "20") == 20 and parse_recipe_value("teacher_thinking", "true") is True
    assert parse_switch_value("teacher_context", " Shuffled ") == "shuffled"
    assert parse_switch_value("clip_mode", "") == "entry"  # empty = the default, as for the variable
    for call, message in [
        (lambda: parse_recipe_value("beta", "2"), "beta=2 is out of range; must be in [0, 1]"),
        (lambda: parse_recipe_value("top_k_loss", "1.5"), "top_k_loss='1.5' is not an integer"),
        (lambda: parse_recipe_value("bta", "0"), "unknown key 'bta' (did you mean beta?)"),
        (lambda: parse_switch_value("pad_side", "middle"),
         "pad_side='middle' is not allowed; expected one of: right, left"),
    ]:
        with pytest.raises(ConfigError) as caught:
            call()
        assert str(caught.value) == message


# -- the variables' listing and the docs' tables --------------------------------

def doc_tables(path: str, heading: str) -> list[str]:
    """The markdown tables of one section of a doc (up to the next `## ` heading), each as its
    lines joined."""
    text = (ROOT / path).read_text(encoding="utf-8")
    body = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return [block.strip("\n") for block in re.findall(r"(?:^\|.*\|\n)+", body, flags=re.M)]


def test_the_switch_and_variable_tables_are_the_declarations():
    """README's switch table and the variable table of docs/SPEC.md §6 are `variables --markdown`,
    row for row: the same names, values (default first), defaults and meanings as opsd/config.py
    declares."""
    generated = run_cli("variables", "--markdown")
    assert generated.returncode == 0, generated.stderr
    switches, variables = generated.stdout.strip("\n").split("\n\n")
    assert doc_tables("README.md", "## Switches and variables") == [switches]
    assert doc_tables("docs/SPEC.md", "### The variables") == [variables]


def test_variables_lists_every_user_setting_and_no_test_only_one():
    from opsd.config import INTERNAL_VARIABLES, SCRIPT_VARIABLES, SWITCH_VARIABLES

    result = run_cli("variables")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert list(lines) == [*SWITCH_VARIABLES.values(), *SCRIPT_VARIABLES]
    assert "tiny[:SEED[:N[:FAMILY]]]" in lines["OPSD_DATA"] and ". Default: siyanzhao/" in lines["OPSD_DATA"]
    assert "or a combination (nomath,hard) (default none)" in lines["OPSD_DATA_SELECT"]
    assert "`" not in result.stdout  # markdown only in --markdown
    for name in INTERNAL_VARIABLES:  # not listed, still accepted (the tests set them)
        assert name not in result.stdout
        check_env({name: "1"})
    with pytest.raises(ConfigError, match="OPSD_DATAA is not an OPSD setting"):
        check_env({"OPSD_DATAA": "tiny"})


@pytest.mark.parametrize("env, message", [
    ({"OPSD_PRESET": "big"}, "OPSD_PRESET='big' is not a preset; the only one is tiny (or leave it unset)"),
    ({"OPSD_USE_VLLM": "yes"}, "OPSD_USE_VLLM='yes' is not allowed; expected 0 (the own engine, default) or 1 (vLLM)"),
    ({"OPSD_VLLM_MODE": "remote"}, "OPSD_VLLM_MODE='remote' is not allowed; expected colocate or server"),
    ({"OPSD_USE_VLLM": "0", "OPSD_VLLM_MODE": "server"},
     "OPSD_VLLM_MODE=server asks for vLLM rollouts but OPSD_USE_VLLM=0; unset one of them"),
])
def test_check_env_holds_the_declared_values_of_the_script_variables(env, message):
    """The values OPSD_PRESET, OPSD_USE_VLLM and OPSD_VLLM_MODE take are declared once (their
    SCRIPT_VARIABLES entry) and checked by check-env, which train_capped.sh runs first."""
    with pytest.raises(ConfigError) as caught:
        check_env(env)
    assert str(caught.value) == message
    result = run_cli("check-env", env={**{k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}, **env})
    assert result.returncode == 2 and result.stderr.strip() == f"error: {message}"
    for fine in ({"OPSD_PRESET": "tiny"}, {"OPSD_USE_VLLM": "1", "OPSD_VLLM_MODE": "server"}, {"OPSD_USE_VLLM": ""}):
        check_env(fine)


@pytest.mark.parametrize("args", [("check", "recipe.env"), ("switches",), ("accelerate-config",), ("variables",),
                                  ("variables", "--markdown"), ("check-env",)])
def test_a_reader_that_closed_the_output_early_gets_no_traceback(args):
    """`python -m opsd.config ... | head` where head has exited: no BrokenPipeError traceback, the
    status a shell gives a command that SIGPIPE ended (check-env prints nothing: 0)."""
    from opsd.cli import CLOSED_OUTPUT_STATUS

    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the command writes: every write fails (EPIPE)
    try:
        result = subprocess.run([sys.executable, "-m", "opsd.config", *args], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={k: v for k, v in os.environ.items() if not k.startswith("OPSD_")})
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == (0 if args == ("check-env",) else CLOSED_OUTPUT_STATUS)
