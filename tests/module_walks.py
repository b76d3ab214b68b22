"""Record the walks over a model's modules (`nn.Module.modules` / `named_modules`) that code in
given folders starts: peft's context managers walk the whole model on each use, which the
trainer avoids in every micro-batch (opsd/adapter_layers.py)."""
import sys
from pathlib import Path

import torch


def record_module_walks(monkeypatch, folders) -> list[str]:
    """Patch the walks (undo with `monkeypatch.undo()`); returns the list that fills with
    "file:line (function)" of each walk started in one of `folders` (recursion not counted)."""
    folders = [Path(f).resolve() for f in folders]
    walks: list[str] = []

    def recording(original):
        def walk(self, *args, **kwargs):
            caller = sys._getframe(1)
            name, path = caller.f_code.co_name, Path(caller.f_code.co_filename).resolve()
            # an installed package under a given folder (a .venv inside the checkout) is not that folder's code
            if name not in ("modules", "named_modules", "walk") and any(
                    f in path.parents and "site-packages" not in path.relative_to(f).parts for f in folders):
                walks.append(f"{path.name}:{caller.f_lineno} ({name})")
            return original(self, *args, **kwargs)
        return walk

    for name in ("modules", "named_modules"):
        monkeypatch.setattr(torch.nn.Module, name, recording(getattr(torch.nn.Module, name)))
    return walks
