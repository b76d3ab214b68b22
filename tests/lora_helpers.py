"""A LoRA adapter that acts, for tests: peft's fresh adapters are no-ops (B = 0)."""
import copy

import torch


def acting_lora(model, targets, r: int, dtype=None, seed: int = 0):
    """peft LoRA (alpha 2r, no dropout) over a deep copy of `model` (cast to `dtype` if given),
    every B matrix drawn 0.3 x N(0, 1) from a generator seeded with `seed`."""
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(model)
    if dtype is not None:
        base = base.to(dtype)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                 target_modules=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.3)
    return peft_model
