"""The rollout engine. This module is its facade, the sampling backends: turn prompt token ids
into sampled completions. Behind it: `static_decode` (the project's CUDA-graph decode loop),
`paged_decode` (transformers' continuous batching), `merged_student` and `fused_projections` (the
sampling copy with the LoRA delta merged and q/k/v, gate/up stacked), `compiled_layers` (decoder
layers through torch.compile, shared with the trainer's step), `vllm_weights` (the student's
weights for vLLM, merged out of place) and `kernels/` (Triton). Importable without TRL.

Evaluation and the trainer both need "sample n completions for each of these
prompts with these settings", and both need the result in the same form: the
sampled token ids, cut right after the first EOS, plus whether the sample ran
out of budget. This module hides the engine behind that one call:

- `TransformersBackend` wraps an in-memory (optionally peft-wrapped) model and
  calls `model.generate`. It runs anywhere, including CPU tests, and is what the
  trainer uses for on-policy rollouts.
- `VLLMBackend` drives vLLM's offline engine. It is the production engine for
  evaluation on GPUs; vLLM is imported only when this backend is built, so the
  rest of the project never needs it installed.
- `make_backend` picks one by name ("transformers" | "vllm" | "auto").

Reproducibility contract: the same seed, prompts, settings, `n` and batch size
give identical completions, independently of whatever ran before in the process.
Changing the batch size (transformers) or the engine may change the samples.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from opsd.model_utils import eval_mode, left_pad, model_device
from opsd.sampling import Completion, SamplingSettings, derive_seed, to_completion
from rollout.paged_decode import PAGED, paged_generate
from rollout.static_decode import (
    CACHE_IMPLEMENTATIONS,
    GRAPH_LOOPS,
    StaticDecoder,
    resolve_cache_implementation,
)

BACKENDS = ("transformers", "vllm", "auto")

# LoRA ranks vLLM can be configured for (`max_lora_rank` must be one of these).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)

# Set before vLLM is imported, unless the user set them. With its engine core in a
# separate process (vLLM's default) seeded samples are not reproducible from run to
# run; in this process they are. vLLM logs to stdout by default, where its lines would
# mix with the evaluation's output and could follow the FINAL line.
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}
# vLLM's top-k/top-p sampler uses flashinfer when it thinks it can, and crashes at the first
# sample when flashinfer is not installed (vLLM 0.26.0 on an H200): its own sampler then.
VLLM_NO_FLASHINFER = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

# The vLLM releases this project runs with (README "Versions"): TRL 1.16's window, in which
# 0.26.0 was run (torch 2.11.0) and is the pin of requirements-gpu.txt (`bash install.sh --gpu`).
VLLM_SUPPORTED = ("0.22.0", "0.31.0")
VLLM_RUN = ("0.26.0",)


class BackendUnavailable(RuntimeError):
    """A requested sampling engine cannot be used here (one-line message)."""


def eos_token_ids_of(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a sample: the tokenizer's EOS plus the checkpoint's
    generation_config list (Qwen3: <|im_end|> and <|endoftext|>)."""
    ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
    if generation_config is not None:
        ids += _as_id_list(generation_config.eos_token_id)
    return list(dict.fromkeys(ids))


# --------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------

