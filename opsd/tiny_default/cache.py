"""The embedded default's cache: artifacts are built once into `cache_dir()`.

Each artifact is written under a temporary name and renamed into place, so
concurrent processes never see a half-written file or folder.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # opsd/tiny_default/ -> the repository

# Bump when a builder changes: cached artifacts carry it in their names, so a
# stale cache from an older design is never picked up.
BUILD_VERSION = "v2"


def cache_dir() -> Path:
    """$OPSD_CACHE, else <repo>/.cache/opsd; created on demand."""
    path = Path(os.environ.get("OPSD_CACHE") or REPO_ROOT / ".cache" / "opsd")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, then os.replace (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cached files are shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_file(path: Path, build: Callable[[], bytes]) -> Path:
    if not path.is_file():
        write_file_atomic(path, build())
    return path


def _make_shareable(folder: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; cached artifacts are shared."""
    os.chmod(folder, 0o755)
    for entry in folder.iterdir():
        os.chmod(entry, 0o755 if entry.is_dir() else 0o644)


def cached_folder(path: Path, build: Callable[[Path], None]) -> Path:
    """Build a multi-file artifact into a temp sibling folder, then rename it into
    place: readers see either no folder or a complete one. If another process
    won the race, its (identical) folder is kept and ours is discarded."""
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        build(tmp)
        _make_shareable(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its copy into place first
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def save_model_folder(model, folder: Path) -> None:
    """The model's config, generation config and weights in `folder`, laid out as
    `save_pretrained` lays them out, written by this process whatever its rank.

    transformers' `save_pretrained` writes nothing on a rank other than 0 once
    torch.distributed is initialised; when several ranks of a launch start with a cold
    cache, the rank that renames its folder into place first may be one of those, and
    the cache would hold a model folder without weights. Tensors that share storage
    (tied embeddings) are stored once, under their first name, as `save_pretrained` does.
    """
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
