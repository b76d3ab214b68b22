"""compiled_layers: compiled forwards only inside `active()`, the model eager outside it."""
from functools import partial

import pytest
import torch

from opsd.rollout import compiled_layers as compiled_layers
from opsd.rollout.compiled_layers import CompiledLayers, decoder_layers
from opsd.tiny_default import build_tiny_model


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


class _CallCheckpointingLayer(torch.nn.Module):
    """A decoder layer as transformers 5.17 writes them: checkpointing in `__call__`, around a
    call that looks `forward` up again when the backward recomputes it."""

    gradient_checkpointing = False

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)

    def forward(self, x, scale=1.0):
        h = self.up(x)
        return x + self.down(h * torch.sigmoid(h)).pow(2) * scale


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_CallCheckpointingLayer() for _ in range(2)])

    def get_decoder(self):
        return self

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return x.square().sum()


@pytest.mark.parametrize("detected", [True, False])
def test_layers_that_checkpoint_in_call_recompute_the_compiled_forward(detected, monkeypatch):
    """The scoring forward runs inside `active()`, its backward after: the recompute must replay
    what the forward ran. With 5.17-style layers it would look up the eager `forward` again
    (different saved tensors: torch's CheckpointError), unless the compiled function carries the
    checkpoint itself, as it does for the layers `checkpoints_in_call` detects."""
    stack = _Stack().train()
    checkpointed = []

    def checkpoint(function, *args):
        checkpointed.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    for layer, on in zip(stack.layers, (True, False), strict=False):  # as every_n_layers=2 leaves them
        layer._gradient_checkpointing_func, layer.gradient_checkpointing = checkpoint, on
    x = torch.randn(4, 8, requires_grad=True)
    stack(x).backward()
    expected = [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad()
    checkpointed.clear()

    assert compiled_layers.checkpoints_in_call(stack.layers[0])
    # the real layers: in `__call__` under transformers 5.17, in `forward` since the rename (5.2x)
    from transformers import PreTrainedModel

    old = not hasattr(PreTrainedModel, "activation_checkpointing_enable")
    assert compiled_layers.checkpoints_in_call(build_tiny_model().model.layers[0]) is old
    if not detected:
        monkeypatch.setattr(compiled_layers, "checkpoints_in_call", lambda layer: False)
    compiled = CompiledLayers(stack, backend="aot_eager")
    with compiled.active():
        loss = stack(x)
        assert [layer.gradient_checkpointing for layer in stack.layers] == [not detected, False]
    assert [layer.gradient_checkpointing for layer in stack.layers] == [True, False]  # back as it was
    assert len(checkpointed) == 1  # the first layer only, by the compiled function or by __call__
    if not detected:
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            loss.backward()
        return
    loss.backward()
    for got, want in zip((p.grad for p in stack.parameters()), expected, strict=False):
        torch.testing.assert_close(got, want)
