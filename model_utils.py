"""Model helpers shared by the rollout engines, the compiled layers and the trainer.

A leaf module (torch only): whatever needs to see through the peft wrapper, find a
model's device or left-pad prompts imports it from here, so that the modules that use
these helpers never import each other for them.
"""
from __future__ import annotations

import torch


def causal_lm(model):
    """The transformers CausalLM under a peft wrapper (LoRA layers are injected into it);
    the model itself when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_device(model) -> torch.device:
    """The device of the model's parameters (a PeftModel's `.device` is not reliable
    across versions; its parameters are)."""
    return next(model.parameters()).device


def left_pad(rows: list[list[int]], pad_token_id: int, device,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length prompts, padded on the left (to `width`, default the
    longest), with their attention mask."""
    width = max(max(len(row) for row in rows), width or 0)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row):] = 1
    return input_ids.to(device), attention_mask.to(device)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder config: what one token's KV cache holds."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim
