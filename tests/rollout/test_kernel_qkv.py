"""opsd/rollout/kernels/qkv.py: the decode step's q/k RMSNorms, rotary embedding and K/V cache writes in
one kernel, against a float64 reference written here, and through the decode loop.

The Triton kernel runs in Triton's CPU interpreter (conftest switches it on without a GPU),
the same source the GPU compiles; on a GPU these tests skip (the rollout benchmark's
log-probability check covers the compiled kernel)."""

import pytest
import torch

from opsd.rollout import static_decode as static_decode
from opsd.rollout.kernels import qkv as decode_qkv
from opsd.rollout.static_decode import StaticDecoder


@pytest.fixture
def interpreted_triton(interpreted_triton, monkeypatch):
    """conftest's (Triton's CPU interpreter), with the kernel forced."""
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")


def reference(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin):
    """float64: per head RMSNorm (when weights are given) times the weight, then
    x * cos + rotate_half(x) * sin. -> query [B, heads, D], key, value [B, kv_heads, D]."""
    batch, dim = cos.shape[0], cos.shape[-1]
    x = qkv.double().view(batch, heads + 2 * kv_heads, dim)
    query, key, value = x.split([heads, kv_heads, kv_heads], dim=1)
    if q_weight is not None:
        def rms(t, w):
            return w.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        query, key = rms(query, q_weight), rms(key, k_weight)
    half = dim // 2
    c, s = cos.double().view(batch, 1, dim), sin.double().view(batch, 1, dim)

    def rotate(t):
        return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s

    return rotate(query), rotate(key), value


def case(batch, heads, kv_heads, dim, dtype, norm, seed=0):
    """Random q/k/v, norm weights, and cos / sin [B, 1, D] whose two halves differ (the
    model's rotary embedding repeats them; distinct halves catch a kernel that mixes them up)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(dtype)
    weights = [(torch.rand(dim, generator=gen) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    angles = torch.arange(1, batch + 1)[:, None, None] * torch.rand(1, 1, dim, generator=gen) * 7
    return qkv, weights, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.float16, 4e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim,norm,eps", [
    (4, 2, 16, True, 1e-6),   # Qwen3: q/k norms, two query heads per KV head
    (4, 2, 16, False, 0.0),   # Qwen2 / Llama: no norms
    (3, 3, 8, True, 0.5),     # no GQA (one query head per KV head); an eps that matters
    (8, 2, 32, True, 1e-6),   # four query heads per KV head
])
def test_kernel_matches_float64(interpreted_triton, dtype, tolerance, heads, kv_heads, dim, norm, eps):
    """The query, and the key and value written at the slot, equal the float64 reference to
    the dtype's rounding (relative to the largest value); every other cache column is untouched."""
    batch, length, slot = 3, 9, 4
    qkv, (q_weight, k_weight), cos, sin = case(batch, heads, kv_heads, dim, dtype, norm)
    # the caches are views into larger buffers: the kernel must address them through their strides
    key_store = torch.full((batch, kv_heads, length + 2, dim), 7.0, dtype=dtype)
    value_store = torch.full((batch, kv_heads, length + 2, dim), 7.0, dtype=dtype)
    key_cache, value_cache = key_store[:, :, 1:-1], value_store[:, :, 1:-1]
    query = decode_qkv.prepare(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, key_cache, value_cache,
                               torch.tensor([slot]))
    expected_query, expected_key, expected_value = reference(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin)
    assert query.shape == (batch, heads, 1, dim) and query.dtype == dtype
    scale = max(expected_query.abs().max(), expected_key.abs().max())
    assert (query[:, :, 0].double() - expected_query).abs().max() <= tolerance * scale
    assert (key_cache[:, :, slot].double() - expected_key).abs().max() <= tolerance * scale
    assert torch.equal(value_cache[:, :, slot].double(), expected_value)  # values are copied as they are
    untouched = torch.ones(length + 2, dtype=torch.bool)
    untouched[1 + slot] = False
    assert (key_store[:, :, untouched] == 7).all() and (value_store[:, :, untouched] == 7).all()


def test_prepare_rejects_inconsistent_shapes(interpreted_triton):
    qkv, (q_weight, k_weight), cos, sin = case(2, 4, 2, 16, torch.float32, True)
    cache = torch.zeros(2, 2, 5, 16)
    with pytest.raises(ValueError, match="expected"):
        decode_qkv.prepare(qkv, 4, 1, q_weight, k_weight, 1e-6, cos, sin, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="norms come together"):
        decode_qkv.prepare(qkv, 4, 2, q_weight, None, 1e-6, cos, sin, cache, cache.clone(), torch.tensor([0]))


