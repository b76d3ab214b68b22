"""bench/rollout_phases.py times the decode loop's own methods by wrapping them: checked
here on the tiny shape that the wrapped methods are the ones a rollout call runs (every
phase took time, the prefill lies inside the loop's run, the refresh and the run inside
the call) and that the originals are back afterwards."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import rollout_phases  # noqa: E402


def test_phases_add_up_to_the_call_and_the_methods_are_restored(tmp_path):
    before = [owner.__dict__[name] for _, owner, name in rollout_phases.PHASES]
    out = tmp_path / "phases.json"
    assert rollout_phases.main(["--shape", "tiny", "--new-tokens", "6", "--calls", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["calls"]
    assert row["new_tokens"] == 6
    assert min(row["refresh_ms"], row["prefill_ms"], row["decode_ms"]) > 0
    assert row["refresh_ms"] + row["prefill_ms"] + row["decode_ms"] <= row["call_ms"]
    assert [owner.__dict__[name] for _, owner, name in rollout_phases.PHASES] == before
