"""Memory-efficient OPSD loss from hidden states (the trainer's GPU path).

The full-vocabulary logits of every completion token (N x V float32, e.g. 8k x 152k
= 5 GB per role) are never held at once. A custom autograd Function projects
`chunk_size` tokens at a time through the (tied) LM head, runs the per-token
objective of `opsd.loss` on that chunk (`rows_divergence` / `rows_tinker`, the
very functions the reference uses) and keeps only scalar sums. Backward recomputes
each chunk's logits and turns d(sum_n D_n)/d(logits) into gradients for the
student hidden states (and the LM head weight / bias when they require grad).

Inputs are the masked completion positions only, already flattened to [N, H];
the reduction is the token mean over N, exactly as `opsd.loss.divergence_loss` (GRPO,
`chunked_grpo_loss`: the sum of per-token values that carry their loss type's weights,
exactly as `opsd.grpo.grpo_loss`; it has no teacher).
Peak extra memory is a few [chunk_size, V] float32 buffers plus [N, H] for the
hidden-state gradient.

With `compile=True` (the trainer's default on CUDA) the per-chunk elementwise math
over [chunk_size, V] (log-softmax, divergence, stats, the analytic gradient) runs
through `torch.compile`. Every chunk then has exactly `chunk_size` rows (the last
one is zero-padded and its padding rows dropped from every result), so one compiled
graph serves every micro-batch whatever its token count.
"""
from __future__ import annotations

import torch

from opsd.grpo import grpo_stat_keys, rows_grpo
from opsd.loss import (
    DIVERGENCE_STAT_KEYS,
    NLL_STAT_KEYS,
    NLL_STUDENT_STAT_KEYS,
    TINKER_STAT_KEYS,
    DivergenceConfig,
    compute_dtype,
    entry_divergence,
    mean_over_tokens,
    rows_divergence,
    rows_nll,
    rows_tinker,
    tempered_log_probs,
)
from opsd.model_utils import import_inductor_quietly

_LOW_PRECISION = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- matmuls


