"""opsd.model_card: the card of an adapter folder, generated from what the run recorded."""
import ast
import json

from opsd import model_card
from opsd.prompts import INSTRUCTION

CONFIG = {
    "model": "Qwen/Qwen3-1.7B", "data": "siyanzhao/Openthoughts_math_30k_opsd", "data_select": "nomath",
    "train_rows": 29000, "preset": "none", "OPSD_CLIP_MODE": "token", "OPSD_PAD_SIDE": "right",
    "OPSD_TEACHER_CONTEXT": "solution", "OPSD_STUDENT_PROMPT": "paper", "lr_scheduler_type": "cosine",
    "seed": 1, "global_batch": 32, "max_steps": 100, "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8, "num_processes": 1, "output_dir": "/runs/a",
}


def data(**changes):
    values = {"folder": "/runs/a/checkpoint-50", "base_model": "Qwen/Qwen3-1.7B", "adapter_base": "Qwen/Qwen3-1.7B",
              "run_config": CONFIG, "step": 50, "metrics": {"step": 50, "loss": 0.0123, "opsd/true_kl": 0.25,
                                                         "learning_rate": 2.5e-6, "timing/rollout_s": 3.0},
              "problem": "What is $2 + 3$?"}
    values.update(changes)
    return model_card.CardData(**values)


def test_the_card_names_the_base_model_the_changed_settings_the_step_and_the_metrics():
    card = model_card.model_card(data())
    front = card.split("---")[1]
    assert "base_model: Qwen/Qwen3-1.7B\n" in front and "library_name: peft\n" in front
    assert "licen" not in card  # no licence field: the base model's terms apply
    assert "[More Information Needed]" not in card and "trl" not in front and "2306.13649" not in card
    assert "# OPSD adapter: a / checkpoint-50" in card and "**Step:** 50 of 100" in card
    # exactly the switches and recipe values that differ from the released recipe
    assert model_card.changed_settings(CONFIG) == [
        ("OPSD_CLIP_MODE", "token", "entry"), ("OPSD_DATA_SELECT", "nomath", "none"),
        ("lr_scheduler_type", "cosine", "constant")]
    assert "| `OPSD_CLIP_MODE` | `token` | `entry` |" in card and "OPSD_PAD_SIDE" not in card
    assert "| `loss` | 0.0123 |" in card and "| `opsd/true_kl` | 0.25 |" in card and "timing/" not in card
    assert "bash dev_eval.sh /runs/a/checkpoint-50" in card


def test_the_snippet_loads_by_the_absolute_path_with_the_students_training_prompt():
    code = model_card.loading_snippet(data())
    tree = ast.parse(code)  # valid Python as written
    assigned = {node.targets[0].id: node.value for node in tree.body if isinstance(node, ast.Assign)}
    assert ast.literal_eval(assigned["adapter"]) == "/runs/a/checkpoint-50"
    messages = ast.literal_eval(assigned["messages"])
    assert messages == [{"role": "user", "content": f"Problem: What is $2 + 3$?\n\n{INSTRUCTION}"}]
    assert "enable_thinking=False" in code and "max_new_tokens=1024" in code  # paper prompt, released budget
    assert "AutoPeftModelForCausalLM.from_pretrained(adapter)" in code
    assert "AutoTokenizer.from_pretrained(adapter)" in code
    evaluation = model_card.loading_snippet(data(run_config={**CONFIG, "OPSD_STUDENT_PROMPT": "eval",
                                                             "max_completion_length": 64}))
    assert "enable_thinking=True" in evaluation and "max_new_tokens=64" in evaluation and "Problem:" not in evaluation


def test_an_embedded_or_local_base_model_is_not_a_hub_field(tmp_path):
    tiny = model_card.model_card(data(base_model="tiny", adapter_base="/cache/tiny-qwen3-learned-x",
                                      run_config={**CONFIG, "preset": "tiny"}))
    assert "base_model:" not in tiny.split("---")[1]
    assert "`tiny`, the OPSD repository's embedded model" in tiny and "/cache/tiny-qwen3-learned-x" in tiny
    assert "resolve_model('tiny')" in tiny  # how to rebuild the cache folder
    local = model_card.model_card(data(base_model="/models/q", adapter_base="/models/q"))
    assert "base_model:" not in local.split("---")[1] and "the local folder `/models/q`" in local
    released = model_card.model_card(data(run_config={"OPSD_CLIP_MODE": "entry"}, checkpoint=False,
                                          folder="/runs/b"))
    assert "No difference: every switch and recipe value is the released recipe's." in released
    assert "None" not in released
    assert "# OPSD adapter: b\n" in released and "(the run's final adapter)" in released


def test_write_card_and_last_metrics(tmp_path):
    history = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5, "opsd/true_kl": 0.1}, {"train_runtime": 9.0}]
    assert model_card.last_metrics(history) == {"step": 2, "loss": 0.5, "opsd/true_kl": 0.1}
    path = model_card.write_card(data(folder=str(tmp_path / "checkpoint-2")), into=str(tmp_path))
    assert path == str(tmp_path / "README.md")
    assert json.dumps(str(tmp_path / "checkpoint-2")) in (tmp_path / "README.md").read_text()


def test_a_baseline_arms_card_says_what_trained_it():
    sft = model_card.model_card(data(run_config={**CONFIG, "loss_type": "sft"}))
    assert "# SFT adapter: a / checkpoint-50" in sft and "cross-entropy on the reference solutions" in sft
    grpo = model_card.model_card(data(run_config={**CONFIG, "loss_type": "grpo", "num_generations": 4,
                                                   "grpo_loss_type": "dapo"}))
    assert "# GRPO adapter: a / checkpoint-50" in grpo and "(4 samples a prompt, loss type `dapo`)." in grpo
    assert "On-Policy Self-Distillation" not in grpo and "On-Policy Self-Distillation" in model_card.model_card(data())
