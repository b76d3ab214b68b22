"""README's checkpoint-loading snippet is one a CPU user can run after the quickstart: it names the
checkpoint the CPU quickstart writes, and runs as written (on a LoRA checkpoint of the embedded random
model at that path), printing what the model generates and no warning (peft's
`is_gradient_checkpointing` FutureWarning is silenced there as in the model card's snippet,
opsd/model_card.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from lora_helpers import lora_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README_CHECKPOINT = "outputs/quickstart-cpu/token_left/seed-10/run/checkpoint-12"


def loading_snippet() -> str:
    snippets = [code for code in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
                if "AutoPeftModelForCausalLM" in code]
    assert len(snippets) == 1
    return snippets[0]


def test_the_snippets_checkpoint_is_the_one_the_cpu_quickstart_trains():
    """quickstart.sh on a CPU runs grids/quickstart_cpu.json into outputs/quickstart-cpu; its trained
    arm's run folder holds checkpoint-<max_steps>, the path the snippet and the quickstart section name."""
    import opsd.research.grid as grid_module

    grid = grid_module.load_grid(str(ROOT / "grids" / "quickstart_cpu.json"))
    (cell,) = [c for c in grid_module.cells(grid, Path("outputs/quickstart-cpu")) if c.arm.train]
    assert cell.arm.name == "token_left"  # the arm quickstart.sh prints the checkpoint of
    expected = cell.folder / "run" / f"checkpoint-{grid.budget['max_steps']}"
    assert expected.as_posix() == README_CHECKPOINT
    assert f'checkpoint = "{README_CHECKPOINT}"' in loading_snippet()
    assert '"$out"/token_left/seed-*/run/checkpoint-*' in (ROOT / "quickstart.sh").read_text()


def test_the_readmes_loading_snippet_runs_without_a_warning(tmp_path):
    lora_checkpoint(tmp_path / README_CHECKPOINT)  # where the snippet looks, from the checkout's root
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    result = subprocess.run([sys.executable, "-"], input=loading_snippet() + "print(type(model).__name__)\n",
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    generated, loaded = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert loaded == "PeftModelForCausalLM" and generated.strip()  # the random model's 64 tokens
    assert "warn" not in result.stderr.lower(), result.stderr
