"""opsd.loss against an independent float64 reference written from docs/SPEC.md §2.

The reference below loops over tokens and spells each formula out (explicit
softmax, explicit mixture M, explicit clip), without calling any helper of the
module under test.
"""
import math

import pytest
import torch

from opsd.loss import DIVERGENCE_STAT_KEYS, TINKER_STAT_KEYS, divergence_loss, tinker_loss, token_clip_scale

F64 = torch.float64
CLIP_STAT_KEYS = ("clipped_entry_frac", "clipped_token_frac", "teacher_argmax_clipped_frac", "clipped_teacher_mass")


# --------------------------------------------------------------------------- reference


def ref_log_softmax(x):
    shifted = x - x.max()
    return shifted - torch.log(torch.exp(shifted).sum())


def ref_entries(ls, lt, beta):
    """l_v for one token from log-probs ls (student), lt (teacher)."""
    ps, pt = torch.exp(ls), torch.exp(lt)
    if beta == 0:
        return pt * (lt - ls)
    if beta == 1:
        return ps * (ls - lt)
    m = beta * pt + (1 - beta) * ps
    return beta * pt * torch.log(pt / m) + (1 - beta) * ps * torch.log(ps / m)


def ref_token(s, t, *, beta, temperature, clip, clip_mode, top_k):
    """(D_n differentiable in s, stats dict of floats) for one token's 1-D logits."""
    t = t.detach()
    ls_full, lt_full = ref_log_softmax(s.detach() / temperature), ref_log_softmax(t / temperature)
    stats = {
        "true_kl": float((torch.exp(lt_full) * (lt_full - ls_full)).sum()),
        "student_entropy": float(-(torch.exp(ls_full) * ls_full).sum()),
        "teacher_entropy": float(-(torch.exp(lt_full) * lt_full).sum()),
    }
    if top_k:
        keep = torch.argsort(t, descending=True)[: min(top_k, t.numel())]
        s, t = s[keep], t[keep]
    ls, lt = ref_log_softmax(s / temperature), ref_log_softmax(t / temperature)
    entries = ref_entries(ls, lt, beta)
    raw = entries.sum()
    raw_value = raw.item()
    stats["loss_unclipped"] = raw_value
    tau = clip or 0.0
    zero = dict.fromkeys(CLIP_STAT_KEYS, 0.0)
    if tau == 0:
        return raw, {**stats, **zero}
    if clip_mode == "token":
        scale = tau / raw_value if raw_value > tau else 1.0
        return raw * scale, {**stats, **zero, "clipped_token_frac": float(raw_value > tau)}
    over = entries.detach() > tau
    # min(l_v, tau): a clipped entry becomes the constant tau (no gradient).
    capped = torch.where(over, torch.full_like(entries, tau).detach(), entries)
    stats.update(
        clipped_entry_frac=over.double().mean().item(),
        clipped_token_frac=float(over.any()),
        teacher_argmax_clipped_frac=float(over[torch.argmax(lt)]),
        clipped_teacher_mass=torch.exp(lt)[over].sum().item(),
    )
    return capped.sum(), stats


def ref_loss(student, teacher, mask, **opts):
    """Token mean over masked positions of ref_token; stats likewise."""
    total, stat_sums, count = torch.zeros((), dtype=F64), {}, 0
    for b in range(mask.shape[0]):
        for c in range(mask.shape[1]):
            if mask[b, c]:
                d, stats = ref_token(student[b, c], teacher[b, c], **opts)
                total = total + d
                count += 1
                for key, value in stats.items():
                    stat_sums[key] = stat_sums.get(key, 0.0) + value
    return total / max(count, 1), {k: v / max(count, 1) for k, v in stat_sums.items()}


