"""The model card (README.md) of every adapter folder a run writes: each `checkpoint-N/` and,
after the last step, the run folder itself (docs/OUTPUTS.md, "What a checkpoint holds").

Generated from data (`CardData`: what the run recorded), not from peft's or TRL's templates:
the base model, the method, every switch and recipe value that differs from the released
recipe (run_config.json records exactly those), the step, the last logged metrics, the
evaluation command, and a Python snippet that loads the folder by its absolute path with
`AutoTokenizer` / `peft.AutoPeftModelForCausalLM` and answers one training problem in the
student's training prompt (`opsd.prompts`). No licence field: the adapter inherits its base
model's terms, which the run cannot know for every base.

Standard library and `opsd` only; the trainer (rank 0) calls `write_card` into the run folder and
`finish_adapter_folder` into each adapter folder it saves, with the data of `card_data`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from opsd.config import SWITCH_VALUES, SWITCH_VARIABLES, Recipe
from opsd.prompts import student_enable_thinking, student_messages
from opsd.run_folder import read_config, write_text_atomic
from opsd.run_log import KL_LINE_FIELDS
from opsd.tiny_default import resolve_model

CARD_FILE = "README.md"
EMBEDDED_MODELS = ("tiny", "tiny-random")  # tiny_default's models: a folder in its cache
# The last logged values shown, in this order (the [OPSD kl] line's, then the optimizer's).
METRIC_KEYS = ("loss", *(key for _, key in KL_LINE_FIELDS), "completions/mean_length", "learning_rate", "grad_norm")
# What the card's snippet suppresses, and why: peft (0.21) reads transformers' deprecated
# `is_gradient_checkpointing` property in PeftModel.__init__ (peft/peft_model.py), which every
# AutoPeftModelForCausalLM.from_pretrained goes through: one FutureWarning no argument avoids.
PEFT_WARNING = "`is_gradient_checkpointing` is deprecated"


@dataclass(frozen=True)
class CardData:
    folder: str            # the adapter folder the card describes, absolute (where it ends up, not a staging copy)
    base_model: str        # as the run was given it: `tiny`, a hub id, a local folder's absolute path
    adapter_base: str      # what adapter_config.json names (base_model_name_or_path): what loads
    run_config: dict       # run_config.json
    step: int              # optimizer steps done
    metrics: dict          # the last logged record (`last_metrics`)
    problem: str           # a training problem: the snippet asks it in the student's training prompt
    checkpoint: bool = True  # a checkpoint-N folder (False: the run folder's final adapter)


def card_data(folder: str, *, base_model: str, run_dir: str, step: int, log_history: list[dict], problem: str,
              checkpoint: bool) -> CardData:
    """The card's data from what the trainer holds: the run folder's recorded config, its step
    and log history, and one training problem."""
    return CardData(folder=os.path.abspath(folder), base_model=base_model, adapter_base=adapter_base(base_model),
                    run_config=read_config(run_dir) or {}, step=step, metrics=last_metrics(log_history),
                    problem=problem, checkpoint=checkpoint)


def last_metrics(log_history: list[dict]) -> dict:
    """The last logged training record that holds a loss (the trainer's log_history)."""
    return next((dict(r) for r in reversed(log_history) if "loss" in r), {})


# The run's loss_type (recorded in run_config.json for the baseline arms only) -> (name, what trained it).
METHODS = {
    "opsd": ("OPSD", "A LoRA adapter trained by On-Policy Self-Distillation (OPSD) with the OPSD research repository "
             "(`opsd_train.py`): the student (base model + this adapter) samples a completion from the problem "
             "alone; the teacher (the same weights, adapter disabled) also sees a verified solution and scores "
             "the completion token by token; the loss is a clipped divergence between the two."),
    "sft": ("SFT", "A LoRA adapter trained as the supervised baseline of the OPSD research repository "
            "(`opsd_train.py --loss_type sft`): the student's cross-entropy on the reference solutions, with the "
            "prompts, budget and LoRA of an OPSD run; nothing sampled."),
    "grpo": ("GRPO", "A LoRA adapter trained as the RL baseline of the OPSD research repository "
             "(`opsd_train.py --loss_type grpo`): the student samples a group of completions per problem, each "
             "rewarded 1 / 0 by the evaluation's grader against the reference answer, with TRL's "
             "group-normalised advantages and clipped loss; no teacher"),
}


def changed_settings(run_config: dict) -> list[tuple[str, object, object]]:
    """(name, value, released value) of every switch and recipe key that differs from the
    released recipe (recipe.released.env, opsd.config)."""
    rows = []
    for name, variable in SWITCH_VARIABLES.items():
        key = "data_select" if name == "data_select" else variable
        value, default = run_config.get(key), SWITCH_VALUES[name][0]
        if value is not None and value != default:
            rows.append((variable, value, default))
    released = dataclasses.asdict(Recipe())
    for key, default in released.items():
        if key in run_config and run_config[key] != default:
            rows.append((key, run_config[key], default))
    return rows


def _shown_model(data: CardData) -> str:
    if data.base_model in EMBEDDED_MODELS:
        return (f"`{data.base_model}`, the OPSD repository's embedded model (its folder in the cache: "
                f"`{data.adapter_base}`)")
    if os.path.isabs(data.base_model):
        return f"the local folder `{data.base_model}`"
    return f"[{data.base_model}](https://huggingface.co/{data.base_model})"


def _value(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _py(text: str) -> str:
    """A double-quoted Python string literal (a JSON string is one)."""
    return json.dumps(text, ensure_ascii=False)


def loading_snippet(data: CardData) -> str:
    """Python that loads the folder and answers one training problem, as written, from any folder."""
    style = data.run_config.get("OPSD_STUDENT_PROMPT", SWITCH_VALUES["student_prompt"][0])
    messages = student_messages(data.problem, style)
    max_new = int(data.run_config.get("max_completion_length", Recipe().max_completion_length))
    return "\n".join([
        "import warnings",
        "",
        "import torch",
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import AutoTokenizer",
        "",
        "# peft reads transformers' deprecated `is_gradient_checkpointing` in PeftModel.__init__: one FutureWarning",
        f'warnings.filterwarnings("ignore", message={_py(PEFT_WARNING)}, category=FutureWarning)',
        "",
        f"adapter = {_py(data.folder)}  # where the run wrote this folder; its new path if you moved it",
        "tokenizer = AutoTokenizer.from_pretrained(adapter)  # saved with the adapter",
        "model = AutoPeftModelForCausalLM.from_pretrained(adapter)  # and adapter_config.json's base model",
        "",
        f"# the student's training prompt (OPSD_STUDENT_PROMPT={style}) of the run's first training problem",
        f"messages = [{{\"role\": \"user\", \"content\": {_py(messages[0]['content'])}}}]",
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
        f"enable_thinking={student_enable_thinking(style)}, return_tensors=\"pt\", return_dict=True)",
        "torch.manual_seed(0)",
        f"output = model.generate(**inputs, max_new_tokens={max_new})  # the run's completion budget",
        "print(tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
    ]) + "\n"


def model_card(data: CardData) -> str:
    config = data.run_config
    hub = data.base_model not in EMBEDDED_MODELS and not os.path.isabs(data.base_model)
    front = ["---", "library_name: peft"]
    if hub:  # the hub's base_model field takes a hub id only
        front.append(f"base_model: {data.base_model}")
    front += ["pipeline_tag: text-generation", "tags:", "- opsd", "- on-policy-self-distillation", "- lora",
              "- peft", "---", ""]
    name = os.path.basename(os.path.normpath(data.folder))
    run = os.path.basename(os.path.dirname(os.path.normpath(data.folder))) if data.checkpoint else name
    title = f"{run} / {name}" if data.checkpoint else run
    max_steps = config.get("max_steps")
    arm, method = METHODS[config.get("loss_type", "opsd")]
    if arm == "GRPO":
        method += (f" ({config.get('num_generations', Recipe().num_generations)} samples a prompt, loss type "
                   f"`{config.get('grpo_loss_type', '?')}`).")
    lines = front + [
        f"# {arm} adapter: {title}",
        "",
        method,
        "",
        f"- **Base model:** {_shown_model(data)}",
        f"- **Step:** {data.step}" + (f" of {max_steps}" if max_steps else "")
        + ("" if data.checkpoint else " (the run's final adapter)"),
        f"- **Training data:** `{config.get('data', '?')}` ({config.get('train_rows', '?')} rows, "
        f"selection `{config.get('data_select', 'none')}`)",
        f"- **Batch:** global {config.get('global_batch', '?')} ({config.get('num_processes', '?')} process(es) x "
        f"{config.get('per_device_train_batch_size', '?')} x {config.get('gradient_accumulation_steps', '?')} "
        f"accumulation), seed {config.get('seed', '?')}, preset `{config.get('preset', 'none')}`",
        "",
        "## Settings that differ from the released recipe",
        "",
    ]
    changed = changed_settings(config)
    if changed:
        lines += ["| setting | this run | released |", "|---|---|---|"]
        lines += [f"| `{k}` | `{v}` | `{d}` |" for k, v, d in changed]
    else:
        lines.append("No difference: every switch and recipe value is the released recipe's.")
    lines += ["", "The whole configuration is `run_config.json` in this folder.", ""]
    shown = [(k, data.metrics[k]) for k in METRIC_KEYS if isinstance(data.metrics.get(k), (int, float))]
    lines += [f"## Last logged metrics (step {data.metrics.get('step', data.step)})", ""]
    if shown:
        lines += ["| metric | value |", "|---|---|"] + [f"| `{k}` | {_value(v)} |" for k, v in shown]
    else:
        lines.append("No metrics logged yet.")
    lines += ["", "All steps: `metrics.jsonl` in the run folder.", "",
              "## Evaluation", "",
              "From the repository's root (the frozen protocol; a tiny run on its tiny eval set):", "",
              "```bash", f"bash dev_eval.sh {data.folder}", "```", "",
              "## Load it", "",
              "This folder holds the adapter and the tokenizer; `adapter_config.json` names the base model "
              f"(`{data.adapter_base}`), which `AutoPeftModelForCausalLM` loads."]
    if data.base_model in EMBEDDED_MODELS:
        lines.append(f"That is the cache folder `{data.base_model}` was built into; if it is gone, rebuild "
                     "it from the repository's root with the same OPSD_CACHE: "
                     "`python -c \"from opsd.tiny_default import resolve_model; "
                     f"resolve_model('{data.base_model}')\"`.")
    lines += ["", "```python", loading_snippet(data).rstrip("\n"), "```", ""]
    return "\n".join(lines)


def write_card(data: CardData, into: str | None = None) -> str:
    """The card written (atomically) into `into`, default `data.folder` (a checkpoint is written
    under the run's staging folder, then renamed to `data.folder`); returns its path."""
    path = os.path.join(into or data.folder, CARD_FILE)
    write_text_atomic(path, model_card(data))
    return path


def finish_adapter_folder(folder: str, data: CardData) -> None:
    """The project's part of an adapter folder transformers saved: adapter_config.json's base
    model set to what loads (`adapter_base`) and the project's card in place of peft's template."""
    name_adapter_base_model(folder, data.adapter_base)
    write_card(data, into=folder)


def adapter_base(base_model: str) -> str:
    """The base model as a checkpoint's adapter_config.json names it: what `from_pretrained`
    loads from anywhere (`tiny` / `tiny-random`: their folder in the cache, absolute)."""
    if base_model in EMBEDDED_MODELS:
        return os.path.abspath(resolve_model(base_model))
    return base_model


def name_adapter_base_model(folder: str, base_model: str) -> None:
    """`base_model_name_or_path` of the adapter in `folder` set to `base_model` (peft records
    the folder the weights were loaded from, relative when they were given so)."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("base_model_name_or_path") != base_model:
        config["base_model_name_or_path"] = base_model
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True))  # as peft writes it