def test_the_op_passes_torchs_custom_op_checks(interpreted_triton):
    """Schema (the caches declared as mutated), fake tensor and tracing checks: what
    torch.compile relies on when it keeps the op whole in the decode step."""
    qkv, (q_weight, k_weight), cos, sin = case(2, 4, 2, 16, torch.float32, True)
    caches = torch.zeros(2, 2, 2, 5, 16)
    result = torch.library.opcheck(decode_qkv._prepare_op, (qkv[:, 0], 4, 2, True, q_weight, k_weight, 1e-6,
                                                            cos[:, 0], sin[:, 0], caches[0], caches[1],
                                                            torch.tensor([2])))
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_failing_kernel_falls_back_to_torch_under_auto(monkeypatch):
    """"auto" must not cost a rollout: the op computes the same in torch, warns, and "auto"
    stops choosing the kernel."""
    monkeypatch.setattr(decode_qkv, "_AUTO_FAILURE", None)
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "auto")

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(decode_qkv, "triton_prepare", broken)
    batch, heads, kv_heads, dim, slot = 3, 4, 2, 16, 2
    qkv, (q_weight, k_weight), cos, sin = case(batch, heads, kv_heads, dim, torch.float32, True)
    key_cache, value_cache = torch.zeros(2, batch, kv_heads, 5, dim)
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        query = decode_qkv.prepare(qkv, heads, kv_heads, q_weight, k_weight, 0.1, cos, sin, key_cache, value_cache,
                                   torch.tensor([slot]))
    expected_query, expected_key, expected_value = reference(qkv, heads, kv_heads, q_weight, k_weight, 0.1, cos, sin)
    assert torch.allclose(query[:, :, 0].double(), expected_query, atol=1e-5)
    assert torch.allclose(key_cache[:, :, slot].double(), expected_key, atol=1e-5)
    assert torch.equal(value_cache[:, :, slot].double(), expected_value)
    assert "no kernel here" in decode_qkv._AUTO_FAILURE
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")
    with pytest.raises(RuntimeError, match="no kernel here"):  # a forced kernel's failure is an error
        decode_qkv.prepare(qkv, heads, kv_heads, q_weight, k_weight, 0.1, cos, sin, key_cache, value_cache,
                           torch.tensor([slot]))


def test_when_the_kernel_applies(monkeypatch):
    qkv = torch.zeros(2, 1, 64)
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "auto")
    assert not decode_qkv.applies(qkv, 16)  # a CPU tensor: the model's own operations
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")
    assert decode_qkv.applies(qkv, 16)
    assert not decode_qkv.applies(qkv, 24)  # the halves must be a power of two
    assert not decode_qkv.applies(qkv.double(), 16)  # float64 keeps the model's own (float64) operations
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "torch")
    assert not decode_qkv.applies(qkv, 16)
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "cuda")
    with pytest.raises(ValueError, match="expected one of"):
        decode_qkv.applies(qkv, 16)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_decode_loop_samples_the_same_tokens_through_the_kernel(interpreted_triton, family, monkeypatch):
    """The merged copy's decode steps through the kernel (no cache.update after the prefill)
    sample what the model's own operations sample, greedy and seeded, with the same
    log-probabilities to float32 rounding."""
    from test_fused_projections import GREEDY, SAMPLE, random_model, sample, with_lora

    model = with_lora(random_model(family, torch.float32))
    updates = []
    update = static_decode._KVCache.update
    monkeypatch.setattr(static_decode._KVCache, "update",
                        lambda self, *args, **kwargs: updates.append(args[0].shape[-2])
                        or update(self, *args, **kwargs))
    results, logprobs = {}, {}
    for implementation in ("torch", "triton"):
        monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", implementation)
        updates.clear()
        results[implementation] = sample(model, GREEDY), sample(model, SAMPLE)
        logprobs[implementation] = StaticDecoder.for_model(model, merge_lora=True).sampled_logprobs(3).clone()
        StaticDecoder.for_model(model, merge_lora=True).release()
        columns = sorted(set(updates))
        # one-column writes through the cache's update only without the kernel (the prefill has its own writer)
        assert (1 in columns) == (implementation == "torch"), columns
    assert results["torch"] == results["triton"]
    assert any(len(ids) > 3 for samples in results["triton"][1] for ids in samples)
    assert torch.allclose(logprobs["torch"], logprobs["triton"], atol=1e-5)
