"""Evaluate a LoRA checkpoint (or the base model) on a math benchmark (docs/SPEC.md §5).

    python opsd_eval.py CHECKPOINT|base [--model M] [--dataset D] [--output-dir O]
                        [--backend transformers|vllm|auto] [--engine E] [--preset tiny]

Samples `n_samples` completions per problem under one frozen settings block,
grades the last \\boxed{...} of each completion against the gold answer, writes
a JSON report and prints, as its very last line:

    FINAL avg@12 accuracy: 53.61% (193/360 solutions correct on 30 problems)

The report, `<output-dir>/eval_<name>.json` (name: `base` or
`<run folder>_<checkpoint folder>`), holds the settings, model, checkpoint,
dataset and backend; `metrics` (avg@k, pass@1..pass@k with the unbiased
estimator, maj@k, truncation and no-answer rates, all in percent); and per
problem the gold answer, accuracy, majority answer and every sample's
extracted answer, correctness, reason, length in tokens, truncation flag and
decoded text.

The module reads top to bottom: frozen settings, grading (imported by other
tools: `extract_boxed`, `is_correct`, `grade`), metrics, input validation,
sampling, report, running. Bad inputs are reported as one `error: ...` line on
stderr with exit status 2, before any model is loaded and without writing
anything.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple, Sequence

from answers import extract_boxed
from jsonl import split_lines
from run_folder import write_text_atomic

DEFAULT_MODEL = "Qwen/Qwen3-1.7B"
DEFAULT_DATASET = "HuggingFaceH4/aime_2024"
TINY = "tiny"


# --------------------------------------------------------------------------
# 1. The frozen settings
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalSettings:
    """The evaluation protocol. A reported "AIME24 avg@12" means exactly these
    values; there are no command-line knobs for them on purpose.

    Sampling values follow the released OPSD evaluator (siyan-zhao/OPSD,
    eval/evaluate_math.py and eval/run_eval.sh): temperature 1.0 (run_eval.sh
    passes --temperature 1.0, also the script's default), top_p 0.95 (its
    automatic value in thinking mode), top_k disabled (-1 there, 0 here),
    max_new_tokens 38912 (its default; Qwen3's recommended budget for
    competition math). Its min_p 0 and presence_penalty 0 are the neutral
    values both backends use anyway. Samples per problem (12, as the released
    script), seed and thinking mode are fixed by docs/SPEC.md §5.
    """
    n_samples: int = 12
    seed: int = 20260610
    enable_thinking: bool = True
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0  # 0 = no top-k filter
    max_new_tokens: int = 38912
    max_problems: int | None = None  # None = every problem of the eval set


FROZEN_SETTINGS = EvalSettings()

# OPSD_PRESET=tiny: the embedded model on its generated eval set (every problem),
# 8 samples each, at most 96 new tokens (its worked solutions take about 50);
# the FINAL line shows avg@8.
TINY_SETTINGS = replace(FROZEN_SETTINGS, n_samples=8, max_new_tokens=96)


def format_settings(settings: EvalSettings) -> str:
    lines = ["evaluation settings (frozen):"]
    lines += [f"  {f.name:<16} {getattr(settings, f.name)}" for f in fields(settings)]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# 2. Grading
# --------------------------------------------------------------------------

# math-verify's own time limit uses signals, which fail outside the main thread, and
# a thread cannot interrupt a big-integer computation that holds the GIL (an answer
# such as 9^{9^{9^{9}}}): math-verify runs in a worker process, killed past this limit.
MATH_VERIFY_TIMEOUT_S = 5.0
ANSWER_WORKER_START_TIMEOUT_S = 120.0  # importing math-verify (sympy) in a fresh process


class GradeResult(NamedTuple):
    answer: str | None  # content of the last \boxed{...}, None if there is none
    correct: bool
    reason: str         # "correct" | "wrong_answer" | "no_answer" | "truncated"


def normalize_answer(answer: str) -> str:
    """A canonical string form for the fallback comparison and for majority
    voting: no spaces or $, no sizing/spacing commands, \\text{x} -> x,
    \\dfrac -> \\frac, no trailing period, integers without leading zeros."""
    text = answer.strip()
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\left|\\right|\\[!,;:]", "", text)
    text = re.sub(r"\s+|\$", "", text)
    text = text.rstrip(".")
    if re.fullmatch(r"[+-]?\d+", text):
        # str(int(text)) without int(), which refuses more than 4300 digits.
        digits = text.lstrip("+-").lstrip("0") or "0"
        text = ("-" if text.startswith("-") and digits != "0" else "") + digits
    return text


def answers_match(answer: str, gold: str) -> bool:
    """True when the extracted answer equals the gold answer, by math-verify or by
    the normalised string form (either one accepting is enough)."""
    gold = extract_boxed(gold) or gold.strip()
    if normalize_answer(answer) == normalize_answer(gold):
        return True
    try:
        return _ANSWER_WORKER.check(answer, gold, MATH_VERIFY_TIMEOUT_S)
    except Exception:  # parse failure or timeout: the string comparison above stands
        return False


def _math_verify_equal(answer: str, gold: str) -> bool:
    from math_verify import parse, verify

    _silence_math_verify_timeout_notice()
    # Wrapped in \boxed{} so math-verify reads the bare answer as LaTeX.
    # Gold comes first: verify() is not symmetric.
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _silence_math_verify_timeout_notice() -> None:
    """math-verify warns that its timeouts are off, which is deliberate here."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())


