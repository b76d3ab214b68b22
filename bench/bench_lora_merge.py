"""The merged sampling copy's refresh: lora_merge's Triton kernel against torch's merge.

    python bench/bench_lora_merge.py --json OUT.json             # GPU: Qwen3-1.7B shape
    python bench/bench_lora_merge.py --shape tiny                # CPU smoke run (torch's merge only)

The trainer's LoRA model (bench/common.py: r=64 on every projection, float32 adapters, lora_B
drawn so that B @ A is not zero), its merged copy with q/k/v and gate/up stacked
(`merged_student.MergedStudent`, as the rollout builds it), and `refresh()` timed with the
device synchronised around it (median of `--repeats`, after one untimed refresh) for each
`lora_merge.IMPLEMENTATION`. Then the merged weights of the two are compared: the share of
elements that differ, and the largest difference in units of the weight's last place (ulp).
"""
from __future__ import annotations

import argparse
import sys
import time

import common
import torch

from opsd.rollout.kernels import lora_merge as lora_merge
from opsd.rollout.merged_student import MergedStudent


def timed_refresh(merged: MergedStudent, repeats: int) -> float:
    merged.refresh()
    times = []
    for _ in range(repeats):
        common.sync()
        start = time.perf_counter()
        merged.refresh()
        common.sync()
        times.append(time.perf_counter() - start)
    return common.median(times) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="qwen3-1.7b (default on a GPU) or tiny (default on a CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    shape = opts.shape or ("qwen3-1.7b" if torch.cuda.is_available() else "tiny")
    merged = MergedStudent(common.build_lora_model(shape))
    implementations = ("torch", "triton") if common.device().type == "cuda" else ("torch",)
    results = {"machine": common.machine(), "shape": shape, "weights": len(merged._targets), "refresh_ms": {}}
    weights = {}
    saved = lora_merge.IMPLEMENTATION
    try:
        for implementation in implementations:
            lora_merge.IMPLEMENTATION = implementation
            results["refresh_ms"][implementation] = timed_refresh(merged, opts.repeats)
            weights[implementation] = [w.detach().clone() for w, _, _ in merged._targets]
            print(f"[merge] {implementation}: refresh {results['refresh_ms'][implementation]:.2f} ms "
                  f"({len(merged._targets)} weights)")
    finally:
        lora_merge.IMPLEMENTATION = saved
    rows = [[name, f"{ms:.2f}"] for name, ms in results["refresh_ms"].items()]
    report = common.markdown_table(["lora_merge", "refresh (ms, median)"], rows)
    if len(weights) == 2:
        differ = total = 0
        worst = 0.0
        for got, expected in zip(weights["triton"], weights["torch"], strict=False):
            diff = (got.float() - expected.float()).abs()
            info = torch.finfo(expected.dtype)  # the dtype's spacing at each value: eps x 2^(exponent - 1)
            _, exponent = torch.frexp(expected.float().abs().clamp_min(info.tiny))
            ulp = torch.ldexp(torch.full_like(diff, info.eps), exponent - 1)
            differ += int((diff > 0).sum())
            total += diff.numel()
            worst = max(worst, float((diff / ulp).max()))
        results["differing_share"], results["max_ulps"] = differ / total, worst
        report += (f"\n\nmerged weights, triton against torch: {differ:,} of {total:,} elements differ "
                   f"({differ / total:.2e}), by at most {worst:.2f} ulp")
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
