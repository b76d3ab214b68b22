"""Choosing a sampling backend by name ("transformers" | "vllm" | "auto") and building it. vLLM's
presence and version are read through the `vllm_backend` module, where they are defined (and where
tests replace them)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

import rollout.vllm_backend as vllm_backend
from rollout.transformers_backend import TransformersBackend

BACKENDS = ("transformers", "vllm", "auto")


def resolve_backend_name(name: str) -> str:
    """'auto' -> 'vllm' when vLLM is importable and CUDA is present, else
    'transformers'. An explicit 'vllm' that cannot work raises BackendUnavailable
    now, before anything expensive is loaded."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "vllm" if vllm_backend.vllm_available() and torch.cuda.is_available() else "transformers"
    if name == "vllm":
        vllm_backend.import_vllm()
        vllm_backend.check_vllm_version()
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
        return vllm_backend.VLLMBackend(model_path, lora_path=lora_path, **vllm_args)
    if model is None or pad_token_id is None or eos_token_ids is None:
        raise ValueError("the transformers backend needs model, pad_token_id and eos_token_ids")
    return TransformersBackend(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                               batch_size=batch_size, cache_implementation=cache_implementation)