class _DropTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _answer_worker_loop(conn) -> None:
    """The worker process: (answer, gold) in, (True, equal) or (False, error) out."""
    import math_verify  # noqa: F401  (imported before "ready", so the first check is not slower)

    _silence_math_verify_timeout_notice()
    conn.send("ready")
    while True:
        try:
            answer, gold = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, _math_verify_equal(answer, gold)))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class _AnswerWorker:
    """One persistent process that runs math-verify; killed and restarted when a
    check overruns its time limit, so no answer can stall grading. Thread-safe
    (checks are serialised); the process is a daemon, ended with the interpreter."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def check(self, answer: str, gold: str, timeout_s: float) -> bool:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            try:
                self._conn.send((answer, gold))
                if not self._conn.poll(timeout_s):
                    self._stop()
                    raise TimeoutError(f"answer check took longer than {timeout_s}s")
                ok, value = self._conn.recv()
            except (EOFError, OSError):  # the worker died (e.g. out of memory): restart next time
                self._stop()
                raise
        if not ok:
            raise ValueError(value)
        return value

    def _start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fork would copy torch's threads and memory
        parent, child = context.Pipe()
        process = context.Process(target=_answer_worker_loop, args=(child,), name="opsd-answer-check", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(ANSWER_WORKER_START_TIMEOUT_S) or parent.recv() != "ready":
            self._stop()
            raise TimeoutError("the answer-check worker did not start")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._process = self._conn = None


_ANSWER_WORKER = _AnswerWorker()


def grade(completion: str, gold: str, truncated: bool) -> GradeResult:
    """Grade one completion. A completion without a box is "truncated" when it ran
    out of tokens and "no_answer" when it stopped on its own."""
    answer = extract_boxed(completion)
    if answer is None:
        return GradeResult(None, False, "truncated" if truncated else "no_answer")
    correct = answers_match(answer, gold)
    return GradeResult(answer, correct, "correct" if correct else "wrong_answer")


def is_correct(completion: str, gold: str) -> bool:
    return grade(completion, gold, truncated=False).correct


# --------------------------------------------------------------------------
# 3. Metrics
# --------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021):
    the chance that k samples drawn without replacement include a correct one."""
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample holding the most frequent answer (compared in
    normalised form; samples without an answer do not vote). Ties go to the
    answer that appeared first. None when no sample has an answer."""
    counts: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        key = normalize_answer(answer)
        counts[key] += 1
        first_seen.setdefault(key, index)
    if not counts:
        return None
    winner = max(counts, key=lambda key: (counts[key], -first_seen[key]))
    return first_seen[winner]


def problem_summary(samples: Sequence[dict]) -> dict:
    """Per-problem aggregates from graded samples (dicts with answer, correct)."""
    n, c = len(samples), sum(s["correct"] for s in samples)
    voted = majority_vote([s["answer"] for s in samples])
    return {
        "num_correct": c,
        "accuracy": c / n,
        "majority_answer": None if voted is None else samples[voted]["answer"],
        "majority_correct": voted is not None and samples[voted]["correct"],
    }


def summarize(problems: Sequence[dict], k: int) -> dict:
    """Aggregate metrics over problems that each hold `k` graded samples.
    Rates are percentages."""
    samples = [s for p in problems for s in p["samples"]]
    num_correct = sum(s["correct"] for s in samples)
    metrics = {
        "k": k,
        "num_problems": len(problems),
        "num_samples": len(samples),
        "num_correct": num_correct,
        f"avg@{k}": 100.0 * num_correct / len(samples),
    }
    for j in range(1, k + 1):
        metrics[f"pass@{j}"] = 100.0 * _mean(pass_at_k(k, p["num_correct"], j) for p in problems)
    metrics[f"maj@{k}"] = 100.0 * _mean(p["majority_correct"] for p in problems)
    metrics["truncated_rate"] = 100.0 * _mean(s["truncated"] for s in samples)
    metrics["no_answer_rate"] = 100.0 * _mean(s["answer"] is None for s in samples)
    metrics["mean_num_tokens"] = _mean(s["num_tokens"] for s in samples)
    return metrics


def final_line(num_correct: int, num_samples: int, num_problems: int, k: int) -> str:
    accuracy = 100.0 * num_correct / num_samples
    return (f"FINAL avg@{k} accuracy: {accuracy:.2f}% "
            f"({num_correct}/{num_samples} solutions correct on {num_problems} problems)")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------------------
# 4. Inputs, validated before any model is loaded
# --------------------------------------------------------------------------

class InputError(Exception):
    """A bad command-line input; reported as one `error:` line, exit 2."""


@dataclass(frozen=True)
class EvalRequest:
    checkpoint: str | None  # LoRA adapter folder; None = the base model
    model: str              # as given (hub id, local path or "tiny")
    dataset: str
    backend: str            # resolved: "transformers" or "vllm"
    settings: EvalSettings
    output_path: Path
    batch_size: int         # transformers: rows per generate() call (paged: per forward pass)
    engine: str | None = None  # the transformers engine, resolved ("dynamic", "paged", ...); None with vLLM
    paged_cache_gib: float | None = None  # the paged engine's KV pool, resolved (it changes the samples)


def build_request(args: argparse.Namespace):
    """Check every input and load the problems. Raises InputError."""
    from opsd_data import DataError, load_eval_dataset
    from rollout import BackendUnavailable, resolve_backend_name

    if args.preset not in (None, TINY):
        raise InputError(f"unknown preset {args.preset!r} (OPSD_PRESET); the only preset is {TINY!r}")
    tiny = args.preset == TINY
    checkpoint = None if args.checkpoint == "base" else args.checkpoint
    if checkpoint is not None:
        check_checkpoint(Path(checkpoint))
    dataset = args.dataset or (TINY if tiny else DEFAULT_DATASET)
    settings = TINY_SETTINGS if tiny else FROZEN_SETTINGS
    try:
        problems = load_eval_dataset(dataset)[:settings.max_problems]
        backend = resolve_backend_name(args.backend)
    except (DataError, BackendUnavailable) as exc:
        raise InputError(str(exc)) from None
    engine = resolve_engine(args.engine, backend, tiny)
    batch_size = args.batch_size
    if batch_size is None:
        from paged_decode import DEFAULT_MAX_ROWS

        batch_size = DEFAULT_MAX_ROWS if engine == "paged" else BATCH_SIZE
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    paged_cache_gib = None
    if args.paged_cache_gib is not None and engine != "paged":
        raise InputError(f"--paged-cache-gib sizes the paged engine's KV pool; the engine here is {engine or backend}")
    if engine == "paged":
        if args.paged_cache_gib is not None and not args.paged_cache_gib > 0:
            raise InputError(f"--paged-cache-gib must be > 0, got {args.paged_cache_gib}")
        paged_cache_gib = args.paged_cache_gib or round(_default_paged_cache_gib(), 3)
    output_dir = Path(args.output_dir) if args.output_dir else Path("outputs") / "eval" / dataset_tag(dataset)
    request = EvalRequest(
        checkpoint=checkpoint,
        model=args.model or (TINY if tiny else DEFAULT_MODEL),
        dataset=dataset,
        backend=backend,
        settings=settings,
        output_path=output_dir / f"eval_{run_name(checkpoint)}.json",
        batch_size=batch_size,
        engine=engine,
        paged_cache_gib=paged_cache_gib,
    )
    return request, problems


def _default_paged_cache_gib() -> float:
    import torch

    from paged_decode import default_cache_gib

    return default_cache_gib(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# The transformers engines (rollout.TransformersBackend's cache_implementation), and
# what --engine auto picks: on CUDA the paged engine (memory bounded by its KV pool
# whatever the number and length of the samples; several times generate()'s rate,
# BENCHMARKS.md section 5), on CPU generate() with the dynamic cache, the simple path
# the tests use. The tiny preset keeps generate() everywhere, so that its published
# GPU results (OPSD_EXPERIMENTS.md) reproduce.
ENGINE_AUTO = {"cuda": "paged", "cpu": "dynamic"}
TINY_ENGINE = "dynamic"
BATCH_SIZE = 16  # rows per generate() call, every engine but paged (paged: paged_decode.DEFAULT_MAX_ROWS)


def engine_names() -> tuple[str, ...]:
    from static_decode import CACHE_IMPLEMENTATIONS

    return tuple(name for name in CACHE_IMPLEMENTATIONS if name is not None)


def resolve_engine(name: str, backend: str, tiny: bool = False) -> str | None:
    """The transformers engine `name` stands for here (`tiny`: the tiny preset's run);
    None for vLLM, which has its own. An explicit engine with the vLLM backend is an
    InputError: it would be ignored."""
    if name not in engine_names():
        raise InputError(f"unknown engine {name!r}; choose one of {', '.join(engine_names())}")
    if backend == "vllm":
        if name != "auto":
            raise InputError(f"--engine {name} picks a transformers engine, but the backend is vllm; "
                             "add --backend transformers")
        return None
    if name == "auto":
        import torch

        return TINY_ENGINE if tiny else ENGINE_AUTO["cuda" if torch.cuda.is_available() else "cpu"]
    return name


def check_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise InputError(f"checkpoint folder not found: {path}")
    if not (path / "adapter_config.json").is_file():
        raise InputError(f"{path} is not a LoRA checkpoint: it has no adapter_config.json")


def run_name(checkpoint: str | None) -> str:
    """'base', or '<run folder>_<checkpoint folder>' so that checkpoints of
    different runs do not overwrite each other's reports."""
    if checkpoint is None:
        return "base"
    path = Path(checkpoint).resolve()
    name = f"{path.parent.name}_{path.name}" if path.parent.name else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def dataset_tag(dataset: str) -> str:
    """A folder-friendly name: 'HuggingFaceH4/aime_2024' -> 'aime_2024',
    'data/x.jsonl' -> 'x', 'tiny' -> 'tiny'."""
    name = Path(dataset).stem if Path(dataset).suffix else dataset.rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name) or "dataset"


