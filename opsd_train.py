"""OPSD training entry point (TRL-style: dataclasses on the command line or a YAML `--config`).

    python opsd_train.py --model_name_or_path Qwen/Qwen3-1.7B --output_dir outputs/run \
        --recipe recipe.env --max_steps 100 --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 8

Precedence, lowest to highest: defaults (and a YAML `--config`) < the tiny preset's
values < `--recipe` file (docs/SPEC.md §6 keys) < `OPSD_*` variables that are set <
command-line flags. Budget knobs in a recipe are warned about and ignored.
Everything is validated (switches, recipe, model path, run folder, dataset) before a
model is loaded; bad input exits with status 2 and a one-line `error:` message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import sys
import textwrap
import time
from dataclasses import dataclass, field

from opsd import run_folder as run_folder
from opsd.config import (
    REPORT_TO_VALUES,
    REPORT_TO_VARIABLE,
    SWITCH_VARIABLES,
    TRACKERS,
    ConfigError,
    Recipe,
    RecipeError,
    Switches,
    check_env,
    parse_recipe,
    read_report_to,
    recipe_field,
    recipe_value_problem,
    switch_field,
    switch_values_text,
)
from opsd.data import DataError, load_train_dataset

TINY_PRESET = {  # the embedded default: its worked solutions take ~50 tokens, its longest teacher prompt ~300
    "max_completion_length": 64,
    "max_teacher_prompt_length": 512,
    # A 3 M-parameter model is launch-bound on a GPU: compiling would cost more than it saves.
    "compile_layers": False,
    "compile_loss": False,
    "rollout_cache_implementation": "dynamic",
}

TINY_MODELS = ("tiny", "tiny-random")  # opsd.tiny_default.TINY, TINY_RANDOM: the embedded models

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default="Qwen/Qwen3-1.7B", metadata={"help": "Hub id, local folder, or `tiny` (embedded default)."}
    )
    dataset_name: str = field(
        default="siyanzhao/Openthoughts_math_30k_opsd",
        metadata={"help": "HF dataset name, local .json/.jsonl/.parquet, or `tiny`."},
    )
    recipe: str | None = field(default=None, metadata={"help": "recipe.env of docs/SPEC.md §6 overrides."})
    preset: str | None = field(default=None, metadata={"help": "`tiny`: embedded model + data, CPU budget."})
    lora_r: int = recipe_field("lora_r")
    lora_alpha: int = recipe_field("lora_alpha")
    lora_dropout: float = field(default=0.0, metadata={"help": "0 keeps both roles on one deterministic network."})
    dtype: str = field(default="auto", metadata={"help": "auto: bfloat16 on GPU, float32 on CPU."})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2."})
    resume: bool = field(default=True, metadata={"help": "Resume from the newest checkpoint in output_dir."})
    data_select: str = switch_field("data_select")

    def __post_init__(self):
        for name in ("lora_r", "lora_alpha"):
            problem = recipe_value_problem(name, getattr(self, name))
            if problem:
                raise ValueError(problem)


# Every recipe key is the config field of the same name (ScriptArguments for lora_r /
# lora_alpha), except warmup_ratio, which transformers 5 folds into warmup_steps.
RECIPE_TO_ARGS = tuple(f.name for f in dataclasses.fields(Recipe) if f.name != "warmup_ratio")


def _text(value) -> str:
    """A value as a command line would spell it (for the notes that compare it with a flag)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _given_flags(argv: list[str]) -> dict[str, str]:
    """{flag name: raw value} of the flags given on the command line."""
    given = {}
    for i, token in enumerate(argv):
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            if not eq:
                following = argv[i + 1] if i + 1 < len(argv) else ""
                value = "" if following.startswith("--") else following
            given[name] = value
    return given


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip().lower() == b.strip().lower()


