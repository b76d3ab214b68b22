"""The sampler's top-k of a decode step: torch against decode_topk's Triton kernels.

    python bench/bench_decode_topk.py --json OUT.json     # GPU

The rollout's shape: 32 rows x 151,936 bf16 logits (Qwen3's vocabulary), top 20, as the
decode step needs them: the k largest as float32 with their ids, and each row's
log-sum-exp. torch: `logits.float()`, `topk`, `logsumexp` (the decode step before
decode_topk); triton: `decode_topk.triton_top_k` at several chunk sizes. Each call is
recorded in a CUDA graph and replayed; microseconds per call, and checks against torch:
values equal, ids equal outside ties, largest log-sum-exp difference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import torch

import decode_topk

ROWS, VOCAB, K = 32, 151936, 20
CHUNKS = (1024, 2048, 4096, 8192)


def graph_time_us(call, repeats: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def torch_top_k(logits):
    x = logits.float()
    values, ids = x.topk(K, dim=-1)
    return values, ids, x.logsumexp(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_topk: needs a CUDA GPU (the kernels' CPU check is tests/test_decode_topk.py)")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, device="cuda", generator=gen) * 3).bfloat16()
    expected = torch_top_k(logits)
    next_value = logits.float().topk(K + 1, dim=-1).values[:, -1]  # a tie across the k-th place counts too
    results = {"machine": common.machine(), "rows": ROWS, "vocab": VOCAB, "k": K, "runs": []}
    table = []
    for name, call in [("torch", lambda: torch_top_k(logits))] + [
            (f"triton chunk {c}", lambda c=c: decode_topk.triton_top_k(logits, K, c)) for c in CHUNKS]:
        values, ids, lse = call()
        same_values = torch.equal(values, expected[0])
        # where a value repeats inside a row's top k (bf16 ties), torch's id order is unspecified
        after = torch.cat([values[:, 1:], next_value[:, None]], 1)
        before = torch.cat([torch.full_like(values[:, :1], float("inf")), values[:, :-1]], 1)
        tied = (values == after) | (values == before)
        same_ids = bool(((ids == expected[1]) | tied).all())
        lse_error = (lse.double() - logits.double().logsumexp(-1)).abs().max().item()
        us = graph_time_us(call)
        results["runs"].append({"implementation": name, "us": us, "values_equal": same_values,
                                "ids_equal_outside_ties": same_ids, "logsumexp_max_abs_error": lse_error})
        print(f"[topk] {name}: {us:.1f} us, values equal {same_values}, ids equal outside ties {same_ids}, "
              f"log-sum-exp error {lse_error:.1e}", flush=True)
        table.append([name, f"{us:.1f}", same_values, same_ids, f"{lse_error:.1e}"])
    report = common.markdown_table(["implementation", "us per call", "values = torch's", "ids = torch's (outside ties)",
                                    "log-sum-exp max abs error vs float64"], table)
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