def ref_tinker(student, teacher, ids, mask, temperature):
    total, count, adv_sum, kl_sum = torch.zeros((), dtype=F64), 0, 0.0, 0.0
    for b in range(mask.shape[0]):
        for c in range(mask.shape[1]):
            if mask[b, c]:
                ls = ref_log_softmax(student[b, c] / temperature)
                lt = ref_log_softmax(teacher[b, c].detach() / temperature)
                y = int(ids[b, c])
                advantage = (lt[y] - ls[y]).item()
                total = total - advantage * ls[y]
                adv_sum += advantage
                kl_sum += (torch.exp(lt) * (lt - ls)).sum().item()
                count += 1
    n = max(count, 1)
    return total / n, {"advantage_mean": adv_sum / n, "true_kl": kl_sum / n}


# --------------------------------------------------------------------------- inputs


def make_mask(batch, length):
    """Row 0 empty, row 1 with holes, other rows full up to a trailing pad (after EOS)."""
    mask = torch.ones(batch, length)
    mask[0] = 0
    mask[1, 1::2] = 0
    mask[2:, -1] = 0
    return mask


def make_logits(shape, spread=4.0, seed=0, dtype=F64):
    """Widely spread logits (so the clip fires); at the second-to-last position the
    teacher is close to the student (small divergence: unclipped tokens exist too)."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(shape, generator=gen, dtype=F64) * spread
    teacher = torch.randn(shape, generator=gen, dtype=F64) * spread
    teacher[:, -2] = student[:, -2] + 0.05 * torch.randn(shape[0], shape[2], generator=gen, dtype=F64)
    return student.to(dtype).requires_grad_(True), teacher.to(dtype)


def num(x):
    return x.item() if torch.is_tensor(x) else float(x)


def close(a, b, tol=1e-9):
    return abs(num(a) - num(b)) <= tol * (1 + abs(num(b)))


# --------------------------------------------------------------------------- loss, stats, gradients


SHAPES = [((3, 5, 7), 1.0, 4.0), ((3, 4, 64), 0.7, 4.0), ((3, 4, 5000), 1.5, 6.0)]
CLIPS = [("entry", 0.05), ("token", 0.05), ("entry", 0.0), ("token", None)]


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("clip_mode,clip", CLIPS)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
@pytest.mark.parametrize("shape,temperature,spread", SHAPES)
def test_matches_reference(shape, temperature, spread, beta, clip_mode, clip, top_k):
    opts = {"beta": beta, "temperature": temperature, "clip": clip, "clip_mode": clip_mode, "top_k": top_k}
    student, teacher = make_logits(shape, spread)
    mask = make_mask(shape[0], shape[1])

    loss, stats = divergence_loss(student, teacher, mask, **opts)
    (grad,) = torch.autograd.grad(loss, student)
    expected, expected_stats = ref_loss(student, teacher, mask, **opts)
    (expected_grad,) = torch.autograd.grad(expected, student)

    assert loss.dtype == F64 and close(loss, expected)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-7, atol=1e-12)
    assert set(stats) == set(DIVERGENCE_STAT_KEYS)
    for key in DIVERGENCE_STAT_KEYS:
        assert stats[key].dim() == 0 and not stats[key].requires_grad
        assert close(stats[key], expected_stats[key]), key
    if clip:  # the inputs are spread enough for the clip to act on some tokens
        assert expected_stats["clipped_token_frac"] > 0
        if clip_mode == "entry":
            assert 0 < expected_stats["clipped_entry_frac"] < 1
    else:
        assert all(float(stats[k]) == 0 for k in CLIP_STAT_KEYS)


def test_vocab_of_one_is_zero_loss():
    student, teacher = make_logits((3, 4, 1))
    loss, stats = divergence_loss(student, teacher, make_mask(3, 4), beta=0.5)
    loss.backward()
    assert loss.item() == 0 and float(student.grad.abs().sum()) == 0
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_forward_kl_entry_clip_gradient_is_analytic():
    """dL/ds = (p_S M - p_T 1[l_v <= tau]) / T / N, M = teacher mass on unclipped entries."""
    temperature, tau = 1.3, 0.05
    student, teacher = make_logits((3, 6, 40))
    mask = make_mask(3, 6)
    loss, _ = divergence_loss(student, teacher, mask, beta=0.0, temperature=temperature, clip=tau)
    (grad,) = torch.autograd.grad(loss, student)

    with torch.no_grad():
        p_s = torch.softmax(student / temperature, -1)
        p_t = torch.softmax(teacher / temperature, -1)
        entries = p_t * (torch.log(p_t) - torch.log(p_s))
        kept = (entries <= tau).to(F64)
        kept_mass = (p_t * kept).sum(-1, keepdim=True)
        expected = (p_s * kept_mass - p_t * kept) / temperature / mask.sum()
        expected = expected * mask.unsqueeze(-1)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-14)

    clipped = (kept == 0) & mask.bool().unsqueeze(-1)
    assert clipped.any()
    # Clipped entries keep only the normalisation push-down: no pull towards the teacher.
    assert (grad[clipped] > 0).all()
    unclipped_grad = (p_s - p_t) / temperature / mask.sum()
    assert (unclipped_grad[clipped] < 0).any()


def test_token_clip_scales_the_unclipped_gradient():
    """Per token: same direction as the unclipped gradient, scaled by tau / D_n if D_n > tau."""
    student, teacher = make_logits((3, 6, 30))
    mask = make_mask(3, 6)
    for beta in (0.0, 0.5):
        per_token = torch.stack([ref_token(student[b, c], teacher[b, c], beta=beta, temperature=1.0, clip=0,
                                           clip_mode="entry", top_k=0)[0].detach()
                                 for b in range(3) for c in range(6)]).view(3, 6)
        tau = float(per_token[mask.bool()].median())  # about half the tokens are capped

        (g_off,) = torch.autograd.grad(divergence_loss(student, teacher, mask, beta=beta, clip=None)[0], student)
        (g_tok,) = torch.autograd.grad(
            divergence_loss(student, teacher, mask, beta=beta, clip=tau, clip_mode="token")[0], student
        )
        rows = mask.bool()
        cosine = torch.nn.functional.cosine_similarity(g_tok[rows], g_off[rows], dim=-1)
        torch.testing.assert_close(cosine, torch.ones_like(cosine))
        scale = torch.where(per_token > tau, tau / per_token, torch.ones_like(per_token))
        torch.testing.assert_close(g_tok, g_off * scale.unsqueeze(-1), rtol=1e-9, atol=1e-15)
        assert (scale[rows] < 1).any() and (scale[rows] == 1).any()


def test_token_clip_scale_never_flips_or_inflates():
    """A tiny negative D_n from rounding must keep scale 1 (tau / D_n would flip the sign)."""
    raw = torch.tensor([-1e-9, 0.0, 0.01, 0.05, 0.1], dtype=F64, requires_grad=True)
    scale = token_clip_scale(raw, 0.05)
    torch.testing.assert_close(scale, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5], dtype=F64))
    assert not scale.requires_grad


def test_entry_clip_loss_can_be_negative():
    """Teacher 0.5 on an entry the student gives 0.001 (l = 3.1, capped at tau) and
    spreads the other half thinner than the student: all other l_v < 0, sum -0.35."""
    vocab = 50
    p_t = torch.full((vocab,), 0.5 / (vocab - 1), dtype=F64)
    p_t[0] = 0.5
    p_s = torch.full((vocab,), 0.999 / (vocab - 1), dtype=F64)
    p_s[0] = 0.001
    student = torch.log(p_s).view(1, 1, vocab).requires_grad_(True)
    teacher = torch.log(p_t).view(1, 1, vocab)
    mask = torch.ones(1, 1)
    loss, stats = divergence_loss(student, teacher, mask, clip=0.05)
    assert loss.item() < 0
    assert close(loss, 0.05 + 0.5 * math.log(0.5 / 0.999))
    assert float(stats["loss_unclipped"]) > 0 and float(stats["teacher_argmax_clipped_frac"]) == 1
    assert close(stats["clipped_teacher_mass"], 0.5) and close(stats["clipped_entry_frac"], 1 / vocab)
    loss.backward()  # a negative loss still trains: gradient is finite
    assert torch.isfinite(student.grad).all()


# --------------------------------------------------------------------------- dtypes, masking, edge cases


@pytest.mark.parametrize("beta,clip_mode", [(0.0, "entry"), (0.5, "token"), (1.0, "entry")])
def test_bf16_inputs_match_float64(beta, clip_mode):
    student64, teacher64 = make_logits((3, 8, 3000), spread=5.0)
    mask = make_mask(3, 8)
    opts = {"beta": beta, "clip_mode": clip_mode, "temperature": 1.1, "clip": 0.05}
    student16 = student64.detach().to(torch.bfloat16).requires_grad_(True)
    teacher16 = teacher64.to(torch.bfloat16)

    loss16, stats16 = divergence_loss(student16, teacher16, mask, **opts)
    loss16.backward()
    assert loss16.dtype == torch.float32 and student16.grad.dtype == torch.bfloat16
    # Against the exact float64 result of the unrounded logits (input rounding only) ...
    loss64, stats64 = divergence_loss(student64, teacher64, mask, **opts)
    assert abs(loss16.item() - loss64.item()) <= 1e-2 * abs(loss64.item())
    # ... and of the same bf16-rounded logits: the computation itself is float32.
    rounded, _ = divergence_loss(student16.detach().double(), teacher16.double(), mask, **opts)
    assert abs(loss16.item() - float(rounded)) <= 1e-5 * abs(float(rounded))
    assert abs(float(stats16["true_kl"]) - float(stats64["true_kl"])) <= 1e-2 * float(stats64["true_kl"])


def test_teacher_gets_no_gradient_and_masked_positions_none():
    student, teacher = make_logits((3, 5, 20))
    teacher.requires_grad_(True)
    mask = make_mask(3, 5)
    for beta in (0.0, 0.5, 1.0):
        student.grad = None
        loss, stats = divergence_loss(student, teacher, mask, beta=beta, top_k=4, clip_mode="token")
        loss.backward()
        assert teacher.grad is None
        assert float(student.grad[~mask.bool()].abs().max()) == 0
        assert float(student.grad[mask.bool()].abs().max()) > 0
        assert not any(v.requires_grad for v in stats.values())
    loss, _ = tinker_loss(student, teacher, torch.zeros(3, 5, dtype=torch.long), mask)
    loss.backward()
    assert teacher.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_mask_gives_zero_loss_with_grad_path(dtype):
    student, teacher = make_logits((2, 3, 11), dtype=dtype)
    mask = torch.zeros(2, 3)
    for loss, stats in (
        divergence_loss(student, teacher, mask, beta=0.5, top_k=3),
        tinker_loss(student, teacher, torch.zeros(2, 3, dtype=torch.long), mask),
    ):
        assert loss.item() == 0 and loss.grad_fn is not None
        student.grad = None
        loss.backward()
        assert float(student.grad.abs().sum()) == 0
        assert all(float(v) == 0 for v in stats.values())


def test_clip_zero_and_none_both_disable():
    student, teacher = make_logits((3, 4, 30))
    mask = make_mask(3, 4)
    off_none = divergence_loss(student, teacher, mask, clip=None)
    off_zero = divergence_loss(student, teacher, mask, clip=0, clip_mode="token")
    assert off_none[0].item() == off_zero[0].item() == float(off_none[1]["loss_unclipped"])
    assert close(off_none[0], off_none[1]["true_kl"])


def test_true_kl_independent_of_beta_top_k_and_clip():
    student, teacher = make_logits((3, 4, 30))
    mask = make_mask(3, 4)
    values = {
        float(divergence_loss(student, teacher, mask, beta=b, top_k=k, clip_mode=m)[1]["true_kl"])
        for b in (0.0, 0.3, 1.0) for k in (0, 3) for m in ("entry", "token")
    }
    assert max(values) - min(values) < 1e-12


def test_top_k_at_least_vocab_equals_full_vocab():
    student, teacher = make_logits((3, 4, 12))
    mask = make_mask(3, 4)
    full, _ = divergence_loss(student, teacher, mask, beta=0.5)
    for k in (12, 100):
        assert close(divergence_loss(student, teacher, mask, beta=0.5, top_k=k)[0], full, 1e-12)


@pytest.mark.parametrize(
    "opts",
    [{"beta": 1.5}, {"beta": -0.1}, {"temperature": 0.0}, {"clip": -0.1}, {"top_k": -1}],
)
def test_invalid_options_raise(opts):
    student, teacher = make_logits((3, 2, 5))
    with pytest.raises(ValueError):
        divergence_loss(student, teacher, make_mask(3, 2), **opts)


def test_every_declared_clip_mode_has_one_clip_function_and_nothing_else_has_one():
    """The clip modes are declared once (opsd.config.CLIP_MODES, where OPSD_CLIP_MODE and
    --clip_mode are validated when they are read); the loss keeps one function per mode and
    trusts the typed value: an undeclared mode has no function (a KeyError, not a silent clip)."""
    from opsd.config import CLIP_MODES
    from opsd.loss import CLIPS

    assert tuple(CLIPS) == CLIP_MODES
    student, teacher = make_logits((3, 2, 5))
    for mode in ("sequence", "Entry"):
        with pytest.raises(KeyError):
            divergence_loss(student, teacher, make_mask(3, 2), clip_mode=mode)


def test_shape_mismatch_raises():
    student, teacher = make_logits((3, 2, 5))
    with pytest.raises(ValueError):
        divergence_loss(student, teacher[:, :1], make_mask(3, 2))
    with pytest.raises(ValueError):
        divergence_loss(student, teacher, make_mask(3, 3))


# --------------------------------------------------------------------------- tinker


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_tinker_matches_reference(temperature):
    student, teacher = make_logits((3, 5, 40))
    mask = make_mask(3, 5)
    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(1))
    loss, stats = tinker_loss(student, teacher, ids, mask, temperature=temperature)
    (grad,) = torch.autograd.grad(loss, student)
    expected, expected_stats = ref_tinker(student, teacher, ids, mask, temperature)
    (expected_grad,) = torch.autograd.grad(expected, student)

    assert close(loss, expected)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-14)
    assert set(stats) == set(TINKER_STAT_KEYS)
    assert close(stats["advantage_mean"], expected_stats["advantage_mean"])
    assert close(stats["true_kl"], expected_stats["true_kl"])
    # Analytic: dL/ds = -a (onehot(y) - p_S) / T / N on masked tokens.
    with torch.no_grad():
        logp_s = torch.log_softmax(student / temperature, -1)
        logp_t = torch.log_softmax(teacher / temperature, -1)
        onehot = torch.nn.functional.one_hot(ids, 40).to(F64)
        advantage = ((logp_t - logp_s) * onehot).sum(-1, keepdim=True)
        analytic = -advantage * (onehot - logp_s.exp()) / temperature / mask.sum() * mask.unsqueeze(-1)
    torch.testing.assert_close(grad, analytic, rtol=1e-9, atol=1e-14)


# --------------------------------------------------------------------------- sft


def test_nll_matches_float64_cross_entropy_and_its_gradient():
    """loss_type=sft: mean masked -log softmax(s)[y] at temperature 1, teacher unused
    by the gradient; analytic gradient (p_S - onehot(y)) / N on masked tokens."""
    from opsd.loss import NLL_STAT_KEYS, nll_loss

    student, teacher = make_logits((3, 5, 40))
    mask = make_mask(3, 5)
    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(2))
    loss, stats = nll_loss(student, teacher, ids, mask)
    (grad,) = torch.autograd.grad(loss, student)
    logp = torch.log_softmax(student.detach(), -1)
    per_token = -logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    expected = (per_token * mask).sum() / mask.sum()
    assert close(loss, expected) and close(stats["nll"], expected)
    onehot = torch.nn.functional.one_hot(ids, 40).to(F64)
    analytic = (logp.exp() - onehot) / mask.sum() * mask.unsqueeze(-1)
    torch.testing.assert_close(grad, analytic, rtol=1e-9, atol=1e-14)
    assert set(stats) == set(NLL_STAT_KEYS)
    logp_t = torch.log_softmax(teacher, -1)
    true_kl = ((logp_t.exp() * (logp_t - logp)).sum(-1) * mask).sum() / mask.sum()
    assert close(stats["true_kl"], true_kl)