class TransformersBackend:
    """Batched sampling from an in-memory (optionally peft-wrapped) model on left-padded prompts.

    Rows are the prompts repeated n times (prompt-major) and are sampled in
    batches of `batch_size`. Each batch re-seeds torch's RNG from
    (seed, batch index) inside `torch.random.fork_rng`, so results depend only on
    the call's arguments and the caller's RNG state is left untouched. The "paged"
    engine instead takes all rows of a call at once (below).

    `cache_implementation` picks the decoding engine (see CACHE_IMPLEMENTATIONS):

    - None / "dynamic": `model.generate` with the dynamic KV cache (the simple
      path; the default on CPU);
    - "static": `model.generate` with a static KV cache; on CUDA transformers then
      torch.compiles the forward pass on its own;
    - "graph": the project's own decode loop (`static_decode.StaticDecoder`): a
      preallocated KV cache, every decode step (forward + sampling + EOS
      bookkeeping) recorded once as a CUDA graph and replayed; with `merge_lora`
      active LoRA adapters are sampled from a merged copy of the adapted weights
      (`rollout/merged_student.py`), else unmerged; the base weights, i.e. the fixed
      teacher, are never written;
    - "graph_compiled": the same loop with the step compiled by torch.compile
      before it is recorded (fewer, fused kernels; pays a compile per shape);
    - "paged": transformers' continuous batching over a paged KV cache of bounded
      size (`rollout/paged_decode.py`): every row of the call is one request, rows join
      and leave the running batch as they start and finish, at most `batch_size`
      rows per forward pass; the KV pool (`paged_cache_gib`, default a share of the
      device's memory), not the number of rows, bounds the memory. For long
      evaluations without vLLM; seeded once per call from (seed, 0);
    - "auto": the fastest measured (BENCHMARKS.md): AUTO_CUDA ("graph_compiled")
      on CUDA for the supported decoder families, "static" for others, the
      dynamic path on CPU.

    On CPU "graph" / "graph_compiled" run the same loop step by step, without
    recording (and without compiling), which is what the CPU tests check.
    """

    def __init__(self, model, *, pad_token_id: int, eos_token_ids: Sequence[int] | int,
                 batch_size: int = 16, cache_implementation: str | None = None, merge_lora: bool = False,
                 paged_cache_gib: float | None = None):
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, "
                             f"got {cache_implementation!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = _as_id_list(eos_token_ids)
        self.batch_size = batch_size
        self.cache_implementation = resolve_cache_implementation(cache_implementation, model)
        self.merge_lora = merge_lora  # graph loops only: generate() runs the model as it is
        self.paged_cache_gib = paged_cache_gib  # paged only: the KV pool in GiB (None: paged_decode's default)

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings, n: int = 1,
                 progress=False) -> list[list[Completion]]:
        """n completions for each prompt: result[prompt][sample]. `progress`: True for a bar of
        this call's samples, or the caller's bar (anything with update(), advanced per sample:
        one bar over many calls)."""
        rows = [list(prompt) for prompt in prompt_ids for _ in range(n)]
        if self.cache_implementation == PAGED:
            completions = self._generate_paged(rows, settings, progress)
            return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]
        completions: list[Completion] = []
        shape_rows = min(self.batch_size, len(rows))  # every batch of this call is run with this many rows
        # The graph loops switch the model to eval mode themselves, only when they sample from it
        # rather than from the merged copy (`StaticDecoder.generate`).
        mode = contextlib.nullcontext() if self.cache_implementation in GRAPH_LOOPS else eval_mode(self.model)
        with _progress_bar(len(rows), progress) as bar, mode, torch.no_grad():
            for batch_index, start in enumerate(range(0, len(rows), self.batch_size)):
                batch = rows[start:start + self.batch_size]
                completions += self._generate_batch(batch, settings, batch_index, shape_rows)
                bar.update(len(batch))
        return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    def _generate_paged(self, rows: list[list[int]], settings: SamplingSettings, progress) -> list[Completion]:
        """All rows at once through transformers' continuous batching (rollout/paged_decode.py)."""
        with _progress_bar(len(rows), progress) as bar, eval_mode(self.model), torch.no_grad():
            config = self.generation_config(settings, processors_passed=False)
            run = paged_generate(self.model, rows, settings, config, max_rows=self.batch_size,
                                 cache_gib=self.paged_cache_gib, progress=bar)
        return [to_completion(tokens, self.eos_token_ids) for tokens in run.tokens]

    def _generate_batch(self, batch: list[list[int]], settings: SamplingSettings,
                        batch_index: int, shape_rows: int | None = None) -> list[Completion]:
        device = model_device(self.model)
        if self.cache_implementation in GRAPH_LOOPS:
            # A short last batch is filled up with copies of its first row, so every
            # batch of a call has one shape (one recorded graph); the copies are dropped.
            rows = len(batch)
            full = batch + [batch[0]] * max((shape_rows or rows) - rows, 0)
            decoder = StaticDecoder.for_model(self.model, compiled=self.cache_implementation == "graph_compiled",
                                              merge_lora=self.merge_lora)
            with _seeded_rng(settings.seed, batch_index, device):
                new_tokens = decoder.generate(full, settings, pad_token_id=self.pad_token_id,
                                              eos_token_ids=self.eos_token_ids)
            return [to_completion(row, self.eos_token_ids) for row in new_tokens[:rows]]
        input_ids, attention_mask = left_pad(batch, self.pad_token_id, device)
        # position_ids are derived by generate() from the attention mask, so
        # left padding does not shift the prompt's rotary positions.
        with _seeded_rng(settings.seed, batch_index, device):
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=self.generation_config(settings, processors_passed=True),
                logits_processor=sampling_processors(settings),
            )
        new_tokens = output[:, input_ids.shape[1]:].tolist()
        return [to_completion(row, self.eos_token_ids) for row in new_tokens]

    def generation_config(self, settings: SamplingSettings, *, processors_passed: bool):
        """The GenerationConfig for `settings`. `processors_passed`: the caller also passes
        `sampling_processors(settings)` to generate(), which then do the filtering and the
        draw, and the config is greedy; False (the paged engine, which takes no processors):
        the config keeps every knob. No default: either wrong choice samples another
        distribution (or none)."""
        from transformers import GenerationConfig

        # Every sampling knob is set explicitly: generate() fills unset (None)
        # fields from the checkpoint's generation_config.json (Qwen3 ships
        # temperature 0.6 / top_k 20) and then from library defaults (top_k 50).
        # Greedy: the sampling knobs are inert; these values merely stop the
        # checkpoint's sampling defaults from triggering "flag ignored" warnings.
        sampling = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
        if settings.temperature > 0 and not processors_passed:
            sampling = dict(do_sample=True, temperature=settings.temperature, top_p=settings.top_p,
                            top_k=max(settings.top_k, 0))  # 0 = no top-k filter
        # With the processors passed, they filter and draw (ending in CandidateDraw), and
        # generate() runs greedily: its argmax picks the one token they leave.
        return GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            min_new_tokens=0,
            repetition_penalty=1.0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            cache_implementation="static" if self.cache_implementation == "static" else None,
            **sampling,
        )


