"""opsd/rollout/kernels/matmul.py: the split-K kernel of the decode step's narrow products against float64
products written here, where `linear` uses it, and the decode loop through it.

The Triton kernel runs in Triton's CPU interpreter (conftest switches it on without a GPU),
the same source the GPU compiles. The interpreter has no bfloat16 matrix product, so the
half-precision case is float16."""

import pytest
import torch
import torch.nn.functional as F

from opsd.rollout.kernels import matmul as decode_matmul
from opsd.rollout.kernels.matmul import GatedConfig, LaunchConfig


@pytest.fixture
def interpreted_triton(interpreted_triton, monkeypatch):
    """conftest's (Triton's CPU interpreter), with the kernel forced."""
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "split_k")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("rows,n,k,config", [
    (32, 96, 256, LaunchConfig(32, 64, 2, 4, 2)),   # two splits of two iterations each
    (5, 70, 200, LaunchConfig(32, 64, 3, 4, 2)),    # ragged everything: rows, columns, K past the last block
    (17, 64, 128, LaunchConfig(64, 128, 1, 4, 2)),  # no split
    (3, 40, 64, LaunchConfig(16, 16, 8, 4, 2)),     # 8 splits asked, K fills 4: the rest hold zeros
])
def test_partials_sum_to_the_float64_product(interpreted_triton, dtype, tolerance, rows, n, k, config):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    partials = decode_matmul.split_k_partials(x, weight, config)
    assert partials.shape == (config.splits, rows, n) and partials.dtype == torch.float32
    expected = x.double() @ weight.double().T
    assert (partials.sum(0).double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_linear_through_the_kernel_is_f_linear(interpreted_triton, monkeypatch):
    """Leading dimensions, a bias, and several splits summed elementwise; more rows than
    MAX_ROWS go to F.linear."""
    calls = []
    kernel = decode_matmul.split_k_partials
    monkeypatch.setattr(decode_matmul, "split_k_partials", lambda *a: calls.append(a[0].shape) or kernel(*a))
    monkeypatch.setattr(decode_matmul, "launch_config", lambda n, k, processors: LaunchConfig(32, 32, 4, 4, 2))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1, 128, generator=gen)
    weight, bias = torch.randn(48, 128, generator=gen), torch.randn(48, generator=gen)
    got = decode_matmul.linear(x, weight, bias)
    assert calls == [(6, 128)]
    assert got.shape == (6, 1, 48)
    assert torch.allclose(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    many = torch.randn(decode_matmul.MAX_ROWS + 1, 128, generator=gen)
    assert torch.equal(decode_matmul.linear(many, weight), F.linear(many, weight))
    assert len(calls) == 1


def test_the_op_passes_torchs_custom_op_checks(interpreted_triton):
    """Schema, fake tensor and tracing checks: what torch.compile relies on when it keeps
    the op whole in the decode step."""
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, 64, generator=gen), torch.randn(40, 64, generator=gen)
    result = torch.library.opcheck(decode_matmul._partials_op, (x, weight, 16, 16, 2, 4, 2))
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_failing_kernel_falls_back_to_f_linear_under_auto(monkeypatch):
    monkeypatch.setattr(decode_matmul, "_AUTO_FAILURE", None)
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "auto")

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(decode_matmul, "split_k_partials", broken)
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(3, 64, generator=gen), torch.randn(40, 64, generator=gen)
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        partials = decode_matmul._partials_op(x, weight, 16, 16, 2, 4, 2)
    assert partials.shape == (2, 3, 40)
    assert torch.allclose(partials.sum(0), F.linear(x, weight), atol=1e-6)
    assert "no kernel here" in decode_matmul._AUTO_FAILURE
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "split_k")
    with pytest.raises(RuntimeError, match="no kernel here"):  # a forced kernel's failure is an error
        decode_matmul._partials_op(x, weight, 16, 16, 2, 4, 2)


