"""The peft adapter layers of a model, listed once and switched in place.

Why: peft's `PeftModel.disable_adapter()` and `peft.helpers.disable_input_dtype_casting()`
walk every module of the model on each use, and `disable_adapter` also builds a status
report of every layer first. On a 28-layer LoRA model that is tens of milliseconds of host
time, which the trainer paid in every micro-batch (the teacher's forward runs with the
adapters off; both forwards keep autocast's dtype). At micro-batch 4 the training step is
bound by the host (BENCHMARKS.md section 3), so that time added directly to each step.
`AdapterLayers` finds the layers once and switches them through each layer's own public
methods, as those two functions do for LoRA-type adapters (the trainer builds LoRA only; prompt
learning, which peft disables differently, is not handled). Two differences: after `disabled()`
only the layers that were on are switched back on (peft switches every layer on), and the
PeftModel's own `_adapters_disabled` flag, which LoRA layers do not read, is left alone.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn


class AdapterLayers:
    """The adapter layers of `model` (a peft model or the transformers model under it)."""

    def __init__(self, model: nn.Module):
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self.model = model
        modules = list(model.modules())
        self.tuner_layers = [m for m in modules if isinstance(m, BaseTunerLayer)]
        # What `disable_adapter` switches: the tuner layers and the modules_to_save-style wrappers.
        self.switchable = [m for m in modules if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]

    @contextmanager
    def disabled(self):
        """Every adapter off inside the block, so the model computes its base weights' output
        (`PeftModel.disable_adapter` for LoRA-type adapters). Afterwards the layers that were
        on are switched back on; any that were already off stay off."""
        if not self.switchable:
            raise ValueError("the model has no peft adapter layers to switch off")
        switched = [m for m in self.switchable if not m.disable_adapters]
        for module in switched:
            module.enable_adapters(False)
        try:
            yield
        finally:
            for module in switched:
                module.enable_adapters(True)

    @contextmanager
    def input_casting_disabled(self):
        """Adapter inputs are not cast to the adapter weights' dtype inside the block
        (`peft.helpers.disable_input_dtype_casting`), so autocast decides the matmuls' dtype."""
        previous = [m.cast_input_dtype_enabled for m in self.tuner_layers]
        for module in self.tuner_layers:
            module.cast_input_dtype_enabled = False
        try:
            yield
        finally:
            for module, value in zip(self.tuner_layers, previous, strict=False):
                module.cast_input_dtype_enabled = value
