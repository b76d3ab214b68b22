"""Evaluate a LoRA checkpoint (or the base model) on a math benchmark (docs/SPEC.md §5).

    python -m opsd.evaluation CHECKPOINT|base [--model M] [--dataset D] [--output-dir O]
                        [--backend transformers|vllm|auto] [--engine E] [--preset tiny]

Samples `n_samples` completions per problem under one frozen settings block,
grades the last \\boxed{...} of each completion against the gold answer, writes
a JSON report and prints, as its very last line:

    FINAL avg@12 accuracy: 53.61% (193/360 solutions correct on 30 problems)

The report, `<output-dir>/eval_<name>.json` (name: `base` or
`<run folder>_<checkpoint folder>`), holds the settings, model, checkpoint,
dataset and backend; `metrics` (avg@k, pass@1..pass@k with the unbiased
estimator, maj@k, truncation and no-answer rates, all in percent; `graded_by`,
how many samples were graded by string match, by math-verify, timed out...); and
per problem the gold answer, accuracy, majority answer and every sample's
extracted answer, correctness, reason, how it was graded, length in tokens,
truncation flag and decoded text.

The module reads top to bottom: frozen settings, input validation, sampling,
report, running. Each sample is graded by opsd.grading (the method library,
whose `grade` and `is_correct` any caller imports) and the report's numbers are
opsd.evaluation.metrics'. Bad inputs are reported as one `error: ...` line on
stderr with exit status 2, before any model is loaded and without writing
anything; so is an answer checker that fails (GradingError), which never grades
an answer wrong in its place.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from opsd.evaluation.metrics import final_line, problem_summary, summarize
from opsd.grading import GradingError, grade_sample, start_answer_worker
from opsd.jsonl import split_lines
from opsd.run_folder import write_text_atomic

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
# 2. Inputs, validated before any model is loaded
# --------------------------------------------------------------------------

class InputError(Exception):
    """A bad command-line input; reported as one `error:` line, exit 2."""


@dataclass(frozen=True)
class EvalRequest:
    checkpoint: str | None  # LoRA adapter folder; None = the base model
    model: str              # as given (hub id, local path or "tiny")
    dataset: str            # its label: a tiny set as tiny:SEED:N (dataset_label)
    backend: str            # resolved: "transformers" or "vllm"
    settings: EvalSettings
    output_path: Path
    batch_size: int         # transformers: rows per generate() call (paged: per forward pass)
    engine: str | None = None  # the transformers engine, resolved ("dynamic", "paged", ...); None with vLLM
    paged_cache_gib: float | None = None  # the paged engine's KV pool, resolved (it changes the samples)
    vllm_kv_cache_gib: float | None = None  # vLLM's KV cache, fixed (None: vLLM's profiled share of the GPU)


def build_request(args: argparse.Namespace):
    """Check every input and load the problems. Raises InputError."""
    from opsd.data import DataError, load_eval_dataset
    from opsd.rollout import BackendUnavailable, resolve_backend_name

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
        from opsd.rollout.paged_decode import DEFAULT_MAX_ROWS

        batch_size = DEFAULT_MAX_ROWS if engine == "paged" else BATCH_SIZE
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    paged_cache_gib = None
    if args.paged_cache_gib is not None and engine != "paged":
        raise InputError(f"--paged-cache-gib sizes the paged engine's KV pool; the engine here is {engine or backend}")
    if engine == "paged":
        if args.paged_cache_gib is not None and not args.paged_cache_gib > 0:
            raise InputError(f"--paged-cache-gib must be > 0, got {args.paged_cache_gib}")
        paged_cache_gib = args.paged_cache_gib or _paged_cache_gib_from_env() or round(_default_paged_cache_gib(), 3)
    if args.vllm_kv_cache_gib is not None:
        if backend != "vllm":
            raise InputError(f"--vllm-kv-cache-gib sizes vLLM's KV cache; the backend here is {backend}")
        if not args.vllm_kv_cache_gib > 0:
            raise InputError(f"--vllm-kv-cache-gib must be > 0, got {args.vllm_kv_cache_gib}")
    output_dir = Path(args.output_dir) if args.output_dir else Path("outputs") / "eval" / dataset_tag(dataset)
    request = EvalRequest(
        checkpoint=checkpoint,
        model=args.model or (TINY if tiny else DEFAULT_MODEL),
        dataset=dataset_label(dataset),
        backend=backend,
        settings=settings,
        output_path=output_dir / f"eval_{run_name(checkpoint)}.json",
        batch_size=batch_size,
        engine=engine,
        paged_cache_gib=paged_cache_gib,
        vllm_kv_cache_gib=args.vllm_kv_cache_gib,
    )
    return request, problems


def _paged_cache_gib_from_env() -> float | None:
    """OPSD_EVAL_PAGED_GIB: the paged engine's pool when --paged-cache-gib is not given (dev_eval.sh's
    variable, and what opsd.research.grid fixes for every cell); other engines ignore it."""
    value = os.environ.get("OPSD_EVAL_PAGED_GIB", "").strip()
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = float("nan")
    if not gib > 0:
        raise InputError(f"OPSD_EVAL_PAGED_GIB={value!r}: expected a size in GiB > 0")
    return gib


def _default_paged_cache_gib() -> float:
    import torch

    from opsd.rollout.paged_decode import default_cache_gib

    return default_cache_gib(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# The transformers engines (opsd.rollout.TransformersBackend's cache_implementation), and
# what --engine auto picks: on CUDA the paged engine (memory bounded by its KV pool
# whatever the number and length of the samples; several times generate()'s rate,
# BENCHMARKS.md section 5), on CPU generate() with the dynamic cache, the simple path
# the tests use. The tiny preset keeps generate() everywhere, so that its published
# GPU results (OPSD_EXPERIMENTS.md) reproduce.
ENGINE_AUTO = {"cuda": "paged", "cpu": "dynamic"}
TINY_ENGINE = "dynamic"
BATCH_SIZE = 16  # rows per generate() call, every engine but paged (paged: paged_decode.DEFAULT_MAX_ROWS)


def engine_names() -> tuple[str, ...]:
    from opsd.rollout.static_decode import CACHE_IMPLEMENTATIONS

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


def apply_run_defaults(args: argparse.Namespace) -> str | None:
    """What a checkpoint's (or run folder's) run_config.json decides where the command line and
    OPSD_* variables left it open: a run of the tiny preset is evaluated on the tiny preset's
    eval set and settings (unless --preset or --dataset is given), any run on its own base model
    (unless --model is given). Sets those on `args`; returns the one line saying what was taken,
    or, without a run_config.json and a dataset, the line naming the hub dataset it will need
    (None: nothing to say). Called before anything loads."""
    if args.checkpoint == "base" or not Path(args.checkpoint).is_dir():
        return None
    from opsd.run_folder import CONFIG_FILE, RunFolderError, read_config

    folder = Path(args.checkpoint).resolve()
    recorded = None
    for where in (folder, folder.parent):  # a checkpoint's own copy, else its run folder's
        try:
            recorded = read_config(str(where))
        except RunFolderError:
            recorded = None
        if recorded:
            break
    if not recorded:
        if args.preset is None and args.dataset is None:
            return (f"[eval] {folder} has no {CONFIG_FILE} saying what it was trained on: evaluating on the default "
                    f"{DEFAULT_DATASET}, which needs the hub (OPSD_PRESET=tiny or OPSD_EVAL_DATA / --dataset choose "
                    "another)")
        return None
    taken = []
    if recorded.get("preset") == TINY and args.preset is None and args.dataset is None:
        args.preset = TINY
        taken.append(f"the tiny preset's eval set ({TINY}) and settings")
    model = recorded.get("model")
    if args.model is None and isinstance(model, str) and model != (TINY if args.preset == TINY else DEFAULT_MODEL):
        args.model = model
        taken.append(f"its base model {model}")
    if not taken:
        return None
    what = "a run of the tiny preset" if recorded.get("preset") == TINY else "a run"
    return (f"[eval] {folder} is {what} ({CONFIG_FILE}): evaluating with {' and '.join(taken)} "
            "(OPSD_PRESET, OPSD_MODEL, OPSD_EVAL_DATA or --preset / --model / --dataset choose otherwise)")


def check_checkpoint(path: Path) -> None:
    if path.is_file():  # the words dev_eval.sh uses for the same mistake
        raise InputError(f"{path} is a file, not a checkpoint folder (holding adapter_config.json) or a run folder "
                         "(holding checkpoint-N folders)")
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


def dataset_label(dataset: str) -> str:
    """What the header and the report call the eval set: a tiny set by its seed and size
    (`tiny` -> `tiny:20240101:30`, `tiny:7` -> `tiny:7:30`), so that a report says which set it
    was and two reports of one set say the same; any other name as given."""
    if dataset == TINY or dataset.startswith(TINY + ":"):  # real runs never import tiny_default
        from opsd import tiny_default
        return tiny_default.eval_set_name(dataset)
    return dataset


def resolve_model_path(model: str) -> str:
    """'tiny' / 'tiny-random' -> the embedded model's folder; anything else is passed on."""
    if model in (TINY, "tiny-random"):
        from opsd import tiny_default
        return str(tiny_default.resolve_model(model))
    return model


