"""The rollout engine: the sampling backends, which turn prompt token ids into sampled
completions. Importable without TRL (and without vLLM, which only the vLLM backend imports, when it
is built). This module is the package's facade; the code lives in:

- `transformers_backend`: `TransformersBackend`, sampling from an in-memory (optionally
  peft-wrapped) model; it runs anywhere, CPU tests included, and is what the trainer uses for
  on-policy rollouts. With it its logits processors (`sampling_processors`, `NucleusFilter`,
  `CandidateDraw`).
- `vllm_backend`: `VLLMBackend`, vLLM's offline engine, the production engine for evaluation on
  GPUs; and what the trainer's colocated vLLM shares with it (`vllm_environment`,
  `check_vllm_version`, `kv_cache_options`, the `VLLM_*` constants).
- `choice`: `resolve_backend_name` picks one by name (`BACKENDS`: "transformers" | "vllm" |
  "auto"); the trainer and evaluation each build the backend they use.
- `backend`: what both share (`BackendUnavailable`, `eos_token_ids_of`).

Behind the transformers backend: `static_decode` (the project's CUDA-graph decode loop),
`paged_decode` (transformers' continuous batching), `merged_student` and `fused_projections` (the
sampling copy with the LoRA delta merged and q/k/v, gate/up stacked), `compiled_layers` (decoder
layers through torch.compile, shared with the trainer's step) and `kernels/` (Triton);
`vllm_weights` gives the student's weights to vLLM, merged out of place, and `trl_patches` the
trainer's two patches of TRL's vLLM generation (not re-exported: only the trainer uses them).

Evaluation and the trainer both need "sample n completions for each of these prompts with these
settings", and both need the result in the same form: the sampled token ids, cut right after the
first EOS, plus whether the sample ran out of budget. The backends hide the engine behind that one
call, `generate(prompt_ids, settings, n)`.

Reproducibility contract: the same seed, prompts, settings, `n` and batch size give identical
completions, independently of whatever ran before in the process. Changing the batch size
(transformers) or the engine may change the samples.
"""
from opsd.rollout.backend import BackendUnavailable, eos_token_ids_of
from opsd.rollout.choice import BACKENDS, resolve_backend_name
from opsd.rollout.transformers_backend import CandidateDraw, NucleusFilter, TransformersBackend, sampling_processors
from opsd.rollout.vllm_backend import (
    VLLM_ENV_DEFAULTS,
    VLLM_LORA_RANKS,
    VLLM_NO_FLASHINFER,
    VLLM_RUN,
    VLLM_SUPPORTED,
    VLLMBackend,
    check_vllm_version,
    kv_cache_options,
    vllm_available,
    vllm_environment,
    vllm_lora_rank,
)

__all__ = [
    "BACKENDS", "BackendUnavailable", "CandidateDraw", "NucleusFilter", "TransformersBackend", "VLLMBackend",
    "VLLM_ENV_DEFAULTS", "VLLM_LORA_RANKS", "VLLM_NO_FLASHINFER", "VLLM_RUN", "VLLM_SUPPORTED",
    "check_vllm_version", "eos_token_ids_of", "kv_cache_options", "resolve_backend_name",
    "sampling_processors", "vllm_available", "vllm_environment", "vllm_lora_rank",
]