def _matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with a `dtype` (float32/float64) result, never rounded to bf16.

    On CUDA, bf16/fp16 operands are multiplied in their own dtype with a float32
    output (no [V, H] float32 copy of the LM head per chunk); elsewhere both
    operands are upcast.
    """
    low = b.dtype if b.dtype in _LOW_PRECISION else a.dtype
    if a.is_cuda and dtype == torch.float32 and low in _LOW_PRECISION:
        return torch.mm(a.to(low), b.to(low), out_dtype=torch.float32)
    return a.to(dtype) @ b.to(dtype)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype) -> torch.Tensor:
    """hidden [n, H] @ weight.T (+ bias) -> [n, V] logits in `dtype`."""
    logits = _matmul(hidden, weight.t(), dtype)
    return logits if bias is None else logits + bias.to(dtype)


def _chunks(num_tokens: int, chunk_size: int):
    for start in range(0, num_tokens, chunk_size):
        yield slice(start, min(start + chunk_size, num_tokens))


def _chunk_rows(hidden: torch.Tensor, rows: slice, pad_to: int | None) -> torch.Tensor:
    """hidden[rows], zero-padded to `pad_to` rows when given (a fixed shape for compiled math)."""
    part = hidden[rows]
    if pad_to is None or part.shape[0] == pad_to:
        return part
    return torch.nn.functional.pad(part, (0, 0, 0, pad_to - part.shape[0]))


_COMPILED: dict = {}


def _compiled(fn):
    """`torch.compile(fn)` built once per function, for the one chunk shape it sees."""
    if fn not in _COMPILED:
        import_inductor_quietly()
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


# --------------------------------------------------------------------------- objectives


def autograd_logit_grad(per_token_fn, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """d(sum_n loss_n)/d student_logits for one chunk, by autograd on a detached leaf.

    Exact for every option (any beta, clip mode, top_k) because it differentiates
    the same per-token function the forward ran.
    """
    leaf = student_logits.detach().requires_grad_(True)
    with torch.enable_grad():
        per_token, _ = per_token_fn(leaf, teacher_logits)
        (grad,) = torch.autograd.grad(per_token.sum(), leaf)
    return grad


def forward_kl_logit_grad(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, cfg: DivergenceConfig
) -> torch.Tensor:
    """Analytic d(sum_n D_n)/d s for forward KL (beta = 0) with the entry clip or no clip.

    With K_n the entries kept by the clip (l_v <= tau; all entries without clip) and
    M_n = sum_{v in K_n} p_T(v) the teacher mass on them:
        dD_n/ds_v = (p_S(v) M_n - p_T(v) 1[v in K_n]) / T
    i.e. a clipped entry loses its pull towards the teacher but still takes part in
    the student's normalisation.
    """
    dtype = compute_dtype(student_logits, teacher_logits)
    student_logp = tempered_log_probs(student_logits, cfg.temperature, dtype)
    teacher_logp = tempered_log_probs(teacher_logits, cfg.temperature, dtype)
    kept_teacher = teacher_logp.exp()
    if cfg.clip_enabled:
        # Same rule as the clamp in token_divergence: gradient passes where l_v <= tau.
        kept_teacher = kept_teacher * (entry_divergence(student_logp, teacher_logp, 0.0) <= cfg.clip)
    kept_mass = kept_teacher.sum(-1, keepdim=True)
    return (student_logp.exp() * kept_mass - kept_teacher) / cfg.temperature


class DivergenceObjective:
    """Clipped divergence per token (`rows_divergence`), for `_ChunkedLoss`."""

    stat_keys = DIVERGENCE_STAT_KEYS

    def __init__(self, cfg: DivergenceConfig, use_analytic_grad: bool = True, compile: bool = False):
        self.cfg = cfg
        # Closed form for the released default (forward KL, entry clip or none, full vocab).
        self.analytic = use_analytic_grad and cfg.beta == 0.0 and cfg.top_k == 0 and (
            cfg.clip_mode == "entry" or not cfg.clip_enabled
        )
        # Compiled: the forward math, and the gradient where it is the closed form (the
        # autograd route differentiates eagerly). Compiled math needs fixed-size chunks.
        self.fixed_chunks = compile
        self._rows_divergence = _compiled(rows_divergence) if compile else rows_divergence
        self._analytic_grad = _compiled(forward_kl_logit_grad) if compile else forward_kl_logit_grad

    def per_token(self, student_logits, teacher_logits, rows: slice, with_stats: bool = True):
        return self._rows_divergence(student_logits, teacher_logits, self.cfg, with_stats=with_stats)

    def logit_grad(self, student_logits, teacher_logits, rows: slice) -> torch.Tensor:
        if self.analytic:
            return self._analytic_grad(student_logits, teacher_logits, self.cfg)
        return autograd_logit_grad(
            lambda s, t: rows_divergence(s, t, self.cfg, with_stats=False), student_logits, teacher_logits
        )


class TinkerObjective:
    """Sampled-token estimator per token (`rows_tinker`), for `_ChunkedLoss`."""

    stat_keys = TINKER_STAT_KEYS
    fixed_chunks = False

    def __init__(self, target_ids: torch.Tensor, temperature: float):
        self.target_ids = target_ids
        self.temperature = temperature

    def per_token(self, student_logits, teacher_logits, rows: slice, with_stats: bool = True):
        return rows_tinker(
            student_logits, teacher_logits, self.target_ids[rows], temperature=self.temperature, with_stats=with_stats
        )

    def logit_grad(self, student_logits, teacher_logits, rows: slice) -> torch.Tensor:
        return autograd_logit_grad(
            lambda s, t: self.per_token(s, t, rows, with_stats=False), student_logits, teacher_logits
        )


class NLLObjective:
    """SFT cross-entropy per token (`rows_nll`), for `_ChunkedLoss`; without a teacher
    (`with_teacher` False) the student's stats only."""

    fixed_chunks = False

    def __init__(self, target_ids: torch.Tensor, with_teacher: bool = True):
        self.target_ids = target_ids
        self.stat_keys = NLL_STAT_KEYS if with_teacher else NLL_STUDENT_STAT_KEYS

    def per_token(self, student_logits, teacher_logits, rows: slice, with_stats: bool = True):
        return rows_nll(student_logits, teacher_logits, self.target_ids[rows], with_stats=with_stats)

    def logit_grad(self, student_logits, teacher_logits, rows: slice) -> torch.Tensor:
        return autograd_logit_grad(
            lambda s, t: self.per_token(s, t, rows, with_stats=False), student_logits, teacher_logits
        )


