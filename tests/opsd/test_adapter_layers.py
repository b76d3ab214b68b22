"""adapter_layers.AdapterLayers switches a peft model's adapters as peft's own context
managers do (PeftModel.disable_adapter, peft.helpers.disable_input_dtype_casting)."""
import copy
from pathlib import Path

import peft
import pytest
import torch
from lora_helpers import acting_lora
from module_walks import record_module_walks
from peft.helpers import disable_input_dtype_casting
from peft.tuners.tuners_utils import BaseTunerLayer

from opsd import scoring, tiny_default
from opsd.adapter_layers import AdapterLayers

IDS = torch.tensor([[3, 17, 42, 9, 5, 77]])


@pytest.fixture(scope="module")
def base():
    return tiny_default.build_tiny_model(seed=0).eval()


@pytest.fixture
def lora(base):
    return acting_lora(base, ["q_proj", "v_proj", "down_proj"], r=4, dtype=torch.float64).eval()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_disabled_gives_the_base_model_and_restores_the_adapters(base, lora):
    adapted = logits(lora)
    grads = {n: p.requires_grad for n, p in lora.named_parameters()}
    with lora.disable_adapter():
        peft_off = logits(lora)
    layers = AdapterLayers(lora)
    assert len(layers.tuner_layers) == 2 * 3  # 2 decoder layers x 3 targets
    with layers.disabled():
        off = logits(lora)
        assert all(m.disable_adapters for m in layers.tuner_layers)
    torch.testing.assert_close(off, peft_off, rtol=0, atol=0)
    torch.testing.assert_close(off, logits(copy.deepcopy(base).double()), rtol=0, atol=1e-12)
    assert (adapted - off).abs().max() > 1e-3  # the adapters act
    torch.testing.assert_close(logits(lora), adapted, rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in lora.named_parameters()} == grads


def test_a_layer_switched_off_before_stays_off(lora):
    layers = AdapterLayers(lora)
    already_off = layers.tuner_layers[0]
    already_off.enable_adapters(False)
    with layers.disabled():
        pass
    assert already_off.disable_adapters
    assert not any(m.disable_adapters for m in layers.tuner_layers[1:])


def test_input_casting_disabled_matches_peft(lora):
    layers = AdapterLayers(lora)
    layers.tuner_layers[1].cast_input_dtype_enabled = False  # a value that must come back as it was
    before = [m.cast_input_dtype_enabled for m in layers.tuner_layers]
    with disable_input_dtype_casting(lora):
        peft_inside = [m.cast_input_dtype_enabled for m in lora.modules() if isinstance(m, BaseTunerLayer)]
    with layers.input_casting_disabled():
        inside = [m.cast_input_dtype_enabled for m in layers.tuner_layers]
    assert inside == peft_inside == [False] * len(before)
    assert [m.cast_input_dtype_enabled for m in layers.tuner_layers] == before


def test_a_model_without_adapters_cannot_be_switched_off(base):
    with pytest.raises(ValueError, match="no peft adapter layers"):
        with AdapterLayers(base).disabled():
            pass


def test_the_trainers_autocast_keeps_the_dtype_without_walking_the_model(lora, monkeypatch):
    """opsd.scoring.bf16_autocast (every micro-batch on a GPU) switches input casting off through
    the listed layers: no module walk started by the project or peft (peft's helper walks twice)."""
    layers = AdapterLayers(lora)
    walks = record_module_walks(monkeypatch, [Path(scoring.__file__).parents[1], Path(peft.__file__).parent])
    with scoring.bf16_autocast(layers, enabled=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not any(m.cast_input_dtype_enabled for m in layers.tuner_layers)
    monkeypatch.undo()
    assert walks == [] and all(m.cast_input_dtype_enabled for m in layers.tuner_layers)