class NucleusFilter:
    """Top-p filtering with transformers' rule (keep a token when the probability
    mass ranked strictly above it is below top_p; at least one), computed on the
    `candidates` most likely tokens when they already hold top_p of the mass, which
    then provably contains the nucleus. transformers' own filter sorts all 151,936
    entries at every step, most of a CPU rollout's time; rows the candidates do not
    cover fall back to the full sort. Must run after temperature and top-k, which
    `sampling_processors` sees to."""

    def __init__(self, top_p: float, candidates: int = 512):
        self.top_p, self.candidates = top_p, candidates

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.float().softmax(-1)
        k = min(self.candidates, scores.shape[-1])
        top, index = probs.topk(k, dim=-1)
        if bool((top.sum(-1) >= self.top_p).all()):
            above = top.cumsum(-1) - top  # mass ranked strictly above each candidate
            keep_sorted = above < self.top_p
            keep_sorted[..., 0] = True
        else:
            # transformers' own arithmetic (ascending float32 cumsum), so that the
            # fallback keeps exactly its set, rounding at the boundary included.
            ascending, index = probs.sort(dim=-1)
            keep_sorted = ascending.cumsum(-1) > 1 - self.top_p
            keep_sorted[..., -1] = True
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, keep_sorted)
        return scores.masked_fill(~keep, -float("inf"))


