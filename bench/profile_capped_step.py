"""Where one steady optimizer step of the real training CLI spends its time, host and GPU.

    python bench/profile_capped_step.py --out $OUT/p            # GPU (random Qwen3-1.7B shape)
    python bench/profile_capped_step.py --tiny --out /tmp/p      # CPU smoke run

Runs `opsd_train.py`'s `main` in this process, as `bench_capped.py` runs the CLI (shipped
defaults, micro-batch 4 x 8, completions up to 1024 tokens, the generated dataset), and
puts torch.profiler around step `--step` only: from the log of the step before to this
step's log, so the rollout, the 8 micro-batches, the optimizer and the logging are all in
it. The trainer is not changed; this script subclasses it to add the profiler callback
and marks the rollout and each micro-batch with `record_function`.

Reported (`summary.json`, `summary.txt`, and the log):
- the step's wall time under the profiler, split into the rollout (sampling and prompts)
  and the training part after it;
- for the training part: GPU busy time (the union of kernel intervals), so wall - busy is
  time the GPU waited on the host; kernel launches; host waits (synchronising CUDA calls);
  per micro-batch wall (the first one's without its rollout) and busy time; the longest GPU idle
  gaps and what the host ran then (the operation, or the operations on either side when it was in plain Python);
- the host's own time by operation and the kernels by CUDA time (torch.profiler tables).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import common
import torch
from bench_capped import write_random_model

ROLLOUT, MICRO_BATCH = "opsd/rollout", "opsd/micro_batch"
# CUDA runtime calls that make the host wait for the GPU (cudaMemcpy: the blocking copy, not cudaMemcpyAsync)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlapping kernels count once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def analyse(trace: dict, top_gaps: int = 12) -> dict:
    """Host/GPU split of the profiled step from a chrome trace's events (times in us)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    rollout = [e for e in marks if e["name"] == ROLLOUT]
    batches = sorted((e for e in marks if e["name"] == MICRO_BATCH), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    start = min(e["ts"] for e in events if e.get("cat") != "kernel")
    end = max(e["ts"] + e["dur"] for e in events)
    rollout_end = max((e["ts"] + e["dur"] for e in rollout), default=start)
    train = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["ts"] >= rollout_end]
    waits = [e for e in host if e["name"] in WAITS and e["ts"] >= rollout_end]

    def busy_between(lo, hi):
        return union_us([(max(a, lo), min(b, hi)) for a, b in train if b > lo and a < hi])

    def rollout_inside(b):  # the first micro-batch samples the step's rollouts (the Trainer prepares its inputs)
        return sum(max(0, min(r["ts"] + r["dur"], b["ts"] + b["dur"]) - max(r["ts"], b["ts"])) for r in rollout)

    # wall time without the rollout's; the GPU's busy time counts kernels after the rollout only
    per_batch = [{"wall_ms": (b["dur"] - rollout_inside(b)) / 1e3,
                  "gpu_busy_ms": busy_between(b["ts"], b["ts"] + b["dur"]) / 1e3} for b in batches]
    gaps = []
    ordered = sorted(train)
    for (_a0, a1), (b0, _) in zip(ordered, ordered[1:], strict=False):
        if b0 - a1 > 50:
            gaps.append((b0 - a1, a1))
    gaps.sort(reverse=True)

    by_end = sorted(host, key=lambda e: e["ts"] + e["dur"])
    ends = [e["ts"] + e["dur"] for e in by_end]
    by_start = sorted(host, key=lambda e: e["ts"])
    starts = [e["ts"] for e in by_start]

    def host_at(t):  # what the host ran then: the op covering t, else the ops on either side of t
        covering = [e for e in host if e["ts"] <= t <= e["ts"] + e["dur"]]
        if covering:
            return "in " + min(covering, key=lambda e: e["dur"])["name"][:70]
        before, after = bisect.bisect_left(ends, t) - 1, bisect.bisect_right(starts, t)
        return (f"in no op, after {by_end[before]['name'][:50] if before >= 0 else '-'}, "
                f"before {by_start[after]['name'][:50] if after < len(by_start) else '-'}")

    train_wall = end - rollout_end
    return {
        "step_wall_ms": (end - start) / 1e3,
        "rollout_wall_ms": sum(e["dur"] for e in rollout) / 1e3,
        "training_wall_ms": train_wall / 1e3,
        "training_gpu_busy_ms": union_us(train) / 1e3,
        "training_gpu_idle_ms": (train_wall - union_us(train)) / 1e3,
        "training_kernels": len(train),
        "training_host_waits": {name: sum(1 for w in waits if w["name"] == name) for name in WAITS},
        "training_host_wait_ms": sum(w["dur"] for w in waits) / 1e3,
        "micro_batches": per_batch,
        "largest_gpu_gaps": [{"gap_ms": g / 1e3, "at_ms_after_rollout": (t - rollout_end) / 1e3,
                              "host": host_at(t + g / 2)} for g, t in gaps[:top_gaps]],
        "gpu_gaps_over_50us_ms": sum(g for g, _ in gaps) / 1e3,
    }


