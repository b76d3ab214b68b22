"""Evaluate a LoRA checkpoint (or the base model) on a math benchmark (docs/SPEC.md §5).

    python opsd_eval.py CHECKPOINT|base [--model M] [--dataset D] [--output-dir O]
                        [--backend transformers|vllm|auto] [--preset tiny]

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
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

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

# `\boxed{`, `\boxed {` and `\fbox{`; the match ends on the opening brace.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")

# math-verify's own time limit uses signals, which fail outside the main thread;
# it is switched off and this limit is enforced with a watchdog thread instead.
MATH_VERIFY_TIMEOUT_S = 5.0


class GradeResult(NamedTuple):
    answer: str | None  # content of the last \boxed{...}, None if there is none
    correct: bool
    reason: str         # "correct" | "wrong_answer" | "no_answer" | "truncated"


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces matched.
    None when there is no box, the last one is never closed, or it is empty."""
    openings = list(_BOX_OPEN.finditer(text))
    if not openings:
        return None
    content = _braced_content(text, openings[-1].end() - 1)
    if content is None or not content.strip():
        return None
    return content.strip()


def _braced_content(text: str, open_at: int) -> str | None:
    """The text between the brace at `open_at` and its matching closing brace.
    Escaped braces (\\{ \\}) are literal set braces, not grouping."""
    depth, i = 0, open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
        i += 1
    return None


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
        text = str(int(text))
    return text


def answers_match(answer: str, gold: str) -> bool:
    """True when the extracted answer equals the gold answer, by math-verify or by
    the normalised string form (either one accepting is enough)."""
    gold = extract_boxed(gold) or gold.strip()
    if normalize_answer(answer) == normalize_answer(gold):
        return True
    try:
        return _run_with_timeout(_math_verify_equal, MATH_VERIFY_TIMEOUT_S, answer, gold)
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


def _run_with_timeout(function: Callable, timeout_s: float, *args):
    """Run `function(*args)` in a daemon thread; TimeoutError if it overruns.
    Works from any thread. A runaway call is abandoned, not killed (Python cannot
    kill threads); being a daemon it never blocks interpreter exit."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="answer-check", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"answer check took longer than {timeout_s}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


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
    batch_size: int


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
    output_dir = Path(args.output_dir) if args.output_dir else Path("outputs") / "eval" / dataset_tag(dataset)
    request = EvalRequest(
        checkpoint=checkpoint,
        model=args.model or (TINY if tiny else DEFAULT_MODEL),
        dataset=dataset,
        backend=backend,
        settings=settings,
        output_path=output_dir / f"eval_{run_name(checkpoint)}.json",
        batch_size=args.batch_size,
    )
    return request, problems


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
    """'tiny' -> the embedded tiny model's folder; anything else is passed on."""
    if model == TINY:
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


def sample_completions(request: EvalRequest, model_path: str, tokenizer, prompts: list[list[int]]):
    """[problem][sample] Completions from the requested backend."""
    from rollout import SamplingSettings

    s = request.settings
    sampling = SamplingSettings(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, seed=s.seed)
    context = model_context(model_path)
    warning = context_warning([len(p) for p in prompts], s.max_new_tokens, context, request.backend)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if request.backend == "vllm":
        # Shut down before returning, so that nothing the engine does on exit (it may
        # print) comes after the results and the FINAL line.
        with _vllm_backend(request, model_path, prompts, context) as backend:
            return backend.generate(prompts, sampling, n=s.n_samples, progress=True)
    backend = _transformers_backend(request, model_path, tokenizer)
    return backend.generate(prompts, sampling, n=s.n_samples, progress=True)


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
                               batch_size=request.batch_size)


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
    """Write to a temporary file in the same folder, then rename over `path`:
    a reader never sees a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, ensure_ascii=False)
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp creates it private (0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


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
    completions = sample_completions(request, model_path, tokenizer, prompts)

    records = [grade_problem(i, p, c, tokenizer) for i, (p, c) in enumerate(zip(problems, completions))]
    for record in records:
        print(format_problem_line(record, len(records)))
    report = {
        "settings": asdict(request.settings),
        "model": request.model,
        "checkpoint": request.checkpoint or "base",
        "dataset": request.dataset,
        "backend": request.backend,
        "metrics": summarize(records, request.settings.n_samples),
        "elapsed_s": round(time.time() - started, 1),
        "problems": records,
    }
    write_json_atomic(request.output_path, report)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per generate() call for the transformers backend")
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
    print(f"model {request.model} | checkpoint {request.checkpoint or 'base'} | dataset {request.dataset} "
          f"({len(problems)} problems{first}) | backend {request.backend}", flush=True)
    report = evaluate(request, problems)
    metrics = report["metrics"]
    print(format_metrics(metrics))
    print(f"report: {request.output_path}")
    print(final_line(metrics["num_correct"], metrics["num_samples"], metrics["num_problems"], metrics["k"]),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
