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
`attention(name, ...)` dispatches. The float64 reference the tests compare against is
written in the tests, not here.
"""
from __future__ import annotations

import functools

import torch

import triton_support

IMPLEMENTATIONS = ("auto", "sdpa", "split_kv")


def resolve(name: str, query: torch.Tensor) -> str:
    """The implementation `name` stands for with this query. "auto" is split_kv where it was
    built and measured: a CUDA GPU of compute capability 8.0 or newer (bf16 tensor cores),
    half-precision activations (in float32 Triton's products would round to TF32, below
    sdpa's precision), a head geometry the kernel takes, Triton importable and not failed
    before in this process; sdpa otherwise."""
    if name == "auto":
        return "split_kv" if _AUTO_FAILURE is None and _split_kv_suits(query) else "sdpa"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"decode attention {name!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return name


def _split_kv_suits(query: torch.Tensor) -> bool:
    return (query.dtype in (torch.float16, torch.bfloat16)
            and split_kv_unsupported(query.shape[-2], query.shape[-1]) is None and triton_support.runs_on(query))


def attention(name: str, query, key, value, mask, scale: float | None = None) -> torch.Tensor:
    global _AUTO_FAILURE
    if resolve(name, query) != "split_kv":
        return sdpa(query, key, value, mask, scale)
    try:
        return split_kv(query, key, value, mask, scale)
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if name != "auto":
            raise
        _AUTO_FAILURE = triton_support.give_up("decode attention", exc, "torch's sdpa")
        return sdpa(query, key, value, mask, scale)


_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing split_kv in this process


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
    columns = key.shape[-2]
    problem = split_kv_unsupported(groups, dim)
    if problem:
        raise ValueError(problem)
    scale = dim ** -0.5 if scale is None else scale
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    block, warps, stages = block or SPLIT_BLOCK, warps or SPLIT_WARPS, stages or SPLIT_STAGES
    span = SPLIT_SPAN if span is None else span
    chunks = chunks or SPLIT_CHUNKS or split_count(batch * heads, columns, triton_support.processors(query.device), block)
    chunk = -(-columns // chunks)
    chunk = -(-chunk // block) * block
    chunks = -(-columns // chunk)
    valid = mask.reshape(batch, mask.shape[-1])
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    out = torch.empty(batch, heads, groups, dim, dtype=query.dtype, device=query.device)
    # one chunk: the kernel normalises and writes `out`; several: float32 partials, then a combine
    partial = out if chunks == 1 else torch.empty(batch, heads, chunks, groups, dim, dtype=torch.float32,
                                                  device=query.device)
    # one chunk needs no running max / sum: `out` only stands in for the unused pointer
    running = out if chunks == 1 else torch.empty(2, batch, heads, chunks, groups, dtype=torch.float32,
                                                  device=query.device)
    kernel, combine = _split_kv_kernels()
    # Triton 3.6's CPU interpreter, where the tests run the kernel, cannot loop to a run-time
    # bound: there the loop makes BLOCKS (a compile-time constant, the longest chunk) trips and
    # masks the blocks outside the program's share of the span; compiled, it makes just as many
    # trips as its share has blocks. Both attend to the same columns in the same order (a
    # masked block changes no running sum). Without the span both make BLOCKS trips.
    kernel[(batch * heads, chunks)](
        query, key, value, valid.view(torch.uint8), partial, running,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0),
        heads, columns, float(scale),
        GROUPS=groups, ROWS=SPLIT_ROWS, DIM=dim, BLOCK=block, BLOCKS=chunk // block, SINGLE=chunks == 1,
        SPAN=triton_support.next_power_of_2(columns) if span else 0, RUNTIME_TRIPS=query.is_cuda and span,
        num_warps=warps, num_stages=stages)
    if chunks > 1:
        combine[(batch * heads * groups,)](partial, running, out, chunks, batch * heads * chunks * groups,
                                           GROUPS=groups, DIM=dim, CHUNKS=triton_support.next_power_of_2(chunks))
    return out


def launch_settings() -> tuple:
    """The SPLIT_* settings, which a recorded CUDA graph bakes in (part of its key)."""
    return SPLIT_BLOCK, SPLIT_WARPS, SPLIT_STAGES, SPLIT_CHUNKS, SPLIT_SPAN


@functools.cache
def _split_kv_kernels():
    """The Triton kernels, built on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, valid_ptr, partial_ptr, running_ptr,
               q_sb, q_sh, q_sg, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, valid_sb,
               heads, columns, scale,
               GROUPS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
               BLOCKS: tl.constexpr, SINGLE: tl.constexpr, SPAN: tl.constexpr, RUNTIME_TRIPS: tl.constexpr):
        """One (row, KV head, chunk): running max / sum / weighted sum of V over the chunk's
        columns (flash attention's online softmax), float32 on chip. SPAN > 0 (a power of two
        >= columns): the row's blocks from its first to its last attended column are split
        between the chunks; SPAN 0: chunk `part` takes the BLOCKS blocks from part x BLOCKS on,
        attended or not."""
        row_head = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        b = row_head // heads
        h = row_head % heads
        g = tl.arange(0, ROWS)
        d = tl.arange(0, DIM)
        rows = g[:, None] < GROUPS
        q = tl.load(q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :], mask=rows, other=0.0)
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
            # scores become -inf below, and predicated-off loads move no memory.
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