def layered_defaults(preset: str | None, recipe: Recipe | None, max_steps: int, report_to: str | None = None,
                     given: dict[str, str] | None = None, switches: dict[str, str] | None = None) -> dict[str, object]:
    """The typed values that replace the dataclasses' defaults, in rising precedence: the tiny
    preset < the recipe < the OPSD_* switches set in the environment (`switches`: field ->
    value, from `set_switches`) < OPSD_REPORT_TO. The parser applies them as its defaults
    (after a YAML `--config`, `_LayeredParser`), so the command line still wins, nothing is
    rendered into flag text and parsed again, and the config's __post_init__ validates every
    value once. The preset's values are defaults: a recipe key the recipe leaves at its
    released value does not undo them, one it changes wins. A command-line flag that overrides
    a different recipe, switch or OPSD_REPORT_TO value is reported."""
    given = given or {}
    values: dict[str, object] = {}
    if preset == "tiny":
        values.update(model_name_or_path=TINY_MODELS[0], dataset_name="tiny", **TINY_PRESET)
    if recipe is not None:
        chosen = {key: getattr(recipe, key) for key in RECIPE_TO_ARGS}
        # transformers 5 folds the ratio into `warmup_steps` (a float < 1 is a ratio).
        ratio = recipe.warmup_ratio
        chosen["warmup_steps"] = ratio if ratio < 1 else max_steps
        released = Recipe()
        changed = {k for k in RECIPE_TO_ARGS if getattr(recipe, k) != getattr(released, k)}
        if recipe.warmup_ratio != released.warmup_ratio:
            changed.add("warmup_steps")
        values.update({k: v for k, v in chosen.items() if k not in values or k in changed})
        for key in sorted(changed):  # unset recipe keys are defaults, not choices that lost
            if key in given and not _same(given[key], _text(chosen[key])):
                print(f"note: --{key} {given[key]} (command line) wins over {key}={_text(chosen[key])} from the recipe",
                      file=sys.stderr)
    for name, value in (switches or {}).items():
        values[name] = value
        if name in given and not _same(given[name], value):
            print(f"note: --{name} {given[name]} (command line) wins over {SWITCH_VARIABLES[name]}={value}",
                  file=sys.stderr)
    if report_to is not None:
        values["report_to"] = report_to  # transformers normalises it (`all`, `none`) as it does a flag's
        if "report_to" in given and not _same(given["report_to"], report_to):
            print(f"note: --report_to {given['report_to']} (command line) wins over {REPORT_TO_VARIABLE}={report_to}",
                  file=sys.stderr)
    return values


def _layered_parser(layers: dict[str, object]):
    """TrlParser for ScriptArguments and OPSDConfig whose defaults are raised to `layers` right
    before the command line is parsed, i.e. after a YAML `--config` has set its own: default <
    YAML config < `layered_defaults` < command line, each value typed where it was read."""
    from trl import TrlParser

    from opsd.train_config import OPSDConfig

    class _LayeredParser(TrlParser):
        def parse_args_into_dataclasses(self, *args, **kwargs):
            self.set_defaults(**layers)
            return super().parse_args_into_dataclasses(*args, **kwargs)

    return _LayeredParser((ScriptArguments, OPSDConfig))


def set_switches(env) -> dict[str, str]:
    """{Switches field: value} of the OPSD_* switches set (non-empty) in `env`, each read and
    checked once where it is read (`Switches.from_env`, whose error names the variable)."""
    switches = Switches.from_env(env)
    return {name: getattr(switches, name) for name, var in SWITCH_VARIABLES.items() if env.get(var, "").strip()}


def _early_flags(argv: list[str]) -> argparse.Namespace:
    """--recipe, --preset and --max_steps, read before the (slow) config parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    pre.add_argument("--preset")
    pre.add_argument("--max_steps", type=int, default=-1)
    return pre.parse_known_args(argv)[0]


def _launcher_flags(argv: list[str]) -> tuple[list[str], bool, int | None]:
    """Remove `--check_only` and `--world_size N` (flags of this script, not of the
    config dataclasses): validate without training, for `train_capped.sh`, which
    checks everything before it starts accelerate with N processes."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--check_only", action="store_true")
    pre.add_argument("--world_size", type=int)
    known, rest = pre.parse_known_args(argv)
    return rest, known.check_only, known.world_size


