"""The decode step's draw: decode_sampler's Triton kernel at each search width and warp count, against torch's draw.

    python bench/bench_decode_sampler.py --json OUT.json    # GPU

32 rows of Qwen3's 151,936 bf16 logits (normal, standard deviation 3), the recipe's sampling
(top-k 20, top-p 0.95, temperature 1.1), blocks of 128 logits. Each variant's calls (10 draws,
each from its own logits, so nothing is served from L2) recorded in one CUDA graph and
replayed; microseconds per draw:
- "kernel": `decode_sampler.triton_sample` alone, after the blocks' maxima and log-sum-exp
  (the reduction the decode step runs before it either way), at `DIGIT_BITS` bits a pass of
  the search and `WARPS` warps;
- "torch": what the kernel replaces, `top_k_and_logsumexp`'s search in the best blocks and
  `torch_draw`, with the same reduction included (its own time is the last row: subtract it
  to compare with the kernel rows).
Every variant's tokens are checked against the first kernel variant's (same noise: the same
search result must give the same draw).
"""
from __future__ import annotations

import argparse
import sys

import common
import torch

from opsd.rollout.kernels import sampler as decode_sampler

ROWS, VOCAB, K, BLOCK, TEMPERATURE, TOP_P, DRAWS = 32, 151936, 20, 128, 1.1, 0.95, 10
# 8 bits a pass ([keys x 256] comparisons) did not finish inside run 53's 80 s limit on the H200
DIGIT_SWEEP, WARP_SWEEP = (1, 2, 4), (4, 8, 16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_sampler: needs a CUDA GPU (the kernel's CPU check is tests/rollout/test_kernel_sampler.py)")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = [(torch.randn(ROWS, VOCAB, device="cuda", generator=gen) * 3).bfloat16() for _ in range(DRAWS)]
    noise = [torch.rand(ROWS, K, device="cuda", generator=gen) for _ in range(DRAWS)]
    reduced = [decode_sampler.block_maxima_and_logsumexp(x, BLOCK)[1:] for x in logits]
    results = {"machine": common.machine(), "rows": ROWS, "vocab": VOCAB, "variants": []}
    saved = decode_sampler.DIGIT_BITS, decode_sampler.WARPS
    first_tokens = None

    def record(label, draw, **extra):
        nonlocal first_tokens
        tokens = draw(0)[0]
        first_tokens = tokens if first_tokens is None else first_tokens
        us = common.graph_time_us([lambda i=i: draw(i) for i in range(DRAWS)])
        row = {"variant": label, "us": us, "same_tokens": bool(torch.equal(tokens, first_tokens)), **extra}
        results["variants"].append(row)
        print(f"[sampler] {label}: {us:.2f} us, same tokens {row['same_tokens']}")

    try:
        for digit in DIGIT_SWEEP:
            for warps in WARP_SWEEP:
                decode_sampler.DIGIT_BITS, decode_sampler.WARPS = digit, warps
                record(f"kernel, {digit} bit(s) a pass, {warps} warps",
                       lambda i: decode_sampler.triton_sample(logits[i], *reduced[i], noise[i], K, BLOCK, TEMPERATURE,
                                                              TOP_P), digit_bits=digit, warps=warps)
    finally:
        decode_sampler.DIGIT_BITS, decode_sampler.WARPS = saved

    def torch_draw(i):
        values, index, logsumexp = decode_sampler.top_k_and_logsumexp(logits[i], K, BLOCK)
        return decode_sampler.torch_draw(values, index, logsumexp, noise[i], TEMPERATURE, TOP_P)

    record("torch: block search, top-k, draw (with the reduction)", torch_draw)
    record("the reduction alone (blocks' maxima and log-sum-exp)",
           lambda i: (decode_sampler.block_maxima_and_logsumexp(logits[i], BLOCK)[1],))
    results["variants"][-1]["same_tokens"] = None  # draws nothing
    rows = [[v["variant"], f"{v['us']:.2f}", {True: "yes", False: "NO", None: "-"}[v["same_tokens"]]]
            for v in results["variants"]]
    report = common.markdown_table(["variant", "us a draw", "same tokens as the first row"], rows)
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
