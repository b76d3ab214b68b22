"""EMA teacher: an exponential moving average of the LoRA adapter weights.

With `use_ema_teacher` the teacher is the base model plus a slowly moving copy of
the student's adapter. Only the adapter tensors are averaged (a few MB), never a
second full model: for the teacher forward the EMA values are swapped into the
live parameters and swapped back afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

EMA_FILE = "ema_adapter.pt"  # the EMA teacher's state in each checkpoint


class AdapterEMA:
    """EMA of a model's trainable parameters: ema <- decay * ema + (1 - decay) * live."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        if not self.shadow:
            raise ValueError("use_ema_teacher needs trainable (adapter) parameters; the model has none")

    def _live(self, model: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(model.named_parameters())
        missing = [n for n in self.shadow if n not in params]
        if missing:
            raise KeyError(f"EMA tensors not found in the model: {missing[:3]}")
        return {n: params[n] for n in self.shadow}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in self._live(model).items():
            self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    @contextmanager
    def swapped_in(self, model: nn.Module):
        """Run the model with the EMA weights; the live weights are restored on exit."""
        live = self._live(model)
        backup = {}
        with torch.no_grad():
            for name, p in live.items():
                backup[name] = p.detach().clone()
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in live.items():
                    p.copy_(backup[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.cpu() for name, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.shadow):
            raise KeyError("EMA state does not match the model's adapter parameters")
        for name, t in state.items():
            self.shadow[name].copy_(t)