class CandidateDraw:
    """The draw, as generate()'s last logits processor (generate() itself then runs greedily
    and picks the one token it leaves finite): samples each row's next token from
    softmax(scores), over the scores the filters before it left finite.

    On a CPU it draws among the kept tokens only, where generate's own draw,
    torch.multinomial over all 151,936 probabilities, makes an exponential draw per entry
    (about 5 ms a row on one thread, as long as the embedded model's forward) although
    top-k and top-p usually keep a few dozen; when some row keeps more than `limit`
    tokens, every row draws over the whole row. Elsewhere (and at `limit` 0) it draws
    exactly as generate() would, torch.multinomial over the whole row from the same random
    stream, so GPU runs sample what they sampled before this processor existed (the tiny
    preset's published GPU results)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = int(torch.isfinite(scores).sum(-1).max()) if scores.device.type == "cpu" else None
        if kept is not None and kept <= self.limit:
            values, index = scores.topk(max(kept, 1), dim=-1)
            tokens = index.gather(-1, torch.multinomial(values.float().softmax(-1), 1))
        else:
            tokens = torch.multinomial(scores.float().softmax(-1), 1)
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


def sampling_processors(settings: SamplingSettings) -> list | None:
    """generate()'s `logits_processor` for `settings`: None when greedy, else temperature ->
    top-k (if on) -> NucleusFilter (if top-p is on), the order of transformers' warpers, then
    CandidateDraw, with generate() itself greedy (`generation_config`). The filters are
    passed rather than left to generate's warpers because generate() runs the processors it
    is given *before* the warpers it builds (transformers 5.x `_get_logits_processor`): a
    NucleusFilter given alone would cut the untempered, untruncated distribution, which is
    another distribution; and the draw must come after all of them."""
    if settings.temperature <= 0:
        return None
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    processors = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_k > 0:
        processors.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        processors.append(NucleusFilter(settings.top_p))
    return processors + [CandidateDraw()]


@contextlib.contextmanager
def _seeded_rng(seed: int | None, batch_index: int, device: torch.device):
    """Seed torch's RNG for one batch and restore the caller's RNG state after."""
    if seed is None:
        yield
        return
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(derive_seed(seed, batch_index))
        yield


# --------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------

def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_environment(training: bool = False) -> dict[str, str]:
    """Set the environment vLLM needs here, where the user has not set it, and return what was
    set: its sampler without flashinfer when flashinfer is missing; for evaluation also
    VLLM_ENV_DEFAULTS (the trainer leaves vLLM's process layout and logs to TRL); for a
    training process started without a launcher, a free rendezvous port (MASTER_PORT) for the
    process group that colocated vLLM opens: TRL takes 29500 whenever it looks free, so runs
    started together on one machine all took it and all but one failed (EADDRINUSE)."""
    wanted = {} if training else dict(VLLM_ENV_DEFAULTS)
    if importlib.util.find_spec("flashinfer") is None:
        wanted.update(VLLM_NO_FLASHINFER)
    if training and "MASTER_PORT" not in os.environ and "WORLD_SIZE" not in os.environ:
        wanted["MASTER_PORT"] = str(_free_port())
    applied = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(applied)
    return applied


def _free_port() -> int:
    """A TCP port the OS hands out as free now (each call a fresh one, not a fixed default)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version, or a BackendUnavailable naming the supported range when it
    lies outside it (or vLLM is missing). Reads the package metadata: nothing is imported."""
    from importlib import metadata

    from packaging.version import Version

    if version is None:
        try:
            version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            raise BackendUnavailable("vLLM is not installed (bash install.sh --gpu on a GPU machine)") \
                from None
    low, high = VLLM_SUPPORTED
    if not Version(low) <= Version(version) <= Version(high):
        raise BackendUnavailable(f"vLLM {version} is outside the supported range {low}-{high} (TRL 1.16's window; "
                                 f"run here: {', '.join(VLLM_RUN)}): install one inside it, e.g. bash install.sh --gpu "
                                 "(vLLM 0.26.0)")
    return version


def kv_cache_options(kv_cache_gib: float | None) -> dict:
    """vLLM engine arguments for a KV cache of a fixed size: `kv_cache_memory_bytes` (no memory
    profiling at start, which other processes on the same GPU can upset: vLLM measures the
    device's free memory, so their allocations and exits during its profile shrink its cache or
    fail its start) and a small `gpu_memory_utilization`, which then only sets how much must be
    free at start. Empty for None: vLLM's share of the GPU, profiled."""
    if kv_cache_gib is None:
        return {}
    return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30), "gpu_memory_utilization": 0.02}


def _import_vllm():
    vllm_environment()
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(
            f"the vllm backend needs vLLM, which cannot be imported here ({exc}); "
            "install it on a GPU machine (bash install.sh --gpu) or use --backend transformers"
        ) from None
    _vllm_logs_to_stderr()
    return vllm


def _vllm_logs_to_stderr() -> None:
    """Move vLLM's console handlers from stdout to stderr: covers a vLLM that was
    imported before VLLM_LOGGING_STREAM was set, or that ignores it."""
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)