def parse(argv=None, env=os.environ, quiet: bool = False):
    """Parse and validate everything that can be checked without a model.

    Switches and the recipe are checked first (stdlib only, instant), then the
    config dataclasses, then the dataset. `quiet` leaves recipe warnings unprinted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    early = _early_flags(argv)
    if early.preset not in (None, "", "tiny"):
        raise ConfigError(f"--preset {early.preset!r}: expected tiny")
    check_env(env)  # a misspelled OPSD_* name would otherwise be ignored
    switches = set_switches(env)
    report_to = read_report_to(env)
    recipe = None
    if early.recipe:
        recipe, warnings = parse_recipe(early.recipe)
        for w in warnings if not quiet else ():
            print(f"warning: {w}", file=sys.stderr)

    given = _given_flags(argv)
    layers = layered_defaults(early.preset, recipe, early.max_steps, report_to, given if not quiet else {}, switches)
    script_args, config = _layered_parser(layers).parse_args_and_config(argv)
    check_trackers(config.report_to)
    if config.use_vllm:
        from opsd.rollout import BackendUnavailable, check_vllm_version

        try:
            check_vllm_version()
        except BackendUnavailable as exc:
            raise ConfigError(f"--use_vllm true: {exc}") from None
    check_model(script_args.model_name_or_path)
    run_folder.check_writable(config.output_dir)
    dataset = load_train_dataset(
        script_args.dataset_name, select=script_args.data_select, teacher_context=config.teacher_context,
        seed=config.seed,
    )
    if config.loss_type == "grpo":  # the reward needs every row's reference answer
        from opsd.rewards import UngradableError, check_gradable

        try:
            check_gradable(dataset, script_args.dataset_name)
        except UngradableError as exc:
            raise ConfigError(str(exc)) from None
    return script_args, config, dataset


def check_trackers(report_to: list[str]) -> None:
    """A chosen tracker whose package is missing is an error now, before the model loads
    (transformers would raise only once the trainer is built)."""
    from transformers import integrations

    for name in report_to:
        if name in TRACKERS and not getattr(integrations, f"is_{name}_available")():
            raise ConfigError(f"report_to {name}: the {name} package is not installed (pip install {name})")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model(name: str) -> None:
    """A local model folder must exist and hold config.json; a hub id must look like one.

    Whether a hub id exists is only known when it loads (it may need the network)."""
    if name in TINY_MODELS:
        return
    if os.path.exists(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"model {name}: not a model folder (no config.json in it)")
        return
    looks_local = name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or "\\" in name
    if looks_local:
        raise ConfigError(f"model {name}: no such folder")
    if not _HUB_ID.fullmatch(name):
        raise ConfigError(f"model {name!r}: neither a local folder nor a hub id (org/name)")


# --------------------------------------------------------------------------
# Run identity: the resolved configuration, printed and stored with the run
# --------------------------------------------------------------------------

def recipe_values(script_args: ScriptArguments, config) -> dict:
    """Every recipe key (docs/SPEC.md §6) as this run resolved it, whatever set it."""
    values = {}
    for f in dataclasses.fields(Recipe):
        if f.name in ("lora_r", "lora_alpha"):
            value = getattr(script_args, f.name)
        elif f.name == "warmup_ratio":  # transformers 5 keeps the ratio in warmup_steps when < 1
            steps = config.warmup_steps
            value = steps if steps < 1 else steps / max(config.max_steps, 1)
        elif f.name == "lr_scheduler_type":
            value = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)
        elif f.name == "jsd_token_clip":
            value = config.jsd_token_clip or 0.0
        else:
            value = getattr(config, f.name)
        values[f.name] = value if isinstance(f.default, bool) else type(f.default)(value)
    return values


def run_identity(script_args: ScriptArguments, config, dataset, world_size: int | None = None) -> dict:
    """The run's configuration as one flat dict: what `run_config.json` holds and
    what a resume compares (run_folder.NOT_COMPARED aside). Recipe keys appear
    only where they differ from the released recipe; the loss type and GRPO's settings
    only for the sft and grpo arms."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    per_device, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
    released = dataclasses.asdict(Recipe())
    identity = {
        # local paths absolute: the same relative path from another folder is another file
        "model": _absolute_if_local(script_args.model_name_or_path),
        "data": _absolute_if_local(script_args.dataset_name),
        "data_select": script_args.data_select,
        "train_rows": len(dataset),
        "preset": script_args.preset or "none",
        "report_to": ",".join(config.report_to) or "none",  # recorded, not compared (run_folder.NOT_COMPARED)
    }
    identity.update({var: getattr(script_args if name == "data_select" else config, name)
                     for name, var in SWITCH_VARIABLES.items() if name != "data_select"})
    identity.update({k: v for k, v in recipe_values(script_args, config).items() if v != released[k]})
    if config.loss_type != "opsd":  # the arm (an OPSD run's identity stays as it always was)
        identity["loss_type"] = config.loss_type
    if config.loss_type == "grpo":
        identity.update(grpo_loss_type=config.grpo_loss_type, scale_rewards=config.scale_rewards,
                        epsilon=config.epsilon, epsilon_high=config.epsilon_high)
        if config.grpo_beta:  # only when on: runs from before the KL keep their identity
            identity["grpo_beta"] = config.grpo_beta
            # A KL run from before the option (uncorrected k3) is another objective: not resumed under the default.
            identity["grpo_use_bias_correction_kl"] = config.grpo_use_bias_correction_kl
    identity.update({
        "seed": config.seed,
        "global_batch": per_device * accumulation * world,
        "max_steps": config.max_steps,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "token_mean_rows": config.token_mean_rows or per_device,
        "num_processes": world,
        "output_dir": os.path.abspath(config.output_dir),
    })
    return identity


