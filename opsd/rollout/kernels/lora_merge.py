"""One LoRA merge, W + scaling * B @ A rounded once into a weight of W's dtype: in torch, or in one Triton kernel.

`merged_student.MergedStudent.refresh` rebuilds every merged weight of the sampling copy
before each rollout. In torch a merge is a float32 copy of the base weight, an addmm of
B @ A into it and a copy back to bf16: about 20 bytes of memory traffic per weight element
and four operations per adapted projection, 196 of them for Qwen3-1.7B (15 ms a rollout call
on one H200, BENCHMARKS.md section 2.9). The kernel reads the base weight once and writes the
merged weight once, one launch per projection: each program multiplies a [block_n, r] tile of
B by an [r, block_k] tile of A in float32 (IEEE products, no TF32), scales it, adds the base
tile in float32 and rounds once, as torch does; only the order of the r terms' float32 sum
may differ.

`IMPLEMENTATION` "torch" (the default): never the kernel; "auto": the kernel for one active
adapter and half-precision weights on a CUDA GPU of compute capability 8.0 or newer, torch
otherwise (several adapters, float32 / float64 weights, CPU) and after the kernel failed once
(with a warning); "triton": the kernel wherever Triton
runs (its CPU interpreter: the tests, against float64). The kernel is not the default because
it has not run on a GPU yet: its refresh time against torch's is what `bench/bench_lora_merge.py`
measures (a float32 product of B and A without tensor cores may cost more than the memory
traffic it saves).
"""
from __future__ import annotations

import functools

import torch

from opsd.rollout.kernels import triton_support

IMPLEMENTATIONS = ("auto", "torch", "triton")
IMPLEMENTATION = "torch"  # "auto" once bench/bench_lora_merge.py has measured it faster on a GPU
BLOCK_N, BLOCK_K = 64, 128  # a program's tile of the weight

_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing the kernel in this process


def applies(out: torch.Tensor, base: torch.Tensor, adapters: list) -> bool:
    """Whether `merge` takes the kernel: one adapter, 2D weights with rows contiguous."""
    if IMPLEMENTATION not in IMPLEMENTATIONS:
        raise ValueError(f"lora merge {IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if IMPLEMENTATION == "torch" or len(adapters) != 1:
        return False
    a, b, _ = adapters[0]
    fits = (out.dim() == base.dim() == a.dim() == b.dim() == 2 and out.shape == base.shape
            and b.shape[0] == base.shape[0] and a.shape[1] == base.shape[1] and a.shape[0] == b.shape[1]
            and all(t.stride(-1) == 1 for t in (out, base, a, b)) and out.device == base.device == a.device == b.device
            and out.dtype in (torch.float16, torch.bfloat16, torch.float32))
    if IMPLEMENTATION == "triton":
        return fits
    return fits and out.dtype != torch.float32 and _AUTO_FAILURE is None and triton_support.runs_on(out)


def merge(out: torch.Tensor, base: torch.Tensor, adapters: list) -> None:
    """out <- base + sum of scaling * B @ A over `adapters` ((A [r, k], B [n, r], scaling) each),
    in float32 (float64 for float64 weights), rounded once to out's dtype. `out` may be a view
    (a stacked weight's rows); `base` is only read."""
    if applies(out, base, adapters):
        try:
            return triton_merge(out, base, *adapters[0])
        except Exception as exc:  # Triton's compile and launch errors share no base class
            if IMPLEMENTATION != "auto":
                raise
            global _AUTO_FAILURE
            _AUTO_FAILURE = triton_support.give_up("lora merge", exc, "torch's addmm")
    torch_merge(out, base, adapters)


def torch_merge(out: torch.Tensor, base: torch.Tensor, adapters: list) -> None:
    compute = torch.promote_types(base.dtype, torch.float32)
    merged = base.to(compute, copy=True)
    for a, b, scaling in adapters:
        merged.addmm_(b.to(compute), a.to(compute), alpha=scaling)
    out.copy_(merged)


def triton_merge(out: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    n, k = base.shape
    r = a.shape[0]
    grid = (-(-n // BLOCK_N), -(-k // BLOCK_K))
    _kernel()[grid](base, a, b, out, n, k, r, base.stride(0), a.stride(0), b.stride(0), out.stride(0), float(scaling),
                    R=max(16, triton_support.next_power_of_2(r)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, a_ptr, b_ptr, out_ptr, n, k, r, w_stride, a_stride, b_stride, out_stride, scaling,
               R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        j = tl.arange(0, R)
        in_rows, in_cols, in_rank = rows < n, cols < k, j < r
        b = tl.load(b_ptr + rows[:, None] * b_stride + j[None, :], mask=in_rows[:, None] & in_rank[None, :], other=0.0)
        a = tl.load(a_ptr + j[:, None] * a_stride + cols[None, :], mask=in_rank[:, None] & in_cols[None, :], other=0.0)
        delta = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        tile = rows[:, None] * w_stride + cols[None, :]
        inside = in_rows[:, None] & in_cols[None, :]
        w = tl.load(w_ptr + tile, mask=inside, other=0.0).to(tl.float32)
        merged = w + scaling * delta
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], merged.to(out_ptr.dtype.element_ty),
                 mask=inside)

    return kernel
