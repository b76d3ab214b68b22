"""GRPO (the method's RL baseline, issue 46): group advantages and the clipped policy loss.

Pure torch, no TRL import: the formulas follow TRL 1.16's `GRPOTrainer`
(trl/trainer/grpo_trainer.py), cited per function below.

Advantages (`group_advantages`). Rewards r [N] come in consecutive groups of G completions
of one prompt (TRL's RepeatSampler order). A_i = r_i - mean(group of i), divided by
(std + 1e-4) unless scale="none"; std is Bessel-corrected (unbiased, TRL's `nanstd`) over
the group (scale="group") or the whole batch (scale="batch"). NaN rewards (unscorable) are
left out of the mean and std and get advantage 0, as in TRL. One deliberate difference: a
group whose rewards are all equal gets exactly 0 (TRL divides the rounding residue of
r - mean by 1e-4, which can leave values of order 1e-4 instead of 0).

Per-token loss (`rows_grpo`), for the sampled token y_t at logits s_t:
    logp_t  = log softmax(s_t / T)[y_t]                      (TRL divides logits by T)
    ratio_t = exp(logp_t - logp_old_t)
    l_t     = -min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t) + beta kl_t
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (only with beta > 0)
    kl_t    = ratio_t k3_t   (bias_correction_kl, TRL 1.16's default `use_bias_correction_kl`)
    kl_t    = k3_t           (bias_correction_kl False)
Without `old_logp` the update is on policy (one optimizer step per generation batch, as in
our trainer): logp_old = logp detached, so ratio = 1 in value and nothing is clipped, but
the gradient is A_t d logp_t. The bias correction multiplies the KL by that differentiable
ratio (TRL `_compute_loss`: `per_token_kl = per_token_kl * coef_1`, the ratio before any
clip), so on policy its value is k3's and its gradient d(ratio k3) = (logp - ref) d logp (the
unbiased reverse-KL gradient), not k3's own (1 - exp(ref - logp)) d logp; TRL logs the
corrected kl_t, as `rows_grpo` does. With old_logp = logp the importance sampling level
"sequence" (GSPO) equals "token" in value and gradient for every loss type here, so only
the token level is implemented. Not implemented, and refused when asked for
(opsd.train_config): `delta` (two-sided clip), `num_iterations` > 1, `steps_per_generation`
other than one generation per optimizer step, importance sampling level "sequence",
`mask_truncated_completions`; not implemented either: vLLM importance-sampling correction
(GRPO with vLLM is refused), entropy masks and bonus, loss types cispo / sapo / vespo / luspo.

Reduction: every loss type is sum_t w_t l_t over the real completion tokens, with weights
known before the forward (`token_weights`, TRL `_compute_loss`, `if self.loss_type ...`):
    grpo     w_t = 1 / (B * L_b)           per-sequence token mean, then mean over the B sequences
    bnpo     w_t = 1 / sum(mask)           token mean over the local micro-batch
    dr_grpo  w_t = 1 / (B * max_completion_length)
    dapo     w_t = 1 / num_items           num_items: the normaliser (see `token_weights`)
L_b is sequence b's token count (clamped to >= 1); B counts every row of the micro-batch,
also rows whose mask is all zero (TRL's `.mean()` / `per_token_loss.size(0)`). TRL also
divides grpo / bnpo / dr_grpo by the gradient accumulation steps; transformers' Trainer does
that for us (our trainer leaves `loss_is_scaled_for_ga` False), so it is not done here.

The same per-token function serves the full-logits reference `grpo_loss` here and the
chunked `opsd.chunked_loss.chunked_grpo_loss` (the weights travel per token, so the chunked
sum needs no knowledge of sequences).

TRL itself: its advantages are computed inline in `_generate_and_score_completions` and
cannot be called alone; `_compute_loss` is a method that reads trainer attributes, and the
tests call it on a stand-in object (tests/opsd/test_grpo.py) to compare with TRL directly.
"""
from __future__ import annotations

import torch

from opsd.loss import PerTokenStats, compute_dtype, reduce_stats, tempered_log_probs