def _absolute_if_local(name: str) -> str:
    return os.path.abspath(name) if name not in TINY_MODELS and os.path.exists(name) else name


def format_identity(identity: dict) -> str:
    width = max(map(len, identity))
    lines = [f"[OPSD] run configuration ({run_folder.CONFIG_FILE} in the run folder):"]
    lines += [f"  {key:<{width}}  {value}" for key, value in identity.items()]
    return "\n".join(lines)


def resume_point(output_dir: str, identity: dict, resume: bool,
                 skipped: list | None = None) -> tuple[int, str] | None:
    """The checkpoint this run continues from (None: a fresh start): the newest one whose files
    read (run_folder.checkpoint_problem); each newer unreadable one is appended to `skipped` as
    (folder, problem).

    Refuses (RunFolderError) when the folder records another configuration: a
    resumed run must not mix two arms; and when no checkpoint is readable."""
    found = run_folder.checkpoints(output_dir) if resume else []
    if not found:
        return None
    last, unreadable = None, []
    for step, path in reversed(found):
        problem = run_folder.checkpoint_problem(path)
        if problem is None:
            last = (step, path)
            break
        unreadable.append((path, problem))
    if last is None:
        raise run_folder.RunFolderError(
            f"no checkpoint in {output_dir} is readable (newest {unreadable[0][0]}: {unreadable[0][1]}); "
            "delete the broken checkpoint-N folders to start fresh, or choose another OPSD_OUTPUT")
    if skipped is not None:
        skipped.extend(unreadable)
    recorded = run_folder.read_config(output_dir)
    if recorded is not None:
        differing = run_folder.config_conflicts(recorded, identity)
        if differing:
            shown = ", ".join(f"{k} ({recorded.get(k)!r} -> {identity.get(k)!r})" for k in differing[:6])
            more = f" and {len(differing) - 6} more" if len(differing) > 6 else ""
            raise run_folder.RunFolderError(
                f"{output_dir} holds a run of another configuration ({shown}{more}); to start fresh, "
                "choose another OPSD_OUTPUT (--output_dir) or delete that folder"
            )
    return last


def build_model_and_tokenizer(script_args: ScriptArguments):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.tiny_default import resolve_model

    path = resolve_model(script_args.model_name_or_path)
    if script_args.dtype == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    else:
        dtype = getattr(torch, script_args.dtype)
    kwargs = {"dtype": dtype}
    if script_args.attn_implementation:
        kwargs["attn_implementation"] = script_args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def lora_config(script_args: ScriptArguments):
    from peft import LoraConfig

    return LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )


