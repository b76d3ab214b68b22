"""The vLLM backend: vLLM's offline engine over token-id prompts, optionally with one LoRA
adapter; the production engine for evaluation on GPUs. vLLM is imported only when this backend is
built (or a backend name is resolved to it), so the rest of the project never needs it installed.
Also here: what the trainer's colocated vLLM shares with it: the environment vLLM is started in
(`vllm_environment`), the supported versions (`check_vllm_version`), a fixed KV cache's engine
arguments (`kv_cache_options`)."""
from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from opsd.rollout.backend import BackendUnavailable, eos_token_ids_of
from opsd.sampling import Completion, SamplingSettings, derive_seed, to_completion

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

# The vLLM releases this project runs with (docs/ENGINE.md, "Versions"): TRL 1.16's window, in which
# 0.26.0 was run (torch 2.11.0) and is the pin of requirements-gpu.txt (`bash install.sh --gpu`).
VLLM_SUPPORTED = ("0.22.0", "0.31.0")
VLLM_RUN = ("0.26.0",)


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


def import_vllm():
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
        vllm = import_vllm()
        engine_args = {
            "model": str(model_path), "tokenizer": str(model_path), "seed": seed,
            "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
        }
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
