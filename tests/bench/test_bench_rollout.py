"""bench/bench_rollout.py's per-configuration record on the tiny shape: the digests of the
samples and of the engine's log-probabilities, by which BENCHMARKS.md compares configurations
bit for bit, repeat for the same seed and change with it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_rollout  # noqa: E402


def test_digests_repeat_for_a_seed_and_change_with_it():
    model = bench_rollout.trainer_model("tiny")
    rows = bench_rollout.bench_prompts(4, tiny=True)
    record = []
    for seed in (7, 7, 8):
        result = bench_rollout.run_config(model, "graph_compiled+merged", "graph_compiled", rows,
                                          bench_rollout.recipe_sampling(8, seed), 1,
                                          lambda msg: None, merge_lora=True)
        assert result["status"] == "ok", result["status"]
        record.append((result["samples_sha256"], result["engine_logprobs_sha256"]))
    assert record[0] == record[1]
    assert record[2][0] != record[0][0] and record[2][1] != record[0][1]
