"""opsd.model_utils' checkpointing switch under either transformers name."""
from opsd.model_utils import checkpointing_is_on, set_checkpointing


class Old:
    """transformers 5.17's names only."""

    def __init__(self):
        self.calls = []
        self.is_gradient_checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1):
        self.calls.append(("enable", gradient_checkpointing_kwargs))
        self.is_gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        self.calls.append(("disable",))
        self.is_gradient_checkpointing = False


class New(Old):
    """Newer transformers: the new names (the old ones still exist and warn)."""

    @property
    def is_activation_checkpointing(self):
        return self._on

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1):
        self.calls.append(("new enable", activation_checkpointing_kwargs))
        self._on = True

    def activation_checkpointing_disable(self):
        self.calls.append(("new disable",))
        self._on = False


class Wrapped:
    def __init__(self, inner):
        self.inner = inner

    def get_base_model(self):
        return self.inner


def test_old_names():
    model = Old()
    assert not checkpointing_is_on(Wrapped(model))
    set_checkpointing(Wrapped(model), True, {"use_reentrant": False})
    assert checkpointing_is_on(Wrapped(model))
    set_checkpointing(model, False)
    assert not checkpointing_is_on(model)
    assert model.calls == [("enable", {"use_reentrant": False}), ("disable",)]


def test_new_names_are_preferred():
    model = New()
    model._on = False
    set_checkpointing(Wrapped(model), True, None)
    assert checkpointing_is_on(model) and not model.is_gradient_checkpointing
    set_checkpointing(model, False)
    assert not checkpointing_is_on(model)
    assert model.calls == [("new enable", None), ("new disable",)]
