"""Student weights for vLLM, with LoRA merged out of place.

TRL's vLLM weight sync merges the adapter into the base weights, reads them, and
unmerges. In bf16, W + dW - dW is not W: every sync perturbs the base weights by
rounding. Here the base weights are the fixed teacher (adapter disabled), so
that drift would silently move the teacher a little every step. This module
yields the same (name, tensor) pairs with each merged weight computed into a new
tensor, leaving the model untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer


def merged_named_parameters(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the base model's naming (what vLLM loads), LoRA deltas added.

    Supports plain LoRA on Linear layers (what opsd_train builds); DoRA and
    multiple active adapters are refused rather than merged wrongly.
    """
    lora_layers = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in peft_model.named_parameters():
        if peft_model.prefix in name:  # adapter tensors: not in vLLM's model
            continue
        vllm_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        layer = lora_layers.get(owner)
        if layer is None or layer.merged or name.endswith(".bias"):
            yield vllm_name, param.data
            continue
        yield vllm_name, _merged_weight(layer, param.data)


@torch.no_grad()
def _merged_weight(layer: LoraLayer, weight: torch.Tensor) -> torch.Tensor:
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(adapters) > 1 or any(layer.use_dora.get(a, False) for a in adapters):
        raise NotImplementedError("vLLM sync supports one active plain-LoRA adapter")
    if not adapters or layer.disable_adapters:
        return weight
    # Add in float32, round once: the same value a merge gives, without touching `weight`.
    delta = layer.get_delta_weight(adapters[0]).float()
    return (weight.float() + delta).to(weight.dtype)
