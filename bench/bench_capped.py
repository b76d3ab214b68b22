"""A few optimizer steps of the real training CLI, timed, to extrapolate a capped run.

    python bench/bench_capped.py --json $OUT/capped.json            # GPU, Qwen3-1.7B shape
    python bench/bench_capped.py --shape qwen3-8b --micro-batches 2  # GPU, another shape (common.SHAPES)
    python bench/bench_capped.py --trainer-args "" --trainer-args "--use_vllm true --vllm_mode colocate"
                                                   # the own engine, then vLLM rollouts, on one model
    python bench/bench_capped.py --tiny                              # CPU smoke run

Writes a random-init model of the shape (bf16; default Qwen3-1.7B) with the project's Qwen3
tokenizer to a folder, then runs `opsd_train.py` on it exactly as
`train_capped.sh` does on one GPU (the OPSDConfig defaults, which are the released
recipe; global batch 32 = micro-batch x accumulation; completions up to 1024
tokens; the generated dataset; no --recipe, whose values would override
--max_completion_length) for
`--steps` optimizer steps, once per micro-batch size. Each `[OPSD kl] step=N`
line is time-stamped when it appears, and the trainer's `timing/rollout_s` (the
sampling's wall time) is read back from `metrics.jsonl`. The early steps also compile
(the rollout loop once per prompt-width bucket, the decoder layers once per shape
family); the capped run is extrapolated as (time to the last measured step) +
(100 - steps) x the median step after the first: compilation seen so far is counted,
compilation a longer run may still meet is not. (Before 2026-12-01 the fastest step
stood in for the median; BENCHMARKS.md says which figures used it.)
A random model almost never samples EOS, so every completion runs to the cap:
the worst case of a real run. On a GPU, the device's used memory (nvidia-smi, every 0.5 s,
all processes: the trainer and, colocated, vLLM) is recorded per run: its peak, and its value
when the first step is logged.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import torch

from opsd.jsonl import read_jsonl

STEP_LINE = re.compile(r"\[OPSD kl\] step=(\d+)")


def write_random_model(folder: Path, shape: str) -> None:
    from opsd import tiny_default
    model = common.build_base_model(shape)
    model.save_pretrained(folder)
    tiny_default.build_qwen3_tokenizer().save_pretrained(folder)
    del model
    common.free_memory()


def run_cli(model_dir: Path, out_dir: Path, micro_batch: int, steps: int, completion: int, log_path: Path,
            timeout_s: float, processes: int = 1, extra: tuple[str, ...] = (), tree: Path | None = None,
            inductor: dict | None = None) -> dict:
    """opsd_train.py for `steps` steps; returns the wall time at which each step's log line appeared.

    One process runs the script directly; several go through `accelerate launch`
    (one per GPU), as train_capped.sh does. `tree`: the checkout whose opsd_train.py runs
    (default: this one). `inductor`: torch._inductor.config settings for the whole process
    (one process only), made before the script runs."""
    launcher = [sys.executable]
    if inductor:
        if processes > 1:
            raise SystemExit("--inductor takes one process")
        settings = "; ".join(f"config.{key} = {value!r}" for key, value in inductor.items())
        launcher += ["-c", f"import runpy, sys, torch._inductor.config as config; {settings}; "
                           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"]
    if processes > 1:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if not torch.cuda.is_available():
            launcher.append("--cpu")
    cmd = [
        *launcher, "opsd_train.py", "--model_name_or_path", str(model_dir), "--dataset_name", "tiny",
        "--output_dir", str(out_dir), "--max_steps", str(steps),
        "--per_device_train_batch_size", str(micro_batch),
        "--gradient_accumulation_steps", str(32 // (micro_batch * processes)),
        "--max_completion_length", str(completion), "--save_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", *extra,
    ]
    start = time.time()
    stamps: dict[int, float] = {}
    memory = _MemoryPoll()
    with open(log_path, "w", buffering=1) as log:  # line-buffered: a run killed from outside keeps its log
        proc = subprocess.Popen(cmd, cwd=tree or common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        watchdog = threading.Timer(timeout_s, proc.kill)  # also ends a run that hangs without output
        watchdog.start()
        try:
            for line in proc.stdout:
                now = time.time() - start
                log.write(f"{now:9.2f} {line}")
                match = STEP_LINE.search(line)
                if match:
                    stamps[int(match.group(1))] = now
                    memory.mark(int(match.group(1)))
                    print(f"[capped] mb={micro_batch} step {match.group(1)} at {now:.1f} s", flush=True)
            rc = proc.wait()
        finally:
            watchdog.cancel()
            memory.stop()
    metrics = out_dir / "metrics.jsonl"  # the trainer's timing/rollout_s per logged step
    records = [record for _, record in read_jsonl(metrics, RuntimeError)] if metrics.exists() else []
    rollout_s = {int(r["step"]): r["timing/rollout_s"] for r in records if "timing/rollout_s" in r}
    return {"micro_batch": micro_batch, "processes": processes, "rc": rc, "step_stamps": stamps,
            "rollout_s": rollout_s, "wall_s": time.time() - start, **memory.summary()}


class _MemoryPoll:
    """The GPU's used memory (nvidia-smi, MiB, every `period` s) while a run lasts: its peak, and
    its value at each logged step. Empty where nvidia-smi is missing (a CPU machine)."""

    def __init__(self, period: float = 0.5):
        import shutil

        self.peak_mib, self.at_step, self._stop = None, {}, threading.Event()
        self._last = None
        if shutil.which("nvidia-smi") and torch.cuda.is_available():
            threading.Thread(target=self._run, args=(period,), daemon=True).start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "--id=0"], capture_output=True, text=True, timeout=10).stdout
                self._last = float(out.split()[0])
                self.peak_mib = max(self.peak_mib or 0.0, self._last)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self._stop.wait(period)

    def mark(self, step: int) -> None:
        if self._last is not None:
            self.at_step[step] = self._last

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict:
        if self.peak_mib is None:
            return {}
        return {"gpu_used_peak_gib": self.peak_mib / 1024,
                "gpu_used_at_step_gib": {k: v / 1024 for k, v in self.at_step.items()}}


def summarize(run: dict, steps_total: int = 100) -> dict:
    stamps = [run["step_stamps"][k] for k in sorted(run["step_stamps"])]
    if len(stamps) < 2:
        return {**run, "status": f"too few steps logged ({len(stamps)})"}
    step_times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    median = statistics.median(step_times)
    later_rollouts = [s for step, s in run.get("rollout_s", {}).items() if step > 1]
    # the steps not run are extrapolated at the median step (the fastest would flatter)
    return {**run, "status": "ok", "first_step_s": stamps[0], "step_times_s": step_times,
            "fastest_step_s": min(step_times), "median_step_s": median,
            "median_rollout_s": statistics.median(later_rollouts) if later_rollouts else None,
            "measured_s": stamps[-1],
            "extrapolated_100_steps_min": (stamps[-1] + (steps_total - len(stamps)) * median) / 60}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="embedded tiny model shape, CPU smoke run")
    parser.add_argument("--shape", choices=common.SHAPE_CHOICES, default=None,
                        help="default: qwen3-1.7b on CUDA, tiny otherwise")
    parser.add_argument("--micro-batches", default="4,16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--num-processes", type=int, default=1, help="> 1: accelerate launch, one process per GPU")
    parser.add_argument("--completion", type=int, default=None, help="default 1024 (tiny: 16)")
    parser.add_argument("--timeout-s", type=float, default=280,
                        help="per run of the CLI; writing the model comes first (about 20 s on an H200), so an outer "
                        "time limit needs that much more")
    parser.add_argument("--trainer-args", action="append", default=None,
                        help="more opsd_train.py flags, one string (e.g. '--activation_checkpointing false'; "
                        "a single flag as --trainer-args=--flag); repeatable: one run per string and micro-batch, "
                        "in order, on the one model written")
    parser.add_argument("--tree", type=Path, default=None,
                        help="run opsd_train.py of another checkout (e.g. a baseline commit unpacked from "
                        "`git archive`): an A/B of two commits on one machine")
    common.add_inductor_argument(parser, "in the CLI's process")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    shape = "tiny" if opts.tiny or not torch.cuda.is_available() else common.default_shape(opts.shape)
    variants = opts.trainer_args or [""]
    completion = opts.completion or (16 if shape == "tiny" else 1024)
    work = Path(tempfile.mkdtemp(prefix="opsd_capped_"))
    out_dir = Path(opts.json).parent if opts.json else work
    out_dir.mkdir(parents=True, exist_ok=True)
    write_random_model(work / "model", shape)
    results = {"shape": shape, "machine": common.machine(), "completion": completion,
               "trainer_args": variants, "inductor": opts.inductor, "tree": str(opts.tree or common.ROOT),
               "runs": []}
    for index, extra in enumerate(variants):
        for mb in (int(x) for x in opts.micro_batches.split(",")):
            if 32 % (mb * opts.num_processes):
                raise SystemExit(f"global batch 32 is not divisible by micro-batch {mb} x {opts.num_processes} "
                                 "processes")
            tag = f"mb{mb}_np{opts.num_processes}" + (f"_v{index}" if len(variants) > 1 else "")
            run = run_cli(work / "model", work / f"run-{tag}", mb, opts.steps, completion,
                          out_dir / f"capped_{tag}.log", opts.timeout_s, opts.num_processes,
                          tuple(shlex.split(extra)), opts.tree, common.inductor_settings(opts.inductor))
            results["runs"].append({**summarize(run), "trainer_args": extra})
            common.write_json(opts.json, results)
    rows = []
    for r in results["runs"]:
        if r["status"] == "ok":
            rollout = r.get("median_rollout_s")
            rows.append([r["trainer_args"] or "defaults", r["processes"], r["micro_batch"],
                         32 // (r["micro_batch"] * r["processes"]),
                         f"{r['first_step_s']:.1f}",
                         ", ".join(f"{t:.1f}" for t in r["step_times_s"]), f"{r['fastest_step_s']:.2f}",
                         f"{r['median_step_s']:.2f}", "" if rollout is None else f"{rollout:.2f}",
                         f"{r['extrapolated_100_steps_min']:.1f}",
                         f"{r['gpu_used_peak_gib']:.1f}" if "gpu_used_peak_gib" in r else "-"])
        else:
            rows.append([r["trainer_args"] or "defaults", r["processes"], r["micro_batch"],
                         32 // (r["micro_batch"] * r["processes"]), r["status"], f"rc={r['rc']}", "", "", "", "", ""])
    table = common.markdown_table(
        ["trainer flags", "processes", "micro-batch", "accumulation", "start to step 1 (s)", "later steps (s)",
         "fastest step (s)", "median step (s)", "its rollout, median (s)", "100 steps at the median step (min)",
         "GPU memory used, peak (GiB)"], rows)
    flags = f", code of {opts.tree}" if opts.tree else ""
    flags += f", inductor {', '.join(opts.inductor)}" if opts.inductor else ""
    report = (f"## Capped run, {shape}, 32 x {completion} per step, `opsd_train.py` defaults and the flags of each "
              f"row{flags} "
              f"({results['machine']})\n\n{table}")
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
