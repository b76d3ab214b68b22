"""Checkpoints written whole or not at all (docs/OUTPUTS.md, "What a checkpoint holds").

The Trainer writes `checkpoint-N` under the run folder's staging folder (`STAGING_DIR`); with
the run's own files added (`add_run_files`: the EMA teacher, the run's config) it is renamed
into place (`move_into_place`, which also rotates the oldest out). A run killed mid-save leaves
only the staging folder, which resume ignores (and the next run removes), so the newest
`checkpoint-N` is always complete. A failed write (disk full, not writable) removes its partial
copy and stops the run with CheckpointWriteError (`writing`); earlier checkpoints are untouched.

The trainer's `_save_checkpoint` drives one `StagedCheckpoint` per save, between its processes'
barriers; everything here runs on the process that saves, except `writing`, which every process
enters.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.trainer_utils import rotate_checkpoints

from opsd import run_folder
from opsd.ema_teacher import EMA_FILE
from opsd.run_folder import STAGING_DIR, CheckpointWriteError, pause_in_save, remove_if_empty


class StagedCheckpoint:
    """The save of `checkpoint-{step}` into `run_dir`: written at `staged`, renamed to `final`."""

    def __init__(self, run_dir: str, step: int):
        self.run_dir = run_dir
        self.name = f"checkpoint-{step}"
        self.root = os.path.join(run_dir, STAGING_DIR)  # what the Trainer takes as its output folder
        self.staged = os.path.join(self.root, self.name)
        self.final = os.path.join(run_dir, self.name)

    def final_folder(self, folder: str) -> str | None:
        """Where `folder` ends up if it is this checkpoint's staged copy (None if not)."""
        if os.path.dirname(os.path.abspath(folder)) != os.path.abspath(self.root):
            return None
        return os.path.join(self.run_dir, os.path.basename(folder))

    @contextmanager
    def writing(self) -> Iterator[None]:
        """The block writes the staged checkpoint; an OSError there removes the partial copy
        and is raised as CheckpointWriteError naming the last intact checkpoint."""
        try:
            yield
        except OSError as e:
            shutil.rmtree(self.staged, ignore_errors=True)
            remove_if_empty(self.root)
            last = run_folder.last_checkpoint(self.run_dir)
            reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise CheckpointWriteError(
                f"cannot write {self.name} in {self.run_dir} ({reason}); earlier checkpoints are intact "
                f"(last: {last[1] if last else 'none'})"
            ) from None

    def add_run_files(self, ema_state: dict | None) -> None:
        """What travels with each checkpoint besides the Trainer's files: the EMA teacher's
        state (when there is one) and the run's identity (run_config.json)."""
        if ema_state is not None:
            torch.save(ema_state, os.path.join(self.staged, EMA_FILE))
        config = os.path.join(self.run_dir, run_folder.CONFIG_FILE)
        if os.path.isfile(config):
            shutil.copy2(config, os.path.join(self.staged, run_folder.CONFIG_FILE))
        pause_in_save(self.name)  # the tests' fault injection: a kill here leaves only the staged copy

    def move_into_place(self, save_total_limit: int | None) -> None:
        """Rename the staged checkpoint to `final` (replacing one of the same step), then delete
        the oldest checkpoints beyond `save_total_limit` (transformers' rotation)."""
        if os.path.exists(self.final):
            shutil.rmtree(self.final)
        os.replace(self.staged, self.final)
        remove_if_empty(self.root)
        rotate_checkpoints(self.run_dir, save_total_limit=save_total_limit, use_mtime=False)
