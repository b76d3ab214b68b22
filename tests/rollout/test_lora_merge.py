"""opsd/rollout/kernels/lora_merge.py: W + scaling * B @ A rounded once, in Triton's CPU interpreter (conftest switches
it on without a GPU) against float64, and the merged sampling copy refreshed through it.

Half precision here is float16: the interpreter converts float32 to bfloat16 by truncation
(a GPU rounds to nearest), so it cannot check a bfloat16 merge's rounding."""

import pytest
import torch

from opsd.rollout.kernels import lora_merge as lora_merge

# ulp of each dtype at 1.0: a merge rounded once is within half of it (relative) of the exact value
EPSILON = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}


@pytest.fixture
def kernel(interpreted_triton, monkeypatch):
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "triton")
    monkeypatch.setattr(lora_merge, "_AUTO_FAILURE", None)


def operands(n, k, r, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k, generator=gen).to(dtype)
    a, b = torch.randn(r, k, generator=gen) * 0.1, torch.randn(n, r, generator=gen) * 0.1  # peft's float32 adapters
    return base, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,r", [(128, 256, 64), (70, 200, 5), (1, 16, 1)])  # whole tiles; ragged; one row
def test_kernel_rounds_the_exact_merge_once(kernel, dtype, n, k, r):
    base, a, b = operands(n, k, r, dtype)
    out = torch.empty_like(base)
    lora_merge.triton_merge(out, base, a, b, 2.5)
    exact = base.double() + 2.5 * (b.double() @ a.double())
    # one rounding to the dtype (half its ulp), after float32 arithmetic whose error is bounded
    # by the terms' magnitudes (r products and the addition, a few float32 ulps each)
    terms = base.double().abs() + 2.5 * (b.double().abs() @ a.double().abs())
    tolerance = 0.5 * EPSILON[dtype] * exact.abs() + (r + 2) * EPSILON[torch.float32] * terms
    assert ((out.double() - exact).abs() <= tolerance).all()
    reference = torch.empty_like(base)
    lora_merge.torch_merge(reference, base, [(a, b, 2.5)])
    # torch's float32 sum over r may differ in its last bits, so the rounded weights by one ulp at most
    assert ((out.double() - reference.double()).abs() <= EPSILON[dtype] * exact.abs() + 2 * tolerance).all()


def test_merge_writes_a_view_of_a_stacked_weight_and_nothing_else(kernel):
    """`out` a row slice of a stacked weight, `base` a column slice of a wider one: each
    operand's own row stride (96 against 130)."""
    base, a, b = operands(48, 96, 8, torch.float16, seed=1)
    base = torch.cat([torch.zeros(48, 34, dtype=torch.float16), base], dim=1)[:, 34:]
    assert base.stride(0) == 130
    stacked = torch.full((3 * 48, 96), 7.0, dtype=torch.float16)
    middle = stacked[48:96]
    lora_merge.merge(middle, base, [(a, b, 0.5)])
    expected = torch.empty_like(base)
    lora_merge.torch_merge(expected, base, [(a, b, 0.5)])
    assert torch.allclose(middle.float(), expected.float(), rtol=2 * EPSILON[torch.float16], atol=0)
    assert (middle == expected).double().mean() >= 0.99  # the same rounding, but at float32 ties
    assert (stacked[:48] == 7).all() and (stacked[96:] == 7).all()


def test_several_adapters_and_float64_merge_in_torch(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(lora_merge, "triton_merge", lambda *args: calls.append(args))
    base, a, b = operands(32, 64, 4, torch.float64, seed=2)
    out = torch.empty_like(base)
    lora_merge.merge(out, base, [(a, b, 1.0)])  # float64: the kernel's float32 would lose precision
    assert torch.allclose(out, base + b.double() @ a.double(), rtol=0, atol=1e-12)
    out32 = torch.empty_like(base, dtype=torch.float32)
    lora_merge.merge(out32, base.float(), [(a, b, 1.0), (a, b, 2.0)])  # two adapters
    assert torch.allclose(out32.double(), base + 3 * (b.double() @ a.double()), rtol=0, atol=1e-5)
    assert calls == []


def test_a_failing_kernel_falls_back_to_torch_under_auto(monkeypatch):
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "auto")
    monkeypatch.setattr(lora_merge, "_AUTO_FAILURE", None)
    monkeypatch.setattr(lora_merge.triton_support, "runs_on", lambda tensor: True)  # as on a GPU

    def broken(*args):
        raise RuntimeError("no merge kernel here")

    monkeypatch.setattr(lora_merge, "triton_merge", broken)
    base, a, b = operands(16, 32, 2, torch.float16, seed=3)
    out = torch.empty_like(base)
    with pytest.warns(RuntimeWarning, match="no merge kernel here"):
        lora_merge.merge(out, base, [(a, b, 1.0)])
    expected = torch.empty_like(base)
    lora_merge.torch_merge(expected, base, [(a, b, 1.0)])
    assert torch.equal(out, expected)
    assert "no merge kernel here" in lora_merge._AUTO_FAILURE
    assert not lora_merge.applies(out, base, [(a, b, 1.0)])  # "auto" stopped choosing it
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "triton")
    with pytest.raises(RuntimeError, match="no merge kernel here"):  # a forced kernel's failure is an error
        lora_merge.merge(out, base, [(a, b, 1.0)])


def test_when_the_kernel_applies(monkeypatch):
    base, a, b = operands(16, 32, 2, torch.bfloat16)
    out = torch.empty_like(base)
    monkeypatch.setattr(lora_merge, "_AUTO_FAILURE", None)
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "auto")
    assert not lora_merge.applies(out, base, [(a, b, 1.0)])  # CPU under "auto": torch
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "triton")
    assert lora_merge.applies(out, base, [(a, b, 1.0)])
    assert not lora_merge.applies(out, base, [(a, b, 1.0)] * 2)  # several adapters
    assert not lora_merge.applies(out, base, [(a[:1], b, 1.0)])  # ranks that do not match
    assert not lora_merge.applies(out.t(), base.t(), [(b.t(), a.t(), 1.0)])  # rows not contiguous
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "torch")
    assert not lora_merge.applies(out, base, [(a, b, 1.0)])
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "fused")
    with pytest.raises(ValueError, match="expected one of"):
        lora_merge.applies(out, base, [(a, b, 1.0)])


def test_merged_copy_refreshes_through_the_kernel(kernel, monkeypatch):
    """Every adapted projection of the merged sampling copy (stacked q/k/v and gate/up views
    included) is filled by the kernel, to what torch's merge fills, in float32."""
    from test_fused_projections import random_model, with_lora

    from opsd.rollout.merged_student import MergedStudent

    model = with_lora(random_model("qwen3", torch.float32))
    merged = MergedStudent(model)
    calls = []
    kernel = lora_merge.triton_merge
    monkeypatch.setattr(lora_merge, "triton_merge", lambda *args: calls.append(1) or kernel(*args))
    merged.refresh()
    through_kernel = {name: p.detach().clone() for name, p in merged.network.named_parameters()}
    assert len(calls) == len(merged._targets) > 0
    monkeypatch.setattr(lora_merge, "IMPLEMENTATION", "torch")
    merged.refresh()
    for name, p in merged.network.named_parameters():
        assert torch.allclose(through_kernel[name], p, rtol=4 * EPSILON[torch.float32], atol=1e-7), name
