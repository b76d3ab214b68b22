"""LoRA merged out of place for the vLLM weight sync (opsd/rollout/vllm_weights.py)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from opsd.model_utils import peft_wrapping
from opsd.rollout.vllm_weights import merged_named_parameters
from opsd.tiny_default import build_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(dtype):
    torch.manual_seed(0)
    with peft_wrapping():
        model = get_peft_model(
            build_tiny_model(0).to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
        )
    with torch.no_grad():  # a trained adapter: B is non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_names_match_the_plain_model_and_base_weights_stay_untouched(dtype):
    model = lora_model(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = dict(merged_named_parameters(model))
    plain = {name for name, _ in build_tiny_model(0).named_parameters()}
    assert set(pairs) == plain
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # bit-exact: the teacher's weights never move


def test_values_equal_peft_merge_in_float32():
    model = lora_model(torch.float32)
    pairs = dict(merged_named_parameters(model))
    merged = lora_model(torch.float32).merge_and_unload()
    changed = 0
    for name, param in merged.named_parameters():
        torch.testing.assert_close(pairs[name], param.data, rtol=1e-6, atol=1e-6)
        changed += int(any(t in name for t in TARGETS))
    assert changed == 7 * 2  # every targeted projection of both layers


def test_bf16_merge_is_rounded_once_from_float32():
    model = lora_model(torch.bfloat16)
    pairs = dict(merged_named_parameters(model))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    expected = (layer.base_layer.weight.float() + layer.get_delta_weight("default").float()).to(torch.bfloat16)
    assert torch.equal(pairs["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not torch.equal(expected, layer.base_layer.weight)


def test_disabled_adapter_gives_the_base_weights():
    model = lora_model(torch.float32)
    with model.disable_adapter():
        pairs = dict(merged_named_parameters(model))
    base = dict(build_tiny_model(0).named_parameters())
    for name, value in pairs.items():
        assert torch.equal(value, base[name].data), name
