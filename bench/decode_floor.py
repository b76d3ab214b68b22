"""The rollout's floor: the decode step reduced to the reads it cannot avoid, measured.

    python bench/decode_floor.py --json $OUT/floor.json                    # GPU, Qwen3-1.7B shape
    python bench/decode_floor.py --shape qwen3-8b --json $OUT/floor8.json  # another shape (common.SHAPES)

A decode step of 32 rows must read every weight once (the layers' q/k/v, o, gate/up and down
products and the LM head) and each row's attended K/V columns. Everything else in the
engine's step (RMSNorms, residual adds, the embedding, the sampler, split-K's sums) is small
kernels. Per KV window of the rollout (`static_decode.decode_limits`: prompt width 192, 1024
new tokens, windows of 128), two variants are recorded in one CUDA graph per window and
replayed, each layer with its own buffers so nothing is served from L2:

- `kernels`: the step's products and attention only, by the engine's own kernels (torch for
  q/k/v and the LM head, `matmul.silu_gated_rows` for gate/up, `matmul.split_k_partials` for o
  and down, `attention.new_token_attention` for the new token's attention, reading each row's
  columns up to the window's middle, as the average step of a window does). Its total is what
  the rollout would take if every small kernel were gone and the products stayed as they are.
- `read`: the same bytes read by a Triton kernel that only loads them (and sums each
  program's share, so the loads stay): the rate the device gives a kernel that does nothing
  else, i.e. the step's floor at its bytes.

The rollout estimate of each variant is the sum over windows of 128 steps x its step time
(the prefill, about 40 ms at 1.7B, and the sampler are not in it). Bytes are counted by
`step_bytes` (tested against a Qwen3 model's own parameter count in tests/bench/test_bench_decode_floor.py).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import common
import torch
import torch.nn.functional as F

from opsd.rollout.kernels import attention as decode_attention
from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels import triton_support
from opsd.rollout.static_decode import decode_limits

ROWS, WIDTH, NEW_TOKENS, WINDOW, KV_HEADS, HEAD_DIM, VOCAB = 32, 192, 1024, 128, 8, 128, 151936


def products(shape: str) -> dict[str, tuple[int, int]]:
    """The decode step's weights as the merged sampling copy stacks them: name -> (n, k)."""
    hidden, intermediate, _, heads, _ = common.SHAPES[shape]
    return {"qkv": ((heads + 2 * KV_HEADS) * HEAD_DIM, hidden), "o": (hidden, heads * HEAD_DIM),
            "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}


def step_bytes(shape: str, rows: int, attended: int) -> dict[str, int]:
    """Bytes (bf16) one decode step reads: every layer's products, the LM head, and K and V of
    `attended` columns for each row and KV head of every layer."""
    layers = common.SHAPES[shape][2]
    hidden = common.SHAPES[shape][0]
    weights = layers * sum(n * k for n, k in products(shape).values()) * 2
    return {"weights": weights, "lm_head": VOCAB * hidden * 2,
            "kv": layers * 2 * rows * KV_HEADS * attended * HEAD_DIM * 2}


def windows(width: int = WIDTH, new_tokens: int = NEW_TOKENS, window: int = WINDOW) -> list[int]:
    return decode_limits(width, new_tokens, window)


def build(shape: str, length: int, device):
    """Per-layer weights and K/V caches (random bf16), the LM head, the step's inputs."""
    hidden, intermediate, layers, heads, _ = common.SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen) * scale).bfloat16()

    layer = [{name: rand(n, k, scale=k ** -0.5) for name, (n, k) in products(shape).items()} for _ in range(layers)]
    for weights in layer:
        weights["key"] = rand(ROWS, KV_HEADS, length, HEAD_DIM)
        weights["value"] = rand(ROWS, KV_HEADS, length, HEAD_DIM)
    angles = torch.arange(1, ROWS + 1, device=device)[:, None] * torch.rand(1, HEAD_DIM, device=device,
                                                                           generator=gen) * 7
    inputs = {"hidden": rand(ROWS, hidden), "attn": rand(ROWS, heads * HEAD_DIM), "inter": rand(ROWS, intermediate),
              "qkv": rand(ROWS, (heads + 2 * KV_HEADS) * HEAD_DIM), "norm": rand(HEAD_DIM).abs() + 0.5,
              "cos": angles.cos().bfloat16(), "sin": angles.sin().bfloat16(), "heads": heads}
    return layer, rand(VOCAB, hidden, scale=hidden ** -0.5), inputs