class _StopRequest:
    """SIGTERM / SIGINT / SIGUSR1 (preemption, a time limit, Ctrl-C) ask the run to stop at the next
    step boundary with a checkpoint. A repeated SIGTERM is the same request: a cluster's TERM reaches
    every process of a job step and accelerate's launcher forwards one more to each rank, which
    must not kill a rank mid-checkpoint. SIGUSR1 is the ranks' own: train_capped.sh starts the
    launcher with it ignored, so a cluster's USR1 (slurm/train_capped.sbatch) stops the ranks while
    the launcher, never told, does not start its grace (30 s on torch 2.11, then SIGKILL). After a
    Ctrl-C the handlers are the previous ones again, so a second Ctrl-C stops at once (under the
    launcher, which turns the second into a SIGTERM, too)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        first = self.signum is None
        if first:
            self.signum = signum
        if signum == signal.SIGINT:
            self.__exit__()
        if first or signum == signal.SIGINT:
            then = "Ctrl-C again stops at once" if signum == signal.SIGINT else "a second Ctrl-C stops at once"
            # os.write, not print: the handler may interrupt a print, and a buffered stream
            # written to from inside its own write raises "reentrant call". A closed stdout (a
            # reader gone) must not turn the request into an exception in the middle of a step.
            try:
                os.write(sys.stdout.fileno(), f"[OPSD] {signal.Signals(signum).name} received: stopping after "
                                              f"this step with a checkpoint ({then})\n".encode())
            except (OSError, ValueError):
                pass

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def train(script_args: ScriptArguments, config, dataset, resume: tuple[int, str] | None = None, stop=None):
    from opsd_trainer import OPSDTrainer

    model, tokenizer = build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(script_args),
        stop_request=stop,
        base_model_name=_absolute_if_local(script_args.model_name_or_path),  # as the adapter records it
    )
    if resume and trainer.accelerator.is_main_process:
        newest = run_folder.last_checkpoint(config.output_dir)
        older = f", the newest readable checkpoint (not {newest[1]})" if newest and newest[0] > resume[0] else ""
        print(f"[OPSD] resuming from {resume[1]}{older}", flush=True)
    trainer.train(resume_from_checkpoint=resume[1] if resume else None)
    if trainer.stopped_by_signal is None:
        trainer.save_model(config.output_dir)  # final adapter + tokenizer at the top of the run folder
    return trainer


def _summary_line(trainer, started: float) -> str:
    last = run_folder.last_checkpoint(trainer.args.output_dir)
    kl = next((r["opsd/true_kl"] for r in reversed(trainer.state.log_history) if "opsd/true_kl" in r), None)
    from opsd.run_log import COLLAPSE_FIELD

    warned = next((r["step"] for r in trainer.state.log_history if r.get(COLLAPSE_FIELD)), None)
    reward = next((r["grpo/reward_mean"] for r in reversed(trainer.state.log_history) if "grpo/reward_mean" in r),
                  None)
    signal = f"last true_kl {'n/a' if kl is None else f'{kl:.4g}'}" if reward is None else f"last reward {reward:.4g}"
    return (
        f"[OPSD] done: {trainer.state.global_step} steps in {time.time() - started:.1f} s | last checkpoint "
        f"{last[1] if last else 'none'} | {signal}"
        + (f" | collapse warning at step {warned} (see [OPSD warn] above)" if warned is not None else "")
    )


def draw_curves(out: str) -> str | None:
    """The run's curves.png beside metrics.jsonl (opsd/analysis/plots.py); its path, or None with one
    warning line: a finished run never fails for its figure."""
    from opsd.analysis import plots as run_plots  # stdlib at import; matplotlib only once it draws

    drawn = run_plots.draw_or_warn("training curves", run_plots.plot_run_curves, out)
    return None if drawn is None else os.path.join(os.path.abspath(out), run_plots.CURVES_FILE)  # as checkpoints


class _InheritedHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help of the inherited flags, wrapped to the width as argparse wraps help text,
    flags included: a flag's choices (`--optim {adamw_torch,...}`, some 600 characters) wrap
    after their commas. No usage block: help_text's own usage line heads the page."""

    def add_usage(self, *args, **kwargs):
        pass

    def _format_action_invocation(self, action):
        text = super()._format_action_invocation(action)
        width = max(self._width - self._current_indent, 20)
        if len(text) <= width:
            return text
        text = re.sub(r"\{[^}]*\}", lambda m: m.group(0).replace(",", ", "), text)
        indent = " " * (self._current_indent + 4)
        return f"\n{indent}".join(textwrap.wrap(text, width - 4, break_on_hyphens=False))


