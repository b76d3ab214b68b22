"""bench/profile_capped_step.py's reading of a profiler trace: the GPU's busy time (kernel
intervals that overlap count once), the split at the rollout, the waits and the idle gaps."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import profile_capped_step as prof  # noqa: E402


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_counts_overlapping_intervals_once():
    assert prof.union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 15 + 5
    assert prof.union_us([]) == 0


def test_analyse_splits_the_step_at_the_rollout():
    trace = {"traceEvents": [
        event("user_annotation", prof.MICRO_BATCH, 0, 1000),
        event("user_annotation", prof.ROLLOUT, 0, 300),
        event("kernel", "sampling", 10, 200),  # during the rollout: not the training part's
        event("cpu_op", "aten::embedding", 310, 5),
        event("kernel", "a", 320, 100),
        event("kernel", "b", 400, 100),  # overlaps a: busy 320-500
        event("cuda_runtime", "cudaStreamSynchronize", 500, 50),
        event("cuda_runtime", "cudaMemcpyAsync", 560, 5),  # not a wait
        event("cpu_op", "aten::mm", 900, 10),
        event("kernel", "c", 900, 100),  # the GPU idled 500-900 while the host was in no op
    ]}
    out = prof.analyse(trace)
    assert out["rollout_wall_ms"] == 0.3 and out["training_wall_ms"] == 0.7
    assert out["training_gpu_busy_ms"] == 0.28 and out["training_kernels"] == 3
    assert out["training_host_waits"]["cudaStreamSynchronize"] == 1 and out["training_host_waits"]["cudaMemcpy"] == 0
    assert out["micro_batches"] == [{"wall_ms": 0.7, "gpu_busy_ms": 0.28}]  # the rollout's 0.3 ms left out
    (gap,) = out["largest_gpu_gaps"]
    assert gap["gap_ms"] == 0.4 and gap["host"] == "in no op, after cudaMemcpyAsync, before aten::mm"