# --------------------------------------------------------------------------
# 3. Sampling
# --------------------------------------------------------------------------

def prompt_token_ids(tokenizer, problems: Sequence[dict], enable_thinking: bool) -> list[list[int]]:
    """The evaluation prompt of each problem, rendered by the chat template."""
    from opsd.prompts import eval_messages

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


def _sample_chunk(backend, request: EvalRequest, prompts: list[list[int]], chunk: range, progress=True):
    """The chunk's samples; `progress`: the evaluation's one bar, advanced per finished sample."""
    from opsd.sampling import SamplingSettings, derive_seed

    s = request.settings
    sampling = SamplingSettings(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, seed=derive_seed(s.seed, chunk.start))
    return backend.generate([prompts[i] for i in chunk], sampling, n=s.n_samples, progress=progress)


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

    from opsd.rollout import TransformersBackend, eos_token_ids_of

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    if request.checkpoint is not None:
        from peft import PeftModel

        from opsd.model_utils import peft_wrapping

        # Merged once up front: sampling then runs at base-model speed.
        with peft_wrapping():
            model = PeftModel.from_pretrained(model, request.checkpoint).merge_and_unload()
    model.eval()
    return TransformersBackend(model, pad_token_id=_pad_token_id(tokenizer),
                               eos_token_ids=eos_token_ids_of(tokenizer, model.generation_config),
                               batch_size=request.batch_size, cache_implementation=request.engine,
                               paged_cache_gib=request.paged_cache_gib)


