"""Model helpers shared by the rollout engines, the compiled layers and the trainer.

A leaf module (torch only): whatever needs to see through the peft wrapper, find a
model's device or left-pad prompts imports it from here, so that the modules that use
these helpers never import each other for them.
"""
from __future__ import annotations

import contextlib

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