def test_when_the_kernel_applies(monkeypatch):
    x, square, wide = torch.zeros(4, 64), torch.zeros(64, 64), torch.zeros(128, 64)
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "auto")
    assert not decode_matmul.applies(x, square)  # CPU under "auto": F.linear
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "split_k")
    assert decode_matmul.applies(x, square) and decode_matmul.applies(x, wide)
    assert not decode_matmul.applies(torch.zeros(decode_matmul.MAX_ROWS + 1, 64), square)
    assert not decode_matmul.applies(x, square.double())  # mixed dtypes
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "torch")
    assert not decode_matmul.applies(x, square)
    monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", "cublas")
    with pytest.raises(ValueError, match="expected one of"):
        decode_matmul.applies(x, square)


def test_launch_config_fills_the_multiprocessors_with_whole_splits():
    """Qwen3-1.7B's o (2048 -> 2048) and down (6144 -> 2048) projections on an H200's 132
    multiprocessors: splits until about one program per multiprocessor, each split a whole
    number of iterations."""
    for n, k, splits in [(2048, 2048, 4), (2048, 6144, 8)]:
        config = decode_matmul.launch_config(n, k, 132)
        assert config.splits == splits
        assert k % (config.splits * config.block_k) == 0
    assert decode_matmul.launch_config(151936, 2048, 132).splits == 1  # enough column blocks already


def test_decode_loop_samples_the_same_tokens_through_the_kernel(interpreted_triton, monkeypatch):
    """The merged copy's o and down projections (and every other product: "split_k" forces it
    wherever it can run) through the kernel sample what F.linear samples."""
    from test_fused_projections import GREEDY, SAMPLE, random_model, sample, with_lora

    from opsd.rollout.static_decode import StaticDecoder

    model = with_lora(random_model("qwen3", torch.float32))
    calls = []
    kernel = decode_matmul.split_k_partials
    monkeypatch.setattr(decode_matmul, "split_k_partials", lambda *a: calls.append(1) or kernel(*a))
    results = {}
    for implementation in ("torch", "split_k"):
        monkeypatch.setattr(decode_matmul, "IMPLEMENTATION", implementation)
        results[implementation] = sample(model, GREEDY), sample(model, SAMPLE)
        StaticDecoder.for_model(model, merge_lora=True).release()
        assert bool(calls) == (implementation == "split_k")
    assert results["torch"] == results["split_k"]


def gated_reference(x, weight, dtype):
    """SiLU(gate) * up in float64 from each product rounded to `dtype`, as F.linear's outputs are."""
    gate, up = (x.double() @ weight.double().T).to(dtype).double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.fixture
def gated_kernel(interpreted_triton, monkeypatch):
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "triton")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows,n,k,config", [
    (32, 64, 256, GatedConfig(32, 64, 4, 2)),   # two blocks of columns, four iterations
    (5, 40, 200, GatedConfig(32, 64, 4, 2)),    # ragged rows, columns, and K past the last block
    (1, 16, 16, GatedConfig(16, 16, 4, 2)),     # one row, one iteration
])
def test_gated_kernel_is_silu_gate_times_up(gated_kernel, dtype, tolerance, rows, n, k, config):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(2 * n, k, generator=gen) * k ** -0.5).to(dtype)
    got = decode_matmul.silu_gated_rows(x, weight, config)
    assert got.shape == (rows, n) and got.dtype == dtype
    expected = gated_reference(x, weight, dtype)
    assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()
    if dtype == torch.float16:
        # element by element: the kernel rounds each product to float16 before the gating, so nearly
        # every output is the reference's rounding (a product's sum lying near a rounding boundary
        # may round the other way; gating unrounded products matches far fewer)
        assert (got == expected.to(dtype)).double().mean() >= 0.98


