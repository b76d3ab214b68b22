"""The sampler's top-k: the k largest logits of each row, their vocabulary ids, and the
row's log-sum-exp, from one read of the logits.

Why: a decode step samples from the top 20 of 151,936 logits per row (the recipe's
top_k). torch's `topk` on them is a radix select of several passes, and the sampler
also needs the float32 logits (a copy) and their log-sum-exp (for the log-probability of
the sampled token): BENCHMARKS.md section 2.5 has these at about 0.12 ms of a 2.8 ms
decode step on an H200. The `triton` implementation reads the logits once, in their
own dtype:
1. one program per (row, chunk of `CHUNK` columns) keeps the chunk's top k (a bitonic
   top-k over keys that pack the value's order-preserving bits above the column, so ties
   go to the lower vocabulary id) and its max and sum of exponentials;
2. one program per row merges the chunks' candidates into the row's top k and the
   chunks' sums into the log-sum-exp.
The values are the logits converted to float32 exactly (no arithmetic), so they equal
torch's `topk` values; the ids differ from torch's only among tied logits, where torch's
order is unspecified.

`top_k(logits, k)` dispatches: the kernels for CUDA inputs when `IMPLEMENTATION` allows
("auto": k at most `MAX_K`, Triton importable), torch otherwise. The tests run the
kernels' source in Triton's CPU interpreter against torch and float64.
"""
from __future__ import annotations

import functools

import torch

