"""Evaluation (opsd/evaluation/evaluate.py, dev_eval.sh): report names, the frozen settings, inputs, and
end-to-end runs of the tiny preset (grading: tests/opsd/test_grading.py; metrics and the FINAL
line: tests/evaluation/test_metrics.py).

The end-to-end part runs `OPSD_PRESET=tiny bash dev_eval.sh base` once as a
subprocess and reuses it; the determinism and LoRA checks run the same entry
point in-process, which is much cheaper than more subprocesses."""
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from answer_workers import installed_workers

from opsd.evaluation import evaluate
from opsd.evaluation.evaluate import TINY_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
FINAL_RE = re.compile(r"^FINAL avg@(\d+) accuracy: (\d+\.\d\d)% \((\d+)/(\d+) solutions correct on (\d+) problems\)$")


# ---------------------------------------------------------------- report names and settings

def test_names_of_reports():
    assert evaluate.run_name(None) == "base"
    assert evaluate.run_name("/runs/capped/checkpoint-100") == "capped_checkpoint-100"
    assert evaluate.dataset_tag("HuggingFaceH4/aime_2024") == "aime_2024"
    assert evaluate.dataset_tag("data/aime 25.jsonl") == "aime-25"
    assert evaluate.dataset_tag("tiny") == "tiny"


@pytest.mark.parametrize("given, label, problems", [("tiny", "tiny:20240101:30", 30), ("tiny:7", "tiny:7:30", 30),
                                                    ("tiny:7:4", "tiny:7:4", 4)])
def test_a_report_names_its_tiny_set_by_seed_and_size(given, label, problems):
    """The header and the report call the set by its seed and size; its folder stays as given."""
    request, loaded = evaluate.build_request(evaluate.parse_args(["base", "--preset", "tiny", "--dataset", given,
                                                                  "--backend", "transformers"]))
    assert (request.dataset, len(loaded)) == (label, problems)
    assert request.output_path == Path("outputs") / "eval" / evaluate.dataset_tag(given) / "eval_base.json"
    assert evaluate.dataset_label("HuggingFaceH4/aime_2024") == "HuggingFaceH4/aime_2024"


def test_frozen_settings():
    frozen = evaluate.FROZEN_SETTINGS
    assert (frozen.n_samples, frozen.seed, frozen.enable_thinking) == (12, 20260610, True)
    assert (frozen.temperature, frozen.top_p, frozen.top_k, frozen.max_new_tokens) == (1.0, 0.95, 0, 38912)
    assert frozen.max_problems is None
    assert TINY_SETTINGS.seed == frozen.seed and TINY_SETTINGS.n_samples < frozen.n_samples


# ---------------------------------------------------------------- end to end (tiny preset)

