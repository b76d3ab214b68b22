"""The student as one plain network for sampling: LoRA merged into a copy of each adapted weight.

Why: with unmerged adapters every projection of a decode step runs three matmuls
(base, A, B) plus casts and an add, in peft's float32 adapter dtype; at batch 32 a
decode step is latency-bound, so these small kernels cost about as much as the
base matmuls themselves. Sampling from W + scaling * B @ A runs one matmul per
projection, as a model without adapters does.

How, keeping the teacher exact: the copy is a second module tree over the same
tensors (embeddings, norms, lm_head, buffers are shared, never written); only each
LoRA-wrapped linear layer gets a new weight tensor, which `refresh` fills out of
place as base + scaling * B @ A (float32 arithmetic, one rounding to the weight's
dtype; `opsd/rollout/kernels/lora_merge.py`, whose Triton kernel for it is not the default yet).
The base weights, which are the teacher, are only read. `refresh` rebuilds every merged
weight, unconditionally: it runs before every rollout (once per optimizer step in training),
costs one pass over the adapted weights (milliseconds on a GPU for a 1.7B model, next to
seconds of sampling), and needs no way to tell whether the adapters changed; tensor version
counters cannot tell, since fused optimizers (AdamW's default in transformers) update
parameters in place without bumping them.

A merged bf16 weight rounds W + BA once where the unmerged path rounds W x and BA x
separately, so the two differ by bf16 rounding (BENCHMARKS.md gives the measured
log-probability difference); in float32 / float64 they agree to rounding (tested).

Layout: by default the copy also stacks each attention's q, k, v and each MLP's gate,
up into one product (`opsd/rollout/fused_projections.py`) where all of them carry adapters; their
merged weights are then views of the stacked weight, filled by the same `refresh`.

Supported: peft LoRA on `torch.nn.Linear` layers (any number of active adapters).
DoRA, LoRA biases, embedding / convolution LoRA raise `MergeUnsupported`; the caller
then samples through the adapters unmerged.
"""
from __future__ import annotations

import copy

import torch

from opsd.model_utils import causal_lm
from opsd.rollout.fused_projections import fusable_projections
from opsd.rollout.fused_projections import fuse as fuse_module
from opsd.rollout.kernels import lora_merge


class MergeUnsupported(ValueError):
    """The adapters cannot be merged into a sampling copy (the reason is the message)."""


def is_lora_layer(module) -> bool:
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters"))


def has_enabled_adapters(model) -> bool:
    """True when a peft LoRA layer of `model` is active (adapters not disabled, not merged in place)."""
    return any(is_lora_layer(m) and not m.disable_adapters and not m.merged and m.active_adapters
               for m in causal_lm(model).modules())


class MergedStudent:
    """A plain copy of `model`'s CausalLM whose adapted weights hold base + LoRA delta.

    With `fuse` (the default), each attention's q, k, v and each MLP's gate, up whose
    projections are all adapted become one stacked product (`opsd/rollout/fused_projections.py`);
    their merged weights are views of the stacked weight."""

    def __init__(self, model, fuse: bool = True):
        inner = causal_lm(model)
        layers = [(name, module) for name, module in inner.named_modules() if is_lora_layer(module)]
        if not layers:
            raise MergeUnsupported("no LoRA layer to merge")
        for name, module in layers:
            _check_mergeable(name, module)
        # Share every tensor: deepcopy's memo returns the same object for each one listed.
        memo = {id(t): t for t in [*inner.parameters(), *inner.buffers()]}
        self.network = copy.deepcopy(inner, memo)
        self.network.eval()
        self.fused = fuse
        lora = dict(layers)
        # Groups to stack: every projection of the group carries an adapter (otherwise the
        # stacked weight would need a copy of the unadapted base weight too).
        groups = {}  # module name -> its projections' qualified names
        for name, module in self.network.named_modules() if fuse else ():
            members = [f"{name}.{p}" if name else p for p in fusable_projections(module)]
            if members and all(m in lora for m in members):
                groups[name] = members
        stacked = {m for members in groups.values() for m in members}
        # name -> (weight of the copy, stacked bias view or None, LoRA layer of the model)
        targets = {}
        for name, module in layers:
            if name in stacked:
                continue  # gets a view of its group's stacked weight below, no weight of its own
            base = module.get_base_layer()
            weight = torch.empty_like(base.weight, requires_grad=False)
            plain = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            plain.weight = torch.nn.Parameter(weight, requires_grad=False)
            plain.bias = base.bias  # shared (None for Qwen3's projections)
            _replace(self.network, name, plain)
            targets[name] = (weight, None, module)
        for name, members in groups.items():  # o_proj / down_proj are plain copies by now
            replacement, views = fuse_module(self.network.get_submodule(name),
                                             [lora[m].get_base_layer() for m in members])
            for member, (weight, bias) in zip(members, views.values(), strict=False):
                targets[member] = (weight, bias, lora[member])
            _replace(self.network, name, replacement)
        self._targets = list(targets.values())

    def refresh(self) -> None:
        """Rebuild every merged weight (and stacked bias) from the current base and adapter weights."""
        with torch.no_grad():
            for weight, bias, layer in self._targets:
                base = layer.get_base_layer()
                adapters = [(layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name])
                            for name in _active(layer)]
                lora_merge.merge(weight, base.weight, adapters)
                if bias is not None:
                    bias.copy_(base.bias)


def _replace(network, name: str, module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(network.get_submodule(parent) if parent else network, child, module)


def _active(layer) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _check_mergeable(name: str, layer) -> None:
    if not isinstance(layer.get_base_layer(), torch.nn.Linear):
        raise MergeUnsupported(f"{name}: LoRA on {type(layer.get_base_layer()).__name__}, not a Linear layer")
    for adapter in _active(layer):
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise MergeUnsupported(f"{name}: DoRA adapter {adapter!r}")
        if getattr(layer.lora_B[adapter], "bias", None) is not None:
            raise MergeUnsupported(f"{name}: LoRA bias in adapter {adapter!r}")
        if getattr(layer, "fan_in_fan_out", False):
            raise MergeUnsupported(f"{name}: fan_in_fan_out weights")
