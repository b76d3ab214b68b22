"""Typed configuration: the `OPSD_*` environment switches and the recipe file.

This is the one place where switches and `recipe.env` files are parsed. It uses
the standard library only, so `python -m opsd.config check recipe.env` answers
(and fails) in a fraction of a second, before torch or any model is loaded.

Recipe files (docs/SPEC.md §6) are .env files: `KEY=VALUE` lines, `#` starts a
comment (also after a value), blank lines are ignored, and an `export ` prefix
or quotes around a value are tolerated. Only the whitelisted keys of `Recipe`
are accepted; budget knobs (`BUDGET_KNOBS`) are fixed by train_capped.sh and are
ignored with a warning. Every other problem is a `RecipeError` whose message is
one line, `PATH:LINE: message`.

It also declares the multi-GPU engines train_capped.sh launches with (`OPSD_ACCELERATE_CONFIG`),
and every other `OPSD_*` variable the scripts read (`SCRIPT_VARIABLES`): an `OPSD_*` name set in
the environment that none of these declares is an error (`check_env`), not a silent default.

CLI:
    python -m opsd.config check RECIPE   # parsed recipe as key=value lines; exit 2 on error
    python -m opsd.config switches       # the OPSD_* switches and OPSD_REPORT_TO in effect; exit 2 on error
    python -m opsd.config accelerate-config [NAME|PATH]   # the accelerate config file; exit 2 on error
    python -m opsd.config check-env      # exit 2 with one line if an OPSD_* variable set is unknown
    python -m opsd.config variables [--markdown]   # every OPSD_* variable a user sets, one line of help
                                         # each (--markdown: the docs' tables, generated from here)

Every subcommand but `variables` runs check-env first.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad switch or recipe; the message is always one line."""


