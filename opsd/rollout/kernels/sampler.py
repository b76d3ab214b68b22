"""The decode step's draw from its logits: top-k, temperature, top-p, Gumbel-max; in torch and in one Triton kernel.

`static_decode._Sampler` samples through these functions. In torch (`top_k_and_logsumexp`,
`tempered_and_filtered`, `torch_draw`): one reduction gives each block of the vocabulary its
maximum and exp-sum, and the log-sum-exp (`block_maxima_and_logsumexp`); a top-k over the
blocks' maxima, a gather of the chosen blocks' logits, a top-k over them with its sort, then
the filter and the draw: at 32 rows, five or six kernels of a few microseconds each for a
few thousand values a row. `sample` does everything after the reduction in one kernel.

How, one program per row:
1. the k blocks with the largest maxima: the k-th largest maximum is found by setting the
   bits of an integer key that orders as the values do (`_order_key`), highest first,
   `DIGIT_BITS` at a time: one reduction counts the keys at or above each of the prefix's
   2^DIGIT_BITS extensions and keeps the largest with at least k (8 passes for bf16 logits
   at 2 bits); the blocks above it, then tied ones in block order up to k;
2. their logits (k x block of them), and the k largest the same way (ties: the lowest
   vocabulary id), written to a scratch row of k and read back, lowest id first;
3. each candidate's rank (best first, ties by id), temperature, top-p over the ranks
   (the probability ranked above a candidate, from a k x k comparison instead of a
   sorted cumulative sum), then the draw: the argmax of tempered logit + Gumbel noise,
   the noise of rank r from column r of `noise`, as `_Sampler.sample` reads it.
The same k values and the same rule as the torch draw (tested against it on the CPU through
Triton's interpreter: the same tokens from the same noise where no value ties and no top-p
boundary sits within float32 rounding). What may differ: which of several logits tied at
the k-th value is kept (the lowest ids here), as between torch's top-k and the block search;
the order of tied candidates, and so which noise each gets; and on a GPU the float32
rounding of the temperature's division, exp and log, so Gumbel scores within a few ulp of
each other may break the other way. Each changes which sample a seed gives, not the
distribution.

`IMPLEMENTATION` "auto" (the default): the kernel on a CUDA GPU of compute capability 8.0 or
newer, k at most `MAX_K`, torch elsewhere and after the kernel failed once (with a warning);
"torch": never the kernel; "triton": the kernel wherever Triton runs (its CPU interpreter
included: the tests). Its searches are block-wide reductions one after the other, so their
latency is its time: on one H200 (`bench/bench_decode_sampler.py`, BENCHMARKS.md section
2.11) 27.6 us at one bit a pass and 4 warps (32 reductions for bf16 logits; the kernel as
first shipped), 15.5 us at 2 bits and 8 warps (16 reductions); at 4 bits the [keys x 16]
comparisons outgrow the registers (165 us at 4 warps, 27 at 8).
"""
from __future__ import annotations

import functools
import math

import torch

from opsd.rollout.kernels import triton_support

IMPLEMENTATIONS = ("auto", "torch", "triton")
IMPLEMENTATION = "auto"
MAX_K = 64  # k x block logits a program searches (8,192 at block 128); larger k: torch
# Bits of the search's integer key set per pass (1, 2, 4 or 8): 2^DIGIT_BITS counts in one
# reduction, BITS / DIGIT_BITS reductions one after the other; and the kernel's warps. 2 bits and
# 8 warps measured fastest on one H200 (bench/bench_decode_sampler.py, BENCHMARKS.md section 2.11).
DIGIT_BITS = 2
WARPS = 8

_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing the kernel in this process


