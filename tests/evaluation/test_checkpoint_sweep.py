"""The checkpoint sweep (`dev_eval.sh RUN_FOLDER`, opsd/evaluation/sweep.py): every checkpoint of a
run in step order, resumable, an accuracy-vs-step table and plot, the best checkpoint against
the last (run_stats.sweep_checkpoints)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from opsd.analysis import stats as run_stats

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the statistics (fabricated reports)

def fake_report(path: Path, step: int, counts, k: int = 8) -> Path:
    problems = [{"problem": f"problem {i}", "gold": str(i), "samples": [{"correct": j < c} for j in range(k)]}
                for i, c in enumerate(counts)]
    path.write_text(json.dumps({"settings": {"n_samples": k, "seed": 1}, "dataset": "tiny:1:4",
                                "checkpoint": f"/runs/x/checkpoint-{step}", "problems": problems}))
    return path


def sweep_of(tmp_path, per_step: dict, **kwargs):
    steps = sorted(per_step)
    runs = [run_stats.load_run(fake_report(tmp_path / f"eval_{s}.json", s, per_step[s])) for s in steps]
    return run_stats.sweep_checkpoints(steps, runs, n_resamples=2000, **kwargs)


def test_best_is_named_and_compared_with_the_last(tmp_path):
    result = sweep_of(tmp_path, {4: [8] * 20, 8: [2] * 20, 12: [3] * 20})
    assert [r["step"] for r in result["checkpoints"]] == [4, 8, 12]
    assert (result["best"], result["last"], result["best_step"]) == ("checkpoint-4", "checkpoint-12", 4)
    assert result["best_vs_last"]["difference"] == pytest.approx(100 * 5 / 8)
    assert result["verdict"] == "distinguishable from the last beyond evaluation-sampling noise"
    line = run_stats.sweep_final_line(result)
    assert line.startswith("FINAL best checkpoint-4 avg@8 100.00% (last checkpoint-12 37.50%: best - last +62.50")
    assert "\n" not in line
    table = run_stats.format_sweep_markdown(result, "t")
    assert "| 4 | checkpoint-4 (best) | 100.00 |" in table and "| 12 | checkpoint-12 | 37.50 |" in table
    json.dumps(result)


def test_a_small_lead_is_not_distinguishable_and_a_tie_goes_to_the_later_step(tmp_path):
    close = sweep_of(tmp_path, {1: [4, 5, 3, 4], 2: [4, 4, 4, 4]})
    assert close["best"] == "checkpoint-2" and close["best_vs_last"] is None  # 16/32 both: the later one
    assert run_stats.sweep_final_line(close).endswith("(the last checkpoint; 2 checkpoint(s))")
    lead = sweep_of(tmp_path, {1: [5, 5, 3, 4], 2: [4, 4, 4, 4]})
    assert lead["best"] == "checkpoint-1" and lead["verdict"] == "not distinguishable from the last"
    assert "not distinguishable from the last; 2 checkpoint(s))" in run_stats.sweep_final_line(lead)


# ---------------------------------------------------------------- end to end on the tiny preset

EVAL_SET = "tiny:7:4"  # 4 problems x 8 samples
FINAL_BEST = re.compile(r"^FINAL best checkpoint-(\d+) avg@8 \d+\.\d\d% \(")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A tiny run (the random tiny model, 16-token completions) with checkpoint-1 and checkpoint-2."""
    import opsd_train

    out = tmp_path_factory.mktemp("sweep") / "run"
    argv = ["--preset", "tiny", "--model_name_or_path", "tiny-random", "--output_dir", str(out),
            "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1", "--report_to", "none",
            "--max_completion_length", "16", "--learning_rate", "1e-2", "--seed", "0"]
    assert opsd_train.main(argv) == 0
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    return out