class GRPOObjective:
    """GRPO's weighted clipped policy loss per token (`opsd.grpo.rows_grpo`), for `_ChunkedLoss`.

    The per-token values already carry the loss type's weights w_n (`opsd.grpo.token_weights`),
    so the loss is their plain sum (`sum_reduction`), not a token mean. GRPO has no teacher:
    `_ChunkedLoss` gets teacher_hidden None and passes teacher_logits None.
    """

    fixed_chunks = False
    sum_reduction = True

    def __init__(self, target_ids, advantages, weights, *, old_logp=None, ref_logp=None, **options):
        self.target_ids, self.advantages, self.weights = target_ids, advantages, weights
        self.old_logp, self.ref_logp, self.options = old_logp, ref_logp, options
        self.stat_keys = grpo_stat_keys(options.get("beta", 0.0))

    def per_token(self, student_logits, teacher_logits, rows: slice, with_stats: bool = True):
        def part(values):
            return None if values is None else values[rows]

        return rows_grpo(
            student_logits, self.target_ids[rows], self.advantages[rows], self.weights[rows],
            old_logp=part(self.old_logp), ref_logp=part(self.ref_logp), with_stats=with_stats, **self.options,
        )  # fmt: skip

    def logit_grad(self, student_logits, teacher_logits, rows: slice) -> torch.Tensor:
        return autograd_logit_grad(
            lambda s, t: self.per_token(s, t, rows, with_stats=False), student_logits, teacher_logits
        )


# --------------------------------------------------------------------------- autograd