def _help_width() -> int:
    """The width argparse wraps to: the terminal's (COLUMNS, else 80 off a terminal) less 2."""
    return max(shutil.get_terminal_size().columns - 2, 40)


def _describe(f, default, width: int, recipe_keys: set[str]) -> str:
    """One flag of the help: `--name (default ...)`, its help indented below."""
    text = (f.metadata.get("help", "") + (" [recipe key]" if f.name in recipe_keys else "")).strip()
    flag = f"  --{f.name} (default {default!r})"
    return "\n".join([flag, *textwrap.wrap(text, width, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                          break_on_hyphens=False)])


def _help_head(prog: str, width: int) -> list[str]:
    return [
        f"usage: {prog} [--preset tiny] [--recipe FILE] [FLAG VALUE ...]",
        "",
        "On-Policy Self-Distillation of a LoRA student against its own teacher role.",
        "",
        *textwrap.wrap(
            "Precedence, lowest to highest: defaults (and a YAML --config) < the tiny preset's values < "
            "the --recipe file < OPSD_* variables that are set < command-line flags; a flag that overrides a "
            "different recipe or variable value is reported. Budget knobs in a recipe are ignored (warned). "
            "Everything is checked before a model loads: bad input is one `error:` line, exit 2.", width,
            break_on_hyphens=False),
    ]


def _help_variables(width: int) -> list[str]:
    lines = ["", "OPSD_* variables (the ablation switches; default first):"]
    for name, var in SWITCH_VARIABLES.items():
        allowed = switch_values_text(name).replace("`", "")
        lines += textwrap.wrap(f"{var:<22} {allowed}  (sets {name})", width, initial_indent="  ",
                               subsequent_indent=" " * 25, break_on_hyphens=False)
    lines += textwrap.wrap(f"{REPORT_TO_VARIABLE:<22} {', '.join(REPORT_TO_VALUES)}  (sets report_to; not a switch)",
                           width, initial_indent="  ", subsequent_indent=" " * 25, break_on_hyphens=False)
    return lines


def short_help(prog: str = "python opsd_train.py") -> str:
    """`--help`: this script's own options, the recipe's keys and the switches, without importing
    TRL or torch (instant); every setting, the inherited flags included, is `--help-all`."""
    width = _help_width()
    recipe_keys = {f.name for f in dataclasses.fields(Recipe)}
    lines = [*_help_head(prog, width), "", "This script's options:"]
    lines += [_describe(f, f.default, width, recipe_keys) for f in dataclasses.fields(ScriptArguments)]
    lines += ["", *textwrap.wrap("Recipe keys (KEY=VALUE lines of a --recipe file, most also a flag of that name; "
                                 "defaults the released recipe's, docs/SPEC.md §6):", width, break_on_hyphens=False)]
    lines += textwrap.wrap(", ".join(sorted(recipe_keys)), width, initial_indent="  ", subsequent_indent="  ",
                           break_on_hyphens=False)
    lines += _help_variables(width)
    lines += ["", *textwrap.wrap(
        "Common flags: --output_dir, --max_steps, --per_device_train_batch_size, --gradient_accumulation_steps, "
        "--seed, --save_steps; --loss_type opsd (default), sft or grpo (the baselines). Every setting with its "
        f"help and default (the OPSD settings, the recipe keys, the flags inherited from TRL and transformers): {prog} "
        "--help-all", width, break_on_hyphens=False)]
    return "\n".join(lines)


def help_text(prog: str = "python opsd_train.py") -> str:
    """`--help-all` (its usage line names `prog`): this script's settings, the OPSD_* variables and the
    precedence first, then the flags inherited from TRL / transformers; every line wrapped to the terminal."""
    from trl import DistillationConfig, TrlParser

    from opsd.train_config import OPSDConfig

    recipe_keys = {f.name for f in dataclasses.fields(Recipe)}
    width = _help_width()

    def describe(f, default) -> str:
        return _describe(f, default, width, recipe_keys)

    own = [f for f in dataclasses.fields(OPSDConfig) if f.name in vars(OPSDConfig).get("__annotations__", {})]
    base = {f.name for f in dataclasses.fields(DistillationConfig)}
    lines = [*_help_head(prog, width), "", "OPSD settings:"]
    lines += [describe(f, f.default) for f in dataclasses.fields(ScriptArguments)]
    lines += [describe(f, f.default) for f in own if f.name not in base]
    lines += ["", "Inherited settings whose defaults are the released recipe's (docs/SPEC.md §6):"]
    lines += [describe(f, f.default) for f in own if f.name in base]
    lines += _help_variables(width)
    lines += ["", "Inherited flags (TRL DistillationConfig, transformers TrainingArguments):"]
    lines.append(TrlParser((DistillationConfig,), prog="opsd_train.py", formatter_class=_InheritedHelp).format_help())
    return "\n".join(lines)