@pytest.mark.slow
def test_sweep_evaluates_every_checkpoint_then_skips_them(two_checkpoints, tmp_path, capsys):
    from opsd.evaluation import evaluate
    from opsd.evaluation import sweep as checkpoint_sweep

    run, evals = two_checkpoints, tmp_path / "evals"
    env = {**os.environ, "OPSD_PRESET": "tiny", "OPSD_MODEL": "tiny-random", "OPSD_EVAL_DATA": EVAL_SET,
           "OPSD_EVAL_OUT": str(evals)}
    proc = subprocess.run(["bash", str(ROOT / "dev_eval.sh"), str(run)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert FINAL_BEST.match(lines[-1]), lines[-1]
    assert [line for line in lines if line.startswith("[sweep] checkpoint-")] == [
        "[sweep] checkpoint-1: evaluating", "[sweep] checkpoint-2: evaluating"]
    stem = f"sweep_{run.parent.name}_run"
    result = json.loads((evals / f"{stem}.json").read_text())
    assert [r["step"] for r in result["checkpoints"]] == [1, 2]
    assert result["best"] in {"checkpoint-1", "checkpoint-2"} and result["last"] == "checkpoint-2"
    assert lines[-1].startswith(f"FINAL best {result['best']} ")
    table = (evals / f"{stem}.md").read_text()
    assert "| 1 | checkpoint-1" in table and "| 2 | checkpoint-2" in table and "(best)" in table
    assert (evals / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for step in (1, 2):  # one report each, as a single evaluation writes it
        assert json.loads((evals / f"eval_run_checkpoint-{step}.json").read_text())["checkpoint"] == \
            str(run / f"checkpoint-{step}")

    # Again, in this process: both reports exist, nothing is sampled, the same table.
    status = evaluate.main([str(run), "--preset", "tiny", "--model", "tiny-random", "--dataset", EVAL_SET,
                            "--output-dir", str(evals), "--backend", "transformers"])
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0
    assert [line for line in out if line.startswith("[sweep] checkpoint-")] == [
        f"[sweep] checkpoint-{s}: report exists, skipped ({evals / f'eval_run_checkpoint-{s}.json'})" for s in (1, 2)]
    assert out[-1] == lines[-1]

    # A report made with other settings is not current: it would be evaluated again.
    args = evaluate.parse_args([str(run / "checkpoint-1"), "--preset", "tiny", "--model", "tiny-random",
                                "--dataset", EVAL_SET, "--output-dir", str(evals), "--backend", "transformers"])
    request, problems = evaluate.build_request(args)
    assert checkpoint_sweep.report_is_current(evaluate, request, len(problems))
    report = json.loads(request.output_path.read_text())
    report["settings"]["seed"] += 1
    request.output_path.write_text(json.dumps(report))
    assert not checkpoint_sweep.report_is_current(evaluate, request, len(problems))


def test_a_run_folder_is_told_from_a_checkpoint(tmp_path):
    from opsd.evaluation import sweep as checkpoint_sweep

    (tmp_path / "checkpoint-3").mkdir()
    assert not checkpoint_sweep.is_run_folder(str(tmp_path))  # no trainer_state.json: not a complete checkpoint
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert checkpoint_sweep.is_run_folder(str(tmp_path))
    assert not checkpoint_sweep.is_run_folder(str(tmp_path / "checkpoint-3"))
    assert not checkpoint_sweep.is_run_folder("base")


class _Sampled(Exception):
    """Raised where sampling would start: what the evaluation chose is known by then."""


@pytest.mark.slow
def test_a_tiny_run_is_evaluated_on_the_tiny_presets_eval_set_without_the_hub(two_checkpoints, monkeypatch, capsys):
    """No OPSD_PRESET, model or dataset given (`bash dev_eval.sh outputs/opsd-tiny`): a run folder
    or checkpoint whose run_config.json records the tiny preset is evaluated with its own model on
    the tiny preset's eval set and settings, said in one line before anything loads; the hub is
    never asked (HF_HUB_OFFLINE=1: a hub dataset would fail)."""
    from opsd import tiny_default
    from opsd.evaluation import evaluate

    for name in ("OPSD_PRESET", "OPSD_MODEL", "OPSD_EVAL_DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    requests = []

    def stop(request, problems):
        requests.append((request, len(problems)))
        raise _Sampled

    monkeypatch.setattr(evaluate, "evaluate", stop)
    for target in (two_checkpoints, two_checkpoints / "checkpoint-2"):
        with pytest.raises(_Sampled):
            evaluate.main([str(target), "--backend", "transformers", "--output-dir", str(two_checkpoints / "e")])
        out = capsys.readouterr().out.splitlines()
        notes = [line for line in out if line.startswith("[eval] ")]
        assert notes == [f"[eval] {target} is a run of the tiny preset (run_config.json): evaluating with the tiny "
                         "preset's eval set (tiny) and settings and its base model tiny-random (OPSD_PRESET, "
                         "OPSD_MODEL, OPSD_EVAL_DATA or --preset / --model / --dataset choose otherwise)"]
        assert out.index(notes[0]) == 0  # before anything else
        request, count = requests.pop()
        assert (request.model, request.dataset, request.settings, count) == \
            ("tiny-random", tiny_default.eval_set_name("tiny"), evaluate.TINY_SETTINGS, tiny_default.N_EVAL_ROWS)


def test_a_checkpoint_without_run_config_names_the_hub_dataset_it_needs(tmp_path):
    """Where nothing says what a checkpoint was trained on, one line says before any hub access
    which hub dataset the default needs and how to choose another."""
    from opsd.evaluation import evaluate

    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "adapter_config.json").write_text("{}")
    args = evaluate.parse_args([str(checkpoint)])
    args.preset = None
    note = evaluate.apply_run_defaults(args)
    assert note == (f"[eval] {checkpoint} has no run_config.json saying what it was trained on: evaluating on the "
                    "default HuggingFaceH4/aime_2024, which needs the hub (OPSD_PRESET=tiny or OPSD_EVAL_DATA / "
                    "--dataset choose another)")
    args.dataset = "tiny"
    assert evaluate.apply_run_defaults(args) is None
