"""The decode step's draw in one Triton kernel (opsd/rollout/kernels/sampler.py) against the torch draw.

The kernel runs here in Triton's CPU interpreter (TRITON_INTERPRET=1, see conftest.py).
The torch draw (`top_k_and_logsumexp` -> `torch_draw`, what `static_decode._Sampler`
runs without the kernel) is the reference: tests/rollout/test_sampling_distribution.py checks its
distribution against a float64 target, test_rollout.py its top-k against a float64 sort.
Given the same noise the kernel must draw the same token with the same log-probability
wherever no two candidates tie (float32 logits); where bf16 logits tie, a token of the
same value.
"""
import math

import pytest
import torch

from opsd.rollout import static_decode as static_decode
from opsd.rollout.kernels import sampler as decode_sampler
from opsd.sampling import SamplingSettings

# (temperature, top_p, top_k): the recipe's; top-p inside a wider top-k (not a power of two); no top-p; a small k
SETTINGS = [(1.1, 0.95, 20), (0.8, 0.6, 50), (1.0, 1.0, 5), (0.7, 0.9, 3)]


def draws(logits, noise, k, block, temperature, top_p):
    """(kernel tokens, kernel log-probabilities, torch tokens, torch log-probabilities)."""
    _, block_max, logsumexp = decode_sampler.block_maxima_and_logsumexp(logits, block)
    tokens, logprobs = decode_sampler.triton_sample(logits, block_max, logsumexp, noise, k, block, temperature, top_p)
    values, index, logsumexp = decode_sampler.top_k_and_logsumexp(logits, k, block)
    expected_tokens, expected_logprobs = decode_sampler.torch_draw(values, index, logsumexp, noise, temperature, top_p)
    return tokens, logprobs, expected_tokens, expected_logprobs


@pytest.mark.parametrize("temperature,top_p,k", SETTINGS)
@pytest.mark.parametrize("vocab,block", [(8001, 64), (8192, 128)])  # a padded last block; whole blocks
def test_kernel_draws_what_torch_draws(interpreted_triton, temperature, top_p, k, vocab, block):
    gen = torch.Generator().manual_seed(k * vocab)
    logits = torch.randn(16, vocab, generator=gen) * torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(4)[:, None]
    logits[3, : vocab // 2] = -math.inf  # whole blocks of -inf
    noise = torch.rand(16, k, generator=gen)
    tokens, logprobs, expected_tokens, expected_logprobs = draws(logits, noise, k, block, temperature, top_p)
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    assert torch.equal(tokens, expected_tokens)
    assert torch.allclose(logprobs, expected_logprobs, rtol=0, atol=1e-6)
    exact = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs.double(), exact, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_digit_width_draws_the_same(interpreted_triton, monkeypatch, dtype):
    """The search's bits per pass (float16's 19-bit keys rounded up to whole digits) change
    how the k-th largest is found, not what it is: the same tokens and log-probabilities as
    torch's draw, on logits with ties (integers) and without."""
    gen = torch.Generator().manual_seed(11)
    k, block = 20, 64
    logits = torch.cat([torch.randn(3, 8001, generator=gen) * 4,
                        torch.randint(-40, 40, (1, 8001), generator=gen).float() / 8]).to(dtype)
    noise = torch.rand(4, k, generator=gen)
    results = []
    for digit in (1, 2, 4, 8):
        monkeypatch.setattr(decode_sampler, "DIGIT_BITS", digit)
        tokens, logprobs, expected_tokens, expected_logprobs = draws(logits, noise, k, block, 1.1, 0.95)
        chosen = logits.float().gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.equal(chosen, logits.float().gather(-1, expected_tokens[:, None]).squeeze(-1))
        assert torch.allclose(logprobs, expected_logprobs, rtol=0, atol=1e-6)
        results.append((tokens, logprobs))
    assert all(torch.equal(t, results[0][0]) and torch.equal(p, results[0][1]) for t, p in results)
    with pytest.raises(ValueError, match="DIGIT_BITS 3"):
        decode_sampler.key_bits(dtype, 3)
    monkeypatch.setattr(decode_sampler, "DIGIT_BITS", 3)  # a bad setting is the caller's error, before the op
    with pytest.raises(ValueError, match="DIGIT_BITS 3"):
        decode_sampler.applies(logits, k, block)


def test_kernel_on_tied_bf16_logits_draws_a_candidate_of_the_same_value(interpreted_triton):
    """Qwen3's vocabulary in bf16 (values tie within the top 20) and rows of integer logits
    (ties everywhere): the token is one of the k largest, of the value torch's draw picks."""
    gen = torch.Generator().manual_seed(1)
    k, block = 20, 128
    logits = torch.cat([torch.randn(6, 151936, generator=gen) * 3,
                        torch.randint(-3, 4, (2, 151936), generator=gen).float()]).bfloat16()
    noise = torch.rand(8, k, generator=gen)
    tokens, logprobs, expected_tokens, expected_logprobs = draws(logits, noise, k, block, 1.1, 0.95)
    chosen = logits.float().gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.equal(chosen, logits.float().gather(-1, expected_tokens[:, None]).squeeze(-1))
    assert (chosen >= logits.float().topk(k).values[:, -1]).all()
    assert torch.allclose(logprobs, expected_logprobs, rtol=0, atol=1e-6)


def test_auto_falls_back_to_torch_once_when_the_kernel_fails(monkeypatch):
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "auto")
    monkeypatch.setattr(decode_sampler, "_AUTO_FAILURE", None)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(decode_sampler, "triton_sample", broken)
    gen = torch.Generator().manual_seed(2)
    logits, noise = torch.randn(4, 1000, generator=gen), torch.rand(4, 20, generator=gen)
    _, block_max, logsumexp = decode_sampler.block_maxima_and_logsumexp(logits, 16)
    with pytest.warns(RuntimeWarning, match="decode sampler: the Triton kernel failed .*no kernel"):
        tokens, logprobs = decode_sampler.sample(logits, block_max, logsumexp, noise, 20, 16, 1.1, 0.95)
    values, index, logsumexp = decode_sampler.top_k_and_logsumexp(logits, 20, 16)
    assert torch.equal(tokens, decode_sampler.torch_draw(values, index, logsumexp, noise, 1.1, 0.95)[0])
    assert decode_sampler._AUTO_FAILURE == "RuntimeError: no kernel"


