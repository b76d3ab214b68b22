"""Model helpers shared by the rollout engines, the compiled layers and the trainer.

A leaf module (torch only): whatever needs to see through the peft wrapper, find a
model's device, left-pad prompts or silence a library's deprecation warning about its own
internals imports it from here, so that the modules that use these helpers never import
each other for them.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch


def causal_lm(model):
    """The transformers CausalLM under a peft wrapper (LoRA layers are injected into it);
    the model itself when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_device(model) -> torch.device:
    """The device of the model's parameters (a PeftModel's `.device` is not reliable
    across versions; its parameters are)."""
    return next(model.parameters()).device


@contextlib.contextmanager
def peft_wrapping():
    """Around our calls that wrap a model in peft (`PeftModel.from_pretrained`, TRL's
    `get_peft_model`): peft 0.21's `PeftModel.__init__` reads transformers' deprecated
    `is_gradient_checkpointing`, one FutureWarning per wrap that no argument of ours avoids.
    Exactly that warning is ignored, and only inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield


def checkpointing_is_on(model) -> bool:
    """Whether the model checkpoints activations, under either transformers name
    (`is_activation_checkpointing` in newer ones, `is_gradient_checkpointing` in 5.17)."""
    inner = causal_lm(model)
    if hasattr(type(inner), "is_activation_checkpointing"):
        return bool(inner.is_activation_checkpointing)
    return bool(getattr(inner, "is_gradient_checkpointing", False))


def set_checkpointing(model, on: bool, kwargs: dict | None = None, every_n_layers: int = 1) -> None:
    """Activation checkpointing on (every `every_n_layers`-th layer, with torch.utils.checkpoint's
    `kwargs`) or off, through whichever name the installed transformers has (the old one warns
    where both exist)."""
    inner = causal_lm(model)
    new = hasattr(inner, "activation_checkpointing_enable")
    if not on:
        (inner.activation_checkpointing_disable if new else inner.gradient_checkpointing_disable)()
    elif new:
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)


def import_inductor_quietly() -> None:
    """Called where we `torch.compile`, before the first compiled call: torch's inductor then
    imports `torch.utils.mkldnn`, whose module-level `@torch.jit.script_method` decorators raise
    torch's own DeprecationWarning of TorchScript (torch 2.13), once per process and no use of
    ours. Importing that module first, with exactly that warning ignored, keeps it silent."""
    if "torch.utils.mkldnn" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401


@contextlib.contextmanager
def eval_mode(model):
    """Run the model itself for sampling: eval mode switches off dropout (LoRA dropout
    included) and gradient checkpointing; the caller's mode is restored after. (A walk
    over every module each way: about 10 ms for a peft-wrapped 1.7B model on a fast CPU,
    so engines that sample from a copy of their own skip it.)"""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def left_pad(rows: list[list[int]], pad_token_id: int, device,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length prompts, padded on the left (to `width`, default the
    longest), with their attention mask."""
    width = max(max(len(row) for row in rows), width or 0)
    input_ids = torch.tensor([[pad_token_id] * (width - len(row)) + list(row) for row in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long)
    return input_ids.to(device), attention_mask.to(device)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder config: what one token's KV cache holds."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim
