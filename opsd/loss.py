"""The OPSD objective (docs/SPEC.md §2): reference implementation on full logits.

Pure torch, no model. Everything is built from per-token functions on flat rows
(`[N, V]` logits of the masked completion positions), so that this reference and the
memory-efficient chunked version (`opsd/chunked_loss.py`) run the very same math:

    rows_divergence   raw logits rows -> per-token clipped divergence D_n + diagnostics
    token_divergence  log-prob rows   -> D_n (the clip) and the unclipped entries l_v
    entry_divergence  log-prob rows   -> l_v for forward KL / reverse KL / generalised JSD

Notation: p_S = softmax(s / T), p_T = softmax(t / T) for student / teacher logits
s, t and temperature T. Per vocabulary entry v (TRL GKD `generalized_jsd_loss`
convention, M = beta * p_T + (1 - beta) * p_S):

    beta = 0       l_v = p_T(v) (log p_T(v) - log p_S(v))                  forward KL
    beta = 1       l_v = p_S(v) (log p_S(v) - log p_T(v))                  reverse KL
    0 < beta < 1   l_v = beta p_T(v) log(p_T(v)/M(v)) + (1-beta) p_S(v) log(p_S(v)/M(v))

Clip tau (0 / None disables):
    "entry"  D_n = sum_v min(l_v, tau)         entries above tau get zero gradient
    "token"  D_n = sum_v l_v * min(1, tau / sum_v l_v), the scale detached

Top-k (top_k > 0): both distributions restricted to the teacher's top-k entries and
renormalised before divergence and clip.

Reduction: loss = sum of D_n over masked tokens / number of masked tokens.
Logits are assumed finite (a -inf logit makes 0 * log 0 terms NaN).

Diagnostics (detached scalars, each the mean over masked tokens of a per-token value):
    true_kl                      unclipped forward KL, full vocabulary (whatever beta/top_k)
    student_entropy, teacher_entropy   full-vocabulary entropies
    loss_unclipped               sum_v l_v: D_n without the clip (on the top-k under top_k)
    clipped_entry_frac           share of entries with l_v > tau         (entry clip only)
    clipped_token_frac           entry: any l_v > tau; token: D_n > tau
    teacher_argmax_clipped_frac  teacher's argmax entry has l_v > tau    (entry clip only)
    clipped_teacher_mass         teacher probability on entries l_v > tau (entry clip only)
The entry-level clip stats are 0 in token mode (no entry is clipped there) and every
clip stat is 0 with the clip disabled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opsd.config import CLIP_MODES  # the declared clip modes (OPSD_CLIP_MODE); each has a function in CLIPS

# Diagnostics of `divergence_loss`; every value is the mean over masked tokens of a
# per-token quantity (see `_divergence_stats`).
DIVERGENCE_STAT_KEYS = (
    "true_kl",
    "clipped_entry_frac",
    "clipped_token_frac",
    "teacher_argmax_clipped_frac",
    "clipped_teacher_mass",
    "student_entropy",
    "teacher_entropy",
    "loss_unclipped",
)
TINKER_STAT_KEYS = ("true_kl", "advantage_mean", "student_entropy", "teacher_entropy")
NLL_STAT_KEYS = ("true_kl", "nll", "student_entropy", "teacher_entropy")
NLL_STUDENT_STAT_KEYS = ("nll", "student_entropy")  # SFT without the teacher's forward: no teacher, no KL

PerTokenStats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DivergenceConfig:
    """Validated options of the divergence objective (shared by both implementations).

    `clip` of None or 0 disables the clip and is stored as 0.0; `top_k` of 0 means
    the full vocabulary.
    """

    beta: float = 0.0
    temperature: float = 1.0
    clip: float | None = 0.05
    clip_mode: str = "entry"
    top_k: int = 0

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.clip is not None and not self.clip >= 0:
            raise ValueError(f"clip must be >= 0 or None, got {self.clip}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "clip", float(self.clip or 0.0))

    @property
    def clip_enabled(self) -> bool:
        return self.clip > 0


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 logits are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# --------------------------------------------------------------------------- per token


def entry_divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-entry divergence l_v, shape [N, K], from normalised log-probs [N, K]."""
    if beta == 0.0:
        return teacher_logp.exp() * (teacher_logp - student_logp)
    if beta == 1.0:
        return student_logp.exp() * (student_logp - teacher_logp)
    # log M = logsumexp(log beta + log p_T, log(1 - beta) + log p_S): no underflow of M.
    log_m = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log1p(-beta))
    return beta * teacher_logp.exp() * (teacher_logp - log_m) + (1 - beta) * student_logp.exp() * (
        student_logp - log_m
    )


