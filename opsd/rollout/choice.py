"""Choosing a sampling backend by name ("transformers" | "vllm" | "auto"): evaluation's `--backend`.
Each caller builds the backend it uses (the trainer in `_sample`, evaluation in
`_transformers_backend` / `_vllm_backend`). vLLM's presence and version are read through the
`vllm_backend` module, where they are defined (and where tests replace them)."""
from __future__ import annotations

import torch

import opsd.rollout.vllm_backend as vllm_backend

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