class _ChunkedLoss(torch.autograd.Function):
    """loss = mean_n objective(h_S[n] W^T + b, h_T[n] W^T + b), chunked over tokens n.

    Returns (loss, stats) where stats is a detached vector ordered as
    `objective.stat_keys`. Gradients: student hidden, weight, bias; never the teacher.
    An objective with `sum_reduction` True (GRPO: its per-token values carry their own
    weights) gets the sum over n instead of the mean; its stats are still token means.
    teacher_hidden may be None (no teacher projection; the objective gets None).
    """

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, weight, bias, objective, chunk_size):
        num_tokens = student_hidden.shape[0]
        dtype = compute_dtype(*(t for t in (student_hidden, teacher_hidden, weight) if t is not None))
        loss_sum = torch.zeros((), dtype=dtype, device=student_hidden.device)
        stat_sums = torch.zeros(len(objective.stat_keys), dtype=dtype, device=student_hidden.device)
        pad_to = chunk_size if objective.fixed_chunks else None
        for rows in _chunks(num_tokens, chunk_size):
            real = rows.stop - rows.start  # rows past `real` are padding
            student_logits = _logits(_chunk_rows(student_hidden, rows, pad_to), weight, bias, dtype)
            teacher_logits = _teacher_logits(teacher_hidden, rows, pad_to, weight, bias, dtype)
            per_token, stats = objective.per_token(student_logits, teacher_logits, rows)
            loss_sum += per_token[:real].sum()
            stat_sums += torch.stack([stats[key][:real].sum() for key in objective.stat_keys])

        ctx.save_for_backward(student_hidden, teacher_hidden, weight, bias)
        ctx.objective, ctx.chunk_size, ctx.dtype = objective, chunk_size, dtype
        stats = mean_over_tokens(stat_sums, num_tokens)
        ctx.mark_non_differentiable(stats)
        return (loss_sum if _sums(objective) else mean_over_tokens(loss_sum, num_tokens)), stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        student_hidden, teacher_hidden, weight, bias = ctx.saved_tensors
        need_hidden, _, need_weight, need_bias = ctx.needs_input_grad[:4]
        dtype, num_tokens = ctx.dtype, student_hidden.shape[0]
        # d loss / d D_n: the token mean (or sum) times the incoming gradient.
        scale = grad_loss.to(dtype) / (1 if _sums(ctx.objective) else max(num_tokens, 1))

        def buffer(like):  # accumulate in float32 (float64) whatever the parameter dtype
            return torch.zeros(like.shape, dtype=dtype, device=like.device)

        grad_hidden = buffer(student_hidden) if need_hidden else None
        grad_weight = buffer(weight) if need_weight else None
        grad_bias = buffer(bias) if need_bias else None
        pad_to = ctx.chunk_size if ctx.objective.fixed_chunks else None
        for rows in _chunks(num_tokens, ctx.chunk_size):
            real = rows.stop - rows.start
            hidden = student_hidden[rows]
            student_logits = _logits(_chunk_rows(student_hidden, rows, pad_to), weight, bias, dtype)
            teacher_logits = _teacher_logits(teacher_hidden, rows, pad_to, weight, bias, dtype)
            grad_logits = ctx.objective.logit_grad(student_logits, teacher_logits, rows)[:real] * scale
            if need_hidden:
                grad_hidden[rows] = _matmul(grad_logits, weight, dtype)
            if need_weight:
                grad_weight += _matmul(grad_logits.t(), hidden, dtype)
            if need_bias:
                grad_bias += grad_logits.sum(0)

        def cast(grad, like):
            return None if grad is None else grad.to(like.dtype)

        return cast(grad_hidden, student_hidden), None, cast(grad_weight, weight), cast(grad_bias, bias), None, None


def _sums(objective) -> bool:
    return getattr(objective, "sum_reduction", False)


def _teacher_logits(teacher_hidden, rows, pad_to, weight, bias, dtype):
    if teacher_hidden is None:
        return None
    return _logits(_chunk_rows(teacher_hidden, rows, pad_to), weight, bias, dtype)