def main(argv=None, prog: str = "python opsd_train.py") -> int:
    argv, check_only, world_size = _launcher_flags(list(sys.argv[1:] if argv is None else argv))
    if "--help-all" in argv:
        print(help_text(prog))
        return 0
    if "-h" in argv or "--help" in argv:
        print(short_help(prog))  # short and instant: --help-all has the 900 lines of every inherited flag
        return 0
    try:
        script_args, config, dataset = parse(argv, quiet=check_only)
        if (world_size or 1) == 1 and config.n_gpu > 1:  # launched processes see n_gpu 1 each
            raise ConfigError(
                f"{config.n_gpu} GPUs are visible to one process, which transformers would run as nn.DataParallel "
                "(not supported): make one visible (CUDA_VISIBLE_DEVICES=0) or start one process per GPU "
                "(train_capped.sh, accelerate launch)")
        identity = run_identity(script_args, config, dataset, world_size)
        unreadable = []
        resume = resume_point(config.output_dir, identity, script_args.resume, unreadable)
        lock = run_folder.RunLock(config.output_dir)
        if check_only:
            lock.check()
    except (ConfigError, RecipeError, DataError, run_folder.RunFolderError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = config.output_dir
    if resume and 0 < config.max_steps <= resume[0]:
        # transformers would still run one step past max_steps when resuming at the end.
        if int(os.environ.get("RANK", "0")) == 0 and not check_only:
            print(f"[OPSD] {out} is finished: its last checkpoint {resume[1]} reached max_steps={config.max_steps}; "
                  "nothing to train (for a new run choose another OPSD_OUTPUT or delete the folder)", flush=True)
        return 0
    if check_only:
        return 0
    from opsd.run_folder import CheckpointWriteError
    from opsd_trainer import NonFiniteLossError

    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        for path, problem in unreadable:
            print(f"[OPSD] checkpoint {path} is unreadable: {problem}", flush=True)
    started = time.time()
    try:
        if main_process:
            lock.acquire()  # other ranks write nothing outside the trainer's own barriers
            print(format_identity(identity), flush=True)
            if run_folder.remove_staging(out):
                print(f"[OPSD] removed the partial checkpoint a killed save left in {out}/{run_folder.STAGING_DIR}")
            run_folder.write_config(out, identity)
            run_folder.truncate_metrics(out, resume[0] if resume else 0)
        with _StopRequest() as stop:
            trainer = train(script_args, config, dataset, resume, stop)
    except run_folder.RunFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, CheckpointWriteError) as e:
        print(f"\nerror: {e}", file=sys.stderr)  # the progress bar's line has no newline yet
        return 1
    finally:
        lock.release()
    if trainer.stopped_by_signal is not None:
        last = run_folder.last_checkpoint(out)
        if main_process:
            print(f"[OPSD] stopped by {signal.Signals(trainer.stopped_by_signal).name} at step "
                  f"{trainer.state.global_step}; checkpoint {last[1] if last else 'none'}; re-run the same "
                  "command to resume", flush=True)
        return 128 + trainer.stopped_by_signal
    if main_process:
        summary = _summary_line(trainer, started)
        curves = draw_curves(out)
        print(summary + (f" | curves {curves}" if curves else ""), flush=True)
    return 0


def close_process_group() -> None:
    """Leave the process group before the interpreter exits: a gloo group left open can
    abort a rank at teardown ("terminate called without an active exception", exit -6)
    after its work is done, and the launcher then reports the whole run as failed."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    status = main()
    close_process_group()
    sys.exit(status)
