"""The decode step's matrix products: torch (cuBLAS) against decode_matmul's split-K kernel.

    python bench/bench_decode_matmul.py --json OUT.json            # GPU
    python bench/bench_decode_matmul.py --sweep --json OUT.json    # and every launch of SWEEP, GATED_SWEEP
    python bench/bench_decode_matmul.py --products gate_up --kernels gated --sweep  # the gated kernel's launches

Qwen3-1.7B's products at the rollout's 32 rows, bf16, in the merged sampling copy's
layout: q/k/v stacked (2048 -> 4096), o (2048 -> 2048), gate/up stacked (2048 -> 12288),
down (6144 -> 2048), and the LM head (2048 -> 151936); the decode step ships the kernel
for o and down only (`decode_matmul.applies`), where it measured faster in the step.
Per product: 28 calls (one per layer, each its own weight, so nothing is served from L2;
2 for the LM head) recorded in one CUDA graph and replayed; microseconds per call, the weight read rate, and the largest
difference from a float64 product relative to the largest output. The kernel's time is
its own: the sum over splits that `decode_matmul.linear` adds fuses into the next
elementwise kernel in the compiled decode step ("split_k default" rows add it eagerly, a
kernel of its own, for comparison). torch's error column is the rounding of its bf16
output; the kernel's partials are float32.

With gate/up, `decode_matmul.silu_gated` ("gate_up gated" rows): the product with its SiLU
gating in one kernel against torch's product followed by the gating, eager (in the compiled
step the gating is one fused kernel after cuBLAS's product, so the plain gate/up product's
torch row is the closer comparison of the product's own time); its error is against SiLU(gate)
x up in float64 from the products rounded to bf16.
"""
from __future__ import annotations

import argparse
import sys

import common
import torch
import torch.nn.functional as F

from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels import triton_support as triton_support
from opsd.rollout.kernels.matmul import GatedConfig, LaunchConfig

ROWS, LAYERS = 32, 28
SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
          "lm_head": (151936, 2048)}  # name -> (n, k)
# (block_n, block_k, splits, warps, stages) measured with --sweep, for every shape where K divides
SWEEP = [LaunchConfig(bn, bk, s, 4, st) for bn, bk in ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128))
         for s in (1, 2, 4, 8) for st in (3, 5)]
# launches of decode_matmul.silu_gated's kernel measured with --sweep (gate/up only; no splits)
GATED_SWEEP = [GatedConfig(bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)
               for st in (3, 4, 5)]


def recorder(product: str, weights: list, reference: torch.Tensor, rows: list, log):
    """record(label, fn): time fn over every weight in one graph and append a row to `rows` (its
    error against `reference` from the first weight; a [splits, ...] output is summed first)."""
    n, k = weights[0].shape
    scale = reference.abs().max().item()

    def record(label, fn):
        try:
            out = fn(weights[0])
            out = out.sum(0) if out.dim() == 3 else out  # the split-K kernel's partials
            error = (out.double() - reference).abs().max().item() / scale
            us = common.graph_time_us([lambda w=w: fn(w) for w in weights])
        except Exception as exc:  # noqa: BLE001 - a launch the hardware refuses (shared memory, say)
            log(f"[matmul] {product} {label}: failed ({type(exc).__name__}: {str(exc)[:200]})")
            return
        row = {"product": product, "n": n, "k": k, "implementation": label, "us": us,
               "tb_per_s": n * k * 2 / us / 1e6, "relative_error": error}
        rows.append(row)
        log(f"[matmul] {product} {label}: {us:.2f} us, {row['tb_per_s']:.2f} TB/s, error {error:.1e}")

    return record