class VLLMBackend:
    """vLLM's offline engine over token-id prompts, optionally with one LoRA adapter.

    Each prompt gets its own seed derived from (seed, prompt index); vLLM gives
    the n samples of a request seeds seed, seed+1, ..., so deriving per-prompt
    seeds by hashing keeps different prompts on unrelated random streams.

    `close()` (or leaving a `with` block) shuts the engine down and frees its GPU
    memory, so that nothing of vLLM runs, or prints, after the caller's results.
    """

    def __init__(self, model_path: str, *, lora_path: str | None = None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1, seed: int = 0,
                 kv_cache_gib: float | None = None):
        vllm = _import_vllm()
        engine_args = dict(
            model=str(model_path), tokenizer=str(model_path), seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
        )
        engine_args.update(kv_cache_options(kv_cache_gib))
        self.lora_request = None
        if lora_path is not None:
            from vllm.lora.request import LoRARequest

            engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_path))
            self.lora_request = LoRARequest("checkpoint", 1, str(lora_path))
        self.llm = vllm.LLM(**engine_args)
        self.eos_token_ids = _eos_ids_from_folder(str(model_path))

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings, n: int = 1,
                 progress=False) -> list[list[Completion]]:
        """As TransformersBackend.generate; a caller's bar advances once vLLM returns."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n,
                seed=None if settings.seed is None else derive_seed(settings.seed, index),
                temperature=settings.temperature,
                top_p=settings.top_p if settings.temperature > 0 else 1.0,
                top_k=settings.top_k if settings.top_k > 0 else -1,  # -1 = disabled in every vLLM version
                max_tokens=settings.max_new_tokens,
            )
            for index in range(len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        own_bar = progress is True  # vLLM's bar of this call; a caller's bar is advanced below
        outputs = self.llm.generate(prompts, params, use_tqdm=own_bar, lora_request=self.lora_request)
        if hasattr(progress, "update"):
            progress.update(len(prompt_ids) * n)
        return [[self._completion(sample) for sample in output.outputs] for output in outputs]

    def _completion(self, sample) -> Completion:
        ids = list(sample.token_ids)
        # vLLM keeps the sampled EOS in token_ids. Should an engine version report
        # an EOS stop without it (no stop strings are used, so stop_reason None
        # means EOS), restore it so the Completion contract still holds.
        if sample.finish_reason == "stop" and sample.stop_reason is None \
                and (not ids or ids[-1] not in self.eos_token_ids):
            ids.append(self.eos_token_ids[0])
        return to_completion(ids, self.eos_token_ids)

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        except ImportError:
            gc.collect()
        else:
            cleanup_dist_env_and_memory()  # process groups, gc, CUDA cache

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_lora_rank(lora_path: str | Path) -> int:
    """Smallest rank vLLM accepts that fits the adapter's `r` (from adapter_config.json)."""
    config = json.loads((Path(lora_path) / "adapter_config.json").read_text())
    ranks = [int(config.get("r", 8)), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    needed = max(ranks)
    for rank in VLLM_LORA_RANKS:
        if rank >= needed:
            return rank
    raise ValueError(f"LoRA rank {needed} in {lora_path} exceeds vLLM's maximum {VLLM_LORA_RANKS[-1]}")


def _eos_ids_from_folder(model_path: str) -> list[int]:
    """The EOS ids vLLM stops on, read the way vLLM reads them: tokenizer EOS plus
    the generation_config.json list, when there is one."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        generation_config = None
    return eos_token_ids_of(tokenizer, generation_config)


# --------------------------------------------------------------------------
# Choosing a backend
# --------------------------------------------------------------------------

def resolve_backend_name(name: str) -> str:
    """'auto' -> 'vllm' when vLLM is importable and CUDA is present, else
    'transformers'. An explicit 'vllm' that cannot work raises BackendUnavailable
    now, before anything expensive is loaded."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "vllm" if vllm_available() and torch.cuda.is_available() else "transformers"
    if name == "vllm":
        _import_vllm()
        check_vllm_version()
    return name


def make_backend(name: str, *, model=None, model_path: str | None = None, lora_path: str | None = None,
                 pad_token_id: int | None = None, eos_token_ids: Sequence[int] | int | None = None,
                 batch_size: int = 16, cache_implementation: str | None = None, **vllm_args):
    """Build a backend by name. transformers needs `model`, `pad_token_id`,
    `eos_token_ids` (the model already carries any adapter); vLLM needs
    `model_path` and optionally `lora_path` and engine arguments."""
    name = resolve_backend_name(name)
    if name == "vllm":
        if model_path is None:
            raise ValueError("the vllm backend needs model_path")
        return VLLMBackend(model_path, lora_path=lora_path, **vllm_args)
    if model is None or pad_token_id is None or eos_token_ids is None:
        raise ValueError("the transformers backend needs model, pad_token_id and eos_token_ids")
    return TransformersBackend(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                               batch_size=batch_size, cache_implementation=cache_implementation)


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

def _as_id_list(ids: Sequence[int] | int | None) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _progress_bar(total: int, progress):
    """The bar a generate() call advances: the caller's (`progress` has update()), a new one over
    `total` samples (`progress` True), or a disabled one."""
    if hasattr(progress, "update"):
        return contextlib.nullcontext(progress)
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not progress, desc="sampling", unit="sample", dynamic_ncols=True)