def resolve_model_path(model: str) -> str:
    """'tiny' / 'tiny-random' -> the embedded model's folder; anything else is passed on."""
    if model in (TINY, "tiny-random"):
        import tiny_default

        return str(tiny_default.resolve_model(model))
    return model


# --------------------------------------------------------------------------
# 5. Sampling
# --------------------------------------------------------------------------

def prompt_token_ids(tokenizer, problems: Sequence[dict], enable_thinking: bool) -> list[list[int]]:
    """The evaluation prompt of each problem, rendered by the chat template."""
    from prompts import eval_messages

    texts = [tokenizer.apply_chat_template(eval_messages(p["problem"]), tokenize=False,
                                           add_generation_prompt=True, enable_thinking=enable_thinking)
             for p in problems]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


# Problems sampled per call of vLLM or the paged engine: each finished call is saved,
# so a killed evaluation resumes after it; fewer calls keep the running batch full.
VLLM_CHUNK_PROBLEMS = 10


def problem_chunks(request: EvalRequest, num_problems: int) -> list[range]:
    """Problems are sampled in fixed chunks, each seeded from (seed, its first problem):
    a chunk's completions do not depend on what else ran, so an evaluation resumed
    after a kill gives the same report as an uninterrupted one. Transformers: the
    problems whose samples fill one batch; vLLM: VLLM_CHUNK_PROBLEMS (it keeps its batch
    full from a queue of rows); the paged engine likewise, but at least the problems
    whose samples fill its rows per forward (`batch_size`), which a smaller call could
    never reach."""
    if request.backend == "vllm":
        size = VLLM_CHUNK_PROBLEMS
    elif request.engine == "paged":
        size = max(VLLM_CHUNK_PROBLEMS, -(-request.batch_size // request.settings.n_samples))
    else:
        size = max(1, request.batch_size // request.settings.n_samples)
    return [range(start, min(start + size, num_problems)) for start in range(0, num_problems, size)]


def _sample_chunk(backend, request: EvalRequest, prompts: list[list[int]], chunk: range):
    from sampling import SamplingSettings, derive_seed

    s = request.settings
    sampling = SamplingSettings(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, seed=derive_seed(s.seed, chunk.start))
    return backend.generate([prompts[i] for i in chunk], sampling, n=s.n_samples, progress=True)


def _sampling_backend(request: EvalRequest, model_path: str, tokenizer, prompts: list[list[int]]):
    """The backend that samples every chunk, after one warning line for prompts the
    context cannot fit. A vLLM backend is a context manager: evaluate() shuts it down
    before printing any result."""
    context = model_context(model_path)
    warning = context_warning([len(p) for p in prompts], request.settings.max_new_tokens, context,
                              request.backend)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if request.backend == "vllm":
        return _vllm_backend(request, model_path, prompts, context)
    return _transformers_backend(request, model_path, tokenizer)


def model_context(model_path: str) -> int | None:
    """The model's context window (max_position_embeddings), None if it declares none."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)


def context_warning(prompt_lengths: Sequence[int], max_new_tokens: int, context: int | None,
                    backend: str) -> str | None:
    """One `warning:` line when prompts are longer than the context leaves after
    max_new_tokens: their samples cannot get the full budget (vLLM stops them at the
    context, as truncated) or run past what the model was trained on (transformers)."""
    if not context:
        return None
    room = context - max_new_tokens
    over = [n for n in prompt_lengths if n > room]
    if not over:
        return None
    effect = ("vLLM stops their samples at the context limit (graded as truncated)" if backend == "vllm"
              else "transformers samples them past the model's context window")
    return (f"warning: {len(over)} of {len(prompt_lengths)} prompts are longer than the {max(room, 0)} tokens "
            f"that the model's context of {context} leaves after max_new_tokens={max_new_tokens} "
            f"(longest {max(over)}); {effect}")


def _transformers_backend(request: EvalRequest, model_path: str, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from rollout import TransformersBackend, eos_token_ids_of

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    if request.checkpoint is not None:
        from peft import PeftModel

        # Merged once up front: sampling then runs at base-model speed.
        model = PeftModel.from_pretrained(model, request.checkpoint).merge_and_unload()
    model.eval()
    return TransformersBackend(model, pad_token_id=_pad_token_id(tokenizer),
                               eos_token_ids=eos_token_ids_of(tokenizer, model.generation_config),
                               batch_size=request.batch_size, cache_implementation=request.engine,
                               paged_cache_gib=request.paged_cache_gib)


def _vllm_backend(request: EvalRequest, model_path: str, prompts: list[list[int]], context: int | None):
    from rollout import VLLMBackend

    # Room for the longest prompt plus a full generation, within the model's context.
    needed = max(len(p) for p in prompts) + request.settings.max_new_tokens
    return VLLMBackend(model_path, lora_path=request.checkpoint, seed=request.settings.seed,
                       max_model_len=min(needed, context) if context else needed)


def _pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# --------------------------------------------------------------------------
# 6. The report
# --------------------------------------------------------------------------

def grade_problem(index: int, problem: dict, completions, tokenizer) -> dict:
    """The report entry of one problem: its graded samples and their summary."""
    samples = []
    for completion in completions:
        text = tokenizer.decode(completion.ids, skip_special_tokens=True)
        result = grade(text, problem["answer"], completion.truncated)
        samples.append({"answer": result.answer, "correct": result.correct, "reason": result.reason,
                        "num_tokens": len(completion.ids), "truncated": completion.truncated,
                        "completion": text})
    return {"index": index, "problem": problem["problem"], "gold": problem["answer"],
            **problem_summary(samples), "samples": samples}


def format_problem_line(record: dict, total: int) -> str:
    samples = record["samples"]
    reasons = Counter(s["reason"] for s in samples)
    if record["majority_answer"] is None:
        vote = "none"
    else:
        vote = f"{_clip(record['majority_answer'])} ({'right' if record['majority_correct'] else 'wrong'})"
    return (f"[{record['index'] + 1:>{len(str(total))}}/{total}] "
            f"{record['num_correct']:>2}/{len(samples)} correct | gold {record['gold']} | majority {vote} | "
            f"truncated {reasons['truncated']}, no answer {reasons['no_answer']}")


def format_metrics(metrics: dict) -> str:
    k = metrics["k"]
    return (f"avg@{k} {metrics[f'avg@{k}']:.2f}% | pass@1 {metrics['pass@1']:.2f}% | "
            f"pass@{k} {metrics[f'pass@{k}']:.2f}% | maj@{k} {metrics[f'maj@{k}']:.2f}% | "
            f"truncated {metrics['truncated_rate']:.1f}% | no answer {metrics['no_answer_rate']:.1f}% | "
            f"mean length {metrics['mean_num_tokens']:.0f} tokens")


def write_json_atomic(path: Path, payload: dict) -> None:
    """The report as JSON, written atomically: a reader never sees a half-written report."""
    write_text_atomic(path, json.dumps(payload, indent=1, ensure_ascii=False))


def _clip(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


# --------------------------------------------------------------------------
# 7. Running an evaluation, command line
# --------------------------------------------------------------------------

def evaluate(request: EvalRequest, problems: list[dict]) -> dict:
    """Sample, grade and summarise; returns the report (also written to disk)."""
    from transformers import AutoTokenizer

    started = time.time()
    model_path = resolve_model_path(request.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = prompt_token_ids(tokenizer, problems, request.settings.enable_thinking)

    partial = PartialResults(request, len(problems))
    done = partial.load()
    if done:
        print(f"resuming: {len(done)} of {len(problems)} problems already sampled and graded ({partial.path})")
    # Shut the backend (vLLM's engine) down before the results, so that nothing the
    # engine does on exit (it may print) comes after them and the FINAL line.
    with contextlib.ExitStack() as stack:
        backend = None
        for chunk in problem_chunks(request, len(problems)):
            if all(i in done for i in chunk):
                continue
            if backend is None:
                backend = _sampling_backend(request, model_path, tokenizer, prompts)
                if hasattr(backend, "__exit__"):
                    stack.enter_context(backend)
            graded = [grade_problem(i, problems[i], c, tokenizer)
                      for i, c in zip(chunk, _sample_chunk(backend, request, prompts, chunk))]
            partial.append(graded)
            done.update((record["index"], record) for record in graded)
    records = [done[i] for i in range(len(problems))]
    for record in records:
        print(format_problem_line(record, len(records)))
    report = {
        "settings": asdict(request.settings),
        "model": request.model,
        "checkpoint": request.checkpoint or "base",
        "dataset": request.dataset,
        "backend": request.backend,
        "engine": request.engine,
        "batch_size": request.batch_size,
        "paged_cache_gib": request.paged_cache_gib,
        "metrics": summarize(records, request.settings.n_samples),
        "elapsed_s": round(time.time() - started, 1),
        "problems": records,
    }
    write_json_atomic(request.output_path, report)
    partial.remove()
    return report


class PartialResults:
    """`<report>.partial.jsonl`: the graded problems of an evaluation in progress.

    The first line records the arguments; each finished chunk appends its problems,
    flushed to disk. A re-run with the same arguments skips them; a file of other
    arguments is ignored and replaced. Removed once the report is written.
    """

    def __init__(self, request: EvalRequest, num_problems: int):
        self.path = request.output_path.with_name(request.output_path.name + ".partial.jsonl")
        self.header = {"settings": asdict(request.settings), "model": request.model,
                       "checkpoint": request.checkpoint or "base", "dataset": request.dataset,
                       "backend": request.backend, "engine": request.engine, "batch_size": request.batch_size,
                       "paged_cache_gib": request.paged_cache_gib, "num_problems": num_problems}

    def load(self) -> dict[int, dict]:
        """{problem index: record} of a previous run with the same arguments."""
        try:
            lines = split_lines(self.path.read_text(encoding="utf-8"))  # a model's text may hold U+2028
        except (OSError, UnicodeDecodeError):
            lines = []
        records = {}
        if lines and _json_or_none(lines[0]) == self.header:
            for line in lines[1:]:  # a torn last line (killed mid-write) is skipped
                record = _json_or_none(line)
                if isinstance(record, dict) and isinstance(record.get("index"), int):
                    records[record["index"]] = record
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.header) + "\n")
        return records

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from paged_decode import DEFAULT_MAX_ROWS

    parser = argparse.ArgumentParser(
        description="Evaluate a LoRA checkpoint (or the base model) with the frozen OPSD protocol.")
    parser.add_argument("checkpoint", help="LoRA checkpoint folder (with adapter_config.json), or 'base'")
    parser.add_argument("--model", help=f"base model: hub id, local folder or 'tiny' (default {DEFAULT_MODEL})")
    parser.add_argument("--dataset", help=f"eval set: hub name, .json/.jsonl/.parquet or 'tiny' "
                                          f"(default {DEFAULT_DATASET})")
    parser.add_argument("--output-dir", help="where eval_<name>.json goes (default outputs/eval/<dataset>)")
    parser.add_argument("--backend", default="auto", choices=("transformers", "vllm", "auto"),
                        help="sampling engine; auto = vllm when importable with CUDA, else transformers")
    parser.add_argument("--preset", default=os.environ.get("OPSD_PRESET") or None, choices=(TINY,),
                        help="tiny: embedded tiny model and eval set, fewer and shorter samples "
                             "(default from OPSD_PRESET)")
    parser.add_argument("--engine", default="auto", metavar="|".join(engine_names()),
                        help="the transformers backend's engine (rollout.TransformersBackend): auto = paged on CUDA "
                             "(transformers' continuous batching over a KV cache of bounded size), dynamic on CPU "
                             "and with the tiny preset (generate() with the dynamic cache); static, graph, "
                             "graph_compiled: the trainer's rollout engines")
    parser.add_argument("--paged-cache-gib", type=float, default=None, metavar="GIB",
                        help="the paged engine's KV pool in GiB (default: half the GPU's total memory, a quarter "
                             "of RAM on CPU); it bounds the evaluation's memory, and the samples depend on it")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"transformers backend: rows per generate() call (default {BATCH_SIZE}); the paged "
                             f"engine: rows per forward pass, about the rows in flight (default {DEFAULT_MAX_ROWS})")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0, or 2 for bad inputs)."""
    args = parse_args(argv)
    try:
        request, problems = build_request(args)
    except InputError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2

    print(format_settings(request.settings))
    first = " (the preset's first)" if request.settings.max_problems else ""
    engine = f" (engine {request.engine}, batch size {request.batch_size})" if request.engine else ""
    print(f"model {request.model} | checkpoint {request.checkpoint or 'base'} | dataset {request.dataset} "
          f"({len(problems)} problems{first}) | backend {request.backend}{engine}", flush=True)
    report = evaluate(request, problems)
    metrics = report["metrics"]
    print(format_metrics(metrics))
    print(f"report: {request.output_path}")
    print(final_line(metrics["num_correct"], metrics["num_samples"], metrics["num_problems"], metrics["k"]),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
