"""README's checkpoint-loading snippet runs as written, on a LoRA checkpoint of the embedded
random model, and prints no warning (peft's `is_gradient_checkpointing` FutureWarning is
silenced there as in the model card's snippet, opsd/model_card.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_CHECKPOINT = "outputs/opsd-capped/checkpoint-100"


def test_the_readmes_loading_snippet_runs_without_a_warning(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd import tiny_default
    from opsd.model_utils import peft_wrapping

    snippets = [code for code in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
                if "AutoPeftModelForCausalLM" in code]
    assert len(snippets) == 1 and README_CHECKPOINT in snippets[0]
    base = tiny_default.resolve_model("tiny-random")
    checkpoint = tmp_path / "checkpoint"
    with peft_wrapping():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(base).save_pretrained(checkpoint)
    code = snippets[0].replace(README_CHECKPOINT, str(checkpoint)) + "\nprint(type(model).__name__)\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    result = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "PeftModelForCausalLM"
    assert "warn" not in result.stderr.lower(), result.stderr