REWARD_SCALES = ("group", "batch", "none")  # TRL GRPOConfig.scale_rewards
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL's loss types with the PPO clip, token level
GRPO_EPSILON = 0.2  # TRL GRPOConfig.epsilon: the only value the trainer takes (ratio 1, opsd.train_config)
# TRL 1.16 GRPOConfig's sampling defaults, as flags: the baseline arms' sampler equal to TRL's
# (the recipe's T 1.1, top_p 0.95, top_k 20 truncate the sampler, which the loss does not correct).
TRL_SAMPLING_FLAGS = ("--temperature", "1.0", "--top_p", "1.0", "--top_k", "0")
STD_EPSILON = 1e-4  # TRL: advantages / (std_rewards + 1e-4)
# Per-token stats of the policy loss (token means over the real completion tokens), TRL's names
# without the "/": clip_ratio is TRL's clip_ratio/region_mean. "kl" is added when beta > 0.
GRPO_STAT_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio", "entropy", "ratio_mean", "advantage_mean")
REWARD_STAT_KEYS = ("reward_mean", "reward_std", "frac_reward_zero_std", "advantage_abs_mean")


# --------------------------------------------------------------------------- advantages


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's `trl.trainer.utils.nanstd`: Bessel-corrected std ignoring NaN; NaN for < 2 values."""
    kwargs = {} if dim is None else {"dim": dim, "keepdim": True}
    mean = torch.nanmean(x, **kwargs)
    variance = torch.nanmean((x - mean) ** 2, **kwargs)
    count = (~torch.isnan(x)).sum(**kwargs).to(x.dtype)  # TRL's int division rounds to float32
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