def _vllm_backend(request: EvalRequest, model_path: str, prompts: list[list[int]], context: int | None):
    from opsd.rollout import VLLMBackend

    # Room for the longest prompt plus a full generation, within the model's context.
    needed = max(len(p) for p in prompts) + request.settings.max_new_tokens
    return VLLMBackend(model_path, lora_path=request.checkpoint, seed=request.settings.seed,
                       max_model_len=min(needed, context) if context else needed,
                       kv_cache_gib=request.vllm_kv_cache_gib)


def _pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# --------------------------------------------------------------------------
# 4. The report
# --------------------------------------------------------------------------

def grade_problem(index: int, problem: dict, completions, tokenizer) -> dict:
    """The report entry of one problem: its graded samples and their summary."""
    samples = []
    for completion in completions:
        text = tokenizer.decode(completion.ids, skip_special_tokens=True)
        result, graded_by = grade_sample(text, problem["answer"], completion.truncated)
        samples.append({"answer": result.answer, "correct": result.correct, "reason": result.reason,
                        "graded_by": graded_by, "num_tokens": len(completion.ids),
                        "truncated": completion.truncated, "completion": text})
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


def format_grading(metrics: dict) -> str:
    """How the samples were graded, one line (metrics["graded_by"]): the counts of answers each
    method decided (right or wrong; not counts of correct answers), then, when there are any,
    the answers graded wrong because math-verify failed and the samples with nothing to grade."""
    counts = dict(metrics["graded_by"])
    total = sum(counts.values())

    def answers(n: int) -> str:
        return f"{n} answer{'' if n == 1 else 's'}"

    line = (f"graded by: string match {answers(counts.pop('string_match', 0))}, "
            f"math-verify {answers(counts.pop('math_verify', 0))} (of {total} samples)")
    failed = [f"{label} {counts.pop(name)}" for name, label in (("math_verify_error", "math-verify error"),
                                                                 ("timeout", "timed out")) if counts.get(name)]
    if failed:
        line += f"; graded wrong: {', '.join(failed)}"
    if counts.get("no_box"):
        line += f"; no \\boxed{{}} to grade: {counts.pop('no_box')}"
    others = [f"{name} {n}" for name, n in counts.items() if n]  # e.g. "unrecorded" in an old report
    return line + (f"; {', '.join(others)}" if others else "")


def write_json_atomic(path: Path, payload: dict) -> None:
    """The report as JSON, written atomically: a reader never sees a half-written report."""
    write_text_atomic(path, json.dumps(payload, indent=1, ensure_ascii=False))