def dev_eval(*args, env=None, cwd=None):
    full_env = {**os.environ, "OPSD_PRESET": "tiny", **(env or {})}
    return subprocess.run(["bash", str(ROOT / "dev_eval.sh"), *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or ROOT, timeout=1500)


# 8 held-out problems: the default 30 x 8 samples cost minutes of CPU per evaluation.
EVAL_SET = "tiny:7:4"  # 4 problems x 8 samples: two chunks of the batch of 16
FIRST = 2  # problems re-sampled by the seed and checkpoint tests: one chunk of 8-sample problems


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One `OPSD_PRESET=tiny bash dev_eval.sh base`, started from another folder."""
    out = tmp_path_factory.mktemp("base_eval")
    started = time.monotonic()
    proc = dev_eval("base", env={"OPSD_EVAL_OUT": str(out), "OPSD_EVAL_DATA": EVAL_SET}, cwd=out)
    return proc, out / "eval_base.json", time.monotonic() - started


def in_process(capsys, *argv):
    """opsd.evaluation.evaluate's entry point in this process: (exit status, stdout, stderr)."""
    status = evaluate.main([*argv, "--preset", "tiny", "--backend", "transformers"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def completions_of(report):
    return [[(s["answer"], s["completion"]) for s in p["samples"]] for p in report["problems"]]


@pytest.mark.slow
def test_dev_eval_base_end_to_end(base_run):
    proc, report_path, elapsed = base_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = FINAL_RE.match(last)
    assert match, last
    k, pct, correct, total, problems = match.groups()

    report = json.loads(report_path.read_text())
    assert set(report) >= {"settings", "model", "checkpoint", "dataset", "backend", "metrics", "problems"}
    assert report["settings"] == evaluate.asdict(TINY_SETTINGS) and int(k) == TINY_SETTINGS.n_samples
    assert (report["checkpoint"], report["dataset"], report["backend"]) == ("base", EVAL_SET, "transformers")
    metrics = report["metrics"]
    assert (metrics["num_correct"], metrics["num_samples"], metrics["num_problems"]) == \
        (int(correct), int(total), int(problems)) == (metrics["num_correct"], len(report["problems"]) * int(k),
                                                    len(report["problems"]))
    assert f"{metrics[f'avg@{k}']:.2f}" == pct
    assert {f"pass@{j}" for j in range(1, int(k) + 1)} | {f"maj@{k}"} <= set(metrics)
    for problem in report["problems"]:
        assert {"gold", "accuracy", "num_correct", "majority_answer", "majority_correct"} <= set(problem)
        assert len(problem["samples"]) == int(k)
        for sample in problem["samples"]:
            assert set(sample) >= {"answer", "correct", "reason", "num_tokens", "truncated"}
            assert sample["reason"] in {"correct", "wrong_answer", "no_answer", "truncated"}
            assert 0 < sample["num_tokens"] <= TINY_SETTINGS.max_new_tokens
    assert not list(report_path.parent.glob(".*.tmp")), "temporary file left behind"
    print(f"tiny dev_eval.sh base: {elapsed:.1f}s")


@pytest.fixture(scope="module")
def first_problems(tmp_path_factory):
    """The first FIRST problems of EVAL_SET as a local file. Problems are sampled in
    chunks seeded from (seed, the chunk's first problem) (`problem_chunks`), so the
    same seed must give these problems the same completions as in the full run."""
    from opsd import tiny_default
    rows = tiny_default.tiny_eval_path(EVAL_SET).read_text().splitlines(keepends=True)[:FIRST]
    path = tmp_path_factory.mktemp("data") / "first.jsonl"
    path.write_text("".join(rows))
    return path


@pytest.mark.slow
def test_same_seed_same_completions(base_run, first_problems, tmp_path, capsys):
    status, out, _ = in_process(capsys, "base", "--dataset", str(first_problems), "--output-dir", str(tmp_path))
    assert status == 0 and FINAL_RE.match(out.strip().splitlines()[-1])
    again = json.loads((tmp_path / "eval_base.json").read_text())
    full = json.loads(base_run[1].read_text())
    assert completions_of(again) == completions_of(full)[:FIRST]


def make_lora_checkpoint(folder: Path) -> Path:
    """A LoRA adapter for the tiny model whose B matrices are non-zero, so it
    actually changes the model (a freshly initialised adapter is a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opsd import tiny_default
    from opsd.model_utils import peft_wrapping

    model = AutoModelForCausalLM.from_pretrained(tiny_default.resolve_model("tiny"))  # the preset's model
    with peft_wrapping():
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                # small enough to keep the model coherent (samples still end with EOS)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_lora_checkpoint_changes_completions(base_run, first_problems, tmp_path, capsys):
    checkpoint = make_lora_checkpoint(tmp_path / "run" / "checkpoint-7")
    status, out, err = in_process(capsys, str(checkpoint), "--dataset", str(first_problems),
                                  "--output-dir", str(tmp_path / "out"))
    assert status == 0, err
    report = json.loads((tmp_path / "out" / "eval_run_checkpoint-7.json").read_text())
    assert report["checkpoint"] == str(checkpoint)
    base = completions_of(json.loads(base_run[1].read_text()))[:FIRST]
    assert completions_of(report) != base


def test_evaluating_a_checkpoint_raises_no_deprecation_warning(tmp_path, monkeypatch, capsys):
    """peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model:
    the evaluation's PeftModel.from_pretrained keeps that FutureWarning to itself, and nothing
    else on the way (loading, merging, sampling, grading) warns of a deprecation."""
    import warnings

    checkpoint = make_lora_checkpoint(tmp_path / "run" / "checkpoint-7")
    monkeypatch.setattr(evaluate, "TINY_SETTINGS",
                        evaluate.replace(TINY_SETTINGS, n_samples=2, max_new_tokens=6, max_problems=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        status, out, err = in_process(capsys, str(checkpoint), "--dataset", "tiny:7:1", "--batch-size", "2",
                                      "--output-dir", str(tmp_path / "out"))
    assert status == 0, err
    assert FINAL_RE.match(out.strip().splitlines()[-1])
    assert "Warning" not in err


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("case", ["missing checkpoint", "not an adapter", "missing data", "no answer column",
                                  "unknown preset", "unknown engine", "pool without paged", "empty pool",
                                  "vllm cache without vllm"])
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(case, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    checkpoint, extra = "base", []
    if case == "missing checkpoint":
        checkpoint = str(tmp_path / "nope")
    elif case == "not an adapter":
        (tmp_path / "empty").mkdir()
        checkpoint = str(tmp_path / "empty")
    elif case == "missing data":
        extra = ["--dataset", str(tmp_path / "missing.jsonl")]
    elif case == "no answer column":
        extra = ["--dataset", str(write_jsonl(tmp_path / "data.jsonl", [{"problem": "1+1?", "solution": "2"}]))]
    elif case == "unknown engine":
        extra = ["--engine", "pages"]
    elif case == "pool without paged":
        extra = ["--engine", "dynamic", "--paged-cache-gib", "4"]
    elif case == "empty pool":
        extra = ["--engine", "paged", "--paged-cache-gib", "0"]
    elif case == "vllm cache without vllm":
        extra = ["--backend", "transformers", "--vllm-kv-cache-gib", "2"]
    if case == "unknown preset":
        monkeypatch.setenv("OPSD_PRESET", "huge")
        status = evaluate.main([checkpoint, "--output-dir", str(out)])
        err = capsys.readouterr().err
    else:
        status, _, err = in_process(capsys, checkpoint, "--output-dir", str(out), *extra)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out.exists()
    if case == "no answer column":
        assert "answer" in lines[0]


def test_dev_eval_bad_checkpoint_and_usage(tmp_path):
    proc = dev_eval("no-such-checkpoint", env={"OPSD_EVAL_OUT": str(tmp_path / "out")}, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: checkpoint folder not found: {tmp_path / 'no-such-checkpoint'}"]
    assert not (tmp_path / "out").exists()
    usage = dev_eval()
    assert usage.returncode == 2 and usage.stderr.startswith("usage: dev_eval.sh")
    assert dev_eval("-h").returncode == 0


@pytest.fixture
def use_worker(monkeypatch):
    """Install an answer checker running `command` for the test; closed after it."""
    yield from installed_workers(monkeypatch)


def test_the_command_line_stops_on_a_failing_checker(use_worker, tmp_path, capsys):
    use_worker([sys.executable, "-m", "no_such_grading_worker_module"])
    status = evaluate.main(["base", "--preset", "tiny", "--backend", "transformers",
                            "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: the answer-check worker"), err
    assert "No module named" in err[0]
    assert not (tmp_path / "out").exists()  # stopped before sampling: nothing written


def test_paged_calls_hold_at_least_its_rows_per_forward():
    """The paged engine keeps up to batch_size rows in one forward: a call must bring that many."""
    frozen = evaluate.FROZEN_SETTINGS  # 12 samples per problem
    request = types.SimpleNamespace(backend="transformers", engine="paged", batch_size=256, settings=frozen)
    assert evaluate.problem_chunks(request, 30) == [range(0, 22), range(22, 30)]  # 22 x 12 = 264 >= 256
    request.batch_size = 24
    assert evaluate.problem_chunks(request, 30) == [range(0, 10), range(10, 20), range(20, 30)]
    request.backend, request.engine = "vllm", None
    assert evaluate.problem_chunks(request, 30) == [range(0, 10), range(10, 20), range(20, 30)]


def test_engine_choice():
    assert evaluate.resolve_engine("auto", "transformers") == "dynamic"  # CPU
    assert evaluate.resolve_engine("auto", "transformers", tiny=True) == evaluate.TINY_ENGINE == "dynamic"
    assert evaluate.ENGINE_AUTO == {"cuda": "paged", "cpu": "dynamic"}
    assert evaluate.resolve_engine("paged", "transformers") == "paged"
    assert evaluate.resolve_engine("auto", "vllm") is None
    with pytest.raises(evaluate.InputError, match="--backend transformers"):
        evaluate.resolve_engine("paged", "vllm")
    assert set(evaluate.ENGINE_AUTO.values()) <= set(evaluate.engine_names())
    assert set(evaluate.engine_names()) == {"auto", "dynamic", "static", "graph", "graph_compiled", "paged"}


def test_paged_engine_end_to_end(tmp_path, monkeypatch, capsys):
    """The tiny preset (2 samples of up to 96 tokens here) on 4 problems through the
    paged engine: every problem's samples in one call, graded, the engine in the report."""
    from opsd.rollout.paged_decode import DEFAULT_MAX_ROWS

    monkeypatch.setattr(evaluate, "TINY_SETTINGS", evaluate.replace(TINY_SETTINGS, n_samples=2))
    calls = []
    real_chunk = evaluate._sample_chunk
    monkeypatch.setattr(evaluate, "_sample_chunk", lambda backend, request, prompts, chunk, **kw: calls.append(
        (backend.cache_implementation, backend.batch_size, chunk))
        or real_chunk(backend, request, prompts, chunk, **kw))
    status, out, err = in_process(capsys, "base", "--engine", "paged", "--dataset", "tiny:7:4",
                                  "--output-dir", str(tmp_path))
    assert status == 0, err
    assert FINAL_RE.match(out.strip().splitlines()[-1])
    assert f"backend transformers (engine paged, batch size {DEFAULT_MAX_ROWS})" in out
    assert calls == [("paged", DEFAULT_MAX_ROWS, range(0, 4))]
    report = json.loads((tmp_path / "eval_base.json").read_text())
    assert (report["backend"], report["engine"], report["batch_size"]) == ("transformers", "paged", DEFAULT_MAX_ROWS)
    assert report["paged_cache_gib"] > 0  # resolved (the default pool), in the report and the resume header
    samples = [s for p in report["problems"] for s in p["samples"]]
    assert len(samples) == 4 * 2
    assert all(0 < s["num_tokens"] <= TINY_SETTINGS.max_new_tokens for s in samples)
    assert any(not s["truncated"] for s in samples)  # the tiny model ends its solutions with EOS


# ---------------------------------------------------------------- an evaluation killed midway

def _small_tiny_settings(monkeypatch):
    """3 problems x 2 samples of 6 tokens at batch size 2: one problem per chunk."""
    monkeypatch.setattr(evaluate, "TINY_SETTINGS",
                        evaluate.replace(TINY_SETTINGS, n_samples=2, max_new_tokens=6, max_problems=3))


def bar_counts(stderr: str) -> list[tuple[int, int]]:
    """(done, total) of every progress-bar frame tqdm drew."""
    return [(int(done), int(total)) for done, total in re.findall(r"sampling: .*?(\d+)/(\d+) \[", stderr)]


def test_one_progress_bar_over_every_sample(tmp_path, monkeypatch, capsys):
    """One bar, samples done of all 6 (3 chunks of 1 problem x 2 samples), not a bar per chunk or
    batch; a resumed evaluation's bar starts at the samples already done."""
    _small_tiny_settings(monkeypatch)
    status, _, err = in_process(capsys, "base", "--batch-size", "2", "--output-dir", str(tmp_path))
    assert status == 0
    frames = bar_counts(err)
    assert frames[0] == (0, 6) and frames[-1] == (6, 6) and {total for _, total in frames} == {6}
    assert "<" in err.split("6/6")[-1].split("\n")[0]  # elapsed<remaining: the ETA

    partial = tmp_path / "eval_base.json.partial.jsonl"  # as if killed after the first two problems
    report = json.loads((tmp_path / "eval_base.json").read_text())
    header = {"settings": report["settings"], "model": report["model"], "checkpoint": "base",
              "dataset": report["dataset"], "backend": report["backend"], "engine": report["engine"],
              "batch_size": report["batch_size"], "paged_cache_gib": report["paged_cache_gib"], "num_problems": 3}
    partial.write_text("".join(json.dumps(r) + "\n" for r in [header, *report["problems"][:2]]))
    status, out, err = in_process(capsys, "base", "--batch-size", "2", "--output-dir", str(tmp_path))
    assert status == 0 and "resuming: 2 of 3 problems" in out
    frames = bar_counts(err)
    assert frames[0] == (4, 6) and frames[-1] == (6, 6)


def test_killed_evaluation_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    _small_tiny_settings(monkeypatch)
    argv = ["--batch-size", "2"]
    status, _, _ = in_process(capsys, "base", *argv, "--output-dir", str(tmp_path / "whole"))
    assert status == 0
    whole = json.loads((tmp_path / "whole" / "eval_base.json").read_text())

    real_grade = evaluate.grade_problem

    def killed_at_third(index, *args):
        if index == 2:
            raise KeyboardInterrupt  # stands in for a kill after two chunks were saved
        return real_grade(index, *args)

    out = tmp_path / "resumed"
    monkeypatch.setattr(evaluate, "grade_problem", killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        in_process(capsys, "base", *argv, "--output-dir", str(out))
    assert not (out / "eval_base.json").exists()
    partial = out / "eval_base.json.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 1 + 2  # the arguments, then two problems

    monkeypatch.setattr(evaluate, "grade_problem", real_grade)
    sampled = []
    real_chunk = evaluate._sample_chunk
    monkeypatch.setattr(evaluate, "_sample_chunk",
                        lambda backend, request, prompts, chunk, **kw: sampled.append(chunk) or real_chunk(
                            backend, request, prompts, chunk, **kw))
    status, stdout, _ = in_process(capsys, "base", *argv, "--output-dir", str(out))
    assert status == 0 and "resuming: 2 of 3 problems" in stdout
    assert sampled == [range(2, 3)]  # only the problem that was not done
    resumed = json.loads((out / "eval_base.json").read_text())
    whole.pop("elapsed_s"), resumed.pop("elapsed_s")
    assert resumed == whole
    assert not partial.exists() and not list(out.glob(".*.tmp"))


def test_partial_results_of_other_arguments_are_not_reused(tmp_path, monkeypatch, capsys):
    _small_tiny_settings(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval_base.json.partial.jsonl").write_text('{"settings": "other"}\n{"index": 0, "bogus": 1}\n')
    status, stdout, _ = in_process(capsys, "base", "--batch-size", "2", "--output-dir", str(out))
    assert status == 0 and "resuming" not in stdout
    report = json.loads((out / "eval_base.json").read_text())
    assert all("bogus" not in p for p in report["problems"])


# ---------------------------------------------------------------- the vLLM backend, with a fake vLLM

def test_context_warning():
    assert evaluate.context_warning([100, 2048], 38912, 40960, "vllm") is None  # 2048 fits exactly
    line = evaluate.context_warning([100, 2049, 3000], 38912, 40960, "vllm")
    assert line.startswith("warning: 2 of 3 prompts are longer than the 2048 tokens ") and "\n" not in line
    assert "(longest 3000)" in line and "vLLM stops their samples at the context limit" in line
    assert "past the model's context" in evaluate.context_warning([5000], 38912, 40960, "transformers")
    assert evaluate.context_warning([10 ** 6], 38912, None, "vllm") is None  # no declared context


def fake_vllm_modules(events: list):
    """The parts of vLLM that the evaluation touches. Like the real one, its logger
    writes to stdout and its engine prints while shutting down."""
    import logging
    import sys
    import types

    logger = logging.getLogger("vllm")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(sys.stdout))

    class EngineCore:
        def shutdown(self):
            print("[fake vllm] engine core shut down")
            events.append("shutdown")

    class LLM:
        def __init__(self, **kwargs):
            events.append(("engine", kwargs, {name: os.environ.get(name) for name in
                                              ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_STREAM")}))
            logger.info("[fake vllm] engine ready")
            self.llm_engine = types.SimpleNamespace(engine_core=EngineCore())

        def generate(self, prompts, params, use_tqdm, lora_request):
            events.append("generate")
            sample = types.SimpleNamespace(token_ids=[7, 8], finish_reason="length", stop_reason=None)
            return [types.SimpleNamespace(outputs=[sample] * p.n) for p in params]

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory = lambda: events.append("cleanup")
    return {"vllm": vllm, "vllm.inputs": inputs, "vllm.distributed": types.ModuleType("vllm.distributed"),
            "vllm.distributed.parallel_state": parallel_state}, logger


@pytest.mark.parametrize("user_multiprocessing", [None, "1"])
def test_vllm_evaluation_env_logs_teardown_and_last_line(monkeypatch, tmp_path, capsys, user_multiprocessing):
    import sys

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_STREAM"):
        monkeypatch.setenv(name, "restored after the test")
        monkeypatch.delenv(name)
    if user_multiprocessing is not None:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", user_multiprocessing)
    events = []
    modules, logger = fake_vllm_modules(events)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    from opsd.rollout import vllm_backend

    monkeypatch.setattr(vllm_backend, "check_vllm_version", lambda: "0.26.0")  # the fake has no package metadata
    # A budget that leaves the tiny prompts too little of the context: the warning case.
    context = evaluate.model_context(evaluate.resolve_model_path("tiny"))  # the learned tiny model's: 4096
    monkeypatch.setattr(evaluate, "TINY_SETTINGS", evaluate.replace(TINY_SETTINGS, max_new_tokens=context - 20))
    try:
        status = evaluate.main(["base", "--preset", "tiny", "--backend", "vllm", "--output-dir", str(tmp_path)])
    finally:
        logger.handlers.clear()
    captured = capsys.readouterr()
    assert status == 0, captured.err
    _, engine_args, env = events[0]
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": user_multiprocessing or "0",
                   "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    assert engine_args["max_model_len"] == context  # capped at the tiny model's context
    chunks = -(-30 // evaluate.VLLM_CHUNK_PROBLEMS)  # one generate per chunk of the 30 tiny problems
    assert events[1:] == ["generate"] * chunks + ["shutdown", "cleanup"]

    out = captured.out.splitlines()
    assert FINAL_RE.match(out[-1]), out[-3:]
    shutdown = out.index("[fake vllm] engine core shut down")
    assert shutdown < next(i for i, line in enumerate(out) if re.match(r"\[ *1/", line))  # before any result
    assert "engine ready" not in captured.out and "[fake vllm] engine ready" in captured.err
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1
    assert f"that the model's context of {context} leaves after max_new_tokens={context - 20}" in warnings[0]


def test_a_vllm_outside_the_supported_range_is_one_line_before_loading(monkeypatch, tmp_path, capsys):
    from importlib import metadata

    from opsd.rollout import vllm_backend

    monkeypatch.setattr(vllm_backend, "import_vllm", lambda: None)  # "installed"
    monkeypatch.setattr(metadata, "version", lambda name: "0.40.0" if name == "vllm" else "0")
    status = evaluate.main(["base", "--preset", "tiny", "--backend", "vllm", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0].startswith("error: vLLM 0.40.0 is outside the supported range 0.22.0-0.31.0")
    assert not (tmp_path / "out").exists()


def test_opsd_eval_names_a_file_given_as_a_checkpoint(tmp_path, capsys):
    """`opsd eval FILE` says the path is a file (as dev_eval.sh does), not that no folder was found."""
    given = tmp_path / "adapter_model.safetensors"
    given.write_bytes(b"")
    status, out, err = in_process(capsys, str(given), "--output-dir", str(tmp_path / "out"))
    assert status == 2 and out == ""
    assert err.strip().splitlines() == [f"error: {given} is a file, not a checkpoint folder (holding "
                                        "adapter_config.json) or a run folder (holding checkpoint-N folders)"]