def _check_groups(rewards: torch.Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"rewards has {rewards.shape[0]} entries, not a multiple of group_size {group_size}")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Advantages [N] of rewards [N] in consecutive groups of `group_size` (module docstring).

    TRL 1.16 `GRPOTrainer._generate_and_score_completions`, the `sum_then_normalize` branch
    (the default `multi_objective_aggregation`). Computed in float32 (float64 for float64
    rewards); rewards from every process must be gathered first, as TRL does.
    """
    _check_groups(rewards, group_size)
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale must be one of {', '.join(REWARD_SCALES)}, got {scale!r}")
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = _nanstd(grouped, dim=1).expand_as(grouped).reshape(-1)
    else:  # "batch" divides by it; "none" does not divide
        std = _nanstd(rewards).expand_as(rewards)
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    # All-equal group (NaN entries aside): exactly 0, not r - mean's rounding residue / 1e-4.
    first = grouped.nan_to_num(nan=0.0).gather(1, torch.isnan(grouped).long().argmin(1, keepdim=True))
    flat = ((grouped == first) | torch.isnan(grouped)).all(1, keepdim=True).expand_as(grouped).reshape(-1)
    advantages = advantages.masked_fill(flat, 0.0)
    return torch.nan_to_num(advantages, nan=0.0)  # unscorable completions (NaN reward) carry no signal


@torch.no_grad()
def reward_stats(rewards: torch.Tensor, group_size: int, advantages: torch.Tensor,
                 scale: str = "group") -> dict[str, torch.Tensor]:
    """What TRL logs per generation batch about rewards: reward mean / std (Bessel, NaN left
    out), the share of completions whose advantage's std is zero, and mean |advantage|.

    frac_reward_zero_std follows TRL 1.16 (`is_std_zero` in `_generate_and_score_completions`):
    under scale "group" and "none" the share of completions in groups of zero reward std; under
    "batch" the std is the batch's, so the share is 1 when every reward of the batch is equal
    and 0 otherwise (all-equal groups in a mixed batch are not counted)."""
    _check_groups(rewards, group_size)
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale must be one of {', '.join(REWARD_SCALES)}, got {scale!r}")
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if scale == "batch":
        std = _nanstd(rewards).reshape(1)
    else:
        std = _nanstd(rewards.view(-1, group_size), dim=1)
    zero_std = torch.isclose(std, torch.zeros_like(std))  # TRL: is_std_zero
    return {
        "reward_mean": torch.nanmean(rewards),
        "reward_std": _nanstd(rewards),
        "frac_reward_zero_std": zero_std.to(rewards.dtype).mean(),
        "advantage_abs_mean": advantages.to(rewards.dtype).abs().mean(),
    }


# --------------------------------------------------------------------------- weights


def token_weights(
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights w [B, C] (float, 0 where mask is 0) with loss = sum_t w_t l_t.

    num_items (dapo only): the normaliser, TRL's global token count over the generation
    batch (all processes, all accumulation steps) rescaled to one micro-batch's share. With
    transformers dividing the loss by the accumulation steps (our trainer), pass
    num_items_in_batch / (num_processes * micro_batches_per_generation); None uses the local
    token count (equal to bnpo). max_completion_length: required for dr_grpo.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, C], got shape {tuple(mask.shape)}")
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    mask = (mask != 0).to(dtype)
    num_sequences = mask.shape[0]
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * max(num_sequences, 1))
    if loss_type == "dr_grpo":
        if not max_completion_length or max_completion_length < 1:
            raise ValueError(f"dr_grpo needs max_completion_length >= 1, got {max_completion_length}")
        return mask / (max(num_sequences, 1) * max_completion_length)
    if loss_type == "dapo" and num_items is not None:
        normaliser = torch.as_tensor(num_items, dtype=dtype, device=mask.device).clamp(min=1.0)
        return mask / normaliser
    return mask / mask.sum().clamp(min=1.0)  # bnpo, and dapo on the local batch


# --------------------------------------------------------------------------- per token


def sampled_log_probs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, dtype=None):
    """(log p(y_n) [N], full tempered log-probs [N, V]) for logits rows [N, V]."""
    logp = tempered_log_probs(logits, temperature, dtype or compute_dtype(logits))
    return logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1), logp


def rows_grpo(
    student_logits: torch.Tensor,
    target_ids: torch.Tensor,
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
    with_stats: bool = True,
) -> tuple[torch.Tensor, PerTokenStats]:
    """Weighted per-token GRPO loss w_n l_n [N] (module docstring) and per-token stats.

    Inputs are rows of the real completion tokens: logits [N, V], sampled ids, advantages
    (each token carries its sequence's), weights (`token_weights` at those tokens), and
    optionally old / reference log-probs [N] (detached here). Summing the result gives the
    loss. `bias_correction_kl` (TRL's `use_bias_correction_kl`, default True as TRL's) multiplies
    the KL by the importance ratio (module docstring). Stats (detached, keys GRPO_STAT_KEYS, + "kl"
    with beta > 0, the corrected KL as TRL logs it) are per-token values whose token mean is the
    logged number.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    dtype = compute_dtype(student_logits)
    logp, full_logp = sampled_log_probs(student_logits, target_ids, temperature, dtype)
    advantages = advantages.detach().to(dtype)
    old = logp.detach() if old_logp is None else old_logp.detach().to(dtype)
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp, the reference model's log-probs of the sampled tokens")
        delta = ref_logp.detach().to(dtype) - logp
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:  # TRL: per_token_kl * coef_1, the ratio with its gradient
            kl = kl * ratio
        per_token = per_token + beta * kl
    per_token = per_token * weights.detach().to(dtype)
    if not with_stats:
        return per_token, {}
    with torch.no_grad():
        ratio = ratio.detach()
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(dtype)  # TRL: is_low_clipped
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(dtype)  # TRL: is_high_clipped
        stats = {
            "clip_ratio_low": low,
            "clip_ratio_high": high,
            "clip_ratio": torch.maximum(low, high),  # the two cannot both hold: their union
            "entropy": -(full_logp.exp() * full_logp).sum(-1).detach(),
            "ratio_mean": ratio,
            "advantage_mean": advantages,
        }
        if kl is not None:
            stats["kl"] = kl.detach()
    return per_token, stats


def grpo_stat_keys(beta: float) -> tuple[str, ...]:
    return GRPO_STAT_KEYS + (("kl",) if beta else ())


# --------------------------------------------------------------------------- public API


def per_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Advantages [B] (one per sequence) or [B, C] -> [B, C]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape[0] != mask.shape[0] or advantages.shape[1] not in (1, mask.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} do not match mask {tuple(mask.shape)}")
    return advantages.expand(mask.shape)


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str,
    temperature: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss on full logits [B, C, V] (the reference for `chunked_grpo_loss`).

    completion_ids, mask [B, C]; advantages [B] (or [B, C]); old_logp / ref_logp [B, C]
    optional; loss_type has no default on purpose (TRL 1.16's default is "dapo"). Returns
    (scalar loss, detached scalar stats: token means over the real tokens, keys
    `grpo_stat_keys(beta)`). Reward stats come from `reward_stats` at generation time.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != mask.shape or completion_ids.shape != mask.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, completion_ids {tuple(completion_ids.shape)} and mask "
            f"{tuple(mask.shape)} do not match"
        )
    weights = token_weights(mask, loss_type, max_completion_length, num_items)
    keep = mask != 0
    per_token, stats = rows_grpo(
        logits[keep], completion_ids[keep], per_token_advantages(advantages, mask)[keep], weights[keep],
        temperature=temperature, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        old_logp=None if old_logp is None else old_logp[keep],
        ref_logp=None if ref_logp is None else ref_logp[keep], beta=beta, bias_correction_kl=bias_correction_kl,
    )  # fmt: skip
    num_tokens = per_token.shape[0]
    return per_token.sum(), reduce_stats({k: v.sum() for k, v in stats.items()}, num_tokens)