def kernel_calls(layer, lm_head, inputs, limit: int, attended: int) -> list:
    """The step's products and attention, by the engine's kernels, at one window."""
    processors = triton_support.processors(lm_head.device)
    mask = torch.zeros(ROWS, 1, 1, limit, dtype=torch.bool, device=lm_head.device)
    mask[..., :attended] = True
    slot = torch.tensor([attended - 1], device=lm_head.device)
    calls = []
    for w in layer:
        new = decode_attention.NewToken(inputs["qkv"], inputs["heads"], inputs["norm"], inputs["norm"], 1e-6,
                                        inputs["cos"], inputs["sin"], slot)
        o_config = decode_matmul.launch_config(*w["o"].shape, processors)
        down_config = decode_matmul.launch_config(*w["down"].shape, processors)
        calls += [lambda w=w: F.linear(inputs["hidden"], w["qkv"]),
                  lambda w=w, new=new: decode_attention.new_token_attention(
                      "auto", new, w["key"][:, :, :limit], w["value"][:, :, :limit], mask, HEAD_DIM ** -0.5),
                  lambda w=w, c=o_config: decode_matmul.split_k_partials(inputs["attn"], w["o"], c),
                  lambda w=w: decode_matmul.silu_gated_rows(inputs["hidden"], w["gate_up"], decode_matmul.GATED_CONFIG),
                  lambda w=w, c=down_config: decode_matmul.split_k_partials(inputs["inter"], w["down"], c)]
    return calls + [lambda: F.linear(inputs["hidden"], lm_head)]


READ_BLOCK = 8192  # elements a program of the streaming read loads (16 KB of bf16)


