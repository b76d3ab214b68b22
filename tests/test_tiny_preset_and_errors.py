"""What a newcomer sees first from train_capped.sh and dev_eval.sh: a bad input is its one
`error:` line and nothing before it (the rollouts line waits until every input is checked),
and the tiny preset says, wherever it runs, that it is a pipeline check (at the released
learning rate its 8 steps leave the model at base accuracy) and where a run that learns is."""
import json
import os
import subprocess
from pathlib import Path

import pytest
from one_line_errors import assert_only_an_error_line

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_CHECK = ("the tiny preset is a pipeline check: its 8 steps at the released learning rate leave the model "
                  "at base accuracy; bash quickstart.sh shows a run that learns")


def run(cmd, env, cwd):
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("env, recipe, fragment", [
    ({"OPSD_CLIP_MODE": "foo"}, None, "OPSD_CLIP_MODE='foo'"),
    ({}, "learning_rate=abc\n", "bad.env:1: learning_rate='abc'"),
    ({"OPSD_DATA": "rows.jsonl"}, None, "train file rows.jsonl: missing column 'problem'"),
], ids=["switch-value", "recipe", "data-file"])
def test_a_bad_input_prints_its_error_line_and_nothing_before_it(tmp_path, env, recipe, fragment):
    (tmp_path / "rows.jsonl").write_text('{"x": 1}\n')
    cmd = ["bash", str(ROOT / "train_capped.sh")]
    if recipe is not None:
        (tmp_path / "bad.env").write_text(recipe)
        cmd.append("bad.env")
    result = run(cmd, {"OPSD_PRESET": "tiny", "OPSD_OUTPUT": str(tmp_path / "out"), **env}, tmp_path)
    assert_only_an_error_line(result, fragment)
    assert not (tmp_path / "out").exists()


def test_train_capped_says_the_tiny_preset_is_a_pipeline_check(tmp_path):
    """Printed once the inputs are checked, before the run starts (a fake accelerate stands in
    for the launch: a sharded engine sends even one process through it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text("#!/usr/bin/env bash\necho \"fake accelerate $*\"\n")
    (bin_dir / "accelerate").chmod(0o755)
    env = {"OPSD_PRESET": "tiny", "OPSD_MODEL": "tiny-random", "OPSD_ACCELERATE_CONFIG": "fsdp2",
           "OPSD_OUTPUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = run(["bash", str(ROOT / "train_capped.sh")], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[OPSD] rollouts: own engine")
    assert lines[1] == f"[OPSD] {PIPELINE_CHECK}"
    assert lines[-1].startswith("fake accelerate launch")


def test_dev_eval_says_a_tiny_runs_folder_is_a_pipeline_check(tmp_path):
    run_folder = tmp_path / "opsd-tiny"
    run_folder.mkdir()
    (run_folder / "run_config.json").write_text(json.dumps({"preset": "tiny"}, indent=1) + "\n")
    (run_folder / "checkpoint-8").mkdir()  # a run folder to dev_eval.sh: a checkpoint with its trainer state
    (run_folder / "checkpoint-8" / "trainer_state.json").write_text("{}\n")
    result = run(["bash", str(ROOT / "dev_eval.sh"), str(run_folder)], {}, tmp_path)
    assert result.stdout.splitlines()[0] == f"[eval] {PIPELINE_CHECK}"


def test_the_docs_say_it_too():
    for doc in ("README.md", "docs/TINY_DEFAULT.md"):
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split()).replace("`", "").lower()
        assert PIPELINE_CHECK in text, doc