def _clip(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


# --------------------------------------------------------------------------
# 5. Running an evaluation, command line
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
        backend = bar = None
        for chunk in problem_chunks(request, len(problems)):
            if all(i in done for i in chunk):
                continue
            if backend is None:
                backend = _sampling_backend(request, model_path, tokenizer, prompts)
                if hasattr(backend, "__exit__"):
                    stack.enter_context(backend)
                bar = stack.enter_context(progress_bar(len(problems), len(done), request.settings.n_samples))
            samples = _sample_chunk(backend, request, prompts, chunk, progress=bar)
            graded = [grade_problem(i, problems[i], c, tokenizer) for i, c in zip(chunk, samples, strict=True)]
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


def progress_bar(num_problems: int, num_done: int, n_samples: int):
    """The evaluation's one progress bar (stderr): samples done of all, with a rate and an ETA,
    across every chunk and batch; a resumed evaluation starts it at the samples already done."""
    from tqdm.auto import tqdm

    return tqdm(total=num_problems * n_samples, initial=num_done * n_samples, desc="sampling", unit="sample",
                dynamic_ncols=True, file=sys.stderr)


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


def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m opsd.evaluation") -> argparse.Namespace:
    from opsd.rollout.paged_decode import DEFAULT_MAX_ROWS

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Evaluate a LoRA checkpoint (or the base model) with the frozen OPSD protocol.")
    parser.add_argument("checkpoint", help="LoRA checkpoint folder (with adapter_config.json), 'base', or a run "
                                           "folder (holding checkpoint-N folders): every checkpoint in step order, "
                                           "then an accuracy-vs-step table and the best (opsd/evaluation/sweep.py)")
    parser.add_argument("--model", help=f"base model: hub id, local folder or 'tiny' (default: the run's, from "
                                        f"run_config.json, else {DEFAULT_MODEL})")
    parser.add_argument("--dataset", help=f"eval set: hub name, .json/.jsonl/.parquet or 'tiny' (default "
                                          f"{DEFAULT_DATASET}; the tiny preset's for a run of the tiny preset)")
    parser.add_argument("--output-dir", help="where eval_<name>.json goes (default outputs/eval/<dataset>)")
    parser.add_argument("--backend", default="auto", choices=("transformers", "vllm", "auto"),
                        help="sampling engine; auto = vllm when importable with CUDA, else transformers")
    parser.add_argument("--preset", default=os.environ.get("OPSD_PRESET") or None, choices=(TINY,),
                        help="tiny: embedded tiny model and eval set, fewer and shorter samples "
                             "(default from OPSD_PRESET)")
    parser.add_argument("--engine", default="auto", metavar="|".join(engine_names()),
                        help="the transformers backend's engine (opsd.rollout.TransformersBackend): auto = paged on "
                             "CUDA (transformers' continuous batching over a KV cache of bounded size), dynamic on CPU "
                             "and with the tiny preset (generate() with the dynamic cache); static, graph, "
                             "graph_compiled: the trainer's rollout engines")
    parser.add_argument("--paged-cache-gib", type=float, default=None, metavar="GIB",
                        help="the paged engine's KV pool in GiB (default: half the GPU's total memory, a quarter "
                             "of RAM on CPU); it bounds the evaluation's memory, and the samples depend on it")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"transformers backend: rows per generate() call (default {BATCH_SIZE}); the paged "
                             f"engine: rows per forward pass, about the rows in flight (default {DEFAULT_MAX_ROWS})")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=None, metavar="GIB",
                        help="vLLM backend: a KV cache of this size instead of vLLM's profiled share (85%%) of the "
                             "GPU, for an evaluation that shares the GPU with other processes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "python -m opsd.evaluation") -> int:
    """The command line; returns the exit status (0, or 2 for bad inputs and for an
    answer checker that fails: GradingError). `argv` may be parsed already (an argparse
    Namespace: one checkpoint of a sweep); `prog` is the name its help shows (`opsd eval`)."""
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv, prog)
    from opsd.evaluation import sweep as checkpoint_sweep  # standard library and run_folder only

    note = apply_run_defaults(args)  # before any hub access: what the run recorded fills the gaps
    if note:
        print(note, flush=True)
    if checkpoint_sweep.is_run_folder(args.checkpoint):  # a folder of checkpoint-N folders: all of them
        return checkpoint_sweep.sweep(args, sys.modules[__name__])
    from opsd.config import ConfigError, check_env

    try:
        check_env()  # a misspelled OPSD_* name would otherwise be ignored
        request, problems = build_request(args)
    except (InputError, ConfigError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2

    print(format_settings(request.settings))
    first = " (the preset's first)" if request.settings.max_problems else ""
    engine = f" (engine {request.engine}, batch size {request.batch_size})" if request.engine else ""
    print(f"model {request.model} | checkpoint {request.checkpoint or 'base'} | dataset {request.dataset} "
          f"({len(problems)} problems{first}) | backend {request.backend}{engine}", flush=True)
    try:
        start_answer_worker()  # a checker that cannot start stops the run before any sampling
        report = evaluate(request, problems)
    except GradingError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    metrics = report["metrics"]
    print(format_metrics(metrics))
    print(format_grading(metrics))
    print(f"report: {request.output_path}")
    print(final_line(metrics["num_correct"], metrics["num_samples"], metrics["num_problems"], metrics["k"]),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
