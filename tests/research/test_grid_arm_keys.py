"""A grid arm with a misspelt key (issue 60 item 7): the error names the key and the four an arm
may have, in one line, before anything runs."""
import json
import subprocess
import sys

import pytest

from opsd.research.grid import GridError, load_grid


@pytest.mark.parametrize("arm, key", [
    ({"evn": {"OPSD_CLIP_MODE": "token"}}, "evn"),
    ({"env": {}, "seed": 3, "flag": []}, "flag"),  # the first unknown key in sorted order
])
def test_a_misspelt_arm_key_is_named_with_the_allowed_ones(tmp_path, arm, key):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"arms": {"base": {"train": False}, "token": arm}}))
    message = f"{grid}: arm 'token': unknown key {key!r}; expected env, flags, recipe, train"
    with pytest.raises(GridError) as info:
        load_grid(str(grid))
    assert str(info.value) == message
    result = subprocess.run([sys.executable, "-m", "opsd.research.grid", str(grid), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n")
    assert not (tmp_path / "out").exists()


def test_an_arm_that_is_not_an_object_says_what_it_must_be(tmp_path):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"arms": {"base": {"train": False}, "token": ["env"]}}))
    with pytest.raises(GridError) as info:
        load_grid(str(grid))
    assert str(info.value) == f"{grid}: arm 'token' must be an object with train / recipe / env / flags"