class StreamRead:
    """One launch of a Triton kernel that reads the first `columns` elements of each of `rows`
    rows (`row_stride` apart) and only sums each program's share (to `out`, so the loads stay)."""

    def __init__(self, tensor: torch.Tensor, rows: int, columns: int, row_stride: int):
        self.tensor, self.rows, self.columns, self.row_stride = tensor, rows, columns, row_stride
        self.chunks = -(-columns // READ_BLOCK)
        self.out = torch.empty(rows * self.chunks, device=tensor.device, dtype=torch.float32)
        self.bytes = rows * columns * tensor.element_size()

    @property
    def grid(self) -> tuple[int, int]:
        # chunks on axis 0, whose limit is 2**31 - 1: axis 1 allows 65,535 programs, fewer than
        # the 8B shape's LM head has chunks (75,968)
        return self.chunks, self.rows

    def __call__(self):
        _stream_read_kernel()[self.grid](self.tensor, self.out, self.columns, self.row_stride,
                                         BLOCK=READ_BLOCK, num_warps=8)


def read_calls(layer, lm_head, attended: int) -> list[StreamRead]:
    """The same bytes as `kernel_calls` reads, each tensor by one `StreamRead`."""
    calls = []
    for w in layer:
        calls += [StreamRead(w[name], 1, w[name].numel(), 0) for name in ("qkv", "o", "gate_up", "down")]
        for name in ("key", "value"):  # [rows, kv heads, length, dim]: each row and head's first `attended` columns
            rows, heads, length, dim = w[name].shape
            calls.append(StreamRead(w[name], rows * heads, attended * dim, length * dim))
    return calls + [StreamRead(lm_head, 1, lm_head.numel(), 0)]


@functools.cache
def _stream_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(x_ptr, out_ptr, columns, row_stride, BLOCK: tl.constexpr):
        chunk, row = tl.program_id(0), tl.program_id(1)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(x_ptr + row.to(tl.int64) * row_stride + offsets, mask=offsets < columns, other=0.0)
        tl.store(out_ptr + row * tl.num_programs(0) + chunk, tl.sum(values.to(tl.float32), 0))

    return stream_read


def step_us(calls, replays: int) -> float:
    """Microseconds of one pass over `calls`, recorded in one CUDA graph."""
    return common.graph_time_us(calls, repeats=replays) * len(calls)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(common.SHAPES), default="qwen3-1.7b")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--replayed-step-ms", type=float, default=None,
                        help="the engine's whole replayed decode step at 1,024 columns (bench_rollout.py "
                        "--profile-steps; 2.41 in run 54), compared in the report with the products and attention "
                        "at 1,024 attended columns")
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_floor: needs a CUDA GPU (its byte count is tested in tests/bench/test_bench_decode_floor.py)")
        return 1
    start = time.time()
    limits = windows()
    layer, lm_head, inputs = build(opts.shape, limits[-1], torch.device("cuda"))
    results = {"machine": common.machine(), "shape": opts.shape, "rows": ROWS, "width": WIDTH,
               "new_tokens": NEW_TOKENS, "window": WINDOW, "windows": []}
    previous = WIDTH
    for limit in limits:
        attended = (previous + limit) // 2  # the window's average step
        previous = limit
        reads = step_bytes(opts.shape, ROWS, attended)
        row = {"limit": limit, "attended": attended, "bytes": reads,
               "kernels_us": step_us(kernel_calls(layer, lm_head, inputs, limit, attended), opts.replays),
               "read_us": step_us(read_calls(layer, lm_head, attended), opts.replays)}
        total = sum(reads.values())
        row["kernels_tb_s"], row["read_tb_s"] = total / row["kernels_us"] / 1e6, total / row["read_us"] / 1e6
        results["windows"].append(row)
        print(f"[floor] window to {limit} (attended {attended}): kernels {row['kernels_us']:.0f} us "
              f"({row['kernels_tb_s']:.2f} TB/s), read {row['read_us']:.0f} us ({row['read_tb_s']:.2f} TB/s), "
              f"{total / 1e9:.2f} GB", flush=True)
        torch.cuda.synchronize()
    steps = NEW_TOKENS // len(limits)
    for key in ("kernels", "read"):
        results[f"{key}_decode_s"] = sum(r[f"{key}_us"] for r in results["windows"]) * steps / 1e6
    results["elapsed_s"] = time.time() - start
    table = [[f"to {r['limit']}", f"{sum(r['bytes'].values()) / 1e9:.2f}",
              f"{r['kernels_us']:.0f} ({r['kernels_tb_s']:.2f})", f"{r['read_us']:.0f} ({r['read_tb_s']:.2f})"]
             for r in results["windows"]]
    table.append([f"{NEW_TOKENS} steps (s)", "", f"{results['kernels_decode_s']:.3f}",
                  f"{results['read_decode_s']:.3f}"])
    report = common.markdown_table(["window", "GB a step", "products + attention: us (TB/s)",
                                    "a plain read of the same bytes: us (TB/s)"], table)
    if opts.replayed_step_ms:
        near = min(results["windows"], key=lambda r: abs(r["attended"] - 1024))
        report += (f"\n\nThe engine's whole replayed step at 1,024 columns: {opts.replayed_step_ms:.2f} ms; "
                   f"its products and attention alone at {near['attended']} attended columns: "
                   f"{near['kernels_us'] / 1000:.2f} ms.")
    return common.finish(results, opts.json, report)


if __name__ == "__main__":
    sys.exit(main())