def measure(name: str, n: int, k: int, configs: list, gated_configs: list, log,
            kernels: tuple = ("split_k", "gated")) -> list[dict]:
    count = 2 if name == "lm_head" else LAYERS
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, k, device="cuda", generator=gen).bfloat16()
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16() for _ in range(count)]
    rows = []
    record = recorder(name, weights, x.double() @ weights[0].double().T, rows, log)
    record("torch", lambda w: F.linear(x, w))
    if "split_k" in kernels:
        default = decode_matmul.launch_config(n, k, triton_support.processors(x.device))
        record(f"split_k default {tuple(default)}", lambda w: decode_matmul.split_k_partials(x, w, default).sum(0))
        record(f"split_k default {tuple(default)} kernel only",
               lambda w: decode_matmul.split_k_partials(x, w, default))
        for config in configs:
            if k % (config.splits * config.block_k) or config == default:
                continue
            if name == "lm_head" and config.splits > 1:
                continue
            record(f"split_k {tuple(config)}", lambda w, c=config: decode_matmul.split_k_partials(x, w, c))
    # The product with its SiLU gating, against the product and the gating in torch.
    if name == "gate_up" and "gated" in kernels:
        rows += measure_gated(x, weights, gated_configs, log)
    return rows


def measure_gated(x, weights, configs, log) -> list[dict]:
    gate, up = (x.double() @ weights[0].double().T).bfloat16().double().chunk(2, dim=-1)
    rows = []
    record = recorder("gate_up gated", weights, gate * torch.sigmoid(gate) * up, rows, log)

    def torch_gated(w):
        g, u = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(g) * u

    record("torch (product, then SiLU and the product of the halves: eager, 3 kernels)", torch_gated)
    default = decode_matmul.GATED_CONFIG
    record(f"gated default {tuple(default)}", lambda w: decode_matmul.silu_gated_rows(x, w, default))
    for config in configs:
        if config != default:
            record(f"gated {tuple(config)}", lambda w, c=config: decode_matmul.silu_gated_rows(x, w, c))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--sweep", action="store_true", help="also every launch configuration of SWEEP (GATED_SWEEP "
                        "for the gated gate/up kernel)")
    parser.add_argument("--products", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--kernels", default="split_k,gated", help="comma-separated: split_k, gated (gate/up only)")
    opts = parser.parse_args(argv)
    products, kernels = opts.products.split(","), tuple(opts.kernels.split(","))
    if set(products) - set(SHAPES):
        parser.error(f"--products: unknown {', '.join(sorted(set(products) - set(SHAPES)))} (of {', '.join(SHAPES)})")
    if not torch.cuda.is_available():
        print("bench_decode_matmul: needs a CUDA GPU (the kernel's CPU check is tests/rollout/test_kernel_matmul.py)")
        return 1
    results = {"machine": common.machine(), "rows": ROWS, "products": []}
    for name in products:
        results["products"] += measure(name, *SHAPES[name], SWEEP if opts.sweep else [],
                                       GATED_SWEEP if opts.sweep else [], print, kernels)
    table = []
    for name in products + ["gate_up gated"] * ("gate_up" in products and "gated" in kernels):
        rows = [r for r in results["products"] if r["product"] == name]
        torch_row = next((r for r in rows if r["implementation"].startswith("torch")), None)
        kernel = "gated" if name == "gate_up gated" else "split_k"
        best = min((r for r in rows if r["implementation"].startswith(kernel)
                    and "kernel only" not in r["implementation"] and "default" not in r["implementation"]),
                   key=lambda r: r["us"], default=None)
        shipped = next((r for r in rows if r["implementation"].endswith("kernel only")
                        or r["implementation"].startswith("gated default")), None)

        def cell(row, label=""):
            return "failed" if row is None else f"{row['us']:.2f} ({row['tb_per_s']:.2f}){label}"

        table.append([name, cell(torch_row), cell(shipped),
                      "-" if best is None else cell(best, " " + best["implementation"].split(" ", 1)[1]),
                      "-" if shipped is None else f"{shipped['relative_error']:.1e}"])
    report = common.markdown_table(["product", "torch: us (TB/s)", "the kernel's default", "best of sweep",
                                    "default rel. error"], table)
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
