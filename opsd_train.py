"""OPSD training entry point (TRL-style: dataclasses on the command line or a YAML `--config`).

    python opsd_train.py --model_name_or_path Qwen/Qwen3-1.7B --output_dir outputs/run \
        --recipe recipe.env --max_steps 100 --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 8

Precedence, lowest to highest: dataclass defaults < YAML / command line <
`--recipe` file (docs/SPEC.md §6 keys) < `OPSD_*` environment switches that are set.
Everything is validated (recipe, switches, dataset) before a model is loaded;
bad input exits with status 2 and a one-line `error:` message.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field

from opsd_config import SWITCH_VARIABLES, ConfigError, Recipe, RecipeError, Switches, parse_recipe
from opsd_data import DataError, load_train_dataset

TINY_PRESET = {  # the embedded default: its worked solutions take ~50 tokens, its longest teacher prompt ~300
    "max_completion_length": 64,
    "max_teacher_prompt_length": 512,
    # A 3 M-parameter model is launch-bound on a GPU: compiling would cost more than it saves.
    "compile_layers": False,
    "compile_loss": False,
    "rollout_cache_implementation": "dynamic",
}

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
    lora_r: int = field(default=64)
    lora_alpha: int = field(default=128)
    lora_dropout: float = field(default=0.0, metadata={"help": "0 keeps both roles on one deterministic network."})
    dtype: str = field(default="auto", metadata={"help": "auto: bfloat16 on GPU, float32 on CPU."})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2."})
    resume: bool = field(default=True, metadata={"help": "Resume from the newest checkpoint in output_dir."})


RECIPE_TO_ARGS = (
    "learning_rate",
    "lr_scheduler_type",
    "max_grad_norm",
    "lora_r",
    "lora_alpha",
    "beta",
    "jsd_token_clip",
    "temperature",
    "top_p",
    "top_k",
    "lmbda",
    "max_completion_length",
    "fixed_teacher",
    "use_ema_teacher",
    "ema_decay",
    "reason_first",
    "teacher_thinking",
    "top_k_loss",
    "use_tinker_loss",
)
# Switches that are trainer config fields (data_select is applied to the dataset instead).
CONFIG_SWITCHES = {name: var for name, var in SWITCH_VARIABLES.items() if name != "data_select"}


def _flag(name: str, value) -> list[str]:
    return [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]


def overrides(preset: str | None, recipe: Recipe | None, max_steps: int, switches: Switches, env) -> list[str]:
    """Extra command-line flags from the preset, the recipe and the set switches.

    Appended after the user's flags, so they win; going through the parser keeps
    every type conversion and check of the config dataclasses in one path.
    """
    extra: list[str] = []
    if recipe is not None:
        for key in RECIPE_TO_ARGS:
            extra += _flag(key, getattr(recipe, key))
        # transformers 5 folds the ratio into `warmup_steps` (a float < 1 is a ratio).
        ratio = recipe.warmup_ratio
        extra += _flag("warmup_steps", ratio if ratio < 1 else max_steps)
    for name, var in CONFIG_SWITCHES.items():
        if var in env:
            extra += _flag(name, getattr(switches, name))
    if preset == "tiny":
        for key, value in TINY_PRESET.items():
            if key == "max_completion_length" and recipe is not None:
                value = min(value, recipe.max_completion_length)
            extra += _flag(key, value)
    return extra


def _early_flags(argv: list[str]) -> argparse.Namespace:
    """--recipe, --preset and --max_steps, read before the (slow) config parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    pre.add_argument("--preset")
    pre.add_argument("--max_steps", type=int, default=-1)
    return pre.parse_known_args(argv)[0]


def parse(argv=None, env=os.environ):
    """Parse and validate everything that can be checked without a model.

    Switches and the recipe are checked first (stdlib only, instant), then the
    config dataclasses, then the dataset.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    early = _early_flags(argv)
    if early.preset not in (None, "", "tiny"):
        raise ConfigError(f"--preset {early.preset!r}: expected tiny")
    switches = Switches.from_env(env)
    recipe = None
    if early.recipe:
        recipe, warnings = parse_recipe(early.recipe)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)

    from trl import TrlParser

    from opsd_trainer import OPSDConfig

    parser = TrlParser((ScriptArguments, OPSDConfig))
    # The tiny preset's model and data come first, so explicit flags still win.
    defaults = ["--model_name_or_path", "tiny", "--dataset_name", "tiny"] if early.preset == "tiny" else []
    extra = overrides(early.preset, recipe, early.max_steps, switches, env)
    script_args, config = parser.parse_args_and_config(defaults + argv + extra)
    if config.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--use_vllm true: vllm is not installed (pip install -r requirements-gpu.txt)")
    dataset = load_train_dataset(
        script_args.dataset_name, select=switches.data_select, teacher_context=config.teacher_context
    )
    return script_args, config, dataset


def build_model_and_tokenizer(script_args: ScriptArguments):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_default import resolve_model

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


def train(script_args: ScriptArguments, config, dataset):
    from transformers.trainer_utils import get_last_checkpoint

    from opsd_trainer import OPSDTrainer

    model, tokenizer = build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(script_args),
    )
    resume = None
    if script_args.resume and os.path.isdir(config.output_dir):
        resume = get_last_checkpoint(config.output_dir)
    if resume and trainer.accelerator.is_main_process:
        print(f"[OPSD] resuming from {resume}", flush=True)
    if resume and 0 < config.max_steps <= _checkpoint_step(resume):
        # transformers would still run one step past max_steps when resuming at the end.
        if trainer.accelerator.is_main_process:
            print(f"[OPSD] {resume} already reached max_steps={config.max_steps}; nothing to train", flush=True)
        return trainer
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(config.output_dir)  # final adapter + tokenizer at the top of the run folder
    return trainer


def _checkpoint_step(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


def main(argv=None) -> int:
    try:
        script_args, config, dataset = parse(argv)
    except (ConfigError, RecipeError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from opsd_trainer import NonFiniteLossError

    try:
        train(script_args, config, dataset)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
