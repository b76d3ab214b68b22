"""compiled_layers: compiled forwards only inside `active()`, the model eager outside it."""
import pytest
import torch

from rollout import compiled_layers as compiled_layers
from rollout.compiled_layers import CompiledLayers, decoder_layers
from tiny_default import build_tiny_model


@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile replaced by a recording wrapper (the real one is exercised by
    tests/test_trainer.py::test_compiled_step_matches_the_eager_step)."""
    calls = []

    def compile_(fn, **options):
        def compiled(*args, **kwargs):
            calls.append(fn)
            return fn(*args, **kwargs)

        return compiled

    monkeypatch.setattr(compiled_layers.torch, "compile", compile_)
    return calls


def test_layers_are_compiled_only_inside_active(fake_compile):
    model = build_tiny_model()
    ids = torch.tensor([[1, 2, 3, 4]])
    compiled = CompiledLayers(model)
    assert compiled.layers == list(model.model.layers)
    with torch.no_grad():
        eager = model(ids).logits
        with compiled.active():
            inside = model(ids).logits
        assert len(fake_compile) == len(compiled.layers)  # every layer went through its compiled forward
        model(ids)
    assert len(fake_compile) == len(compiled.layers)  # and none after the block
    torch.testing.assert_close(inside, eager)
    assert all("forward" not in layer.__dict__ for layer in compiled.layers)


def test_instance_forward_is_restored_even_after_an_error(fake_compile):
    """A layer's own instance-level forward (e.g. accelerate's hooks) comes back as it was."""
    model = build_tiny_model()
    first = model.model.layers[0]
    hooked = first.forward
    first.forward = hooked  # an instance attribute now, like a hook's wrapper
    compiled = CompiledLayers(model)
    with pytest.raises(RuntimeError, match="boom"), compiled.active():
        assert first.forward is not hooked
        raise RuntimeError("boom")
    assert first.__dict__["forward"] is hooked
    assert all("forward" not in layer.__dict__ for layer in compiled.layers[1:])


def test_recompile_limit_is_raised_only_inside_active(fake_compile):
    default = torch._dynamo.config.recompile_limit
    with CompiledLayers(build_tiny_model()).active():
        assert torch._dynamo.config.recompile_limit == compiled_layers.RECOMPILE_LIMIT
    assert torch._dynamo.config.recompile_limit == default


def test_a_model_without_decoder_layers_is_a_clear_error():
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="no decoder `.layers`"):
        decoder_layers(NoLayers())