def token_clip_scale(raw: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, tau / D_n) for the token clip, detached; `where` keeps D_n <= 0 at scale 1."""
    raw = raw.detach()
    return torch.where(raw > clip, clip / raw, torch.ones_like(raw))


def clip_entries(entries: torch.Tensor, clip: float) -> torch.Tensor:
    """entry (the released clip): D_n = sum_v min(l_v, tau); the clamp passes gradient only where l_v <= tau."""
    return entries.clamp(max=clip).sum(-1)


def clip_token(entries: torch.Tensor, clip: float) -> torch.Tensor:
    """token: D_n = (sum_v l_v) * min(1, tau / sum_v l_v), the scale detached (the direction is kept)."""
    raw = entries.sum(-1)
    return raw * token_clip_scale(raw, clip)


# The clip of each declared mode: entries l [N, K] and tau -> D [N]. A new clip is one function here
# and its name in opsd.config.CLIP_MODES (where the switch, the flag and the help read it).
CLIPS = {"entry": clip_entries, "token": clip_token}
if set(CLIPS) != set(CLIP_MODES):
    raise ImportError(f"opsd.loss.CLIPS {sorted(CLIPS)} and opsd.config.CLIP_MODES {sorted(CLIP_MODES)} differ")


def token_divergence(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, *, beta: float, clip: float, clip_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped per-token divergence.

    Args: normalised log-probs [N, K] (teacher detached by the caller), clip tau
    (0 disables), clip_mode one of CLIP_MODES (validated where it was read: the switch or the
    config; here it only picks the function of CLIPS).
    Returns (D [N], l [N, K]): the clipped D_n (`CLIPS[clip_mode]`; without a clip sum_v l_v)
    and the unclipped entries l_v.
    """
    entries = entry_divergence(student_logp, teacher_logp, beta)
    if not clip:
        return entries.sum(-1), entries
    return CLIPS[clip_mode](entries, clip), entries


