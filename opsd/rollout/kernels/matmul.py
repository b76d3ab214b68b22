"""Matrix products of the decode step: a few rows (one new token per sequence) times a weight.

At 32 rows a decode step's projections read megabytes of weights to do a few MFLOPs, so
they are bound by how fast the weights stream. cuBLAS's kernels stream the products
whose output is narrow slowly: a [32, 2048] x [2048, 2048] product (Qwen3-1.7B's o
projection) gives too few output tiles to keep every multiprocessor reading, and for
the down projection (6144 -> 2048) cuBLAS splits the reduction and adds a second kernel.

`split_k`: a Triton kernel that splits the reduction dimension as well as the output
columns, so that every multiprocessor streams its own slice of the weight. Each program
multiplies the rows by a [block_k, block_n] tile of the weight at a time and writes its
float32 sum over its share of K to `partials[split]`; `linear` adds the splits
elementwise, in a fixed order (the same result from run to run, unlike atomic
additions), which in the compiled decode step fuses into the residual addition and
RMSNorm that follow, so the split costs no kernel of its own.

Where it is used (`applies`, under "auto"): one token per row (a decode step), at most
`MAX_ROWS` rows, half precision on a CUDA GPU of compute capability 8.0 or newer, and
weights whose reduction is at least as long as their output (k >= n):
Qwen3-1.7B's o and down projections, measured faster than cuBLAS in the decode step; the
wider products (q/k/v, gate/up: n > k) measured slower (BENCHMARKS.md section 2.5): q/k/v
stays with cuBLAS, gate/up goes through `silu_gated` below. Everything else (the prefill, CPU, float32) runs `F.linear`,
and so does everything after the kernel failed once under "auto" (with a warning).

`silu_gated`: the gated MLP's first half, SiLU(x @ gate.T) * (x @ up.T), from the stacked
[gate; up] weight of the merged copy in one Triton kernel (`GATED_IMPLEMENTATION`), where the
compiled step ran cuBLAS's product and then a kernel of its own for the gating. Each program
multiplies the rows by a block of gate columns and the same block of up columns, rounds both
sums to the inputs' dtype (as the product's output would be), and writes the gated block: one
kernel a layer fewer. No split of K (the gating needs the whole sums).

The tests run the same kernel sources in Triton's CPU interpreter against float64 products.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from opsd.rollout.kernels import triton_support

# "auto": split_k where it measured faster (see `applies`); "split_k": wherever the kernel
# can run (Triton's interpreter on CPU included: the tests). Read when a decode step is recorded.
IMPLEMENTATIONS = ("auto", "torch", "split_k")
IMPLEMENTATION = "auto"
MAX_ROWS = 64  # more rows (a prefill, a large decode batch) are not weight-bound: F.linear
# `silu_gated`: "auto" the kernel in a decode step on a GPU (see `gated_applies`); "torch" the
# product, then the gating; "triton" the kernel wherever Triton runs (its CPU interpreter: the tests).
GATED_IMPLEMENTATIONS = ("auto", "torch", "triton")
GATED_IMPLEMENTATION = "auto"


class LaunchConfig(NamedTuple):
    block_n: int  # output columns per program
    block_k: int  # reduction columns per loop iteration
    splits: int  # programs sharing one block of output columns, each a contiguous share of K
    warps: int
    stages: int


def launch_config(n: int, k: int, processors: int) -> LaunchConfig:
    """The launch for an [rows, k] x [k, n] product: 64-column blocks, and the reduction
    split until there are at least as many programs as multiprocessors, each keeping
    at least 4 iterations of 128 columns."""
    block_n, block_k = 64, 128
    blocks = -(-n // block_n)
    splits = 1
    while blocks * splits < processors and k // (2 * splits) >= 4 * block_k:
        splits *= 2
    return LaunchConfig(block_n, block_k, splits, 4, 4)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel for these operands under `IMPLEMENTATION`."""
    if IMPLEMENTATION == "torch":
        return False
    if IMPLEMENTATION not in IMPLEMENTATIONS:
        raise ValueError(f"decode matmul {IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    rows = x.numel() // x.shape[-1]
    n, k = weight.shape
    fits = 0 < rows <= MAX_ROWS and weight.dtype == x.dtype and weight.stride(-1) == 1
    if IMPLEMENTATION == "split_k":
        return fits
    one_token = x.dim() < 3 or x.shape[-2] == 1  # a decode step's rows, not a short prefill's
    return (fits and one_token and x.dtype in (torch.float16, torch.bfloat16) and k >= n
            and _AUTO_FAILURE is None and triton_support.runs_on(x))


_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing the kernel in this process


class GatedConfig(NamedTuple):
    """`silu_gated`'s launch: no split of K (the gating needs the whole sums)."""
    block_n: int  # gate columns per program (and as many up columns)
    block_k: int  # reduction columns per loop iteration
    warps: int
    stages: int


# 64 gate and 64 up columns a program (96 programs for Qwen3-1.7B's 6,144), 128-column K steps:
# the fastest of bench_decode_matmul's GATED_SWEEP on one H200 (BENCHMARKS.md section 2.11;
# 32 columns a program took 25.7 us against 15.4)
GATED_CONFIG = GatedConfig(64, 128, 4, 4)
_GATED_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing the gated kernel in this process


def gated_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `silu_gated` takes the kernel for rows `x` and a stacked [gate; up] `weight`."""
    if GATED_IMPLEMENTATION not in GATED_IMPLEMENTATIONS:
        raise ValueError(f"decode gated product {GATED_IMPLEMENTATION!r}: expected one of "
                         f"{', '.join(GATED_IMPLEMENTATIONS)}")
    if GATED_IMPLEMENTATION == "torch":
        return False
    rows = x.numel() // x.shape[-1]
    fits = (0 < rows <= MAX_ROWS and weight.dtype == x.dtype and weight.stride(-1) == 1 and weight.shape[0] % 2 == 0
            and weight.shape[1] == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16, torch.float32))
    if GATED_IMPLEMENTATION == "triton":  # float32 included (the tests; its products are IEEE, not TF32)
        return fits
    one_token = x.dim() < 3 or x.shape[-2] == 1
    return (fits and one_token and x.dtype != torch.float32 and _GATED_AUTO_FAILURE is None
            and triton_support.runs_on(x))


def _torch_silu_gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for `gate, up = F.linear(x, weight).chunk(2, -1)`, through the kernel
    where it `gated_applies` (the caller checks that the activation is SiLU)."""
    if not gated_applies(x, weight):
        return _torch_silu_gated(x, weight)
    n, k = weight.shape[0] // 2, weight.shape[1]
    out = _gated_op(x.reshape(-1, k), weight, *GATED_CONFIG)
    return out.view(*x.shape[:-1], n)


def silu_gated_rows(x: torch.Tensor, weight: torch.Tensor, config: GatedConfig) -> torch.Tensor:
    """The kernel itself: [rows, n] = SiLU(x @ gate.T) * (x @ up.T) for x [rows, k] and the
    stacked weight [gate; up] of [2n, k]; each product rounded to x's dtype before the gating."""
    rows, k = x.shape
    if weight.shape[1] != k or weight.shape[0] % 2:
        raise ValueError(f"decode gated product: x has {k} columns, the stacked weight's shape is "
                         f"{tuple(weight.shape)} (expected [2n, {k}])")
    if rows > MAX_ROWS:
        raise ValueError(f"decode gated product: {rows} rows, the kernel takes at most {MAX_ROWS}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    iterations = -(-k // config.block_k)
    _gated_kernel()[(-(-n // config.block_n),)](
        x, weight, out, rows, n, x.stride(0), weight.stride(0),
        K=k, ROWS=max(16, triton_support.next_power_of_2(rows)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        ITERATIONS=iterations, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.warps, num_stages=config.stages)
    return out


@torch.library.custom_op("opsd::decode_silu_gated", mutates_args=())
def _gated_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, warps: int,
              stages: int) -> torch.Tensor:
    """`silu_gated_rows` as an op torch.compile keeps whole. Should the kernel fail under
    "auto", the product and the gating run in torch, with a warning, and "auto" stops
    choosing the kernel for the process."""
    global _GATED_AUTO_FAILURE
    try:
        return silu_gated_rows(x, weight, GatedConfig(block_n, block_k, warps, stages))
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if GATED_IMPLEMENTATION != "auto":
            raise
        _GATED_AUTO_FAILURE = triton_support.give_up("decode gated product", exc, "F.linear and F.silu")
        return _torch_silu_gated(x, weight)


@_gated_op.register_fake
def _(x, weight, block_n, block_k, warps, stages):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the split-K kernel where it `applies`."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    config = launch_config(n, k, triton_support.processors(x.device))
    partials = _partials_op(rows, weight, *config)
    out = partials[0]
    for split in range(1, config.splits):  # elementwise, so it fuses into the next kernel when compiled
        out = out + partials[split]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def launch_settings() -> tuple:
    """What a recorded decode step bakes in from this module (part of its key)."""
    return (IMPLEMENTATION, GATED_IMPLEMENTATION, GATED_CONFIG, MAX_ROWS)


def split_k_partials(x: torch.Tensor, weight: torch.Tensor, config: LaunchConfig) -> torch.Tensor:
    """[config.splits, rows, n] float32 partial sums of x [rows, k] @ weight[n, k].T; their
    sum over the first dimension is the product."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"decode matmul: x has {k} columns, the weight {weight.shape[1]}")
    if rows > MAX_ROWS:
        raise ValueError(f"decode matmul: {rows} rows, the kernel takes at most {MAX_ROWS}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_n, block_k, splits, warps, stages = config
    share = -(-k // splits)
    share = -(-share // block_k) * block_k  # each split a whole number of iterations
    splits = -(-k // share)
    partials = torch.empty(config.splits, rows, n, dtype=torch.float32, device=x.device)
    if splits < config.splits:  # rounding left the last splits without columns
        partials[splits:].zero_()
    kernel = _kernel()
    # K, the share and the loop count are compile-time constants (Triton 3.6's CPU
    # interpreter, where the tests run the kernel, cannot loop to a run-time bound)
    kernel[(-(-n // block_n), splits)](
        x, weight, partials, rows, n, x.stride(0), weight.stride(0),
        K=k, SHARE=share, ROWS=max(16, triton_support.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        ITERATIONS=share // block_k, num_warps=warps, num_stages=stages)
    return partials


@torch.library.custom_op("opsd::decode_matmul_partials", mutates_args=())
def _partials_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, splits: int, warps: int,
                 stages: int) -> torch.Tensor:
    """`split_k_partials` as an op torch.compile keeps whole (its sum over splits fuses into
    the elementwise kernel that follows). Should the kernel fail under "auto", the product
    comes from F.linear as the first split, with a warning, and "auto" stops choosing the
    kernel for the process."""
    global _AUTO_FAILURE
    config = LaunchConfig(block_n, block_k, splits, warps, stages)
    try:
        return split_k_partials(x, weight, config)
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if IMPLEMENTATION != "auto":
            raise
        _AUTO_FAILURE = triton_support.give_up("decode matmul", exc, "F.linear")
        partials = torch.zeros(splits, x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        partials[0] = F.linear(x, weight).float()
        return partials


@_partials_op.register_fake
def _(x, weight, block_n, block_k, splits, warps, stages):
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, rows, n, x_stride, w_stride,
               K: tl.constexpr, SHARE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, ITERATIONS: tl.constexpr):
        """One (block of output columns, share of K): float32 sum over the share."""
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        r = tl.arange(0, ROWS)
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for i in range(ITERATIONS):
            k = split * SHARE + i * BLOCK_K + tl.arange(0, BLOCK_K)
            inside = k < K
            a = tl.load(x_ptr + r[:, None] * x_stride + k[None, :], mask=(r[:, None] < rows) & inside[None, :],
                        other=0.0)
            # the weight tile transposed: [BLOCK_K, BLOCK_N], contiguous along K
            b = tl.load(w_ptr + columns[None, :] * w_stride + k[:, None], mask=(columns[None, :] < n) & inside[:, None],
                        other=0.0)
            acc += tl.dot(a, b)
        out = out_ptr + split * rows * n + r[:, None] * n + columns[None, :]
        tl.store(out, acc, mask=(r[:, None] < rows) & (columns[None, :] < n))

    return kernel


@functools.cache
def _gated_kernel():
    """`silu_gated`'s Triton kernel, built on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, rows, n, x_stride, w_stride,
               K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               ITERATIONS: tl.constexpr, PRECISION: tl.constexpr):
        """One block of columns: its gate and up sums over all of K, then the gating
        (PRECISION: the products' for float32 inputs, "ieee" as F.linear; half inputs ignore it)."""
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, ROWS)
        gate = tl.zeros([ROWS, BLOCK_N], tl.float32)
        up = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for i in range(ITERATIONS):
            k = i * BLOCK_K + tl.arange(0, BLOCK_K)
            inside = k < K
            a = tl.load(x_ptr + r[:, None] * x_stride + k[None, :], mask=(r[:, None] < rows) & inside[None, :],
                        other=0.0)
            tile = w_ptr + columns[None, :] * w_stride + k[:, None]  # [BLOCK_K, BLOCK_N], contiguous along K
            mask = (columns[None, :] < n) & inside[:, None]
            gate += tl.dot(a, tl.load(tile, mask=mask, other=0.0), input_precision=PRECISION)
            up += tl.dot(a, tl.load(tile + n * w_stride, mask=mask, other=0.0), input_precision=PRECISION)
        # each product rounded to the output's dtype, as F.linear's would be, then the gating in float32
        dtype = out_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        gated = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
        tl.store(out_ptr + r[:, None] * n + columns[None, :], gated.to(dtype),
                 mask=(r[:, None] < rows) & (columns[None, :] < n))

    return kernel
