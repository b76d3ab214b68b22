"""Fixtures shared by the opsd loss tests."""
import pytest

from opsd import chunked_loss


@pytest.fixture
def projected_rows(monkeypatch):
    """The row count of every lm-head projection the chunked losses make (forward and backward),
    in call order: a test asserts that no more than a chunk is ever projected at once."""
    rows = []
    project = chunked_loss._logits

    def recording(hidden, *args):
        rows.append(hidden.shape[0])
        return project(hidden, *args)

    monkeypatch.setattr(chunked_loss, "_logits", recording)
    return rows
