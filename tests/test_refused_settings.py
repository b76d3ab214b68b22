"""Settings the project's engines would silently ignore are refused before any model loads: one
`error:` line naming the setting, exit 2, nothing written (opsd.train_config.check_honoured),
through the real command line (opsd_train.py in a subprocess) and through opsd_train.main."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import opsd_train

REPO = Path(__file__).resolve().parents[1]
OWN_ENGINE = "the rollouts (use_vllm false) are sampled by the project's own rollout engine, which does not implement"


def tiny_argv(out, *extra):
    return ["--preset", "tiny", "--output_dir", str(out), "--max_steps", "1", "--report_to", "none", *extra]


def test_min_p_with_the_own_engine_is_one_line_exit_2_from_the_command_line(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "opsd_train.py"), *tiny_argv(tmp_path / "run", "--min_p", "0.1")],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OPSD_CACHE": str(tmp_path)},
                         timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"error: min_p=0.1: {OWN_ENGINE} min_p (vLLM does: --use_vllm true without reason_first, not for loss_type "
        "grpo)"]
    assert run.stdout == ""
    assert not (tmp_path / "run").exists() and list(tmp_path.iterdir()) == []  # no run folder, no model built


@pytest.mark.parametrize("extra, message", [
    (["--repetition_penalty", "1.1"], f"repetition_penalty=1.1: {OWN_ENGINE} repetition_penalty"),
    (["--generation_kwargs", '{"min_tokens": 4}'], f"generation_kwargs={{'min_tokens': 4}}: {OWN_ENGINE} "
                                                   "generation_kwargs"),
    (["--vllm_structured_outputs_regex", "[0-9]+"], f"vllm_structured_outputs_regex='[0-9]+': {OWN_ENGINE}"),
    (["--use_vllm", "true", "--reason_first", "true", "--min_p", "0.05"],
     "min_p=0.05: reason_first's analyses are sampled by the project's own rollout engine"),
    (["--cache_implementation", "static"], "cache_implementation='static': TRL's cache of transformers generate()"),
    (["--num_iterations", "3"], "num_iterations=3: one optimizer step per generation batch"),
    (["--grpo_beta", "0.1"], "grpo_beta=0.1: a GRPO setting, which loss_type opsd does not read (leave it at 0.0)"),
    (["--loss_type", "sft", "--grpo_use_bias_correction_kl", "false"],
     "grpo_use_bias_correction_kl=False: a GRPO setting, which loss_type sft does not read (leave it at True)"),
    (["--scale_rewards", "none"], "scale_rewards='none': a GRPO setting, which loss_type opsd does not read"),
])
def test_ignored_settings_are_refused(tmp_path, capsys, extra, message):
    assert opsd_train.main(tiny_argv(tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--min_p", "0"], ["--repetition_penalty", "1.0"], ["--generation_kwargs", "{}"]])
def test_neutral_values_are_accepted(tmp_path, extra):
    opsd_train.parse(tiny_argv(tmp_path / "run", *extra), env={})