# "torch": torch's topk on the logits in their own dtype (a radix select of half the passes
# for bf16); "torch_float32": on float32 logits (a copy first: the decode step before this module)
IMPLEMENTATIONS = ("auto", "torch", "torch_float32", "triton")
IMPLEMENTATION = "auto"  # read when the decode step is recorded (part of its key)
CHUNK = 4096  # logits per program of the first kernel
MAX_K = 256


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [B, k] float32, best first; ids [B, k] int64; log-sum-exp [B] float32) of
    [B, V] logits, 0 < k <= V."""
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"top_k: k={k} for {logits.shape[-1]} logits per row")
    if IMPLEMENTATION not in IMPLEMENTATIONS:
        raise ValueError(f"decode top-k {IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if IMPLEMENTATION == "triton":
        return _top_k_op(logits, k, CHUNK)
    if IMPLEMENTATION == "torch_float32":
        logits = logits.float()
    values, ids = logits.topk(k, dim=-1)
    return values.float(), ids, logits.float().logsumexp(-1)


def launch_settings() -> tuple:
    """What a recorded decode step bakes in from this module (part of its key)."""
    return IMPLEMENTATION, CHUNK, MAX_K


def triton_top_k(logits: torch.Tensor, k: int, chunk: int = CHUNK
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two kernels; `chunk` (a power of two) is capped at the vocabulary's next power of two."""
    rows, vocab = logits.shape
    if chunk & (chunk - 1):
        raise ValueError(f"top_k: chunk {chunk} is not a power of two")
    padded_k = max(16, _next_power_of_2(k))
    chunk = max(padded_k, min(chunk, _next_power_of_2(vocab)))
    if padded_k > chunk or vocab >= 2**31:
        raise ValueError(f"top_k: k={k} over {vocab} logits is outside the kernel's range")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    chunks = -(-vocab // chunk)
    keys = torch.empty(rows, chunks, padded_k, dtype=torch.int64, device=logits.device)
    stats = torch.empty(2, rows, chunks, dtype=torch.float32, device=logits.device)
    values = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    logsumexp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    chunk_kernel, merge_kernel = _kernels()
    chunk_kernel[(rows, chunks)](logits, keys, stats, vocab, logits.stride(0), CHUNK=chunk, PADDED_K=padded_k)
    merge_kernel[(rows,)](keys, stats, values, ids, logsumexp, chunks, _LOWEST_KEY, K=k, PADDED_K=padded_k,
                          CANDIDATES=_next_power_of_2(chunks * padded_k), CHUNKS=_next_power_of_2(chunks))
    return values, ids, logsumexp


@torch.library.custom_op("opsd::decode_top_k", mutates_args=())
def _top_k_op(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`triton_top_k` as an op torch.compile keeps whole."""
    return triton_top_k(logits, k, chunk)


@_top_k_op.register_fake
def _(logits, k, chunk):
    rows = logits.shape[0]
    return (logits.new_empty(rows, k, dtype=torch.float32), logits.new_empty(rows, k, dtype=torch.int64),
            logits.new_empty(rows, dtype=torch.float32))


def _key(value: float, column: int) -> int:
    """The kernels' key of a float32 logit at a column (see `_kernels`), in Python."""
    import struct

    bits = struct.unpack("<i", struct.pack("<f", value))[0]
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered << 32) | (0x7FFFFFFF - column)


_LOWEST_KEY = _key(float("-inf"), 0x7FFFFFFF)  # below every key of a column inside the vocabulary


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The Triton kernels, built on first use (Triton is imported only here).

    A key is a logit's float32 bits made order-preserving as a signed integer (negative
    values have their magnitude bits flipped) in the high 32 bits, and 2^31 - 1 - column
    in the low 32: keys order as (value, lower column first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_kernel(logits_ptr, keys_ptr, stats_ptr, vocab, row_stride,
                     CHUNK: tl.constexpr, PADDED_K: tl.constexpr):
        """One (row, chunk): the chunk's top PADDED_K keys, its max and sum of exp(x - max)."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        chunks = tl.num_programs(1)
        columns = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = columns < vocab
        x = tl.load(logits_ptr + row * row_stride + columns, mask=inside, other=float("-inf")).to(tl.float32)
        best = tl.max(x, 0)
        base = tl.where(best == float("-inf"), 0.0, best)  # a chunk of -inf logits sums to 0
        total = tl.sum(tl.exp(x - base), 0)
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        # columns past the vocabulary hold -inf and the highest columns: after every real logit
        keys = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - columns).to(tl.int64)
        top = tl.topk(keys, PADDED_K)
        slot = row * chunks + chunk
        tl.store(keys_ptr + slot * PADDED_K + tl.arange(0, PADDED_K), top)
        tl.store(stats_ptr + slot, best)
        tl.store(stats_ptr + tl.num_programs(0) * chunks + slot, total)  # the second plane

    @triton.jit
    def merge_kernel(keys_ptr, stats_ptr, values_ptr, ids_ptr, logsumexp_ptr, chunks, lowest,
                     K: tl.constexpr, PADDED_K: tl.constexpr, CANDIDATES: tl.constexpr, CHUNKS: tl.constexpr):
        """One row: the top K of its chunks' candidates, and the log-sum-exp of its chunks."""
        row = tl.program_id(0)
        rows = tl.num_programs(0)
        i = tl.arange(0, CANDIDATES)
        present = i < chunks * PADDED_K
        keys = tl.load(keys_ptr + row * chunks * PADDED_K + i, mask=present, other=0)
        top = tl.topk(tl.where(present, keys, lowest), PADDED_K)
        ordered = (top >> 32).to(tl.int32)
        values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        ids = 0x7FFFFFFF - (top & 0xFFFFFFFF)
        j = tl.arange(0, PADDED_K)
        tl.store(values_ptr + row * K + j, values, mask=j < K)
        tl.store(ids_ptr + row * K + j, ids, mask=j < K)
        c = tl.arange(0, CHUNKS)
        bests = tl.load(stats_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
        totals = tl.load(stats_ptr + rows * chunks + row * chunks + c, mask=c < chunks, other=0.0)
        best = tl.max(bests, 0)
        weights = tl.where(c < chunks, tl.exp(bests - best), 0.0)
        tl.store(logsumexp_ptr + row, best + tl.log(tl.sum(totals * weights, 0)))

    return chunk_kernel, merge_kernel
