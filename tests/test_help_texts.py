"""Help texts a newcomer reads: short by default, no internal names, the same default in every
place that states one."""
import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_opsd_train_help_is_short_fast_and_points_to_the_full_list():
    from opsd.config import SWITCH_VARIABLES, Recipe
    from opsd.objective import LOSS_TYPES

    # Fast: neither torch nor TRL nor transformers is imported (the full list, --help-all, imports
    # them all: 5 s on 2 cores).
    probe = run("-c", "import contextlib, io, sys, opsd_train\n"
                      "with contextlib.redirect_stdout(io.StringIO()): opsd_train.main(['--help'])\n"
                      "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))")
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    result = run("opsd_train.py", "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    text = result.stdout
    assert len(text.splitlines()) <= 80
    assert text.startswith("usage: python opsd_train.py")
    flat = " ".join(text.split())
    assert flat.endswith("python opsd_train.py --help-all")
    recipe_keys = [f.name for f in dataclasses.fields(Recipe)]
    for name in ("--model_name_or_path", "--recipe", "--preset", *recipe_keys, *SWITCH_VARIABLES.values()):
        assert name in flat, name
    assert f"--loss_type {LOSS_TYPES[0]} (default), {LOSS_TYPES[1]} or {LOSS_TYPES[2]}" in flat
    assert "Inherited flags" not in text and "--optim" not in text


def test_grid_and_stats_help_name_no_internal_module_and_say_where_the_format_is():
    grid = run("-m", "opsd.research.grid", "--help")
    assert grid.returncode == 0
    assert "run_stats" not in grid.stdout and "docs/RESEARCH.md" in grid.stdout
    tokens = run("-m", "opsd.analysis.stats", "tokens", "--help")
    assert tokens.returncode == 0
    assert "an research" not in tokens.stdout and "a opsd.research.grid folder" in tokens.stdout


def test_variables_state_defaults_without_nested_parentheses():
    result = run("-m", "opsd.config", "variables")
    assert result.returncode == 0
    for line in result.stdout.splitlines():
        depth = deepest = 0
        for char in line:
            depth += {"(": 1, ")": -1}.get(char, 0)
            deepest = max(deepest, depth)
        assert deepest <= 1, line
    output = next(line for line in result.stdout.splitlines() if line.startswith("OPSD_OUTPUT "))
    assert "Default: outputs/opsd-capped in the repository; the tiny preset: outputs/opsd-tiny;" in output


def test_the_paged_pools_default_is_stated_one_way_everywhere():
    from opsd.config import SCRIPT_VARIABLES
    from opsd.rollout.paged_decode import CACHE_FRACTION

    assert CACHE_FRACTION == {"cuda": 0.5, "cpu": 0.25}  # what the words below say
    words = "half the GPU's total memory, a quarter of RAM on CPU"
    assert SCRIPT_VARIABLES["OPSD_EVAL_PAGED_GIB"].default.startswith(words)
    for path in ("dev_eval.sh", "docs/SPEC.md", "docs/EVALUATION.md", "docs/ENGINE.md", "opsd/evaluation/evaluate.py"):
        text = " ".join((ROOT / path).read_text(encoding="utf-8").replace('"', " ").split())
        mentions = text.split("half the GPU's")[1:]
        assert mentions and all(m.startswith(words.removeprefix("half the GPU's")) for m in mentions), path