def tempered_log_probs(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """log softmax(logits / T), computed in `dtype` (float32 or float64)."""
    return F.log_softmax(logits.to(dtype) / temperature, dim=-1)


def restrict_to_teacher_top_k(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the teacher's top-k entries, renormalised: [N, k] log-probs.

    Gathering log-probs and re-normalising equals a log_softmax of the gathered
    tempered logits (log_softmax is shift invariant per row). Ranking by teacher
    log-probs equals ranking by teacher logits.
    """
    k = min(k, teacher_logp.shape[-1])
    top = teacher_logp.topk(k, dim=-1).indices
    return (
        F.log_softmax(student_logp.gather(-1, top), dim=-1),
        F.log_softmax(teacher_logp.gather(-1, top), dim=-1),
    )


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _role_stats(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> PerTokenStats:
    """Full-vocabulary per-token diagnostics: unclipped forward KL and both entropies."""
    return {
        "true_kl": (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1),
        "student_entropy": _entropy(student_logp),
        "teacher_entropy": _entropy(teacher_logp),
    }


@torch.no_grad()
def _divergence_stats(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_logp_k: torch.Tensor,
    entries: torch.Tensor,
    cfg: DivergenceConfig,
) -> PerTokenStats:
    """Per-token diagnostics [N] of the divergence objective (detached).

    `student_logp`/`teacher_logp` are full-vocabulary, `teacher_logp_k`/`entries`
    live on the entries the divergence considers (the teacher's top-k under top_k).
    Entry-level clip stats describe what the active clip does: in "token" mode no
    entry is clipped, so clipped_entry_frac, teacher_argmax_clipped_frac and
    clipped_teacher_mass are 0 there; clipped_token_frac counts tokens with D_n > tau.
    """
    raw = entries.sum(-1)
    stats = _role_stats(student_logp, teacher_logp)
    stats["loss_unclipped"] = raw
    zeros = torch.zeros_like(raw)
    if cfg.clip_enabled and cfg.clip_mode == "entry":
        over = entries > cfg.clip  # the entries whose gradient the clip zeroes
        teacher_argmax = teacher_logp_k.argmax(-1, keepdim=True)
        stats["clipped_entry_frac"] = over.to(raw.dtype).mean(-1)
        stats["clipped_token_frac"] = over.any(-1).to(raw.dtype)
        stats["teacher_argmax_clipped_frac"] = over.gather(-1, teacher_argmax).squeeze(-1).to(raw.dtype)
        stats["clipped_teacher_mass"] = (teacher_logp_k.exp() * over).sum(-1)
    else:
        token_clipped = (raw > cfg.clip).to(raw.dtype) if cfg.clip_enabled else zeros
        stats["clipped_entry_frac"] = zeros
        stats["clipped_token_frac"] = token_clipped
        stats["teacher_argmax_clipped_frac"] = zeros
        stats["clipped_teacher_mass"] = zeros
    return {key: stats[key] for key in DIVERGENCE_STAT_KEYS}


def rows_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, cfg: DivergenceConfig, *, with_stats: bool = True
) -> tuple[torch.Tensor, PerTokenStats]:
    """Per-token clipped divergence D [N] (differentiable wrt student logits) and stats.

    Inputs are raw logits rows [N, V] of any float dtype; log-probs are computed in
    float32 (float64 if an input is float64). The teacher is detached here. Under
    top_k both distributions are restricted to the teacher's top-k and renormalised
    before divergence and clip; true_kl and the entropies stay full-vocabulary.
    """
    dtype = compute_dtype(student_logits, teacher_logits)
    student_logp = tempered_log_probs(student_logits, cfg.temperature, dtype)
    teacher_logp = tempered_log_probs(teacher_logits.detach(), cfg.temperature, dtype)
    student_k, teacher_k = student_logp, teacher_logp
    if cfg.top_k:
        student_k, teacher_k = restrict_to_teacher_top_k(student_logp, teacher_logp, cfg.top_k)
    divergence, entries = token_divergence(
        student_k, teacher_k, beta=cfg.beta, clip=cfg.clip, clip_mode=cfg.clip_mode
    )
    if not with_stats:
        return divergence, {}
    stats = _divergence_stats(student_logp.detach(), teacher_logp, teacher_k, entries.detach(), cfg)
    return divergence, stats


def rows_tinker(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_stats: bool = True,
) -> tuple[torch.Tensor, PerTokenStats]:
    """Sampled-token estimator per token: -a_n log p_S(y_n), a_n = log p_T(y_n) - log p_S(y_n).

    The advantage a_n is detached, so the gradient is -a_n * d log p_S(y_n), a
    REINFORCE-style step towards the teacher on the sampled token only.
    Inputs: logits rows [N, V], target_ids [N]. Returns (per-token loss [N], stats).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = compute_dtype(student_logits, teacher_logits)
    student_logp = tempered_log_probs(student_logits, temperature, dtype)
    teacher_logp = tempered_log_probs(teacher_logits.detach(), temperature, dtype)
    index = target_ids.long().unsqueeze(-1)
    student_y = student_logp.gather(-1, index).squeeze(-1)
    advantage = (teacher_logp.gather(-1, index).squeeze(-1) - student_y).detach()
    per_token = -advantage * student_y
    if not with_stats:
        return per_token, {}
    with torch.no_grad():
        stats = _role_stats(student_logp, teacher_logp)
        stats["advantage_mean"] = advantage
    return per_token, {key: stats[key] for key in TINKER_STAT_KEYS}


def rows_nll(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    target_ids: torch.Tensor,
    *,
    with_stats: bool = True,
) -> tuple[torch.Tensor, PerTokenStats]:
    """Supervised fine-tuning per token: -log p_S(y_n) at temperature 1 (the SFT
    baseline, `loss_type=sft`, on the reference solution's tokens y_n).

    The teacher only feeds the diagnostics (true KL, teacher entropy: NLL_STAT_KEYS), so an
    SFT run with them logs the same divergence an OPSD run minimises; teacher_logits None
    (no teacher forward) gives the student's stats only (NLL_STUDENT_STAT_KEYS). Inputs:
    logits rows [N, V], target_ids [N]. Returns (per-token loss [N], stats).
    """
    dtype = compute_dtype(*(t for t in (student_logits, teacher_logits) if t is not None))
    student_logp = tempered_log_probs(student_logits, 1.0, dtype)
    per_token = -student_logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    if not with_stats:
        return per_token, {}
    with torch.no_grad():
        if teacher_logits is None:
            return per_token, {"nll": per_token.detach(), "student_entropy": _entropy(student_logp)}
        stats = _role_stats(student_logp, tempered_log_probs(teacher_logits.detach(), 1.0, dtype))
        stats["nll"] = per_token.detach()
    return per_token, {key: stats[key] for key in NLL_STAT_KEYS}


# --------------------------------------------------------------------------- reduction


def mean_over_tokens(total: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token mean; an empty selection gives 0 (not 0/0) and keeps `total`'s grad path."""
    return total / max(num_tokens, 1)


def reduce_stats(stat_sums: dict[str, torch.Tensor], num_tokens: int) -> dict[str, torch.Tensor]:
    """Per-token stat sums -> detached scalar means over the tokens."""
    return {key: mean_over_tokens(value.detach(), num_tokens) for key, value in stat_sums.items()}


def _sum_stats(stats: PerTokenStats) -> dict[str, torch.Tensor]:
    return {key: value.sum() for key, value in stats.items()}


def _masked_rows(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate [B, C, V] / [B, C] inputs and select the masked positions as [N, V] rows."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} != teacher {tuple(teacher_logits.shape)} logits")
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(student_logits.shape)}")
    keep = mask != 0
    return student_logits[keep], teacher_logits[keep], keep


# --------------------------------------------------------------------------- public API


def divergence_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    clip: float | None = 0.05,
    clip_mode: str = "entry",
    top_k: int = 0,
    config: DivergenceConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPSD loss on full logits: mean over masked tokens of the clipped divergence D_n.

    Args:
        student_logits, teacher_logits: [B, C, V], any float dtype; only the student
            receives gradients.
        mask: [B, C], nonzero on real completion tokens.
        beta, temperature, clip, clip_mode, top_k: see the module docstring.
        config: the same options as one DivergenceConfig (the trainer's, built once); given,
            it replaces them.
    Returns:
        (loss, stats): scalar loss (float32, float64 for float64 inputs) and detached
        scalar diagnostics, keys DIVERGENCE_STAT_KEYS. An all-zero mask gives a zero
        loss that still back-propagates (zero gradients) and zero stats.
    """
    cfg = config or DivergenceConfig(beta=beta, temperature=temperature, clip=clip, clip_mode=clip_mode,
                                     top_k=top_k)
    student_rows, teacher_rows, _ = _masked_rows(student_logits, teacher_logits, mask)
    divergence, stats = rows_divergence(student_rows, teacher_rows, cfg)
    num_tokens = divergence.shape[0]
    return mean_over_tokens(divergence.sum(), num_tokens), reduce_stats(_sum_stats(stats), num_tokens)


def tinker_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sampled-token OPSD loss: -mean over masked tokens of a_n * log p_S(y_n).

    a_n = log p_T(y_n) - log p_S(y_n) (tempered, detached), y_n = completion_ids [B, C].
    Stats (keys TINKER_STAT_KEYS): true_kl, advantage_mean and the two entropies.
    """
    student_rows, teacher_rows, keep = _masked_rows(student_logits, teacher_logits, mask)
    if completion_ids.shape != mask.shape:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} does not match mask {tuple(mask.shape)}")
    per_token, stats = rows_tinker(student_rows, teacher_rows, completion_ids[keep], temperature=temperature)
    num_tokens = per_token.shape[0]
    return mean_over_tokens(per_token.sum(), num_tokens), reduce_stats(_sum_stats(stats), num_tokens)


def nll_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT loss: mean over masked tokens of -log p_S(y_n), y_n = completion_ids [B, C]
    (stats keys NLL_STAT_KEYS; NLL_STUDENT_STAT_KEYS with teacher_logits None)."""
    if teacher_logits is None:  # no teacher: the student's own rows
        student_rows, _, keep = _masked_rows(student_logits, student_logits, mask)
        teacher_rows = None
    else:
        student_rows, teacher_rows, keep = _masked_rows(student_logits, teacher_logits, mask)
    if completion_ids.shape != mask.shape:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} does not match mask {tuple(mask.shape)}")
    per_token, stats = rows_nll(student_rows, teacher_rows, completion_ids[keep])
    num_tokens = per_token.shape[0]
    return mean_over_tokens(per_token.sum(), num_tokens), reduce_stats(_sum_stats(stats), num_tokens)
