"""The decode loop's attention kernels (opsd/rollout/kernels/attention.py) against a float64 reference.

The Triton kernel runs here in Triton's CPU interpreter (TRITON_INTERPRET=1), the same
kernel source the GPU compiles; install.sh installs Triton on CPU-only machines for it.
The interpreter has no bfloat16 matrix product, so the half-precision case is float16.
"""
import dataclasses
import math

import pytest
import torch

from opsd.rollout import static_decode as static_decode
from opsd.rollout.kernels import attention as decode_attention


def reference(query, key, value, mask, scale):
    """Softmax attention in float64, written out: scores, masked, normalised, times V."""
    q, k, v = query.double(), key.double(), value.double()
    scores = torch.einsum("bhgd,bhnd->bhgn", q, k) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("bhgn,bhnd->bhgd", weights / weights.sum(-1, keepdim=True), v)


def case(batch, heads, groups, dim, columns, dtype, seed=0):
    """Query, K/V views into a longer cache (strided, as the decode loop slices its cache),
    and a left-padding mask: row 0 unpadded, row 1 attends to its last column only."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, groups, dim, generator=gen).to(dtype)
    cache = torch.randn(2, batch, heads, columns + 7, dim, generator=gen).to(dtype)
    key, value = cache[0, :, :, :columns], cache[1, :, :, :columns]
    padding = torch.randint(0, columns, (batch,), generator=gen)
    padding[0] = 0
    if batch > 1:
        padding[1] = columns - 1
    valid = torch.arange(columns + 7)[None, :] >= padding[:, None]
    return query, key, value, valid[:, None, None, :columns]


# float32: the online softmax's rescalings cost a few float32 roundings (sdpa: ~1e-6 here)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape,chunks,block", [
    ((3, 2, 2, 16, 40), 1, 16),      # one chunk: the kernel normalises and writes the output itself
    ((3, 2, 2, 16, 200), 3, 16),     # three chunks + the combine kernel; the last chunk runs past the end
    ((2, 1, 4, 32, 130), 2, 16),     # four query heads per KV head
    ((2, 3, 1, 16, 70), None, 16),   # no GQA; chunk count from split_count
    ((2, 2, 2, 16, 40), 4, 16),      # chunks rounded up to whole blocks: 4 asked, 3 run
    ((2, 2, 2, 128, 300), 2, None),  # Qwen3's head dim at the shipped block size
])
def test_split_kv_matches_float64_attention(interpreted_triton, dtype, tolerance, shape, chunks, block):
    query, key, value, mask = case(*shape, dtype)
    scale = 0.3
    got = decode_attention.split_kv(query, key, value, mask, scale, chunks, block=block)
    assert got.dtype == dtype and got.shape == query.shape
    expected = reference(query, key, value, mask, scale)
    assert (got.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("chunks", [1, 3])
def test_split_kv_does_not_read_masked_columns(interpreted_triton, chunks):
    """Left padding and the window's unwritten end are skipped, not read and zero-weighted:
    NaN there (0 x NaN would poison the weighted sum of V) leaves the output unchanged."""
    query, key, value, mask = case(3, 2, 2, 16, 120, torch.float32, seed=4)
    expected = reference(query, key, value, mask, 0.3)
    hidden = ~mask[:, 0, 0, :, None, None].transpose(1, 2)  # [B, 1, L, 1] -> broadcast over heads and dims
    poisoned_key = key.masked_fill(hidden.expand_as(key), math.nan)
    poisoned_value = value.masked_fill(hidden.expand_as(value), math.nan)
    got = decode_attention.split_kv(query, poisoned_key, poisoned_value, mask, 0.3, chunks, block=16)
    assert bool(hidden.any()) and (got.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_split_kv_loops_over_each_rows_attended_span(interpreted_triton, chunks):
    """Rows whose attended columns start and end anywhere (left padding, holes, an unwritten
    end, one row attending to a single middle column): the span loop attends to exactly the
    masked-in columns, as the loop over every block does."""
    query, key, value, _ = case(4, 2, 2, 16, 150, torch.float32, seed=5)
    columns = torch.arange(150)
    mask = torch.stack([(columns >= 3) & (columns < 140),                      # padding and an unwritten end
                        (columns >= 40) & (columns % 7 != 0) & (columns < 101),  # holes inside the span
                        columns == 77,                                          # one column, mid-block
                        torch.ones(150, dtype=torch.bool)])[:, None, None, :]
    expected = reference(query, key, value, mask, 0.3)
    spanned = decode_attention.split_kv(query, key, value, mask, 0.3, chunks, block=16, span=True)
    every_block = decode_attention.split_kv(query, key, value, mask, 0.3, chunks, block=16, span=False)
    assert (spanned.double() - expected).abs().max().item() < 1e-5
    assert (every_block.double() - expected).abs().max().item() < 1e-5


def test_sdpa_matches_float64_attention():
    query, key, value, mask = case(3, 2, 2, 16, 50, torch.float64)
    got = decode_attention.sdpa(query, key, value, mask, 0.25)
    assert torch.allclose(got, reference(query, key, value, mask, 0.25), atol=1e-12)


def test_auto_falls_back_to_sdpa_once_when_the_kernel_fails(monkeypatch):
    monkeypatch.setattr(decode_attention, "_AUTO_FAILURE", None)
    monkeypatch.setattr(decode_attention, "_split_kv_suits", lambda *args: True)
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("PTX assembly failed\ndetails")

    monkeypatch.setattr(decode_attention, "split_kv", broken)
    query, key, value, mask = case(2, 2, 2, 16, 30, torch.float64)
    expected = reference(query, key, value, mask, 0.25)
    with pytest.warns(RuntimeWarning, match="Triton kernel failed .RuntimeError: PTX assembly failed.; using torch"):
        got = decode_attention.attention("auto", query, key, value, mask, 0.25)
    assert torch.allclose(got, expected, atol=1e-12)
    again = decode_attention.attention("auto", query, key, value, mask, 0.25)  # sdpa now, no second try
    assert len(calls) == 1 and torch.allclose(again, expected, atol=1e-12)
    with pytest.raises(RuntimeError, match="PTX"):  # asked for by name, a failure is the caller's
        decode_attention.attention("split_kv", query, key, value, mask, 0.25)


def test_split_count_fills_the_processors_without_tiny_chunks():
    assert decode_attention.split_count(32 * 8, 1024, 132, 64) == 1  # the rollout bench's shape on an H200
    assert decode_attention.split_count(8 * 8, 1024, 132, 64) == 3   # fewer rows: split to cover the GPU
    assert decode_attention.split_count(8 * 8, 200, 132, 64) == 1    # but never below two blocks a chunk
    assert decode_attention.split_count(1, 4096, 132, 64) == 32


def test_auto_and_unsupported_geometries():
    query = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16)
    assert decode_attention.resolve("auto", query) == "sdpa"  # CPU
    assert decode_attention.resolve("split_kv", query) == "split_kv"
    with pytest.raises(ValueError, match="decode attention 'flash'"):
        decode_attention.resolve("flash", query)
    assert decode_attention.split_kv_unsupported(2, 128) is None
    assert "24" in decode_attention.split_kv_unsupported(2, 24)       # head dim not a power of two
    assert "17" in decode_attention.split_kv_unsupported(17, 128)     # more query heads than a tile's rows
    with pytest.raises(ValueError, match="power-of-two head dim"):
        decode_attention.split_kv(torch.zeros(1, 1, 2, 24), torch.zeros(1, 1, 4, 24), torch.zeros(1, 1, 4, 24),
                                  torch.ones(1, 1, 1, 4, dtype=torch.bool))


def test_decode_loop_with_the_kernel_samples_what_sdpa_samples(interpreted_triton, monkeypatch):
    """The whole decode loop on the tiny model (float32), attention through the Triton kernel:
    the same greedy tokens and seeded samples as through sdpa, log-probabilities to 1e-5."""
    from transformers import AutoModelForCausalLM

    from opsd import tiny_default
    from opsd.rollout import TransformersBackend
    from opsd.sampling import SamplingSettings

    model = AutoModelForCausalLM.from_pretrained(tiny_default.random_model_dir()).eval()
    rows = [[151644, 872, 198, 16, 10, 16], [151644, 872, 198, 50, 30, 20, 17, 10, 19, 24, 11], [87, 30]]
    results = {}
    for kernel in ("sdpa", "split_kv"):
        monkeypatch.setattr(static_decode, "DECODE_ATTENTION", kernel)
        backend = TransformersBackend(model, pad_token_id=151643, eos_token_ids=[151645],
                                      cache_implementation="graph")
        outputs = []
        for settings in (SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6, seed=None),
                         SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=6, seed=7)):
            outputs.append([[c.ids for c in samples] for samples in backend.generate(rows, settings)])
        decoder = static_decode.StaticDecoder.for_model(model)
        results[kernel] = outputs, decoder.sampled_logprobs(len(rows)).clone()
        decoder.release()
    assert results["split_kv"][0] == results["sdpa"][0]
    assert torch.allclose(results["split_kv"][1], results["sdpa"][1], atol=1e-5)


def new_token_case(batch, kv_heads, groups, dim, columns, dtype, norm, seed=0):
    """A decode step's q/k/v product, norm weights, cos / sin (test_kernel_qkv's), a cache whose
    column `slot` holds stale values (NaN: the kernel must neither read them nor keep them)
    and a mask that attends to the slot: (NewToken, key, value, mask)."""
    from test_kernel_qkv import case as qkv_case

    heads = kv_heads * groups
    qkv, (q_weight, k_weight), cos, sin = qkv_case(batch, heads, kv_heads, dim, dtype, norm, seed)
    _, key, value, mask = case(batch, kv_heads, groups, dim, columns, dtype, seed)
    slot = columns - 5
    key[:, :, slot], value[:, :, slot] = math.nan, math.nan
    mask = mask.clone()
    mask[..., slot] = True
    new = decode_attention.NewToken(qkv.view(batch, -1), heads, q_weight, k_weight, 1e-6, cos.view(batch, dim),
                                    sin.view(batch, dim), torch.tensor([slot]))
    return new, key, value, mask


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("shape,chunks,norm", [
    ((3, 2, 2, 16, 40), 1, True),     # Qwen3: q/k norms; one chunk
    ((3, 2, 2, 16, 200), 3, True),    # three chunks: one writes the column, the slot's own reads it from registers
    ((2, 1, 4, 32, 130), 2, False),   # four query heads per KV head, no norms (Qwen2 / Llama)
    ((2, 3, 1, 16, 70), 1, True),     # no GQA
])
def test_split_kv_new_token_matches_float64(interpreted_triton, dtype, tolerance, shape, chunks, norm):
    """The query, key and value made from the q/k/v product (float64 reference: test_kernel_qkv's),
    the new column written to the cache (every other column untouched), the attention output
    against float64 attention over the cache with that column."""
    from test_kernel_qkv import reference as qkv_reference

    batch, kv_heads, groups, dim, columns = shape
    new, key, value, mask = new_token_case(*shape, dtype, norm)
    before_key, before_value = key.clone(), value.clone()
    got = decode_attention.split_kv_new_token(new, key, value, mask, 0.3, chunks, block=16)
    query, new_key, new_value = qkv_reference(new.qkv[:, None], new.heads, kv_heads, new.q_weight, new.k_weight,
                                              new.eps, new.cos[:, None], new.sin[:, None])
    slot = int(new.slot)
    scale = max(query.abs().max(), new_key.abs().max())
    assert (key[:, :, slot].double() - new_key).abs().max() <= tolerance * scale
    assert torch.equal(value[:, :, slot].double(), new_value)
    others = torch.arange(columns) != slot
    assert torch.equal(key[:, :, others], before_key[:, :, others])
    assert torch.equal(value[:, :, others], before_value[:, :, others])
    expected = reference(query.view(batch, kv_heads, groups, dim), key.double(), value.double(), mask, 0.3)
    assert got.shape == (batch, kv_heads, groups, dim) and got.dtype == dtype
    assert (got.double() - expected).abs().max().item() < tolerance * 10


@pytest.mark.parametrize("chunks", [1, 3])
def test_split_kv_new_token_is_decode_qkv_then_split_kv(interpreted_triton, monkeypatch, chunks):
    """One kernel or two (decode_qkv's, then split_kv): the same cache column bit for bit (one
    Triton function makes it), the same output to float32 rounding (the new column is added
    first instead of in its block)."""
    from opsd.rollout.kernels import qkv as decode_qkv

    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")
    new, key, value, mask = new_token_case(3, 2, 2, 16, 200, torch.float32, True, seed=2)
    key2, value2 = key.clone(), value.clone()
    fused = decode_attention.split_kv_new_token(new, key, value, mask, 0.3, chunks, block=16)
    query = decode_qkv.prepare(new.qkv[:, None], new.heads, 2, new.q_weight, new.k_weight, new.eps,
                               new.cos[:, None], new.sin[:, None], key2, value2, new.slot)
    separate = decode_attention.split_kv(query.view(3, 2, 2, 16), key2, value2, mask, 0.3, chunks, block=16)
    assert torch.allclose(fused, separate, rtol=0, atol=1e-6) and not torch.isnan(fused).any()
    assert torch.equal(key, key2) and torch.equal(value, value2)


def test_new_token_attention_dispatch_and_fallback(interpreted_triton, monkeypatch):
    """split_kv with SPLIT_NEW_TOKEN: the one kernel; off, or under sdpa: decode_qkv then the
    attention; under "auto", a failing kernel warns once and decode_qkv + sdpa take over."""
    from opsd.rollout.kernels import qkv as decode_qkv

    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")
    monkeypatch.setattr(decode_attention, "_AUTO_FAILURE", None)
    new, key, value, mask = new_token_case(2, 2, 2, 16, 40, torch.float32, True, seed=3)
    kernels = []
    for name in ("split_kv_new_token", "split_kv", "sdpa"):
        original = getattr(decode_attention, name)
        monkeypatch.setattr(decode_attention, name,
                            lambda *args, _name=name, _original=original, **kw: kernels.append(_name)
                            or _original(*args, **kw))
    expected = decode_attention.new_token_attention("split_kv", new, key.clone(), value.clone(), mask, 0.3)
    assert kernels == ["split_kv_new_token"]
    monkeypatch.setattr(decode_attention, "SPLIT_NEW_TOKEN", False)
    kernels.clear()
    assert torch.allclose(decode_attention.new_token_attention("split_kv", new, key.clone(), value.clone(), mask, 0.3),
                          expected, rtol=0, atol=1e-6)
    assert kernels == ["split_kv"]
    monkeypatch.setattr(decode_attention, "SPLIT_NEW_TOKEN", True)
    kernels.clear()
    by_sdpa = decode_attention.new_token_attention("sdpa", new, key.clone(), value.clone(), mask, 0.3)
    assert kernels == ["sdpa"] and torch.allclose(by_sdpa, expected, atol=1e-5)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed\ndetails")

    monkeypatch.setattr(decode_attention, "split_kv_new_token", broken)
    monkeypatch.setattr(decode_attention, "_split_kv_suits", lambda *args: True)
    kernels.clear()
    failed = "Triton kernel failed .RuntimeError: PTX assembly failed.; using decode_qkv"
    with pytest.warns(RuntimeWarning, match=failed):
        fallback = decode_attention.new_token_attention("auto", new, key.clone(), value.clone(), mask, 0.3)
    assert kernels == ["sdpa"] and torch.allclose(fallback, expected, atol=1e-5)
    assert decode_attention.resolve("auto", torch.zeros(1, 2, 2, 16, dtype=torch.float16)) == "sdpa"  # stays off


def test_decode_loop_through_the_one_kernel_samples_what_two_kernels_sample(interpreted_triton, monkeypatch):
    """The merged copy's decode steps (Qwen3, float32) with split_kv making the new token itself, against
    decode_qkv's kernel and then split_kv: the same tokens, greedy and seeded, and the same
    log-probabilities to float32 rounding. (Two kernels against the model's own operations:
    test_kernel_qkv; split_kv against sdpa: the test above.)"""
    from test_fused_projections import GREEDY, SAMPLE, random_model, sample, with_lora

    from opsd.rollout.kernels import qkv as decode_qkv

    model = with_lora(random_model("qwen3", torch.float32, head_dim=16))  # split_kv takes head dims from 16
    short_greedy, short_sample = (dataclasses.replace(s, max_new_tokens=6) for s in (GREEDY, SAMPLE))
    launches = []
    fused = decode_attention.split_kv_new_token
    monkeypatch.setattr(decode_attention, "split_kv_new_token",
                        lambda *args, **kwargs: launches.append(1) or fused(*args, **kwargs))
    results = {}
    monkeypatch.setattr(decode_qkv, "IMPLEMENTATION", "triton")
    monkeypatch.setattr(static_decode, "DECODE_ATTENTION", "split_kv")
    for name, one_kernel in (("one kernel", True), ("two kernels", False)):
        monkeypatch.setattr(decode_attention, "SPLIT_NEW_TOKEN", one_kernel)
        launches.clear()
        tokens = sample(model, short_greedy), sample(model, short_sample)
        decoder = static_decode.StaticDecoder.for_model(model, merge_lora=True)
        results[name] = tokens, decoder.sampled_logprobs(3).clone()
        decoder.release()
        assert bool(launches) == (name == "one kernel")
    assert results["one kernel"][0] == results["two kernels"][0]
    assert any(len(ids) > 3 for samples in results["one kernel"][0][1] for ids in samples)
    assert torch.allclose(results["one kernel"][1], results["two kernels"][1], atol=1e-5)
