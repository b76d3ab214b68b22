"""From a decode step's q/k/v product to attention's inputs, in one kernel: the q and k
RMSNorms (Qwen3), rotary position embedding, and the new K/V column's cache writes.

Why: compiled, these small operations are 4 kernels a layer of about 1.6 us each
(BENCHMARKS.md section 2.5): at one token per row they are launch- and latency-bound,
not work. One program per (row, KV head) does them all for the KV head's query heads.
The computation itself is a Triton function (`decode_qkv_triton.new_token`) that
`decode_attention`'s split_kv kernel runs too: in the decode loop the attention kernel
makes its query and the new column itself, and this kernel runs only where the attention
is not split_kv (`decode_attention.new_token_attention`).

What it computes is transformers' attention forward for Qwen3 / Qwen2 / Llama up to
the attention call (`fused_projections.FusedAttention`): per head, RMSNorm in float32
(rounded to the input dtype, times the norm's weight), then `x * cos + rotate_half(x) *
sin`; keys and values written to cache column `slot`. Float32 inside, one rounding to
the output dtype at the end, where the eager forward rounds after each operation:
the two agree to the activations' rounding (tested in float32 and float16 against a
float64 reference, and in bf16 on the GPU by the rollout's log-probability check).

`applies` says whether to call `prepare` (the kernel: under "auto" on a CUDA GPU of compute
capability 8.0 or newer with Triton, for half-precision or float32 activations; "triton"
forces it, in Triton's CPU interpreter for the tests); where it does not, the caller runs
the model's own operations. Should the kernel fail under "auto", `prepare` computes the
same in torch, warns once, and "auto" stops choosing the kernel for the process.
"""
from __future__ import annotations

import functools

import torch

from opsd.rollout.kernels import triton_support

IMPLEMENTATIONS = ("auto", "torch", "triton")
IMPLEMENTATION = "auto"  # read when a decode step is recorded (part of its key)


def launch_settings() -> tuple:
    """What a recorded decode step bakes in from this module (part of its key)."""
    return (IMPLEMENTATION,)