def test_silu_gated_keeps_leading_dimensions_and_falls_to_torch_beyond_max_rows(gated_kernel, monkeypatch):
    calls = []
    kernel = decode_matmul.silu_gated_rows
    monkeypatch.setattr(decode_matmul, "silu_gated_rows", lambda *a: calls.append(a[0].shape) or kernel(*a))
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(6, 1, 128, generator=gen), torch.randn(96, 128, generator=gen)
    got = decode_matmul.silu_gated(x, weight)
    assert calls == [(6, 128)] and got.shape == (6, 1, 48)
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    many = torch.randn(decode_matmul.MAX_ROWS + 1, 128, generator=gen)
    gate, up = F.linear(many, weight).chunk(2, dim=-1)
    assert torch.equal(decode_matmul.silu_gated(many, weight), F.silu(gate) * up)
    assert len(calls) == 1


def test_the_gated_op_passes_torchs_custom_op_checks(gated_kernel):
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(3, 64, generator=gen), torch.randn(80, 64, generator=gen)
    result = torch.library.opcheck(decode_matmul._gated_op, (x, weight, 16, 16, 4, 2))
    assert set(result.values()) == {"SUCCESS"}, result


def test_a_failing_gated_kernel_falls_back_to_torch_under_auto(monkeypatch):
    monkeypatch.setattr(decode_matmul, "_GATED_AUTO_FAILURE", None)
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "auto")

    def broken(*args):
        raise RuntimeError("no gated kernel here")

    monkeypatch.setattr(decode_matmul, "silu_gated_rows", broken)
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(3, 64, generator=gen), torch.randn(80, 64, generator=gen)
    with pytest.warns(RuntimeWarning, match="no gated kernel here"):
        got = decode_matmul._gated_op(x, weight, 16, 16, 4, 2)
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-6)
    assert "no gated kernel here" in decode_matmul._GATED_AUTO_FAILURE
    assert not decode_matmul.gated_applies(x, weight)  # "auto" stopped choosing it
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "triton")
    with pytest.raises(RuntimeError, match="no gated kernel here"):  # a forced kernel's failure is an error
        decode_matmul._gated_op(x, weight, 16, 16, 4, 2)


def test_when_the_gated_kernel_applies(monkeypatch):
    x, stacked = torch.zeros(4, 64), torch.zeros(128, 64)
    monkeypatch.setattr(decode_matmul, "_GATED_AUTO_FAILURE", None)
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "auto")
    assert not decode_matmul.gated_applies(x.half(), stacked.half())  # CPU under "auto": torch
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "triton")
    assert decode_matmul.gated_applies(x, stacked)
    assert not decode_matmul.gated_applies(x, stacked[:127])  # no equal halves
    assert not decode_matmul.gated_applies(torch.zeros(decode_matmul.MAX_ROWS + 1, 64), stacked)
    assert not decode_matmul.gated_applies(x, stacked.double())
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "torch")
    assert not decode_matmul.gated_applies(x, stacked)
    monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", "cublas")
    with pytest.raises(ValueError, match="expected one of"):
        decode_matmul.gated_applies(x, stacked)


def test_decode_loop_samples_the_same_tokens_through_the_gated_kernel(gated_kernel, monkeypatch):
    """The merged copy's MLPs with product and gating in one kernel sample what the product
    and torch's SiLU sample (float32, so the rounding of the products is the same)."""
    from test_fused_projections import GREEDY, SAMPLE, random_model, sample, with_lora

    from opsd.rollout.static_decode import StaticDecoder

    model = with_lora(random_model("qwen3", torch.float32))
    calls = []
    kernel = decode_matmul.silu_gated_rows
    monkeypatch.setattr(decode_matmul, "silu_gated_rows", lambda *a: calls.append(1) or kernel(*a))
    results = {}
    for implementation in ("torch", "triton"):
        monkeypatch.setattr(decode_matmul, "GATED_IMPLEMENTATION", implementation)
        results[implementation] = sample(model, GREEDY), sample(model, SAMPLE)
        StaticDecoder.for_model(model, merge_lora=True).release()
        assert bool(calls) == (implementation == "triton")
    assert results["torch"] == results["triton"]
