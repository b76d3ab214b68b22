"""Attention of one new token per row over a KV cache: the decode loop's kernels.

Every function here takes the decode loop's layout and returns the same thing:

    query [B, kv_heads, groups, D]   the query heads that share a KV head, packed as rows
    key, value [B, kv_heads, L, D]   the cache columns to read (a view; strides are kept)
    mask [B, 1, 1, L] bool           True = attend (left padding of the prompts is False)
    -> [B, kv_heads, groups, D]      in the query's dtype

- `sdpa`: torch's scaled_dot_product_attention, whichever backend torch picks (on an H200
  with a boolean mask, cuDNN's flash kernel: built for long queries, it reads the cache at
  1.3-2.3 TB/s for one token, BENCHMARKS.md section 2.3);
- `split_kv`: a Triton "flash-decoding" kernel: one program per (row, KV head, chunk)
  streams K and V once, keeping the running max / sum / weighted sum of the online softmax
  in float32 on chip (the query heads of a KV head are the rows of one tensor-core tile);
  with several chunks a second kernel rescales each chunk to the overall max and
  normalises once. Each row's loop covers only the blocks of columns from its first to
  its last attended one (`SPLIT_SPAN`), split evenly between its chunks: the left padding
  of short prompts and the window's unwritten end cost no iterations, and masked columns
  inside the span are not read. Runs wherever Triton does: CUDA, and Triton's CPU
  interpreter, where the tests run it.

`IMPLEMENTATIONS` names them ("auto": split_kv on CUDA when Triton imports, else sdpa);
`attention(name, ...)` dispatches. `new_token_attention(name, ...)` starts one step earlier,
from the new token's q/k/v product: split_kv then also does `decode_qkv`'s work (q/k norms,
rotary embedding, the new K/V column written to the cache) in the same kernel
(`split_kv_new_token`, SPLIT_NEW_TOKEN), one launch a layer fewer; otherwise decode_qkv
runs first. The float64 reference the tests compare against is
written in the tests, not here.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from opsd.rollout.kernels import qkv as decode_qkv
from opsd.rollout.kernels import triton_support

IMPLEMENTATIONS = ("auto", "sdpa", "split_kv")


def resolve(name: str, query: torch.Tensor) -> str:
    """The implementation `name` stands for with this query. "auto" is split_kv where it was
    built and measured: a CUDA GPU of compute capability 8.0 or newer (bf16 tensor cores),
    half-precision activations (in float32 Triton's products would round to TF32, below
    sdpa's precision), a head geometry the kernel takes, Triton importable and not failed
    before in this process; sdpa otherwise."""
    return _resolve(name, query, query.shape[-2], query.shape[-1])


def _resolve(name: str, like: torch.Tensor, groups: int, dim: int) -> str:
    """`resolve` for queries of `like`'s dtype and device and this head geometry."""
    if name == "auto":
        return "split_kv" if _AUTO_FAILURE is None and _split_kv_suits(like, groups, dim) else "sdpa"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"decode attention {name!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return name


def _split_kv_suits(like: torch.Tensor, groups: int, dim: int) -> bool:
    return (like.dtype in (torch.float16, torch.bfloat16) and split_kv_unsupported(groups, dim) is None
            and triton_support.runs_on(like))


def attention(name: str, query, key, value, mask, scale: float | None = None) -> torch.Tensor:
    if resolve(name, query) == "split_kv":
        out = _kernel_unless_it_fails(name, lambda: split_kv(query, key, value, mask, scale), "torch's sdpa")
        if out is not None:
            return out
    return sdpa(query, key, value, mask, scale)


_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing split_kv in this process


def _kernel_unless_it_fails(name: str, launch, fallback: str) -> torch.Tensor | None:
    """`launch()`, a split_kv kernel. Should it fail under "auto", warn once that `fallback`
    takes over, stop choosing split_kv for the process and return None (the caller runs the
    fallback); asked for by name, the failure is the caller's."""
    global _AUTO_FAILURE
    try:
        return launch()
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if name != "auto":
            raise
        _AUTO_FAILURE = triton_support.give_up("decode attention", exc, fallback)
        return None


def new_token_attention(name: str, new: NewToken, key, value, mask, scale: float | None = None) -> torch.Tensor:
    """`decode_qkv.prepare` (the new token's query; its key and value written to the cache at
    `new.slot`), then `attention`: in one kernel (`split_kv_new_token`) where `name` resolves
    to split_kv and SPLIT_NEW_TOKEN is on. -> [B, kv_heads, groups, D]."""
    batch, dim = new.cos.shape
    kv_heads = key.shape[1]
    if SPLIT_NEW_TOKEN and _resolve(name, new.qkv, new.heads // kv_heads, dim) == "split_kv":
        out = _kernel_unless_it_fails(name, lambda: split_kv_new_token(new, key, value, mask, scale),
                                      "decode_qkv and torch's sdpa")
        if out is not None:
            return out
    query = decode_qkv.prepare(new.qkv[:, None], new.heads, kv_heads, new.q_weight, new.k_weight, new.eps,
                               new.cos[:, None], new.sin[:, None], key, value, new.slot)
    return attention(name, query.view(batch, kv_heads, new.heads // kv_heads, dim), key, value, mask, scale)


def sdpa(query, key, value, mask, scale=None) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


# The Triton kernel's launch configuration (BENCHMARKS.md section 2.3 measured the choices):
# columns per loop iteration, warps, software-pipeline stages; and the query rows a
# tensor-core tile needs (a KV head's query heads, 2 for Qwen3-1.7B, are padded up to it).
SPLIT_BLOCK, SPLIT_WARPS, SPLIT_STAGES, SPLIT_ROWS = 64, 4, 3, 16
SPLIT_CHUNKS: int | None = None  # chunks per (row, KV head); None: `split_count` decides
# Loop over each row's attended span only (first to last attended block); False: over every
# block of the columns passed, masked ones included (the kernel before; kept for comparison).
SPLIT_SPAN = True
# `new_token_attention` makes the new token's query, key and value inside the split_kv kernel
# (`split_kv_new_token`); False: decode_qkv's kernel first, then split_kv (for comparison).
SPLIT_NEW_TOKEN = True


def split_count(batch_heads: int, columns: int, processors: int, block: int) -> int:
    """Chunks per (row, KV head): at least one program per multiprocessor, each chunk at
    least two blocks of columns. (At 32 rows x 8 KV heads on an H200 that is one chunk: with
    the span loop at 3 pipeline stages the fastest configuration measured, 2 to 4 chunks
    were slower; smaller batches, which split, were not measured.)"""
    by_occupancy = max(1, -(-processors // batch_heads))
    by_length = max(1, columns // (2 * block))
    return min(by_occupancy, by_length)


def split_kv_unsupported(groups: int, dim: int) -> str | None:
    """Why the kernel cannot take this head geometry, or None."""
    if groups > SPLIT_ROWS or dim & (dim - 1) or dim < 16:
        return (f"decode attention 'split_kv' takes at most {SPLIT_ROWS} query heads per KV head and a "
                f"power-of-two head dim >= 16; this model has {groups} and {dim}")
    return None


def split_kv(query, key, value, mask, scale=None, chunks: int | None = None, *, block: int | None = None,
             warps: int | None = None, stages: int | None = None, span: bool | None = None) -> torch.Tensor:
    """The Triton kernel; `chunks`, `block`, `warps`, `stages`, `span` default to the SPLIT_* settings.
    Every row must attend to at least one column (a fully masked row would be 0 / 0: NaN;
    the decode loop's rows always attend to the token just fed)."""
    batch, heads, groups, dim = query.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    return _launch(query, None, batch, heads, groups, dim, key, value, mask, scale, chunks, block, warps, stages, span)


class NewToken(NamedTuple):
    """A decode step's new token as the q/k/v product gives it (`decode_qkv.prepare`'s inputs):
    `split_kv_new_token` makes its query and its key / value column in the attention kernel."""
    qkv: torch.Tensor  # [B, (heads + 2 kv_heads) D]
    heads: int  # query heads
    q_weight: torch.Tensor | None  # q / k RMSNorm weights [D] (None: no norms)
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor  # [B, D]
    sin: torch.Tensor
    slot: torch.Tensor  # 1-element: the cache column the new key and value go to


def split_kv_new_token(new: NewToken, key, value, mask, scale=None, chunks: int | None = None, *,
                       block: int | None = None, warps: int | None = None, stages: int | None = None,
                       span: bool | None = None) -> torch.Tensor:
    """`decode_qkv.prepare` and then `split_kv`, in one kernel: each program makes its row's
    query heads and the new key and value (decode_qkv's own Triton function, so the same
    bits), writes the new column to the cache (one program per row and KV head) and adds it
    to its sums first, from its registers (`split_kv` adds it in its block: the two agree to
    float32 rounding of the sums)."""
    batch, dim = new.cos.shape
    heads = key.shape[1]
    groups = new.heads // heads
    if new.qkv.shape != (batch, (new.heads + 2 * heads) * dim):
        raise ValueError(f"decode attention: expected q/k/v [{batch}, {(new.heads + 2 * heads) * dim}], "
                         f"got {list(new.qkv.shape)}")
    decode_qkv.check_contiguous_rows(new.qkv, new.q_weight, new.k_weight, new.cos, new.sin, key, value)
    return _launch(None, new, batch, heads, groups, dim, key, value, mask, scale, chunks, block, warps, stages, span)


def _launch(query, new, batch, heads, groups, dim, key, value, mask, scale, chunks, block, warps, stages, span):
    """The kernel over `query` [B, heads, groups, D], or over the query `new` makes."""
    columns = key.shape[-2]
    problem = split_kv_unsupported(groups, dim)
    if problem:
        raise ValueError(problem)
    scale = dim ** -0.5 if scale is None else scale
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    block, warps, stages = block or SPLIT_BLOCK, warps or SPLIT_WARPS, stages or SPLIT_STAGES
    span = SPLIT_SPAN if span is None else span
    chunks = chunks or SPLIT_CHUNKS or split_count(batch * heads, columns, triton_support.processors(key.device), block)
    chunk = -(-columns // chunks)
    chunk = -(-chunk // block) * block
    chunks = -(-columns // chunk)
    valid = mask.reshape(batch, mask.shape[-1])
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    dtype = query.dtype if new is None else new.qkv.dtype
    out = torch.empty(batch, heads, groups, dim, dtype=dtype, device=key.device)
    # one chunk: the kernel normalises and writes `out`; several: float32 partials, then a combine
    partial = out if chunks == 1 else torch.empty(batch, heads, chunks, groups, dim, dtype=torch.float32,
                                                  device=key.device)
    # one chunk needs no running max / sum: `out` only stands in for the unused pointer
    running = out if chunks == 1 else torch.empty(2, batch, heads, chunks, groups, dtype=torch.float32,
                                                  device=key.device)
    kernel, combine = _split_kv_kernels()
    if new is None:  # the new-token operands are not read: stand-ins
        new_args = (out, out, out, out, out, out, 0, 0, 0, 0.0)
        q_strides = (query.stride(0), query.stride(1), query.stride(2))
    else:
        norm = new.q_weight is not None
        new_args = (new.qkv, new.q_weight if norm else new.cos, new.k_weight if norm else new.cos, new.cos, new.sin,
                    new.slot, new.qkv.stride(0), new.cos.stride(0), new.sin.stride(0), float(new.eps))
        query, q_strides = out, (0, 0, 0)
    # Triton 3.6's CPU interpreter, where the tests run the kernel, cannot loop to a run-time
    # bound: there the loop makes BLOCKS (a compile-time constant, the longest chunk) trips and
    # masks the blocks outside the program's share of the span; compiled, it makes just as many
    # trips as its share has blocks. Both attend to the same columns in the same order (a
    # masked block changes no running sum). Without the span both make BLOCKS trips.
    kernel[(batch * heads, chunks)](
        query, key, value, valid.view(torch.uint8), partial, running, *new_args,
        *q_strides,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0),
        heads, columns, float(scale),
        GROUPS=groups, ROWS=SPLIT_ROWS, DIM=dim, BLOCK=block, BLOCKS=chunk // block, SINGLE=chunks == 1,
        SPAN=triton_support.next_power_of_2(columns) if span else 0, RUNTIME_TRIPS=key.is_cuda and span,
        NEW=new is not None, NORM=new is not None and new.q_weight is not None,
        NEW_TOKEN=decode_qkv.new_token_function(),
        num_warps=warps, num_stages=stages)
    if chunks > 1:
        combine[(batch * heads * groups,)](partial, running, out, chunks, batch * heads * chunks * groups,
                                           GROUPS=groups, DIM=dim, CHUNKS=triton_support.next_power_of_2(chunks))
    return out


def launch_settings() -> tuple:
    """The SPLIT_* settings, which a recorded CUDA graph bakes in (part of its key)."""
    return SPLIT_BLOCK, SPLIT_WARPS, SPLIT_STAGES, SPLIT_CHUNKS, SPLIT_SPAN, SPLIT_NEW_TOKEN


@functools.cache
def _split_kv_kernels():
    """The Triton kernels, built on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, valid_ptr, partial_ptr, running_ptr,
               qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slot_ptr, qkv_sb, cos_sb, sin_sb, eps,
               q_sb, q_sh, q_sg, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, valid_sb,
               heads, columns, scale,
               GROUPS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
               BLOCKS: tl.constexpr, SINGLE: tl.constexpr, SPAN: tl.constexpr, RUNTIME_TRIPS: tl.constexpr,
               NEW: tl.constexpr, NORM: tl.constexpr, NEW_TOKEN: tl.constexpr):
        """One (row, KV head, chunk): running max / sum / weighted sum of V over the chunk's
        columns (flash attention's online softmax), float32 on chip. SPAN > 0 (a power of two
        >= columns): the row's blocks from its first to its last attended column are split
        between the chunks; SPAN 0: chunk `part` takes the BLOCKS blocks from part x BLOCKS on,
        attended or not. NEW: the query, and the key and value of cache column `slot`, come
        from the q/k/v product through NEW_TOKEN (decode_qkv's function); chunk 0 writes the
        column to the cache and adds it first, from its registers; no program reads it."""
        row_head = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        b = row_head // heads
        h = row_head % heads
        g = tl.arange(0, ROWS)
        d = tl.arange(0, DIM)
        rows = g[:, None] < GROUPS
        if NEW:
            query, new_k, new_v = NEW_TOKEN(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, b, h, heads,
                                            qkv_sb, cos_sb, sin_sb, eps, heads * GROUPS, GROUPS, ROWS, DIM, NORM)
            q = query.to(qkv_ptr.dtype.element_ty)  # rounded as decode_qkv's kernel stores it
            new_k = new_k.to(k_ptr.dtype.element_ty)
            new_v = new_v.to(v_ptr.dtype.element_ty)
            slot = tl.load(slot_ptr)
            first = part == 0
            tl.store(k_ptr + b * k_sb + h * k_sh + slot * k_sn + d, new_k, mask=(d < DIM) & first)
            tl.store(v_ptr + b * v_sb + h * v_sh + slot * v_sn + d, new_v, mask=(d < DIM) & first)
            # Chunk 0 starts its running max / sum / weighted sum from the new column (weight
            # exp(0) = 1); the loop skips it. (Swapping it into the loaded K/V tiles instead
            # measured slower: the loads no longer fed the products directly; BENCHMARKS.md 2.8.)
            fresh = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * scale
            best = tl.where(first, fresh, float("-inf"))
            total = tl.where(first, 1.0, 0.0) + tl.zeros([ROWS], tl.float32)
            acc = tl.where(first, new_v.to(tl.float32)[None, :], 0.0) + tl.zeros([ROWS, DIM], tl.float32)
        else:
            q = tl.load(q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :], mask=rows, other=0.0)
            slot = -1
            best = tl.full([ROWS], float("-inf"), tl.float32)
            total = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, DIM], tl.float32)
        if SPAN > 0:
            c = tl.arange(0, SPAN)
            attended = tl.load(valid_ptr + b * valid_sb + c, mask=c < columns, other=0) != 0
            first = tl.min(tl.where(attended, c, columns), 0) // BLOCK
            end = (tl.max(tl.where(attended, c, -1), 0) + BLOCK) // BLOCK  # one past the last attended block
            share = tl.maximum(tl.cdiv(end - first, parts), 0)
            start = first + part * share
            stop = tl.minimum(start + share, end)
        else:
            start = part * BLOCKS
            stop = start + BLOCKS
        for i in range(stop - start if RUNTIME_TRIPS else BLOCKS):  # the last chunk may end past the columns
            n = (start + i) * BLOCK + tl.arange(0, BLOCK)
            keep = tl.load(valid_ptr + b * valid_sb + n, mask=(n < columns) & (start + i < stop), other=0) != 0
            # Masked columns (left padding, the window's unwritten end) are not read: their
            # scores become -inf below, and predicated-off loads move no memory. Nor is the new
            # column under NEW (this kernel writes it; it is in the running sums already).
            keep = keep & (n != slot)
            k = tl.load(k_ptr + b * k_sb + h * k_sh + n[:, None] * k_sn + d[None, :], mask=keep[:, None],
                        other=0.0)
            v = tl.load(v_ptr + b * v_sb + h * v_sh + n[:, None] * v_sn + d[None, :], mask=keep[:, None],
                        other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(keep[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, 1))
            base = tl.where(new_best == float("-inf"), 0.0, new_best)  # no attended column yet
            p = tl.exp(s - base[:, None])
            rescale = tl.exp(best - base)
            total = total * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        if SINGLE:  # out [B, H, G, D], contiguous, in the query's dtype
            out = partial_ptr + row_head * GROUPS * DIM + g[:, None] * DIM + d[None, :]
            tl.store(out, (acc / total[:, None]).to(partial_ptr.dtype.element_ty), mask=rows)
        else:  # partial [B, H, parts, G, D] and running [2, B, H, parts, G], contiguous
            slot = row_head * parts + part
            tl.store(partial_ptr + slot * GROUPS * DIM + g[:, None] * DIM + d[None, :], acc, mask=rows)
            stats = running_ptr + slot * GROUPS + g
            tl.store(stats, best, mask=g < GROUPS)
            tl.store(stats + tl.num_programs(0) * parts * GROUPS, total, mask=g < GROUPS)  # the second plane

    @triton.jit
    def combine(partial_ptr, running_ptr, out_ptr, parts, plane,
                GROUPS: tl.constexpr, DIM: tl.constexpr, CHUNKS: tl.constexpr):
        """One (row, KV head, query head): every chunk rescaled to the overall max, summed,
        normalised once, written in out's dtype."""
        index = tl.program_id(0)
        row_head = index // GROUPS
        g = index % GROUPS
        c = tl.arange(0, CHUNKS)
        d = tl.arange(0, DIM)
        present = c < parts
        stats = running_ptr + (row_head * parts + c) * GROUPS + g
        best = tl.load(stats, mask=present, other=float("-inf"))
        total = tl.load(stats + plane, mask=present, other=0.0)
        overall = tl.max(best, 0)
        weight = tl.where(present, tl.exp(best - overall), 0.0)
        acc = tl.load(partial_ptr + ((row_head * parts + c[:, None]) * GROUPS + g) * DIM + d[None, :],
                      mask=present[:, None], other=0.0)
        result = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
        tl.store(out_ptr + (row_head * GROUPS + g) * DIM + d, result.to(out_ptr.dtype.element_ty))

    return kernel, combine