class RecipeError(ConfigError):
    """A bad recipe file. str() is `PATH:LINE: message` (`PATH: message` when the
    problem is the file itself)."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path, self.line, self.message = str(path), line, message
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------
# Environment switches
# --------------------------------------------------------------------------

# Allowed values; the first one is the default.
CLIP_MODES = ("entry", "token")
PAD_SIDES = ("right", "left")
# OPSD_TEACHER_CONTEXT: value -> what the teacher sees next to the problem (docs/SPEC.md §3).
# `shuffled`, `answer` and `none` are control arms: each keeps the method and takes away part
# of what the reference adds (its fit to the problem, its worked steps, all of it).
TEACHER_CONTEXT_HELP = {
    "solution": "the row's concise reference solution",
    "cot": "the row's verified long trace (COT_Reason)",
    "both": "the solution, then the long trace",
    "shuffled": "another row's solution, by a fixed pairing drawn from the training seed (right form, wrong problem)",
    "answer": "only the row's final answer (Answer, else the solution's last \\boxed{})",
    "none": "nothing: the teacher prompt is the student prompt, token for token",
}
TEACHER_CONTEXTS = tuple(TEACHER_CONTEXT_HELP)
STUDENT_PROMPTS = ("paper", "eval")
# Data filters in the order they apply when combined (`nomath,hard`: drop math rows,
# then keep the longer half of what remains), whatever order they are written in.
DATA_FILTERS = ("nomath", "hard")
DATA_SELECTS = ("none", *DATA_FILTERS)


def _switch(variable: str, allowed: tuple[str, ...], changes: str):
    """A Switches field: read from `variable`, one of `allowed`, the first by default; `changes`
    says what it changes (README's switch table, `variables`)."""
    return dataclasses.field(default=allowed[0], metadata={"variable": variable, "allowed": allowed,
                                                           "changes": changes})


@dataclass(frozen=True)
class Switches:
    """The method switches of docs/SPEC.md §2-§4, read from the environment. Each is
    declared once, here; the tables below are derived from these fields."""

    clip_mode: str = _switch("OPSD_CLIP_MODE", CLIP_MODES, "the clip caps each vocabulary entry (released) or "
                             "scales the whole token, keeping the gradient's direction")
    pad_side: str = _switch("OPSD_PAD_SIDE", PAD_SIDES,
                            "pads between prompt and completion (released) or a contiguous prompt -> completion")
    teacher_context: str = _switch("OPSD_TEACHER_CONTEXT", TEACHER_CONTEXTS,
                                   "the teacher's privileged context; the last three are control arms")
    student_prompt: str = _switch("OPSD_STUDENT_PROMPT", STUDENT_PROMPTS,
                                  "the student's prompt: the paper's (thinking off) or the evaluation prompt")
    data_select: str = _switch("OPSD_DATA_SELECT", DATA_SELECTS,
                               "drop rows whose `source` is `math`; keep the longer half by trace length")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Switches:
        """Unset or empty variables take the default; values are matched after
        stripping whitespace and lower-casing. A bad value is a ConfigError."""
        return cls(**{name: _read_switch(env, var, allowed) for name, (var, allowed) in _SWITCHES.items()})

    def as_env(self) -> dict[str, str]:
        """{variable: value}, e.g. to log the run's switches or pass them on."""
        return {var: getattr(self, name) for name, (var, _) in _SWITCHES.items()}


# Switches field -> (environment variable, allowed values), from the fields' metadata.
_SWITCH_FIELDS = {f.name: f for f in dataclasses.fields(Switches)}
_SWITCHES = {name: (f.metadata["variable"], f.metadata["allowed"]) for name, f in _SWITCH_FIELDS.items()}


# Where the run's logs also go: transformers' `report_to`, from OPSD_REPORT_TO; the first value
# is the default. Not a method switch: it changes no number of the run, so it is read apart
# from Switches and is no part of what a resume compares.
REPORT_TO_VARIABLE = "OPSD_REPORT_TO"
TRACKERS = ("tensorboard", "wandb", "trackio")  # each needs the package of the same name
REPORT_TO_VALUES = ("none", *TRACKERS, "all")  # all: every tracker whose package is installed

# Switches field -> environment variable (derived; for code that maps switches onto config fields).
SWITCH_VARIABLES = {name: var for name, (var, _) in _SWITCHES.items()}
# Switches field -> allowed values, the default first (derived; for help texts).
SWITCH_VALUES = {name: allowed for name, (_, allowed) in _SWITCHES.items()}


def switch_field(name: str):
    """A config dataclass field for switch `name` (a Switches field): its default and its help,
    with the values and the variable, from the one declaration in Switches."""
    declared = _SWITCH_FIELDS[name]
    var = declared.metadata["variable"]
    help = f"{_plain(switch_values_text(name))} ({var}; the first is the default): {declared.metadata['changes']}."
    return dataclasses.field(default=declared.default, metadata={"help": help})


def read_report_to(env: Mapping[str, str] = os.environ) -> str | None:
    """OPSD_REPORT_TO, checked like a switch; None when unset or empty (the config's default,
    REPORT_TO_VALUES[0], then stands unless a YAML --config or a flag sets report_to)."""
    if not env.get(REPORT_TO_VARIABLE, "").strip():
        return None
    return _read_switch(env, REPORT_TO_VARIABLE, REPORT_TO_VALUES)


def _read_switch(env: Mapping[str, str], var: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(var, "")
    if allowed is DATA_SELECTS:  # the one switch that takes a combination
        return parse_data_select(raw, var)
    value = raw.strip().lower()
    if not value:
        return allowed[0]
    if value not in allowed:
        raise ConfigError(f"{var}={raw!r} is not allowed; expected one of: {', '.join(allowed)}")
    return value


def parse_data_select(raw: str, var: str = "OPSD_DATA_SELECT") -> str:
    """The canonical form of a data selection: `none`, or the named filters joined by
    commas in the order they apply (DATA_FILTERS), so `hard,nomath` -> `nomath,hard`.
    Empty means none; an unknown, repeated or empty name, or `none` combined with a
    filter, is a ConfigError."""
    names = [name.strip().lower() for name in raw.split(",")]
    if names == [""]:
        return DATA_SELECTS[0]
    problem = None
    unknown = [name for name in names if name not in DATA_SELECTS]
    if unknown:
        problem = f"{unknown[0] or 'an empty name'} is not a selection"
    elif len(set(names)) < len(names):
        problem = f"{next(n for n in names if names.count(n) > 1)} is named twice"
    elif len(names) > 1 and "none" in names:
        problem = "none cannot be combined with a filter"
    if problem:
        raise ConfigError(
            f"{var}={raw!r} is not allowed ({problem}); expected one of: {', '.join(DATA_SELECTS)}, "
            f"or a comma-separated combination of {', '.join(DATA_FILTERS)}"
        )
    return ",".join(name for name in DATA_FILTERS if name in names) or DATA_SELECTS[0]


# --------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------

MAX_COMPLETION_LENGTH_CAP = 4096

# The sampling temperatures vLLM uses as given (vllm/sampling_params.py, 0.30.0): it
# refuses one above 2 at the first rollout, and raises one below 0.01 to 0.01, which
# would make sampling and the loss use different temperatures.
VLLM_TEMPERATURE_RANGE = (0.01, 2.0)

# Fixed by train_capped.sh (100 steps at global batch 32 on OPSD_MODEL).
BUDGET_KNOBS = (
    "max_steps", "num_train_epochs", "per_device_train_batch_size",
    "gradient_accumulation_steps", "num_processes", "model",
)

# transformers.SchedulerType values (transformers 5.24), hard-coded so that no
# import is needed to validate a recipe.
SCHEDULER_TYPES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau",
    "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy",
)


def _key(default, help: str, accepts: Callable[[float], bool] | None = None, allowed: str = ""):
    """One recipe key, declared once: default (its type is the key's type), help, allowed range.
    Everything else is derived: the whitelist, parsing, the range check here and in the
    trainer's config, the config field's default and help (`recipe_field`)."""
    return dataclasses.field(default=default, metadata={"help": help, "range": (accepts, allowed) if accepts else None})


@dataclass(frozen=True)
class Recipe:
    """The whitelisted recipe keys with the released defaults (docs/SPEC.md §6).
    Each field's type is the type of its default, which is how values are parsed."""

    learning_rate: float = _key(5e-6, "Peak learning rate.", lambda v: v > 0, "> 0")
    lr_scheduler_type: str = _key("constant", "Learning-rate schedule (a transformers SchedulerType).")
    warmup_ratio: float = _key(0.0, "Share of the steps spent warming up.", lambda v: 0 <= v <= 1, "in [0, 1]")
    max_grad_norm: float = _key(0.1, "Gradient clipping norm.", lambda v: v >= 0, ">= 0")
    lora_r: int = _key(64, "LoRA rank.", lambda v: v >= 1, ">= 1")
    lora_alpha: int = _key(128, "LoRA alpha.", lambda v: v >= 1, ">= 1")
    beta: float = _key(0.0, "Divergence: 0 forward KL, 1 reverse KL, between: generalized JSD.",
                       lambda v: 0 <= v <= 1, "in [0, 1]")
    jsd_token_clip: float = _key(0.05, "Clip tau; 0 (`none` in a recipe) disables the clip.",
                                 lambda v: v >= 0, ">= 0 (0 or none disables the clip)")
    temperature: float = _key(1.1, "Sampling and loss temperature.",
                              lambda v: VLLM_TEMPERATURE_RANGE[0] <= v <= VLLM_TEMPERATURE_RANGE[1],
                              "in [{}, {}], the range vLLM samples with".format(*VLLM_TEMPERATURE_RANGE))
    # A truncated sampler (top_p < 1, top_k > 0) is not the distribution GRPO's loss differentiates
    # (the full softmax at the temperature): its policy gradient is then biased, uncorrected.
    top_p: float = _key(0.95, "Nucleus sampling of the rollouts; 1 disables. Below 1, GRPO's policy gradient is "
                              "biased (its loss uses the untruncated softmax; TRL's GRPO default is 1).",
                        lambda v: 0 < v <= 1, "in (0, 1]")
    top_k: int = _key(20, "Top-k sampling of the rollouts; 0 disables. Above 0, GRPO's policy gradient is biased "
                          "(its loss uses the untruncated softmax; TRL's GRPO default is 0).",
                      lambda v: v >= 0, ">= 0 (0 disables top-k)")
    lmbda: float = _key(1.0, "Share of on-policy batches; the rest use the solution.",
                        lambda v: 0 <= v <= 1, "in [0, 1]")
    max_completion_length: int = _key(1024, "Rollout length limit in tokens.",
                                      lambda v: 1 <= v <= MAX_COMPLETION_LENGTH_CAP,
                                      f"in [1, {MAX_COMPLETION_LENGTH_CAP}]")
    fixed_teacher: bool = _key(True, "Teacher = initial weights (adapter disabled).")
    use_ema_teacher: bool = _key(False, "Teacher = EMA of the adapter.")
    ema_decay: float = _key(0.999, "EMA decay per optimizer step.", lambda v: 0 <= v < 1, "in [0, 1)")
    reason_first: bool = _key(False, "Teacher writes an analysis of the reference first.")
    teacher_thinking: bool = _key(False, "enable_thinking for the teacher prompt.")
    top_k_loss: int = _key(0, "Restrict the divergence to the teacher's top-k (0 = off).",
                           lambda v: v >= 0, ">= 0 (0 disables)")
    use_tinker_loss: bool = _key(False, "Sampled-token estimator instead of the full vocabulary.")
    num_generations: int = _key(8, "GRPO (loss_type grpo): completions sampled per prompt, one group.",
                                lambda v: v >= 2, ">= 2")

    def as_lines(self) -> list[str]:
        """`key=value` lines in field order; parse_recipe reads them back unchanged."""
        return [f"{f.name}={_format_value(getattr(self, f.name))}" for f in dataclasses.fields(self)]


_RECIPE_FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
_FIELD_TYPES: dict[str, type] = {name: type(f.default) for name, f in _RECIPE_FIELDS.items()}
# key -> (accepts the parsed value, what the allowed range is)
_RANGES = {name: f.metadata["range"] for name, f in _RECIPE_FIELDS.items() if f.metadata["range"]}


def recipe_field(name: str, **kwargs):
    """A config dataclass field for recipe key `name`: its released default and help."""
    key = _RECIPE_FIELDS[name]
    return dataclasses.field(default=key.default, metadata={"help": key.metadata["help"]}, **kwargs)


def parse_recipe_value(name: str, raw: str) -> object:
    """One recipe key's value from text, parsed and range-checked as on a recipe line
    (for settings given another way, e.g. a probe variant); ConfigError otherwise."""
    try:
        return _parse_value(name, raw.strip())
    except _LineProblem as problem:
        raise ConfigError(str(problem)) from None


def parse_switch_value(name: str, raw: str) -> str:
    """One switch's value (Switches field `name`) from text, read as its environment variable
    is; empty means the default. ConfigError, naming `name`, otherwise."""
    return _read_switch({name: raw}, name, _SWITCHES[name][1])


def recipe_value_problem(name: str, value) -> str | None:
    """Why `value` is out of the range declared for recipe key `name` (None when it is fine
    or unset); for settings that arrive another way than the recipe file."""
    check = _RANGES.get(name)
    if check is None or value is None or check[0](value):
        return None
    return f"{name}={value} is out of range; must be {check[1]}"


_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
_EXPORT = re.compile(r"^export\s+")
_INTEGER = re.compile(r"[+-]?\d+")


class _LineProblem(Exception):
    """Raised by the per-line helpers; parse_recipe adds the path and line number."""


def parse_recipe(path: str | os.PathLike) -> tuple[Recipe, list[str]]:
    """Parse a recipe file into a Recipe (unset keys keep their defaults) and a
    list of one-line warnings. Raises RecipeError on the first problem."""
    text = _read_text(path)
    values: dict[str, object] = {}
    set_on: dict[str, int] = {}  # key -> line that set it
    warnings: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            entry = _split_line(line)
            if entry is None:
                continue
            key, raw = entry
            if key in BUDGET_KNOBS:
                warnings.append(f"{path}:{number}: {key} is a budget knob fixed by train_capped.sh; ignored")
                continue
            if key in set_on:
                raise _LineProblem(f"duplicate key {key} (first set on line {set_on[key]})")
            values[key] = _parse_value(key, raw)
            set_on[key] = number
        except _LineProblem as problem:
            raise RecipeError(path, number, str(problem)) from None
    recipe = Recipe(**values)
    _check_teacher_choice(path, recipe, set_on)
    return recipe, warnings


def recipe_overrides(path: str | os.PathLike) -> dict[str, object]:
    """The keys a recipe file sets, parsed, in file order (budget knobs left out, as parse_recipe
    ignores them): what the file changes from the released recipe. RecipeError as parse_recipe."""
    parse_recipe(path)  # every line checked first: an error names its line
    values = {}
    for line in _read_text(path).splitlines():
        entry = _split_line(line)
        if entry is not None and entry[0] not in BUDGET_KNOBS:
            values[entry[0]] = _parse_value(*entry)
    return values


def _read_text(path: str | os.PathLike) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise RecipeError(path, None, f"cannot read recipe file ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise RecipeError(path, None, "recipe file is not UTF-8 text") from None


def _split_line(line: str) -> tuple[str, str] | None:
    """(key, raw value) of a `KEY=VALUE` line, or None for a blank/comment line."""
    body = line.split("#", 1)[0].strip()
    if not body:
        return None
    body = _EXPORT.sub("", body, count=1)
    key, sep, value = body.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise _LineProblem(f"expected KEY=VALUE, got {line.strip()!r}")
    return key, _unquote(value.strip())


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].strip()
    return value


def _parse_value(key: str, raw: str) -> object:
    kind = _FIELD_TYPES.get(key)
    if kind is None:
        raise _LineProblem(_unknown_key_message(key, raw))
    value = _convert(key, raw, kind)
    check = _RANGES.get(key)
    if check is not None and not check[0](value):
        raise _LineProblem(f"{key}={raw} is out of range; must be {check[1]}")
    return value


def _convert(key: str, raw: str, kind: type) -> object:
    if kind is bool:
        if raw.lower() not in _BOOLEANS:
            raise _LineProblem(f"{key}={raw!r} is not a boolean; use true/false or 1/0")
        return _BOOLEANS[raw.lower()]
    if kind is int:
        if not _INTEGER.fullmatch(raw):
            raise _LineProblem(f"{key}={raw!r} is not an integer")
        return int(raw)
    if kind is float:
        if key == "jsd_token_clip" and raw.lower() == "none":
            return 0.0
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise _LineProblem(f"{key}={raw!r} is not a finite number")
        return value
    # the only string key
    if raw not in SCHEDULER_TYPES:
        raise _LineProblem(f"{key}={raw!r} is not a scheduler; expected one of: {', '.join(SCHEDULER_TYPES)}")
    return raw


def _unknown_key_message(key: str, raw: str) -> str:
    if key.startswith(VARIABLE_PREFIX):  # a switch or script variable: one place for each setting
        return (f"{key} is an environment variable, not a recipe key: set it in the environment "
                f"({key}={raw} bash train_capped.sh RECIPE) or in a grid arm's \"env\"")
    message = f"unknown key {key!r}"
    close = difflib.get_close_matches(key.lower(), [*_FIELD_TYPES, *BUDGET_KNOBS], n=1)
    return f"{message} (did you mean {close[0]}?)" if close else f"{message}; allowed keys: {', '.join(_FIELD_TYPES)}"


def _check_teacher_choice(path, recipe: Recipe, set_on: dict[str, int]) -> None:
    """fixed_teacher and use_ema_teacher are mutually exclusive. fixed_teacher is
    true by default, so a file asking for an EMA teacher must turn it off."""
    if not (recipe.fixed_teacher and recipe.use_ema_teacher):
        return
    line = max(set_on.get("fixed_teacher", 0), set_on["use_ema_teacher"])
    default = "" if "fixed_teacher" in set_on else " (fixed_teacher is true by default)"
    raise RecipeError(
        path, line,
        f"fixed_teacher and use_ema_teacher are mutually exclusive{default}; "
        "set fixed_teacher=false for an EMA teacher",
    )


def _format_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------
# Multi-GPU engine (train_capped.sh)
# --------------------------------------------------------------------------

ACCELERATE_CONFIG_VARIABLE = "OPSD_ACCELERATE_CONFIG"
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")  # the repository's
# name -> (accelerate config file in configs/, when to choose it); the first is the default.
ACCELERATE_CONFIGS = {
    "ddp": ("ddp.yaml", "a full replica per GPU, gradients averaged: LoRA on a model that fits one GPU (1.7B)"),
    "fsdp2": ("fsdp2.yaml", "parameters sharded per decoder layer: models, or full fine-tuning, that do not fit"),
    "zero2": ("zero2.yaml", "DeepSpeed, gradients and optimizer state sharded (needs deepspeed)"),
    "zero3": ("zero3.yaml", "DeepSpeed, parameters sharded too, where FSDP2 is not an option (needs deepspeed)"),
}


def accelerate_config_path(raw: str, var: str = ACCELERATE_CONFIG_VARIABLE) -> str:
    """The accelerate config file that `raw` names: one of ACCELERATE_CONFIGS (empty: the
    first), or the path of an existing .yaml / .yml / .json file, relative to the current
    folder. Returned absolute; anything else is a ConfigError."""
    value = raw.strip()
    name = value.lower() or next(iter(ACCELERATE_CONFIGS))
    if name in ACCELERATE_CONFIGS:
        return os.path.join(CONFIGS_DIR, ACCELERATE_CONFIGS[name][0])
    expected = f"expected one of: {', '.join(ACCELERATE_CONFIGS)}, or the path of an accelerate config file"
    if not value.lower().endswith((".yaml", ".yml", ".json")):
        raise ConfigError(f"{var}={raw!r} is not allowed; {expected} (.yaml, .yml or .json)")
    if not os.path.isfile(value):
        raise ConfigError(f"{var}={raw!r}: no such file; {expected}")
    return os.path.abspath(value)


# --------------------------------------------------------------------------
# Every OPSD_* variable
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Variable:
    """An OPSD_* variable that is not a switch, declared once: what it sets, its default, what
    reads it. `meaning` and `default` are the cells of docs/SPEC.md §6's table (markdown; `variables` prints
    them without backticks)."""

    meaning: str
    default: str
    read_by: str
    allowed: tuple[str, ...] = ()  # the values check-env accepts when it is set (empty: any)
    refusal: str = ""  # what check-env's error says after `NAME='value'` when the value is not allowed


# The variables the scripts and entry points read besides the switches, in the table's order: name ->
# Variable. README's switch table and the variable table of docs/SPEC.md §6 are
# `python -m opsd.config variables --markdown` (tests/opsd/test_config.py).
SCRIPT_VARIABLES = {
    "OPSD_MODEL": Variable("model: hub id or local folder", "`Qwen/Qwen3-1.7B`", "train_capped.sh, dev_eval.sh"),
    "OPSD_DATA": Variable("training data: HF name, `.json`, `.jsonl`, `.parquet`, `tiny[:SEED[:N[:FAMILY]]]`",
                          "`siyanzhao/Openthoughts_math_30k_opsd`", "train_capped.sh"),
    "OPSD_OUTPUT": Variable("run folder (`quickstart.sh`: its grid's folder)",
                            "`outputs/opsd-capped` in the repository; the tiny preset: `outputs/opsd-tiny`; "
                            "`quickstart.sh`: `outputs/quickstart-cpu`, with CUDA `outputs/quickstart-gpu`",
                            "train_capped.sh, quickstart.sh"),
    "OPSD_PRESET": Variable("`tiny`: embedded model + data, 8 steps x batch 4, completions of at most 64 tokens, "
                            "no compilation (`OPSD_MODEL` / `OPSD_DATA`, when set, still win)", "unset",
                            "train_capped.sh, dev_eval.sh, python -m opsd.evaluation", ("tiny",),
                            "is not a preset; the only one is tiny (or leave it unset)"),
    "OPSD_NUM_PROCESSES": Variable("training processes, one GPU each; fewer than the visible GPUs train on the "
                                   "first ones", "the visible GPUs (server mode: less the server's), else 1",
                                   "train_capped.sh"),
    "OPSD_MAIN_PORT": Variable("a run across nodes (`srun`, one task a node): the main process's port",
                               "29500 + SLURM job id % 2000", "train_capped.sh"),
    ACCELERATE_CONFIG_VARIABLE: Variable(
        f"the multi-GPU engine: {', '.join(f'`{name}`' for name in ACCELERATE_CONFIGS)} or an accelerate config "
        "file", f"`{next(iter(ACCELERATE_CONFIGS))}`", "train_capped.sh"),
    "OPSD_PER_DEVICE_BATCH": Variable("micro-batch per process", "4", "train_capped.sh"),
    "OPSD_TOKEN_MEAN_ROWS": Variable("rows per token mean (a divisor of the micro-batch): the loss of micro-batches "
                                     "of that size, scored in fewer forwards", "the micro-batch", "train_capped.sh"),
    "OPSD_USE_VLLM": Variable("`0`/`1`: `1` samples the rollouts with vLLM instead of the project's own engine "
                              "(faster and leaner on one GPU: README \"Real runs: which engine\")", "`0`",
                              "train_capped.sh", ("0", "1"),
                              "is not allowed; expected 0 (the own engine, default) or 1 (vLLM)"),
    "OPSD_VLLM_MODE": Variable("with vLLM: `colocate` (on the training GPUs) or `server` (a running "
                               "`trl vllm-serve`); set, it asks for vLLM", "`colocate`", "train_capped.sh",
                               ("colocate", "server"), "is not allowed; expected colocate or server"),
    "OPSD_VLLM_SERVER_GPU": Variable("server mode: the server's GPU id(s), comma-separated, or `none` (another host)",
                                     "`0`", "train_capped.sh"),
    REPORT_TO_VARIABLE: Variable(
        f"where the logs also go: {', '.join(f'`{v}`' for v in REPORT_TO_VALUES[:-1])} or `all` (every installed "
        "tracker); not a switch: it changes no number of the run", f"`{REPORT_TO_VALUES[0]}`", "opsd_train.py"),
    "OPSD_EVAL_DATA": Variable("eval set: hub name, `.json`/`.jsonl`/`.parquet`, `tiny[:SEED[:N[:FAMILY]]]`",
                               "`HuggingFaceH4/aime_2024`", "dev_eval.sh"),
    "OPSD_EVAL_BACKEND": Variable("`transformers`, `vllm`, `auto` (vLLM with CUDA when installed)", "`auto`",
                                  "dev_eval.sh"),
    "OPSD_EVAL_ENGINE": Variable("the transformers backend's engine: `auto`, `dynamic`, `paged`, `static`, `graph`, "
                                 "`graph_compiled`", "`auto` (`paged` on CUDA, else `dynamic`)", "dev_eval.sh"),
    "OPSD_EVAL_PAGED_GIB": Variable("the paged engine's KV pool in GiB (the samples depend on it; other engines "
                                    "ignore it)", "half the GPU's total memory, a quarter of RAM on CPU; in a "
                                    "`opsd.research.grid` cell 32", "python -m opsd.evaluation, dev_eval.sh"),
    "OPSD_EVAL_OUT": Variable("folder of `eval_<name>.json`", "`outputs/eval/<dataset>`", "dev_eval.sh"),
    "OPSD_CACHE": Variable("the embedded default's cache folder", "`.cache/opsd` in the repository",
                           "opsd.tiny_default"),
}
# Known but not a user setting: accepted by check_env, listed by neither `variables` nor the docs' tables.
INTERNAL_VARIABLES = {
    "OPSD_TEST_PAUSE_IN_SAVE": "tests only: seconds a checkpoint save pauses half-written (opsd_trainer.py)",
}
VARIABLE_PREFIX = "OPSD_"


def switch_values_text(name: str) -> str:
    """A switch's values as README's table shows them, the default first (markdown)."""
    allowed = SWITCH_VALUES[name]
    text = ", ".join(f"`{value}`" for value in allowed)
    if allowed is DATA_SELECTS:
        text += f", or a combination (`{','.join(DATA_FILTERS)}`)"
    return text


def user_variables() -> dict[str, str]:
    """Every OPSD_* variable a user sets -> one line of help (plain text): the switches, then
    SCRIPT_VARIABLES. What `variables` prints; the test-only INTERNAL_VARIABLES are left out."""
    lines = {}
    for f in dataclasses.fields(Switches):
        lines[f.metadata["variable"]] = _plain(
            f"ablation switch: {switch_values_text(f.name)} (default {f.default}): {f.metadata['changes']}")
    for var, v in SCRIPT_VARIABLES.items():
        # Default and readers as sentences of their own: a default in parentheses would nest them.
        lines[var] = _plain(f"{v.meaning}. Default: {v.default}. Read by {v.read_by}.")
    return lines


def variables_markdown() -> str:
    """The switch table of README's "Switches and variables" and the variable table of
    docs/SPEC.md §6 ("The variables"), from the declarations above."""
    lines = ["| switch | values (default first) | what it changes |", "|---|---|---|"]
    lines += [f"| `{f.metadata['variable']}` | {switch_values_text(f.name)} | {f.metadata['changes']} |"
              for f in dataclasses.fields(Switches)]
    lines += ["", "| variable | meaning | default |", "|---|---|---|"]
    lines += [f"| `{var}` | {v.meaning} | {v.default} |" for var, v in SCRIPT_VARIABLES.items()]
    return "\n".join(lines)


def _plain(markdown: str) -> str:
    return markdown.replace("`", "")


def declared_variables() -> dict[str, str]:
    """Every OPSD_* variable anything here reads -> one line of help: user_variables() and the
    test-only INTERNAL_VARIABLES. The one list check_env holds the environment to."""
    return {**user_variables(), **INTERNAL_VARIABLES}


def check_env(env: Mapping[str, str] = os.environ) -> None:
    """A ConfigError naming the first (sorted) variable of `env` that starts with OPSD_, in
    any case, that no setting declares, and the closest declared name: a misspelled name
    would otherwise be ignored silently and the run would use the default. Variables set
    to an empty string are unset, as for the switches. Then the declared values (check_values)."""
    declared = declared_variables()
    unknown = sorted(name for name, value in env.items()
                     if name.upper().startswith(VARIABLE_PREFIX) and name not in declared and value.strip())
    if not unknown:
        check_values(env)
        return
    name = unknown[0]
    # Compared without the common prefix, which would make every name look close.
    tails = {var[len(VARIABLE_PREFIX):]: var for var in declared if var not in INTERNAL_VARIABLES}
    close = difflib.get_close_matches(name[len(VARIABLE_PREFIX):].upper(), tails, n=1)
    hint = f"did you mean {tails[close[0]]}?" if close else "python -m opsd.config variables lists them"
    raise ConfigError(f"{name} is not an OPSD setting ({hint})")


def check_values(env: Mapping[str, str] = os.environ) -> None:
    """A ConfigError for a declared variable set to a value it does not take (SCRIPT_VARIABLES'
    `allowed`), or for OPSD_VLLM_MODE asking for vLLM while OPSD_USE_VLLM=0 turns it off."""
    for name, variable in SCRIPT_VARIABLES.items():
        value = env.get(name, "")
        if variable.allowed and value and value not in variable.allowed:
            raise ConfigError(f"{name}={value!r} {variable.refusal}")
    mode = env.get("OPSD_VLLM_MODE", "")
    if mode and env.get("OPSD_USE_VLLM") == "0":
        raise ConfigError(f"OPSD_VLLM_MODE={mode} asks for vLLM rollouts but OPSD_USE_VLLM=0; unset one of them")


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def main(argv: list[str] | None = None, prog: str = "python -m opsd.config") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Validate OPSD configuration before anything loads.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="parse a recipe file and print it as key=value lines")
    check.add_argument("recipe", help="path of the recipe file, e.g. recipe.env")
    commands.add_parser("switches", help="print the OPSD_* switches (and OPSD_REPORT_TO) read from the environment")
    engines = "; ".join(f"{name}: {why}" for name, (_, why) in ACCELERATE_CONFIGS.items())
    engine = commands.add_parser(
        "accelerate-config", help=f"print the accelerate config file that {ACCELERATE_CONFIG_VARIABLE} names",
        description=f"{ACCELERATE_CONFIG_VARIABLE}: {engines}; or the path of an accelerate config file.")
    engine.add_argument("value", nargs="?", default="", help="a name or a path; empty: the default (ddp)")
    commands.add_parser("check-env", help="exit 2 with one line if an OPSD_* variable set is no OPSD setting")
    listing = commands.add_parser("variables", help="list every OPSD_* variable with one line of help")
    listing.add_argument("--markdown", action="store_true",
                         help="the docs' tables instead: README's switches, docs/SPEC.md §6's variables")
    args = parser.parse_args(argv)
    try:
        if args.command == "variables":
            print(variables_markdown() if args.markdown else
                  "\n".join(f"{var:<24} {help}" for var, help in user_variables().items()))
            return 0
        check_env()
        if args.command == "check-env":
            return 0
        if args.command == "check":
            recipe, warnings = parse_recipe(args.recipe)
            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
            lines = recipe.as_lines()
        elif args.command == "accelerate-config":
            lines = [accelerate_config_path(args.value)]
        else:
            lines = [f"{var}={value}" for var, value in Switches.from_env().as_env().items()]
            lines.append(f"{REPORT_TO_VARIABLE}={read_report_to() or REPORT_TO_VALUES[0]}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

    sys.exit(exit_status(main))