def test_where_the_kernel_applies(monkeypatch):
    logits = torch.zeros(2, 1000)
    assert decode_sampler.IMPLEMENTATION == "auto"
    assert not decode_sampler.applies(logits, 20, 16)  # "auto" on a CPU: torch
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "torch")
    assert not decode_sampler.applies(logits, 20, 16)
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "triton")
    assert decode_sampler.applies(logits, 20, 16)  # 63 blocks
    assert not decode_sampler.applies(logits, 20, 64)  # 16 blocks: fewer than k
    assert not decode_sampler.applies(logits, 20, 24)  # not a power of two
    assert not decode_sampler.applies(logits, decode_sampler.MAX_K + 1, 8)
    assert not decode_sampler.applies(logits.double(), 20, 16)
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "fast")
    with pytest.raises(ValueError, match="decode sampler 'fast': expected one of auto, torch, triton"):
        decode_sampler.applies(logits, 20, 16)


def test_a_callers_error_is_not_taken_for_a_kernel_failure(monkeypatch):
    """Mismatched inputs raise before the op: "auto" keeps the kernel."""
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "auto")
    monkeypatch.setattr(decode_sampler, "_AUTO_FAILURE", None)
    logits = torch.zeros(2, 1000)
    _, block_max, logsumexp = decode_sampler.block_maxima_and_logsumexp(logits, 16)
    with pytest.raises(ValueError, match="noise \\[2, 5\\] .* top-k 20"):
        decode_sampler.sample(logits, block_max, logsumexp, torch.rand(2, 5), 20, 16, 1.0, 1.0)
    assert decode_sampler._AUTO_FAILURE is None


def test_sampler_takes_the_kernel_and_keeps_its_results(interpreted_triton, monkeypatch):
    """`_Sampler.sample` as the decode loop calls it: the kernel where it applies, the same
    tokens and log-probabilities as without it (float32 logits)."""
    gen = torch.Generator().manual_seed(3)
    logits, noise = torch.randn(8, 5000, generator=gen) * 2, torch.rand(8, 20, generator=gen)
    sampler = static_decode._Sampler(SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=1), 5000)
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "torch")
    expected = sampler.sample(logits, noise)
    launched = []
    original = decode_sampler.triton_sample
    monkeypatch.setattr(decode_sampler, "triton_sample", lambda *a: launched.append(1) or original(*a))
    monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", "triton")
    got = sampler.sample(logits, noise)
    assert launched and torch.equal(got[0], expected[0]) and torch.allclose(got[1], expected[1], atol=1e-6)


def test_decode_loop_through_the_kernel_samples_what_torch_samples(interpreted_triton, monkeypatch):
    """The whole decode loop on the tiny model (float32, Qwen3's vocabulary), the recipe's
    sampling through the kernel: the same seeded tokens and log-probabilities as through torch."""
    from transformers import AutoModelForCausalLM

    from opsd import tiny_default
    from opsd.rollout import TransformersBackend

    model = AutoModelForCausalLM.from_pretrained(tiny_default.random_model_dir()).eval()
    rows = [[151644, 872, 198, 16, 10, 16], [151644, 872, 198, 50, 30, 20, 17, 10, 19, 24, 11], [87, 30]]
    settings = SamplingSettings(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=6, seed=7)
    results, launched = {}, []
    original = decode_sampler.triton_sample
    monkeypatch.setattr(decode_sampler, "triton_sample", lambda *a: launched.append(1) or original(*a))
    for implementation in ("torch", "triton"):
        monkeypatch.setattr(decode_sampler, "IMPLEMENTATION", implementation)
        backend = TransformersBackend(model, pad_token_id=151643, eos_token_ids=[151645], cache_implementation="graph")
        samples = [[c.ids for c in row] for row in backend.generate(rows, settings)]
        decoder = static_decode.StaticDecoder.for_model(model)
        results[implementation] = samples, decoder.sampled_logprobs(len(rows)).clone()
        decoder.release()
    assert len(launched) == settings.max_new_tokens  # the prefill's draw and every decode step's
    assert results["triton"][0] == results["torch"][0]
    assert torch.allclose(results["triton"][1], results["torch"][1], rtol=0, atol=1e-6)
