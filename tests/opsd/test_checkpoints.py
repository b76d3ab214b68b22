"""opsd.checkpoints: a checkpoint is staged, then renamed into place; a failed write leaves the
earlier ones and no partial copy (the trainer's runs: tests/test_trainer.py, tests/test_scripts.py)."""
import errno
import json

import pytest
import torch

from opsd import checkpoints, run_folder
from opsd.checkpoints import StagedCheckpoint
from opsd.ema_teacher import EMA_FILE
from opsd.run_folder import STAGING_DIR, CheckpointWriteError


def test_a_staged_checkpoint_moves_into_place_with_the_runs_files_and_rotates(tmp_path):
    (tmp_path / run_folder.CONFIG_FILE).write_text(json.dumps({"seed": 1}))
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
    stage = StagedCheckpoint(str(tmp_path), 3)
    assert stage.root == str(tmp_path / STAGING_DIR) and stage.final == str(tmp_path / "checkpoint-3")
    assert stage.final_folder(str(tmp_path / STAGING_DIR / "checkpoint-3")) == stage.final
    assert stage.final_folder(str(tmp_path)) is None  # the run folder's own (final) adapter
    with stage.writing():
        (tmp_path / STAGING_DIR / "checkpoint-3").mkdir(parents=True)
        stage.add_run_files({"shadow": torch.ones(2)})
    stage.move_into_place(save_total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", run_folder.CONFIG_FILE]
    assert json.loads((tmp_path / "checkpoint-3" / run_folder.CONFIG_FILE).read_text()) == {"seed": 1}
    assert torch.equal(torch.load(tmp_path / "checkpoint-3" / EMA_FILE)["shadow"], torch.ones(2))


def test_a_failed_write_removes_its_partial_copy_and_names_the_last_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")  # complete

    def full(name):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "pause_in_save", full)
    stage = StagedCheckpoint(str(tmp_path), 2)
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint-2 .* \(no space left on device\); "
                                                   r"earlier checkpoints are intact \(last: .*checkpoint-1\)"):
        with stage.writing():
            (tmp_path / STAGING_DIR / "checkpoint-2").mkdir(parents=True)
            stage.add_run_files(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # the staging folder is gone too
