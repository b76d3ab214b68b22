"""`decode_qkv`'s computation as a Triton function, for the kernels that run it: decode_qkv's
own and `decode_attention`'s split_kv over a new token (which makes the query and the new
K/V column in the attention kernel itself). Imported only by their kernel builders, so
Triton is imported only when a kernel is built; a module of its own because Triton looks a
called function's `tl` up in the function's module globals."""
import triton
import triton.language as tl


@triton.jit
def new_token(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, b, h, kv_heads, qkv_sb, cos_sb, sin_sb,
              eps, HEADS: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
              NORM: tl.constexpr):
    """Row b's query heads h * GROUPS + g ([ROWS, DIM]; rows from GROUPS on are 0), the
    key and the value ([DIM]) of KV head h, float32, not rounded yet. Rotary position
    embedding pairs column d with its partner d +- DIM / 2 (rotate_half)."""
    d = tl.arange(0, DIM)
    partner = (d + DIM // 2) % DIM
    g = tl.arange(0, ROWS)
    rows = g[:, None] < GROUPS
    row = qkv_ptr + b * qkv_sb
    cos = tl.load(cos_ptr + b * cos_sb + d).to(tl.float32)
    # rotate_half(x)[d] = -x[partner] in the first half, x[partner] in the second
    sin = tl.load(sin_ptr + b * sin_sb + d).to(tl.float32) * tl.where(d < DIM // 2, -1.0, 1.0)
    q_at = row + (h * GROUPS + g[:, None]) * DIM
    q = tl.load(q_at + d[None, :], mask=rows, other=0.0)
    q_partner = tl.load(q_at + partner[None, :], mask=rows, other=0.0)
    k_at = row + (HEADS + h) * DIM
    k = tl.load(k_at + d)
    k_partner = tl.load(k_at + partner)
    v = tl.load(row + (HEADS + kv_heads + h) * DIM + d).to(tl.float32)
    if NORM:  # RMSNorm in float32, rounded to the input dtype, times the weight
        q32 = q.to(tl.float32)
        q_scale = tl.rsqrt(tl.sum(q32 * q32, 1) / DIM + eps)[:, None]
        q_weight = tl.load(q_weight_ptr + d).to(tl.float32)[None, :]
        q_weight_partner = tl.load(q_weight_ptr + partner).to(tl.float32)[None, :]
        q, q_partner = ((q32 * q_scale).to(q.dtype).to(tl.float32) * q_weight,
                        (q_partner.to(tl.float32) * q_scale).to(q.dtype).to(tl.float32) * q_weight_partner)
        k32 = k.to(tl.float32)
        k_scale = tl.rsqrt(tl.sum(k32 * k32, 0) / DIM + eps)
        k, k_partner = ((k32 * k_scale).to(k.dtype).to(tl.float32) * tl.load(k_weight_ptr + d).to(tl.float32),
                        (k_partner.to(tl.float32) * k_scale).to(k.dtype).to(tl.float32)
                        * tl.load(k_weight_ptr + partner).to(tl.float32))
    else:
        q, q_partner, k, k_partner = q.to(tl.float32), q_partner.to(tl.float32), k.to(tl.float32), k_partner.to(
            tl.float32)
    query = tl.where(rows, q * cos[None, :] + q_partner * sin[None, :], 0.0)
    return query, k * cos + k_partner * sin, v