def applies(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether `prepare` should run for this step under `IMPLEMENTATION` (otherwise the
    caller runs the model's own operations)."""
    if IMPLEMENTATION not in IMPLEMENTATIONS:
        raise ValueError(f"decode q/k/v {IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if IMPLEMENTATION == "torch" or head_dim & (head_dim - 1) or head_dim < 2:
        return False
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False  # the kernel computes in float32: float64 keeps the model's own operations
    return IMPLEMENTATION == "triton" or (_AUTO_FAILURE is None and triton_support.runs_on(qkv))


_AUTO_FAILURE: str | None = None  # why "auto" stopped choosing the kernel in this process


def prepare(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
            key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The query [B, heads, 1, D] of one new token per row, its key and value written to
    `key_cache` / `value_cache` [B, kv_heads, L, D] at column `slot` (a 1-element tensor).

    qkv: [B, 1, (heads + 2 kv_heads) D], the stacked product; q_weight / k_weight: the
    q/k RMSNorm weights [D] (None: no norms, Qwen2 / Llama); cos, sin: [B, 1, D]."""
    batch = qkv.shape[0]
    dim = key_cache.shape[-1]
    if qkv.shape != (batch, 1, (heads + 2 * kv_heads) * dim):
        raise ValueError(f"decode q/k/v: expected [{batch}, 1, {(heads + 2 * kv_heads) * dim}], got {list(qkv.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("decode q/k/v: q and k norms come together")
    norm = q_weight is not None
    stand_in = cos.new_empty(0)  # the op takes tensors only
    query = _prepare_op(qkv.reshape(batch, -1), heads, kv_heads, norm, q_weight if norm else stand_in,
                        k_weight if norm else stand_in, float(eps), cos.reshape(batch, dim), sin.reshape(batch, dim),
                        key_cache, value_cache, slot)
    return query.view(batch, heads, 1, dim)


@torch.library.custom_op("opsd::decode_qkv", mutates_args=("key_cache", "value_cache"))
def _prepare_op(qkv: torch.Tensor, heads: int, kv_heads: int, norm: bool, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`triton_prepare` as an op torch.compile keeps whole."""
    global _AUTO_FAILURE
    weights = (q_weight, k_weight) if norm else (None, None)
    try:
        return triton_prepare(qkv, heads, kv_heads, *weights, eps, cos, sin, key_cache, value_cache, slot)
    except Exception as exc:  # Triton's compile and launch errors share no base class
        if IMPLEMENTATION != "auto":
            raise
        _AUTO_FAILURE = triton_support.give_up("decode q/k/v", exc, "torch")
        return _torch_prepare(qkv, heads, kv_heads, *weights, eps, cos, sin, key_cache, value_cache, slot)


def _torch_prepare(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, slot):
    """The kernel's computation in torch (after a kernel failure): [B, heads, D]."""
    batch, dim = cos.shape
    query, key, value = qkv.view(batch, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)
    if q_weight is not None:
        query, key = _rms_norm(query, q_weight, eps), _rms_norm(key, k_weight, eps)
    cos, sin = cos[:, None].float(), sin[:, None].float()
    query = (query.float() * cos + _rotate_half(query.float()) * sin).to(qkv.dtype)
    key = key.float() * cos + _rotate_half(key.float()) * sin
    key_cache.index_copy_(2, slot, key[:, :, None].to(key_cache.dtype))
    value_cache.index_copy_(2, slot, value[:, :, None].to(value_cache.dtype))
    return query


def _rms_norm(x, weight, eps):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * normed.to(x.dtype).float()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@_prepare_op.register_fake
def _(qkv, heads, kv_heads, norm, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, slot):
    return qkv.new_empty(qkv.shape[0], heads, cos.shape[-1])


def triton_prepare(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, slot):
    """The kernel: qkv [B, (heads + 2 kv_heads) D], cos / sin [B, D] -> query [B, heads, D]."""
    batch, dim = cos.shape
    groups = heads // kv_heads
    check_contiguous_rows(qkv, q_weight, k_weight, cos, sin, key_cache, value_cache)
    query = torch.empty(batch, heads, dim, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None
    kernel, new_token = _kernels()
    kernel[(batch, kv_heads)](
        qkv, q_weight if norm else cos, k_weight if norm else cos, cos, sin, key_cache, value_cache, slot, query,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        float(eps),
        HEADS=heads, GROUPS=groups, ROWS=max(2, triton_support.next_power_of_2(groups)), DIM=dim, NORM=norm,
        NEW_TOKEN=new_token)
    return query


def check_contiguous_rows(qkv, q_weight, k_weight, cos, sin, key_cache, value_cache) -> None:
    """The kernels address every operand's last dimension as contiguous."""
    tensors = {"qkv": qkv, "cos": cos, "sin": sin, "key_cache": key_cache, "value_cache": value_cache,
               "q_weight": q_weight, "k_weight": k_weight}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"decode q/k/v: {name} must be contiguous in its last dimension")


def new_token_function():
    """The Triton function the kernel runs (`_kernels`), for kernels elsewhere that do its work too."""
    return _kernels()[1]


@functools.cache
def _kernels():
    """(the kernel, `decode_qkv_triton.new_token`), built on first use (Triton is imported only here).

    `new_token` is the computation itself, a Triton function that `decode_attention`'s
    kernel also runs (its query and new column made in the attention kernel, one launch
    fewer). Kernels take it as a compile-time argument: Triton resolves a called function's
    name in the caller's module globals, where Triton is not imported."""
    import triton
    import triton.language as tl

    from opsd.rollout.kernels.qkv_triton import new_token

    @triton.jit
    def kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, key_ptr, value_ptr, slot_ptr, query_ptr,
               qkv_sb, cos_sb, sin_sb, key_sb, key_sh, key_sn, value_sb, value_sh, value_sn, eps,
               HEADS: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
               NORM: tl.constexpr, NEW_TOKEN: tl.constexpr):
        """One (row, KV head): its GROUPS query heads, its key and its value."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        query, key, value = NEW_TOKEN(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, b, h, tl.num_programs(1),
                                      qkv_sb, cos_sb, sin_sb, eps, HEADS, GROUPS, ROWS, DIM, NORM)
        d = tl.arange(0, DIM)
        g = tl.arange(0, ROWS)
        q_out = query_ptr + (b * HEADS + h * GROUPS + g[:, None]) * DIM + d[None, :]
        tl.store(q_out, query.to(query_ptr.dtype.element_ty), mask=g[:, None] < GROUPS)
        slot = tl.load(slot_ptr)
        tl.store(key_ptr + b * key_sb + h * key_sh + slot * key_sn + d, key.to(key_ptr.dtype.element_ty))
        tl.store(value_ptr + b * value_sb + h * value_sh + slot * value_sn + d, value.to(value_ptr.dtype.element_ty))

    return kernel, new_token
