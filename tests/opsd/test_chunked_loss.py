"""opsd.chunked_loss equals opsd.loss on the full logits hidden @ W.T (+ bias).

float64 on CPU, small vocabulary: loss, every stat and the gradients wrt the
hidden states, the LM head weight and bias must agree for every option and chunk
size (1, a divisor-free 8, 64 and more than N).
"""
import pytest
import torch

from opsd import chunked_loss
from opsd.chunked_loss import (
    DivergenceObjective,
    chunked_divergence_loss,
    chunked_tinker_loss,
    forward_kl_logit_grad,
)
from opsd.loss import DIVERGENCE_STAT_KEYS, TINKER_STAT_KEYS, DivergenceConfig, divergence_loss, tinker_loss

F64 = torch.float64
N, H, V = 37, 16, 300
CHUNK_SIZES = [1, 8, 64, 100]


def make_inputs(n=N, seed=0, with_bias=False, dtype=F64):
    """Hidden states and a head whose logits spread widely (std ~6), so the clip fires;
    every fifth teacher token is close to its student token (unclipped tokens exist)."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(n, H, generator=gen, dtype=F64)
    teacher = torch.randn(n, H, generator=gen, dtype=F64)
    teacher[::5] = student[::5] + 0.01 * torch.randn(teacher[::5].shape, generator=gen, dtype=F64)
    weight = 1.5 * torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64) if with_bias else None
    leaves = [student.to(dtype).requires_grad_(True), teacher.to(dtype), weight.to(dtype).requires_grad_(True)]
    if bias is not None:
        bias = bias.to(dtype).requires_grad_(True)
    return (*leaves, bias)


def full_logits(hidden, weight, bias):
    """[1, n, V] logits for the reference functions, which take [B, C, V]."""
    logits = hidden @ weight.T
    return (logits if bias is None else logits + bias).unsqueeze(0)


def grads(loss, tensors):
    """Gradients of 2.5 * loss (a non-unit upstream gradient is part of the contract)."""
    params = [t for t in tensors if t is not None]
    return torch.autograd.grad(2.5 * loss, params)


def assert_same(loss, stats, expected_loss, expected_stats, got_grads, expected_grads):
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-13)
    assert stats.keys() == expected_stats.keys()
    for key in stats:
        assert not stats[key].requires_grad
        torch.testing.assert_close(stats[key], expected_stats[key], rtol=1e-10, atol=1e-13, msg=key)
    for got, expected in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-14)


OPTIONS = [
    {"beta": 0.0},  # the released default: analytic backward
    {"beta": 0.0, "clip": None, "temperature": 1.7},
    {"beta": 0.0, "clip_mode": "token"},
    {"beta": 0.0, "top_k": 10},
    {"beta": 1.0},
    {"beta": 1.0, "clip_mode": "token", "temperature": 0.6, "top_k": 25},
    {"beta": 0.5},
    {"beta": 0.5, "clip": 0},
    {"beta": 0.5, "clip_mode": "token", "top_k": 10, "temperature": 1.3},
]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_divergence_matches_reference(opts, chunk_size):
    student, teacher, weight, _ = make_inputs()
    loss, stats = chunked_divergence_loss(student, teacher, weight, chunk_size=chunk_size, **opts)
    got = grads(loss, [student, weight])

    mask = torch.ones(1, N)
    expected_loss, expected_stats = divergence_loss(
        full_logits(student, weight, None), full_logits(teacher, weight, None), mask, **opts
    )
    assert_same(loss, stats, expected_loss, expected_stats, got, grads(expected_loss, [student, weight]))
    assert set(stats) == set(DIVERGENCE_STAT_KEYS)
    if opts.get("clip", 0.05):
        assert 0 < float(stats["clipped_token_frac"]) < 1


@pytest.mark.parametrize("chunk_size", [8, 100])
def test_bias_and_frozen_head(chunk_size):
    student, teacher, weight, bias = make_inputs(with_bias=True)
    opts = {"beta": 0.5, "clip_mode": "entry", "top_k": 20, "temperature": 1.2}
    loss, stats = chunked_divergence_loss(
        student, teacher, weight, lm_head_bias=bias, chunk_size=chunk_size, **opts
    )
    expected_loss, expected_stats = divergence_loss(
        full_logits(student, weight, bias), full_logits(teacher, weight, bias), torch.ones(1, N), **opts
    )
    params = [student, weight, bias]
    assert_same(loss, stats, expected_loss, expected_stats, grads(loss, params), grads(expected_loss, params))

    # Frozen head (the usual LoRA case): only the hidden states get a gradient.
    frozen = weight.detach()
    loss, _ = chunked_divergence_loss(student, teacher, frozen, chunk_size=chunk_size, **opts)
    loss.backward()
    assert frozen.grad is None and student.grad is not None


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_tinker_matches_reference(temperature, chunk_size):
    student, teacher, weight, _ = make_inputs()
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    loss, stats = chunked_tinker_loss(student, teacher, weight, ids, temperature=temperature, chunk_size=chunk_size)
    expected_loss, expected_stats = tinker_loss(
        full_logits(student, weight, None), full_logits(teacher, weight, None), ids.unsqueeze(0),
        torch.ones(1, N), temperature=temperature,
    )
    params = [student, weight]
    assert_same(loss, stats, expected_loss, expected_stats, grads(loss, params), grads(expected_loss, params))
    assert set(stats) == set(TINKER_STAT_KEYS)


def test_no_tokens_gives_zero_loss_with_grad_path():
    student, teacher, weight, _ = make_inputs(n=0)
    for loss, stats in (
        chunked_divergence_loss(student, teacher, weight, beta=0.5, top_k=4),
        chunked_tinker_loss(student, teacher, weight, torch.zeros(0, dtype=torch.long)),
    ):
        assert loss.item() == 0 and loss.grad_fn is not None
        g_hidden, g_weight = torch.autograd.grad(loss, [student, weight])
        assert g_hidden.shape == (0, H) and float(g_weight.abs().sum()) == 0
        assert all(float(v) == 0 for v in stats.values())


@pytest.mark.parametrize("clip", [0.05, None])
def test_analytic_forward_kl_grad_equals_autograd(clip):
    cfg = DivergenceConfig(beta=0.0, temperature=1.4, clip=clip)
    student, teacher, weight, _ = make_inputs()
    s_logits, t_logits = (student @ weight.T).detach(), (teacher @ weight.T).detach()
    assert DivergenceObjective(cfg).analytic
    autograd = DivergenceObjective(cfg, use_analytic_grad=False)
    assert not autograd.analytic
    expected = autograd.logit_grad(s_logits, t_logits, slice(0, N))
    torch.testing.assert_close(forward_kl_logit_grad(s_logits, t_logits, cfg), expected, rtol=1e-10, atol=1e-15)


def test_never_projects_more_than_a_chunk(projected_rows):
    """Forward and backward only ever build [<= chunk_size, V] logits."""
    student, teacher, weight, _ = make_inputs()
    for beta in (0.0, 0.5):
        loss, _ = chunked_divergence_loss(student, teacher, weight, beta=beta, chunk_size=8)
        loss.backward()
    assert max(projected_rows) == 8 and sum(projected_rows) == 4 * 2 * N  # 2 roles x (forward + backward) x 2 runs


def test_bf16_hidden_states_close_to_float64():
    student64, teacher64, weight64, _ = make_inputs()
    student = student64.detach().to(torch.bfloat16).requires_grad_(True)
    teacher, weight = teacher64.to(torch.bfloat16), weight64.detach().to(torch.bfloat16)
    loss, stats = chunked_divergence_loss(student, teacher, weight, temperature=1.1, chunk_size=16)
    loss.backward()
    assert loss.dtype == torch.float32 and student.grad.dtype == torch.bfloat16

    # Same bf16-rounded inputs in float64: the computation itself runs in float32,
    # only the returned bf16 gradient is rounded.
    student_exact = student.detach().double().requires_grad_(True)
    exact, exact_stats = chunked_divergence_loss(student_exact, teacher.double(), weight.double(), temperature=1.1)
    exact.backward()
    assert abs(loss.item() - exact.item()) <= 1e-5 * abs(exact.item())
    assert abs(float(stats["true_kl"]) - float(exact_stats["true_kl"])) <= 1e-5 * float(exact_stats["true_kl"])
    error = (student.grad.double() - student_exact.grad).norm() / student_exact.grad.norm()
    assert error < 1e-2


def test_teacher_hidden_gets_no_gradient():
    student, teacher, weight, _ = make_inputs()
    teacher.requires_grad_(True)
    loss, _ = chunked_divergence_loss(student, teacher, weight, beta=1.0, clip_mode="token")
    loss.backward()
    assert teacher.grad is None and student.grad is not None


@pytest.mark.parametrize(
    "kwargs",
    [{"beta": 2.0}, {"chunk_size": 0}, {"top_k": -3}],
)
def test_invalid_arguments_raise(kwargs):
    student, teacher, weight, _ = make_inputs()
    with pytest.raises(ValueError):
        chunked_divergence_loss(student, teacher, weight, **kwargs)


def test_an_undeclared_clip_mode_has_no_clip_function():
    """As divergence_loss: the mode was validated where it was read; here only CLIPS picks."""
    student, teacher, weight, _ = make_inputs()
    with pytest.raises(KeyError):
        chunked_divergence_loss(student, teacher, weight, clip_mode="per-token", clip=0.05)


def test_shape_mismatch_raises():
    student, teacher, weight, _ = make_inputs()
    with pytest.raises(ValueError):
        chunked_divergence_loss(student, teacher[:5], weight)
    with pytest.raises(ValueError):
        chunked_divergence_loss(student, teacher, weight[:, :4])
    with pytest.raises(ValueError):
        chunked_tinker_loss(student, teacher, weight, torch.zeros(N + 1, dtype=torch.long))


COMPILE_OPTIONS = [{"beta": 0.0}, {"beta": 0.5, "clip_mode": "token", "top_k": 10, "temperature": 1.3}]
COMPILE_IDS = ["analytic-grad", "autograd-grad"]


def check_against_reference(opts, chunk_size, **kwargs):
    student, teacher, weight, _ = make_inputs()
    loss, stats = chunked_divergence_loss(student, teacher, weight, chunk_size=chunk_size, **opts, **kwargs)
    got = grads(loss, [student, weight])
    expected_loss, expected_stats = divergence_loss(
        full_logits(student, weight, None), full_logits(teacher, weight, None), torch.ones(1, N), **opts
    )
    assert_same(loss, stats, expected_loss, expected_stats, got, grads(expected_loss, [student, weight]))


@pytest.mark.parametrize("chunk_size", [8, 64])
@pytest.mark.parametrize("opts", COMPILE_OPTIONS, ids=COMPILE_IDS)
def test_fixed_chunks_pad_and_drop_rows(monkeypatch, opts, chunk_size):
    """compile=True projects exactly chunk_size rows every time (N = 37: the last chunk of 8
    carries 3 padding rows, the single chunk of 64 carries 27) and the padding rows leave
    no trace in the loss, stats or gradients. The padding here is random and different for
    the two roles (zeros would give zero divergence and hide a leak); torch.compile itself
    is replaced by the identity (the next test compiles for real)."""
    rows_seen = []
    pad_rows = chunked_loss._chunk_rows
    gen = torch.Generator().manual_seed(7)

    def random_padding(hidden, rows, pad_to):
        part = pad_rows(hidden, rows, pad_to)
        real = rows.stop - rows.start
        if pad_to is not None and real < pad_to:
            part = part.clone()
            part[real:] = 3.0 * torch.randn(part[real:].shape, generator=gen, dtype=part.dtype)
        rows_seen.append(part.shape[0])
        return part

    monkeypatch.setattr(chunked_loss, "_compiled", lambda fn: fn)
    monkeypatch.setattr(chunked_loss, "_chunk_rows", random_padding)
    check_against_reference(opts, chunk_size, compile=True)
    assert set(rows_seen) == {chunk_size}


@pytest.mark.parametrize("opts", COMPILE_OPTIONS, ids=COMPILE_IDS)
def test_compiled_chunk_math_matches_reference(opts):
    """The trainer's GPU default (compile_loss): the per-chunk math through torch.compile
    (inductor on CPU here), float64, against the reference on full logits."""
    check_against_reference(opts, chunk_size=16, compile=True)


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_nll_matches_reference(chunk_size):
    from opsd.chunked_loss import chunked_nll_loss
    from opsd.loss import NLL_STAT_KEYS, nll_loss

    student, teacher, weight, _ = make_inputs()
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    loss, stats = chunked_nll_loss(student, teacher, weight, ids, chunk_size=chunk_size)
    expected_loss, expected_stats = nll_loss(
        full_logits(student, weight, None), full_logits(teacher, weight, None), ids.unsqueeze(0), torch.ones(1, N))
    params = [student, weight]
    assert_same(loss, stats, expected_loss, expected_stats, grads(loss, params), grads(expected_loss, params))
    assert set(stats) == set(NLL_STAT_KEYS)
