"""torch.compile of the decoder layers, switched on only for the training step's forwards and the rollout's prefill.

Why: with LoRA on every projection, a decoder layer spends much of its time in small
memory-bound kernels around its GEMMs (peft's `lora_B(lora_A(x)) * scaling` and the
add, RMSNorm, SiLU gating, rotary, residual adds, dtype casts): a fifth of a step's
GPU time in the H200 profile of BENCHMARKS.md. Compiling each layer fuses them.

Every layer runs the same code with its parameters as graph inputs, so one compiled
graph serves all of them (per grad mode, adapter state and shape family; the first
step compiles, later ones reuse). Activation checkpointing stays as transformers
applies it, inside the compiled graph, so the backward's recompute replays the compiled
forward after `active()` has ended: newer transformers (5.2x) checkpoint inside the
layer's `forward`, which is what gets compiled; transformers 5.17 checkpoints in the
layer's `__call__` around a lookup of `forward` that the recompute repeats, by then the
eager one (its saved tensors differ: torch's CheckpointError), so for such layers the
compiled function carries the checkpoint itself and their `__call__` is told not to.

The compiled forwards are installed only inside `CompiledLayers.active()`, i.e. for
the two scoring forwards of `OPSDTrainer._opsd_loss` (training steps, and loss
evaluation if an eval set is given), and, with an instance of its own over the network
that samples, for the prefill of `static_decode`'s "graph_compiled" loop (whose decode
step is compiled whole). vLLM rollouts, the evaluation and checkpoint saving see the eager model.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from opsd.model_utils import causal_lm, import_inductor_quietly

# Graphs one layer forward may need in one process: grad on / off, adapter on / off,
# checkpointing on / off (per layer with every_n_layers), whether the input requires
# grad (layer 0 differs), a static then a dynamic shape, batch size 1. Dynamo's
# default of 8 per function was exceeded on the H200 (BENCHMARKS.md) and then runs
# the layer eagerly without a word beyond a log warning.
RECOMPILE_LIMIT = 64


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers CausalLM (under a peft wrapper or not)."""
    inner = causal_lm(model)
    layers = getattr(inner.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(inner).__name__}: no decoder `.layers` to compile")
    return list(layers)


class CompiledLayers:
    """Compiled `forward`s for a model's decoder layers, built once, used inside `active()`.

    `backend`, `dynamic`: torch.compile's (tests count graphs with the "eager" backend).
    `own_cache`: compile through `_call` rather than the layers' `forward` itself. Dynamo keeps
    its compiled graphs per code object, and every decoder layer of a class (the training
    model's and the sampling copy's alike) shares the class's `forward`: the graphs of one
    use would sit in the cache the other's calls search, and count against its recompile limit."""

    def __init__(self, model, backend: str = "inductor", dynamic: bool | None = None, own_cache: bool = False):
        self.layers = decoder_layers(model)
        self.backend, self.dynamic, self.own_cache = backend, dynamic, own_cache
        self._compiled: list | None = None
        self._in_call = [checkpoints_in_call(layer) for layer in self.layers]  # fixed by each layer's class

    @contextmanager
    def active(self):
        if self._compiled is None:
            # Built lazily from whatever `forward` each layer has (hooks included); compiled at first call.
            import_inductor_quietly()
            targets = [partial(_checkpointed, layer, layer.forward) if in_call else layer.forward
                       for layer, in_call in zip(self.layers, self._in_call, strict=False)]
            if self.own_cache:
                call = torch.compile(_call, backend=self.backend, dynamic=self.dynamic)
                self._compiled = [partial(call, target) for target in targets]
            else:
                self._compiled = [torch.compile(target, backend=self.backend, dynamic=self.dynamic)
                                  for target in targets]
        # A layer may carry an instance-level forward already (e.g. accelerate's device hooks).
        own = [layer.__dict__.get("forward") for layer in self.layers]
        for layer, compiled, in_call in zip(self.layers, self._compiled, self._in_call, strict=False):
            layer.forward = compiled
            if in_call:  # the compiled function checkpoints, not __call__
                layer.opsd_checkpointing, layer.gradient_checkpointing = layer.gradient_checkpointing, False
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                yield
        finally:
            for layer, previous, in_call in zip(self.layers, own, self._in_call, strict=False):
                if previous is None:
                    del layer.forward
                else:
                    layer.forward = previous
                if in_call:
                    layer.gradient_checkpointing = layer.opsd_checkpointing


def checkpoints_in_call(layer: torch.nn.Module) -> bool:
    """Whether the layer's class checkpoints in its own `__call__` (transformers 5.17's
    GradientCheckpointingLayer) rather than inside `forward` (5.2x)."""
    for cls in type(layer).__mro__:
        if cls is torch.nn.Module:
            return False
        if "__call__" in cls.__dict__:
            return hasattr(layer, "gradient_checkpointing")
    return False


def _checkpointed(layer, forward, *args, **kwargs):
    """`forward`, checkpointed as transformers 5.17's `__call__` would (caching is off in the
    scoring forwards that run here), so that the checkpoint is part of the compiled graph."""
    if layer.opsd_checkpointing and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(partial(forward, **kwargs), *args)
    return forward(*args, **kwargs)


def _call(forward, *args, **kwargs):
    """`forward(*args, **kwargs)`: what `CompiledLayers(own_cache=True)` compiles, a code object of its own."""
    return forward(*args, **kwargs)