def applies(logits: torch.Tensor, k: int, block: int) -> bool:
    """Whether `sample` takes the kernel for [B, V] logits, top-k `k` searched in blocks of `block`."""
    if IMPLEMENTATION not in IMPLEMENTATIONS:
        raise ValueError(f"decode sampler {IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if IMPLEMENTATION == "torch":
        return False
    key_bits(torch.float32, DIGIT_BITS)  # a bad setting raises here, not inside the op (not a kernel failure)
    fits = (0 < k <= MAX_K and block > 0 and block & (block - 1) == 0 and logits.dim() == 2
            and -(-logits.shape[-1] // block) >= k and logits.dtype in _KEY_BITS)
    if IMPLEMENTATION == "triton":
        return fits
    return fits and _AUTO_FAILURE is None and triton_support.runs_on(logits)


def launch_settings() -> tuple:
    """What a recorded decode step bakes in from this module (part of its key)."""
    return IMPLEMENTATION, MAX_K, DIGIT_BITS, WARPS


# Bits of a value's float32 pattern that can differ between values of the logits' dtype
# (sign, exponent, the dtype's mantissa): the search sets only these.
_KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}


def key_bits(dtype: torch.dtype, digit: int) -> int:
    """The key's width for the search: `_KEY_BITS` rounded up to whole digits of `digit` bits
    (the extra low bits are zero in every key, so the order is the same)."""
    if digit not in (1, 2, 4, 8):
        raise ValueError(f"decode sampler: DIGIT_BITS {digit}: expected 1, 2, 4 or 8")
    return -(-_KEY_BITS[dtype] // digit) * digit


def sample(logits: torch.Tensor, block_max: torch.Tensor, logsumexp: torch.Tensor, noise: torch.Tensor, k: int,
           block: int, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, their log-probabilities [B] float32 under the untempered logits).
    logits [B, V]; block_max [B, blocks] (blocks of `block` logits, the last one padded with
    -inf); logsumexp [B] float32; noise [B, >= k] uniform in (0, 1)."""
    _check(logits, block_max, logsumexp, noise, k, block)  # a caller's error, not the kernel's: before the op
    return _sample_op(logits, block_max, logsumexp, noise, k, block, float(temperature), float(top_p))


@torch.library.custom_op("opsd::decode_sample", mutates_args=())
def _sample_op(logits: torch.Tensor, block_max: torch.Tensor, logsumexp: torch.Tensor, noise: torch.Tensor, k: int,
               block: int, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_sample` as an op torch.compile keeps whole. Should the kernel fail under "auto",
    the draw comes from this module's torch draw (`top_k_and_logsumexp`, `torch_draw`), with a
    warning, and "auto" stops choosing the kernel for the process (steps recorded before keep
    the op, which then draws with torch every time)."""
    global _AUTO_FAILURE
    try:
        return triton_sample(logits, block_max, logsumexp, noise, k, block, temperature, top_p)
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if IMPLEMENTATION != "auto":
            raise
        _AUTO_FAILURE = triton_support.give_up("decode sampler", exc, "torch's top-k")
        values, index, logsumexp = top_k_and_logsumexp(logits, k, block)
        return torch_draw(values, index, logsumexp, noise, temperature, top_p)


@_sample_op.register_fake
def _(logits, block_max, logsumexp, noise, k, block, temperature, top_p):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)


def _check(logits, block_max, logsumexp, noise, k, block) -> None:
    rows, vocab = logits.shape
    blocks = block_max.shape[-1]
    if block_max.shape != (rows, blocks) or blocks * block < vocab or blocks < k or block & (block - 1):
        raise ValueError(f"decode sampler: {list(block_max.shape)} block maxima for {rows} x {vocab} logits "
                         f"in blocks of {block} (a power of two), top-k {k}")
    if noise.shape[0] != rows or noise.shape[-1] < k or logsumexp.shape != (rows,):
        raise ValueError(f"decode sampler: noise {list(noise.shape)} and log-sum-exp {list(logsumexp.shape)} "
                         f"for {rows} rows and top-k {k}")


def triton_sample(logits, block_max, logsumexp, noise, k, block, temperature, top_p):
    """The kernel's launch (see the module's docstring)."""
    _check(logits, block_max, logsumexp, noise, k, block)
    rows, vocab = logits.shape
    blocks = block_max.shape[-1]
    width = triton_support.next_power_of_2(k)
    logits, block_max, noise = (t if t.stride(-1) == 1 else t.contiguous() for t in (logits, block_max, noise))
    # scratch rows: the chosen blocks, then the candidates' logits and ids
    chosen = torch.empty(rows, width, dtype=torch.int32, device=logits.device)
    values = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, width, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _kernel()[(rows,)](
        logits, block_max, logsumexp.float().contiguous(), noise, chosen, values, ids, tokens, logprobs,
        vocab, blocks, logits.stride(0), block_max.stride(0), noise.stride(0), temperature, top_p,
        K=k, WIDTH=width, BLOCK=block, BLOCKS=triton_support.next_power_of_2(blocks),
        BITS=key_bits(logits.dtype, DIGIT_BITS), DIGIT=DIGIT_BITS, TOP_P=top_p < 1.0, num_warps=WARPS)
    return tokens, logprobs


# ---- torch: the draw as `static_decode._Sampler` runs it without the kernel (and its fallback) ----


def block_maxima_and_logsumexp(logits: torch.Tensor, block: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the logits as [B, blocks, block] tiles, the last one padded with -inf; each block's
    maximum [B, blocks] in the logits' dtype; each row's log-sum-exp [B] float32), from one
    pass over the row: each block's maximum and exp-sum, combined."""
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:  # the last block's missing logits never count: -inf
        logits = torch.nn.functional.pad(logits, (0, blocks * block - vocab), value=-math.inf)
    tiles = logits.view(rows, blocks, block)
    block_max = tiles.amax(-1)
    block_max32 = block_max.float()
    row_max = block_max32.amax(-1, keepdim=True)
    # Shifts of 0 where a maximum is -inf: a block (or row) of -inf logits adds 0, not NaN.
    block_shift = torch.where(block_max32.isfinite(), block_max32, 0.0)
    row_shift = torch.where(row_max.isfinite(), row_max, 0.0)
    block_sum = (tiles.float() - block_shift[..., None]).exp().sum(-1)
    logsumexp = row_shift.squeeze(-1) + (block_sum * (block_max32 - row_shift).exp()).sum(-1).log()
    return tiles, block_max, logsumexp


def top_k_and_logsumexp(logits: torch.Tensor, k: int, block: int | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the k largest logits of each row in float32, best first; their vocabulary ids; the
    row's log-sum-exp in float32) of [B, V] logits.

    With `block`, one pass over the row gives each block of `block` logits its maximum and
    its exp-sum (which make the log-sum-exp), and the top-k is searched only in the k blocks
    with the largest maxima: a logit outside them has k larger or equal ones (those blocks'
    maxima), so it is in the top-k only as a tie at the k-th value, and the k values are
    exactly torch.topk's. Which of several tied logits at the k-th value is kept may differ.
    Rows too short for k blocks take one torch.topk."""
    rows, vocab = logits.shape
    blocks = -(-vocab // block) if block else 0
    if blocks < k:
        values, index = logits.topk(k, dim=-1)
        return values.float(), index, logits.float().logsumexp(-1)
    tiles, block_max, logsumexp = block_maxima_and_logsumexp(logits, block)
    # The blocks' order does not matter (the second top-k sorts their logits): unsorted saves a sort.
    chosen = block_max.topk(k, dim=-1, sorted=False).indices  # [B, k] blocks
    searched = tiles.gather(1, chosen[..., None].expand(rows, k, block)).view(rows, k * block)
    values, position = searched.topk(k, dim=-1)
    index = chosen.gather(1, position // block) * block + position % block
    return values.float(), index, logsumexp


def tempered_and_filtered(values: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Candidates' logits (best first) divided by the temperature; -inf where top-p drops them
    (the probability ranked above a candidate is top_p or more; the first always stays)."""
    values = values / temperature
    if top_p < 1.0:
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the candidates ranked above
        values = values.masked_fill(mass_before >= top_p, -math.inf)
    return values


def torch_draw(values: torch.Tensor, index: torch.Tensor, logsumexp: torch.Tensor, noise: torch.Tensor,
               temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel-max draw among candidates (best first, `noise` column r for rank r):
    (tokens [B], their log-probabilities [B] under the untempered logits)."""
    gumbel = -torch.log(-torch.log(noise))
    choice = (tempered_and_filtered(values, temperature, top_p) + gumbel).argmax(-1, keepdim=True)
    return index.gather(-1, choice).squeeze(-1), values.gather(-1, choice).squeeze(-1) - logsumexp


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is imported only here)."""
    from opsd.rollout.kernels import sampler_triton as decode_sampler_triton

    return decode_sampler_triton.kernel