def profiled_trainer(step: int, out_dir: Path, summary: dict):
    """OPSDTrainer with the profiler around optimizer step `step` and the rollout / micro-batches marked."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import TrainerCallback

    import opsd_trainer

    class Profiler(TrainerCallback):
        prof = None

        def on_log(self, args, state, control, **kwargs):
            common.sync()
            if state.global_step == step - 1 and self.prof is None:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self.prof = profile(activities=activities)
                self.prof.__enter__()
                self.started = time.perf_counter()
            elif state.global_step == step and self.prof is not None:
                wall = time.perf_counter() - self.started
                self.prof.__exit__(None, None, None)
                write_report(self.prof, wall, out_dir, summary)
                self.prof = None

    class ProfiledTrainer(opsd_trainer.OPSDTrainer):
        def __init__(self, *args, callbacks=None, **kwargs):
            super().__init__(*args, callbacks=[*(callbacks or []), Profiler()], **kwargs)

        def _generate_and_score_completions(self, inputs):
            with record_function(ROLLOUT):
                return super()._generate_and_score_completions(inputs)

        def training_step(self, *args, **kwargs):
            with record_function(MICRO_BATCH):
                return super().training_step(*args, **kwargs)

    return ProfiledTrainer


def write_report(prof, wall_s: float, out_dir: Path, summary: dict) -> None:
    trace_path = out_dir / "step_trace.json"
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    with gzip.open(out_dir / "step_trace.json.gz", "wt") as f:  # for chrome://tracing / perfetto
        json.dump(trace, f)
    trace_path.unlink()
    summary.update(analyse(trace), wall_s_perf_counter=wall_s)
    averages = prof.key_averages()
    cuda = torch.cuda.is_available()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80)]
    if cuda:
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=80))
    (out_dir / "tables.txt").write_text("By the host's own time:\n" + tables[0]
                                       + ("\n\nBy CUDA time:\n" + tables[1] if cuda else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="embedded tiny model shape, CPU smoke run")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--step", type=int, default=4, help="the optimizer step to profile (after the first)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--completion", type=int, default=None, help="default 1024 (tiny: 16)")
    parser.add_argument("--trainer-args", default="", help="more opsd_train.py flags, one string")
    opts = parser.parse_args(argv)
    shape = "tiny" if opts.tiny or not torch.cuda.is_available() else "qwen3-1.7b"
    completion = opts.completion or (16 if shape == "tiny" else 1024)
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="opsd_profile_"))
    write_random_model(work / "model", shape)

    import opsd_train
    import opsd_trainer

    summary: dict = {"shape": shape, "machine": common.machine(), "step": opts.step, "micro_batch": opts.micro_batch,
                     "completion": completion, "trainer_args": opts.trainer_args}
    opsd_trainer.OPSDTrainer = profiled_trainer(opts.step, opts.out, summary)  # what opsd_train.train builds
    rc = opsd_train.main([
        "--model_name_or_path", str(work / "model"), "--dataset_name", "tiny", "--output_dir", str(work / "run"),
        "--max_steps", str(opts.step), "--per_device_train_batch_size", str(opts.micro_batch),
        "--gradient_accumulation_steps", str(32 // opts.micro_batch), "--max_completion_length", str(completion),
        "--save_strategy", "no", "--logging_steps", "1", "--report_to", "none", *shlex.split(opts.trainer_args),
    ])
    if "step_wall_ms" not in summary:
        print(f"[profile_step] no profile (opsd_train exit {rc})", flush=True)
        return 1
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"[profile_step] {shape} mb {opts.micro_batch} step {opts.step} ({summary['machine']})",
        f"[profile_step] step {summary['step_wall_ms']:.0f} ms under the profiler: rollout "
        f"{summary['rollout_wall_ms']:.0f} ms, training part {summary['training_wall_ms']:.0f} ms, of which GPU busy "
        f"{summary['training_gpu_busy_ms']:.0f} ms (idle {summary['training_gpu_idle_ms']:.0f} ms), "
        f"{summary['training_kernels']} kernels, host waits {summary['training_host_waits']} "
        f"({summary['training_host_wait_ms']:.0f} ms)",
    ]
    for i, mb in enumerate(summary["micro_batches"]):
        lines.append(f"[profile_step]   micro-batch {i}: wall {mb['wall_ms']:.1f} ms, "
                     f"GPU busy {mb['gpu_busy_ms']:.1f} ms")
    for gap in summary["largest_gpu_gaps"]:
        lines.append(f"[profile_step]   GPU idle {gap['gap_ms']:.2f} ms at +{gap['at_ms_after_rollout']:.0f} ms: "
                     f"host {gap['host']}")
    (opts.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
