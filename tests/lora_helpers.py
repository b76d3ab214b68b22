"""A LoRA adapter that acts, for tests: peft's fresh adapters are no-ops (B = 0); a saved checkpoint."""
import copy
import math

import torch


def acting_lora(model, targets, r: int, dtype=None, seed: int = 0):
    """peft LoRA (alpha 2r, no dropout) over a deep copy of `model` (cast to `dtype` if given),
    every A matrix drawn as peft draws it (Kaiming-uniform) and every B matrix 0.3 x N(0, 1),
    both from a generator seeded with `seed`: peft draws A from the global generator, which
    would make the adapter depend on whatever ran before in the process."""
    from peft import LoraConfig, get_peft_model

    from opsd.model_utils import peft_wrapping

    base = copy.deepcopy(model)
    if dtype is not None:
        base = base.to(dtype)
    with peft_wrapping():
        peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                     target_modules=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5), generator=gen)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.3)
    return peft_model


def lora_checkpoint(folder) -> str:
    """A LoRA checkpoint of the embedded random model saved in `folder` (made if missing), its
    tokenizer beside it, as a run saves one; returns the base model's folder (adapter_config.json's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd import tiny_default
    from opsd.model_utils import peft_wrapping

    base = tiny_default.resolve_model("tiny-random")
    with peft_wrapping():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return base
