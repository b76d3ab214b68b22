"""`decode_sampler`'s Triton kernel and its helpers. Imported only by `decode_sampler._kernel`, so
Triton is imported only when the kernel is built; a module of its own because Triton looks a
called function up in the calling function's module globals."""
import triton
import triton.language as tl


@triton.jit
def _order_key(x, BITS: tl.constexpr):
    """An integer in [0, 2^BITS) per float32 value, ordered as the values are (-0.0 < +0.0):
    int32 below 32 bits (half the registers of int64 in the search's comparisons), int64 at 32."""
    bits = x.to(tl.int32, bitcast=True)
    flipped = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (flipped.to(tl.int64) + 2147483648) >> (32 - BITS)
    if BITS < 32:
        key = key.to(tl.int32)
    return key


@triton.jit
def _kth_largest(key, K: tl.constexpr, BITS: tl.constexpr, DIGIT: tl.constexpr):
    """The K-th largest of `key` (absent entries -1): the largest prefix with K keys at or above
    it, DIGIT bits a pass (BITS a multiple of DIGIT). Each pass counts the keys at or above each
    of the 2^DIGIT extensions of the prefix in one reduction and keeps the largest extension with
    K of them (the first always has: it is the prefix)."""
    digits = tl.arange(0, 1 << DIGIT).to(key.dtype)
    prefix = tl.max(digits, 0) * 0
    for i in tl.static_range(BITS // DIGIT):
        shift = BITS - (i + 1) * DIGIT
        candidates = prefix | (digits << shift)
        counts = tl.sum((key[:, None] >= candidates[None, :]).to(tl.int32), 0)
        prefix = prefix | (tl.max(tl.where(counts >= K, digits, 0), 0) << shift)
    return prefix


@triton.jit
def _exactly_k(key, threshold, K: tl.constexpr):
    """The keys above `threshold`, then those equal to it in index order, K in all."""
    above = key > threshold
    tied = key == threshold
    room = K - tl.sum(above.to(tl.int32), 0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= room))


@triton.jit
def kernel(logits_ptr, block_max_ptr, lse_ptr, noise_ptr, chosen_ptr, values_ptr, ids_ptr, tokens_ptr,
           logprobs_ptr, vocab, blocks, logits_sb, block_max_sb, noise_sb, temperature, top_p,
           K: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
           BITS: tl.constexpr, DIGIT: tl.constexpr, TOP_P: tl.constexpr):
    row = tl.program_id(0)
    # 1. the K blocks with the largest maxima, in block order
    i = tl.arange(0, BLOCKS)
    present = i < blocks
    maxima = tl.load(block_max_ptr + row * block_max_sb + i, mask=present, other=0.0).to(tl.float32)
    key = tl.where(present, _order_key(maxima, BITS), -1)
    chosen = _exactly_k(key, _kth_largest(key, K, BITS, DIGIT), K)
    tl.store(chosen_ptr + row * WIDTH + tl.cumsum(chosen.to(tl.int32), 0) - 1, i, mask=chosen)
    tl.debug_barrier()
    # 2. their logits, lowest vocabulary id first, and the K largest of them
    r = tl.arange(0, WIDTH * BLOCK)
    slot = r // BLOCK
    first = tl.load(chosen_ptr + row * WIDTH + slot, mask=slot < K, other=0) * BLOCK
    column = first + r % BLOCK
    inside = (slot < K) & (column < vocab)
    logits = tl.load(logits_ptr + row * logits_sb + column, mask=inside, other=0.0).to(tl.float32)
    key = tl.where(inside, _order_key(logits, BITS), -1)
    kept = _exactly_k(key, _kth_largest(key, K, BITS, DIGIT), K)
    place = row * WIDTH + tl.cumsum(kept.to(tl.int32), 0) - 1
    tl.store(values_ptr + place, logits, mask=kept)
    tl.store(ids_ptr + place, column, mask=kept)
    tl.debug_barrier()
    c = tl.arange(0, WIDTH)
    real = c < K
    value = tl.load(values_ptr + row * WIDTH + c, mask=real, other=float("-inf"))
    ids = tl.load(ids_ptr + row * WIDTH + c, mask=real, other=0)
    # 3. rank (best first, ties by id), temperature, top-p, the Gumbel-max draw
    ahead = (value[None, :] > value[:, None]) | ((value[None, :] == value[:, None]) & (c[None, :] < c[:, None]))
    rank = tl.sum((ahead & real[None, :]).to(tl.int32), 1)
    tempered = value / temperature
    if TOP_P:
        weight = tl.where(real, tl.exp(tempered - tl.max(tempered, 0)), 0.0)
        probs = weight / tl.sum(weight, 0)
        before = tl.sum(tl.where(rank[None, :] < rank[:, None], probs[None, :], 0.0), 1)
        tempered = tl.where(before >= top_p, float("-inf"), tempered)  # rank 0 always stays
    noise = tl.load(noise_ptr + row * noise_sb + rank, mask=real, other=0.5)
    score = tl.where(real, tempered + -tl.log(-tl.log(noise)), float("-inf"))
    pick = tl.min(tl.where(score == tl.max(score, 0), rank, WIDTH), 0)  # the best rank among equal scores
    picked = real & (rank == pick)
    tl.store(tokens_ptr + row, tl.sum(tl.where(picked, ids, 0), 0).to(tl.int64))
    tl.store(logprobs_ptr + row, tl.sum(tl.where(picked, value, 0.0), 0) - tl.load(lse_ptr + row))