def _check_inputs(student_hidden, teacher_hidden, lm_head_weight, lm_head_bias, chunk_size):
    if teacher_hidden is None and student_hidden.dim() != 2:
        raise ValueError(f"student hidden states must be [N, H], got {tuple(student_hidden.shape)}")
    if teacher_hidden is not None and (student_hidden.dim() != 2 or student_hidden.shape != teacher_hidden.shape):
        raise ValueError(
            f"hidden states must both be [N, H], got {tuple(student_hidden.shape)} and {tuple(teacher_hidden.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != student_hidden.shape[1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} is not [V, {student_hidden.shape[1]}]")
    if lm_head_bias is not None and lm_head_bias.shape != lm_head_weight.shape[:1]:
        raise ValueError(f"lm_head_bias {tuple(lm_head_bias.shape)} is not [{lm_head_weight.shape[0]}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _apply(objective, student_hidden, teacher_hidden, weight, bias, chunk_size):
    _check_inputs(student_hidden, teacher_hidden, weight, bias, chunk_size)
    # The teacher is a constant: detaching here also keeps it out of the saved graph.
    teacher_hidden = None if teacher_hidden is None else teacher_hidden.detach()
    loss, stats = _ChunkedLoss.apply(student_hidden, teacher_hidden, weight, bias, objective, chunk_size)
    return loss, dict(zip(objective.stat_keys, stats.unbind(), strict=False))


# --------------------------------------------------------------------------- public API


def chunked_divergence_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    clip: float | None = 0.05,
    clip_mode: str = "entry",
    top_k: int = 0,
    config: DivergenceConfig | None = None,
    chunk_size: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
    compile: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`opsd.loss.divergence_loss` on logits = hidden @ W.T (+ bias), chunked over tokens.

    Args:
        student_hidden: [N, H] final hidden states of the masked completion tokens
            (bf16 or fp32; receives the gradient).
        teacher_hidden: [N, H], same tokens, no gradient.
        lm_head_weight: [V, H]; gets a gradient too if it requires grad (same for
            lm_head_bias [V]).
        config: the divergence options as one DivergenceConfig; given, it replaces beta,
            temperature, clip, clip_mode and top_k.
        chunk_size: tokens per chunk; memory scales with chunk_size * V.
        compile: run the per-chunk math through torch.compile (fixed-size chunks; the
            first call compiles). Same values to float rounding.
    Returns:
        (loss, stats) with the same values and keys as `divergence_loss`; N = 0 gives
        a zero loss that still back-propagates.
    """
    cfg = config or DivergenceConfig(beta=beta, temperature=temperature, clip=clip, clip_mode=clip_mode,
                                     top_k=top_k)
    objective = DivergenceObjective(cfg, compile=compile)
    return _apply(objective, student_hidden, teacher_hidden, lm_head_weight, lm_head_bias, chunk_size)


def chunked_tinker_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`opsd.loss.tinker_loss` on hidden states, chunked; target_ids [N] are the sampled tokens."""
    if target_ids.shape != student_hidden.shape[:1]:
        raise ValueError(f"target_ids {tuple(target_ids.shape)} is not [{student_hidden.shape[0]}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    objective = TinkerObjective(target_ids, temperature)
    return _apply(objective, student_hidden, teacher_hidden, lm_head_weight, lm_head_bias, chunk_size)


def chunked_nll_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    lm_head_weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    chunk_size: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`opsd.loss.nll_loss` on hidden states, chunked; target_ids [N] are the reference tokens;
    teacher_hidden None: no teacher projection, the student's stats only."""
    if target_ids.shape != student_hidden.shape[:1]:
        raise ValueError(f"target_ids {tuple(target_ids.shape)} is not [{student_hidden.shape[0]}]")
    objective = NLLObjective(target_ids, with_teacher=teacher_hidden is not None)
    return _apply(objective, student_hidden, teacher_hidden, lm_head_weight, lm_head_bias, chunk_size)


def chunked_grpo_loss(
    student_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    temperature: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
    chunk_size: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`opsd.grpo.grpo_loss` on hidden states, chunked over tokens (no teacher).

    All per-token inputs are [N] over the real completion tokens, in the order of
    student_hidden [N, H]: completion_ids (the sampled tokens), advantages (each token its
    sequence's), weights (`opsd.grpo.token_weights(mask, loss_type, ...)[mask]`: they fix
    the loss type), optional old_logp / ref_logp. Same loss and stats as `grpo_loss` on
    the full logits.
    """
    if student_hidden.dim() != 2:
        raise ValueError(f"student_hidden must be [N, H], got {tuple(student_hidden.shape)}")
    n = student_hidden.shape[:1]
    for name, values in (("completion_ids", completion_ids), ("advantages", advantages), ("weights", weights),
                         ("old_logp", old_logp), ("ref_logp", ref_logp)):
        if values is not None and values.shape != n:
            raise ValueError(f"{name} {tuple(values.shape)} is not [{n[0]}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    objective = GRPOObjective(
        completion_ids, advantages, weights, old_logp=old_logp, ref_logp=ref_logp, temperature=temperature,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, bias_correction_kl=bias_correction_kl,
    )  # fmt: skip
    return _apply(objective, student_hidden, None, lm_head_weight, lm_head_bias, chunk_size)
