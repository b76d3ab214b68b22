"""The project's patches of TRL's vLLM generation (TRL 1.16, `trl.generation.vllm_generation`),
each applied by OPSDTrainer when it builds TRL's engine, each removable once TRL has a hook:

- `trl_vllm_engine_options`: extra keyword arguments for the `vllm.LLM` of colocate mode
  (TRL 1.16's VLLMGeneration passes a fixed set; the project needs `kv_cache_memory_bytes`);
- `sync_merged_lora`: the LoRA weight sync merges out of place (TRL 1.16 merges into the bf16
  base weights and unmerges, which moves the fixed teacher a little at every sync).

TRL is imported inside the functions, so `opsd.rollout` imports without it.
"""
from __future__ import annotations

from contextlib import contextmanager

from opsd.rollout.backend import BackendUnavailable
from opsd.rollout.vllm_weights import merged_named_parameters


@contextmanager
def trl_vllm_engine_options(**options):
    """Extra keyword arguments for the `vllm.LLM` that TRL's colocate mode builds (TRL 1.16's
    VLLMGeneration passes a fixed set and has no hook): inside the block its module's `LLM` is
    `LLM` with `options` bound. Nothing happens without options."""
    if not options:
        yield
        return
    import functools

    from trl.generation import vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:
        raise BackendUnavailable("TRL's vLLM colocate mode is not available (vLLM missing?)")
    vllm_generation.LLM = functools.partial(original, **options)
    try:
        yield
    finally:
        vllm_generation.LLM = original


def sync_merged_lora(vllm_generation) -> None:
    """Make TRL's weight sync send the student with its LoRA merged out of place
    (opsd.rollout.vllm_weights): TRL's in-place merge and unmerge would perturb the bf16 base
    weights, i.e. the fixed teacher, a little at every sync. Not for sharded runs: TRL's own
    path gathers the parameters first (and keeps that drift; README)."""
    vllm_generation._iter_named_params = lambda: merged_named_parameters(vllm_generation.model)
