"""opsd.grpo and chunked_grpo_loss against float64 references written from TRL 1.16's formulas,
and against TRL's own `GRPOTrainer._compute_loss` run on a stand-in trainer object.

The references below spell TRL's code out on [B, C] tensors (trl/trainer/grpo_trainer.py:
advantages in `_generate_and_score_completions`, the `sum_then_normalize` branch; the loss
in `_compute_loss`, the `coef_1` / `coef_2` clip and the `if self.loss_type == ...`
reductions) and call no helper of the module under test.
"""
import dataclasses
import inspect
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opsd.chunked_loss import chunked_grpo_loss
from opsd.grpo import (
    GRPO_LOSS_TYPES,
    GRPO_STAT_KEYS,
    REWARD_SCALES,
    TRL_SAMPLING_FLAGS,
    group_advantages,
    grpo_loss,
    reward_stats,
    token_weights,
)

F64 = torch.float64
B, C, H, V = 5, 9, 12, 40
MAX_LEN = 11  # dr_grpo's max_completion_length (> C: TRL's config value, not the padded width)
LENGTHS = [9, 4, 0, 7, 1]  # one row without tokens: TRL's B still counts it


# --------------------------------------------------------------------------- references


def ref_std(values):
    """Bessel-corrected std (TRL `nanstd`: variance * count / (count - 1)), NaN left out."""
    values = [v for v in values if not math.isnan(v)]
    if len(values) < 2:
        return float("nan")
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def ref_advantages(rewards, group_size, scale):
    """TRL grpo_trainer.py `_generate_and_score_completions`: advantages = rewards - group mean,
    / (std_rewards + 1e-4) unless scale_rewards == "none"; NaN -> 0 (`nan_to_num`)."""
    rewards = [float(r) for r in rewards]
    batch_std = ref_std(rewards)
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        real = [r for r in group if not math.isnan(r)]
        mean = sum(real) / len(real) if real else float("nan")
        std = ref_std(group) if scale == "group" else batch_std
        for r in group:
            a = r - mean
            if scale != "none":
                a = a / (std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return torch.tensor(out, dtype=F64)


def make_mask(lengths=LENGTHS, width=C):
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=F64)


def ref_loss(logits, ids, mask, adv, *, loss_type, temperature=1.0, eps_low=0.2, eps_high=None, max_len=MAX_LEN,
             num_items=None, old=None, ref=None, beta=0.0, bias_correction=True):
    """TRL `_compute_loss` for one process and no accumulation, in float64 on [B, C]; `bias_correction`
    is TRL's `use_bias_correction_kl` (default True): the KL times coef_1, the differentiable ratio."""
    eps_high = eps_low if eps_high is None else eps_high
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = logp.detach() if old is None else old
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = adv.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if beta:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * (kl * coef_1 if bias_correction else kl)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    normaliser = mask.sum() if num_items is None else torch.tensor(float(num_items), dtype=F64)
    return (per_token * mask).sum() / normaliser.clamp(min=1.0)  # dapo


def make_batch(seed=0, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = spread * torch.randn(B, C, V, generator=gen, dtype=F64)
    ids = torch.randint(0, V, (B, C), generator=gen)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return logits.requires_grad_(True), ids, make_mask(), adv, gen


def sampled_logp(logits, ids, temperature):
    return torch.log_softmax(logits.detach() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [2, 4])
def test_advantages_match_trl_formula(scale, group_size):
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(group_size), dtype=F64)
    rewards[:group_size] = 0.7  # an all-equal group
    got = group_advantages(rewards, group_size, scale)
    torch.testing.assert_close(got, ref_advantages(rewards.tolist(), group_size, scale), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[:group_size], torch.zeros(group_size, dtype=F64))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_groups_give_exact_zeros(scale):
    """Three times 0.9 in float32: the group mean is off by one ulp, and TRL's formula divides
    that residue by std + 1e-4 (6e-4, not 0); here every all-equal group is exactly 0, no NaN."""
    rewards = torch.tensor([0.9] * 3 + [1.0, 0.0, 1.0] + [0.3] * 3 + [1.0] * 3)
    residue = rewards[:3] - rewards[:3].mean()
    assert (residue != 0).all()  # the case this test is about
    got = group_advantages(rewards, 3, scale)
    assert not torch.isnan(got).any()
    for group in (0, 2, 3):
        assert torch.equal(got[3 * group : 3 * group + 3], torch.zeros(3)), group
    assert (got[3:6] != 0).all()
    every_group_flat = group_advantages(torch.full((6,), 0.9), 3, scale)  # batch std 0 too
    assert torch.equal(every_group_flat, torch.zeros(6))


def test_nan_rewards_are_left_out_and_get_zero_advantage():
    """TRL: an unscorable completion (NaN reward) is excluded from its group's mean and std
    (nanmean / nanstd) and gets advantage 0; a group left with one value has std NaN -> 0."""
    nan = float("nan")
    rewards = [1.0, nan, 0.0, 0.5, nan, 2.0, nan, nan, 1.0, 3.0, 1.0, 0.0]
    for scale in ("group", "batch", "none"):
        got = group_advantages(torch.tensor(rewards, dtype=F64), 3, scale)
        torch.testing.assert_close(got, ref_advantages(rewards, 3, scale), rtol=1e-12, atol=1e-12)
        assert not torch.isnan(got).any() and got[1] == 0 and got[4] == 0


@pytest.mark.parametrize(
    "size, group_size, scale",
    [(8, 1, "group"), (8, 0, "group"), (9, 2, "group"), (8, 3, "batch"), (8, 4, "std"), (0, -1, "none")],
)
def test_bad_groups_raise_one_line(size, group_size, scale):
    with pytest.raises(ValueError) as error:
        group_advantages(torch.zeros(size), group_size, scale)
    assert "\n" not in str(error.value)


def test_two_dimensional_rewards_raise():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


def test_reward_stats():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], dtype=F64)
    adv = group_advantages(rewards, 2)
    stats = reward_stats(rewards, 2, adv)
    assert stats["reward_mean"].item() == pytest.approx(4.0 / 6)
    assert stats["reward_std"].item() == pytest.approx(ref_std(rewards.tolist()))
    assert stats["frac_reward_zero_std"].item() == pytest.approx(2 / 3)
    assert stats["advantage_abs_mean"].item() == pytest.approx(float(adv.abs().mean()))
    assert stats["advantage_abs_mean"].item() > 0.2


def trl_frac_reward_zero_std(rewards, num_generations, scale_rewards):
    """TRL 1.16's `is_std_zero` (`_generate_and_score_completions`, `sum_then_normalize`), line
    by line with TRL's own nanstd."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return is_std_zero.float().mean().item()


@pytest.mark.parametrize("scale", REWARD_SCALES)
@pytest.mark.parametrize("rewards", [
    [1.0, 1.0, 0.0, 1.0, 0.0, 0.0],  # mixed batch with all-equal groups: batch scaling counts none
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all equal: 1 under every scaling
    [1.0, float("nan"), 0.0, 0.0, 1.0, 0.0],  # a group with one scorable reward: NaN std, not zero
])
def test_frac_reward_zero_std_is_trls(scale, rewards):
    rewards = torch.tensor(rewards)
    stats = reward_stats(rewards, 2, group_advantages(rewards, 2, scale), scale)
    assert stats["frac_reward_zero_std"].item() == pytest.approx(trl_frac_reward_zero_std(rewards, 2, scale))
    if scale == "batch" and rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]:
        assert stats["frac_reward_zero_std"].item() == 0.0  # the group figure would be 2 / 3


def test_nanstd_equals_trls():
    utils = pytest.importorskip("trl.trainer.utils")
    from opsd.grpo import _nanstd

    # float32, the dtype of TRL's rewards (its Bessel factor count / (count - 1) is float32 anyway).
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 3.0, 0.5], [2.0, 2.0, nan, nan], [1.0, nan, nan, nan]])
    torch.testing.assert_close(_nanstd(x, dim=1), utils.nanstd(x, dim=1, keepdim=True), equal_nan=True)
    torch.testing.assert_close(_nanstd(x), utils.nanstd(x))


# --------------------------------------------------------------------------- loss


LOSS_OPTIONS = [
    {},  # on policy: ratio 1, no clip
    {"temperature": 0.7},
    {"off_policy": True, "eps_low": 0.2, "eps_high": 0.28},  # the two-sided clip fires
    {"off_policy": True, "temperature": 1.3, "beta": 0.04},
    {"beta": 0.1},
    {"beta": 0.1, "bias_correction": False},  # TRL's use_bias_correction_kl False: k3 alone
    {"off_policy": True, "beta": 0.04, "bias_correction": False},
]


def ids_of(opts):
    return "-".join(f"{k}={v}" for k, v in opts.items()) or "on-policy"


def loss_inputs(opts, logits, ids, gen):
    """(reference kwargs, grpo_loss kwargs) for LOSS_OPTIONS entry `opts`."""
    temperature = opts.get("temperature", 1.0)
    logp = sampled_logp(logits, ids, temperature)
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen, dtype=F64) if opts.get("off_policy") else None
    ref = logp + 0.5 * torch.randn(logp.shape, generator=gen, dtype=F64) if opts.get("beta") else None
    eps_low, eps_high = opts.get("eps_low", 0.2), opts.get("eps_high")
    beta, correction = opts.get("beta", 0.0), opts.get("bias_correction", True)
    reference = {"temperature": temperature, "eps_low": eps_low, "eps_high": eps_high, "old": old, "ref": ref,
                 "beta": beta, "bias_correction": correction}
    ours = {"temperature": temperature, "epsilon_low": eps_low, "epsilon_high": eps_high, "old_logp": old,
            "ref_logp": ref, "beta": beta, "bias_correction_kl": correction}
    return reference, ours


@pytest.mark.parametrize("opts", LOSS_OPTIONS, ids=ids_of)
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_loss_and_gradient_match_reference(loss_type, opts):
    logits, ids, mask, adv, gen = make_batch()
    reference, ours = loss_inputs(opts, logits, ids, gen)
    num_items = 50.0 if loss_type == "dapo" else None
    loss, stats = grpo_loss(logits, ids, mask, adv, loss_type=loss_type, max_completion_length=MAX_LEN,
                            num_items=num_items, **ours)
    expected = ref_loss(logits, ids, mask, adv, loss_type=loss_type, num_items=num_items, **reference)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    (got_grad,) = torch.autograd.grad(2.5 * loss, logits)
    (expected_grad,) = torch.autograd.grad(2.5 * expected, logits)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert float(got_grad.abs().sum()) > 0 and float(got_grad[mask == 0].abs().sum()) == 0

    assert set(stats) == set(GRPO_STAT_KEYS) | ({"kl"} if opts.get("beta") else set())
    keep = mask != 0
    logp = sampled_logp(logits, ids, reference["temperature"])
    ratio = torch.ones_like(logp) if reference["old"] is None else torch.exp(logp - reference["old"])
    a = adv.unsqueeze(1).expand_as(logp)
    eps_high = opts.get("eps_high", reference["eps_low"])
    low = (ratio < 1 - reference["eps_low"]) & (a < 0)
    high = (ratio > 1 + eps_high) & (a > 0)
    assert stats["clip_ratio_low"].item() == pytest.approx(low[keep].double().mean().item(), abs=1e-12)
    assert stats["clip_ratio_high"].item() == pytest.approx(high[keep].double().mean().item(), abs=1e-12)
    assert stats["clip_ratio"].item() == pytest.approx((low | high)[keep].double().mean().item(), abs=1e-12)
    if opts.get("off_policy"):
        assert 0 < stats["clip_ratio"].item() < 1
    else:
        assert stats["clip_ratio"].item() == 0 and stats["ratio_mean"].item() == 1
    full = torch.log_softmax(logits.detach() / reference["temperature"], -1)
    entropy = -(full.exp() * full).sum(-1)
    assert stats["entropy"].item() == pytest.approx(entropy[keep].mean().item(), rel=1e-12)
    assert stats["advantage_mean"].item() == pytest.approx(a[keep].mean().item(), rel=1e-12)
    if opts.get("beta"):
        delta = reference["ref"] - logp
        kl = (torch.exp(delta) - delta - 1) * (ratio if reference["bias_correction"] else 1)  # TRL logs it corrected
        assert stats["kl"].item() == pytest.approx(kl[keep].mean().item(), rel=1e-12)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_on_policy_gradient_is_the_weighted_policy_gradient(loss_type):
    """ratio = exp(logp - logp.detach()) is 1 but its gradient is d logp: the loss's gradient
    is that of -sum_t w_t A_t logp_t (the REINFORCE surrogate with TRL's weights)."""
    logits, ids, mask, adv, _ = make_batch(seed=1)
    loss, _ = grpo_loss(logits, ids, mask, adv, loss_type=loss_type, max_completion_length=MAX_LEN, temperature=0.9)
    logp = torch.log_softmax(logits / 0.9, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    counts = mask.sum(-1, keepdim=True)
    weight = {
        "grpo": mask / (counts.clamp(min=1) * B),
        "bnpo": mask / mask.sum(),
        "dapo": mask / mask.sum(),
        "dr_grpo": mask / (B * MAX_LEN),
    }[loss_type]
    surrogate = -(weight * adv.unsqueeze(1) * logp).sum()
    assert loss.item() == pytest.approx(-(weight * adv.unsqueeze(1)).sum().item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(surrogate, logits)[0],
                               rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_off_policy_gradcheck(loss_type):
    """Finite differences (a fixed old_logp; on policy the old log-probs move with the input)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 6, (3, 4), generator=gen)
    mask = make_mask([4, 2, 3], width=4)
    adv = torch.tensor([1.0, -0.5, 0.8], dtype=F64)
    # Ratios 0.5 .. 1.6, none within finite-difference reach of the clip's kinks at 0.8 and 1.28.
    old = sampled_logp(logits, ids, 1.1) - torch.tensor([0.5, -0.4, 0.05, 0.7]).to(F64)
    ref = sampled_logp(logits, ids, 1.1) + 0.3

    def f(x):
        return grpo_loss(x, ids, mask, adv, loss_type=loss_type, temperature=1.1, epsilon_high=0.28,
                         max_completion_length=5, num_items=7, old_logp=old, ref_logp=ref, beta=0.2)[0]

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-8)


def test_token_weights():
    mask = make_mask()
    n = sum(LENGTHS)
    w = token_weights(mask, "grpo")
    torch.testing.assert_close(w.sum(-1), torch.tensor([1 / B if n else 0.0 for n in LENGTHS], dtype=F64))
    torch.testing.assert_close(token_weights(mask, "bnpo").sum(), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(token_weights(mask, "dapo").sum(), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(token_weights(mask, "dapo", num_items=2 * n).sum(), torch.tensor(0.5, dtype=F64))
    dr_grpo = token_weights(mask, "dr_grpo", MAX_LEN)
    torch.testing.assert_close(dr_grpo.sum(), torch.tensor(n / (B * MAX_LEN), dtype=F64))
    assert float(w[mask == 0].abs().sum()) == 0
    assert torch.equal(token_weights(torch.zeros(2, 3), "bnpo"), torch.zeros(2, 3))  # no tokens: no NaN
    with pytest.raises(ValueError, match="max_completion_length"):
        token_weights(mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        token_weights(mask, "cispo")
    with pytest.raises(ValueError, match="beta > 0 needs ref_logp"):
        logits, ids, mask, adv, _ = make_batch()
        grpo_loss(logits, ids, mask, adv, loss_type="grpo", beta=0.1)


# --------------------------------------------------------------------------- TRL itself


class _OneProcess:
    """The accelerator calls `_compute_loss` makes, for one process (gather / reduce: identity)."""

    def __init__(self, num_processes=1):
        self.num_processes = num_processes

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_compute_loss(logits, ids, mask, adv, *, loss_type, temperature, level="token", grad_accum=1,
                     steps_per_generation=1, num_processes=1, num_items_in_batch=None, old=None, ref=None, beta=0.0,
                     eps_low=0.2, eps_high=None, use_bias_correction_kl=True):
    """TRL 1.16 `GRPOTrainer._compute_loss` on a stand-in `self`: the model's log-probs and
    entropies are ours (log_softmax(logits / T) at the sampled token, as TRL's fused head).
    `use_bias_correction_kl` defaults to TRL 1.16 GRPOConfig's default, True."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    full = torch.log_softmax(logits / temperature, -1)
    logp = full.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(full.exp() * full).sum(-1)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp, entropy, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_low if eps_high is None else eps_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=use_bias_correction_kl,
                             steps_per_generation=steps_per_generation),
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=MAX_LEN,
        accelerator=_OneProcess(num_processes), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(ids.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(ids.shape[0], 1, dtype=torch.long),
        "completion_ids": ids, "completion_mask": mask, "advantages": adv,
        "num_items_in_batch": torch.tensor(float(num_items_in_batch or mask.sum())),
    }  # fmt: skip
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = grpo_trainer.GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, stand_in._metrics["train"]


@pytest.mark.parametrize("opts", LOSS_OPTIONS, ids=ids_of)
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_equals_trl_compute_loss(loss_type, opts):
    """TRL with 2 processes, 3 accumulation steps, a generation batch of 3 micro-batches and
    num_items_in_batch = 120 tokens against ours with num_items = 120 / (2 * 3), divided by the
    accumulation steps as transformers' Trainer does for us (`loss_is_scaled_for_ga` False)."""
    logits, ids, mask, adv, gen = make_batch(seed=2)
    reference, ours = loss_inputs(opts, logits, ids, gen)
    trl_loss, metrics = trl_compute_loss(
        logits, ids, mask, adv, loss_type=loss_type, temperature=reference["temperature"], grad_accum=3,
        steps_per_generation=3, num_processes=2, num_items_in_batch=120, old=reference["old"], ref=reference["ref"],
        beta=reference["beta"], eps_low=reference["eps_low"], eps_high=reference["eps_high"],
        use_bias_correction_kl=reference["bias_correction"],
    )  # fmt: skip
    loss, stats = grpo_loss(logits, ids, mask, adv, loss_type=loss_type, max_completion_length=MAX_LEN,
                            num_items=120 / (2 * 3), **ours)
    torch.testing.assert_close(loss / 3, trl_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss / 3, logits)[0], torch.autograd.grad(trl_loss, logits)[0],
                               rtol=1e-10, atol=1e-14)
    assert stats["clip_ratio"].item() == pytest.approx(metrics["clip_ratio/region_mean"][-1], abs=1e-12)
    assert stats["clip_ratio_low"].item() == pytest.approx(metrics["clip_ratio/low_mean"][-1], abs=1e-12)
    assert stats["clip_ratio_high"].item() == pytest.approx(metrics["clip_ratio/high_mean"][-1], abs=1e-12)
    assert stats["entropy"].item() == pytest.approx(metrics["entropy"][-1], rel=1e-12)
    if opts.get("beta"):
        assert stats["kl"].item() == pytest.approx(metrics["kl"][-1], rel=1e-12)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_on_policy_sequence_level_equals_token_level(loss_type):
    """The module docstring's claim: with old = current log-probs, TRL's importance sampling
    level "sequence" (GSPO) gives the token level's value and gradient for every loss type."""
    logits, ids, mask, adv, _ = make_batch(seed=3)
    sequence, _ = trl_compute_loss(logits, ids, mask, adv, loss_type=loss_type, temperature=0.8, level="sequence")
    loss, _ = grpo_loss(logits, ids, mask, adv, loss_type=loss_type, temperature=0.8, max_completion_length=MAX_LEN)
    torch.testing.assert_close(loss, sequence, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(sequence, logits)[0],
                               rtol=1e-10, atol=1e-14)


def test_trl_default_is_the_bias_corrected_kl():
    """The default of TRL 1.16 (GRPOConfig.use_bias_correction_kl) is what grpo_loss defaults to."""
    grpo_config = pytest.importorskip("trl").GRPOConfig
    defaults = {f.name: f.default for f in dataclasses.fields(grpo_config)}
    assert defaults["use_bias_correction_kl"] is True
    assert inspect.signature(grpo_loss).parameters["bias_correction_kl"].default is True
    assert inspect.signature(chunked_grpo_loss).parameters["bias_correction_kl"].default is True


@pytest.mark.parametrize("correction, coefficient", [(True, 1.0), (False, 1 - math.exp(-1))])
def test_on_policy_kl_gradient_per_token(correction, coefficient):
    """Issue 59's numbers: at logp = -1 and ref = -2 the KL's gradient is c * d logp with
    c = logp - ref = 1.00 when bias-corrected (TRL's default), 1 - exp(ref - logp) = 0.63 without."""
    logits = torch.tensor([[[0.0, math.log(math.e - 1)]]], dtype=F64, requires_grad=True)  # p(token 0) = 1/e
    ids, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=F64)
    logp = torch.log_softmax(logits, -1)[0, 0, 0]
    assert logp.item() == pytest.approx(-1.0, abs=1e-15)
    loss, stats = grpo_loss(logits, ids, mask, torch.zeros(1, dtype=F64), loss_type="bnpo", beta=0.5,
                            ref_logp=torch.full((1, 1), -2.0, dtype=F64), bias_correction_kl=correction)
    assert stats["kl"].item() == pytest.approx(math.exp(-1), rel=1e-12)  # k3 at ref - logp = -1 (ratio 1 in value)
    (grad,) = torch.autograd.grad(loss, logits)
    (grad_logp,) = torch.autograd.grad(logp, logits)
    torch.testing.assert_close(grad, 0.5 * coefficient * grad_logp, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------- chunked


def make_hidden(seed=0, with_bias=False):
    """LoRA-like: hidden = x @ P (P the trained input projection), logits = hidden @ W.T (+ b)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, generator=gen, dtype=F64)
    projection = (torch.randn(H, H, generator=gen, dtype=F64) / math.sqrt(H)).requires_grad_(True)
    weight = (1.5 * torch.randn(V, H, generator=gen, dtype=F64)).requires_grad_(True)
    bias = torch.randn(V, generator=gen, dtype=F64).requires_grad_(True) if with_bias else None
    ids = torch.randint(0, V, (B, C), generator=gen)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return x, projection, weight, bias, ids, adv, gen


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
@pytest.mark.parametrize("opts", LOSS_OPTIONS, ids=ids_of)
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_chunked_equals_full(loss_type, opts, chunk_size):
    x, projection, weight, bias, ids, adv, gen = make_hidden(with_bias=loss_type == "bnpo")
    mask = make_mask()
    keep = mask != 0
    hidden = x @ projection  # [B, C, H]: gradients reach the projection through both paths
    logits = hidden @ weight.T + (0 if bias is None else bias)
    _, ours = loss_inputs(opts, logits, ids, gen)
    num_items = 40.0 if loss_type == "dapo" else None
    full, full_stats = grpo_loss(logits, ids, mask, adv, loss_type=loss_type, max_completion_length=MAX_LEN,
                                 num_items=num_items, **ours)

    hidden_rows = hidden[keep].detach().requires_grad_(True)
    weights = token_weights(mask, loss_type, MAX_LEN, num_items)[keep]
    per_token = dict(ours, old_logp=None if ours["old_logp"] is None else ours["old_logp"][keep],
                     ref_logp=None if ours["ref_logp"] is None else ours["ref_logp"][keep])
    chunked, stats = chunked_grpo_loss(hidden_rows, weight, ids[keep], adv.unsqueeze(1).expand(B, C)[keep], weights,
                                       chunk_size=chunk_size, lm_head_bias=bias, **per_token)
    torch.testing.assert_close(chunked, full, rtol=1e-12, atol=1e-14)
    assert stats.keys() == full_stats.keys()
    for key in stats:
        assert not stats[key].requires_grad
        torch.testing.assert_close(stats[key], full_stats[key], rtol=1e-10, atol=1e-13, msg=key)

    params = [projection, weight] + ([bias] if bias is not None else [])
    expected = torch.autograd.grad(2.5 * full, [hidden] + params)
    got_rows, *got_params = torch.autograd.grad(2.5 * chunked, [hidden_rows] + params[1:])
    torch.testing.assert_close(got_rows, expected[0][keep], rtol=1e-10, atol=1e-14)
    for got, want in zip(got_params, expected[2:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    # The LoRA-like input projection: chain the chunked hidden-state gradient through hidden = x @ P.
    grad_projection = torch.einsum("nh,nk->hk", x[keep], got_rows)
    torch.testing.assert_close(grad_projection, expected[1], rtol=1e-10, atol=1e-14)


def test_chunked_projects_no_teacher_and_only_chunks(projected_rows):
    x, projection, weight, _, ids, adv, _ = make_hidden()
    mask = make_mask()
    keep = mask != 0
    hidden = (x @ projection)[keep].detach().requires_grad_(True)
    n = hidden.shape[0]
    loss, _ = chunked_grpo_loss(hidden, weight, ids[keep], adv.unsqueeze(1).expand(B, C)[keep],
                                token_weights(mask, "grpo")[keep], chunk_size=6)
    loss.backward()
    assert max(projected_rows) == 6 and sum(projected_rows) == 2 * n  # one role, forward + backward


def test_chunked_no_tokens_gives_zero_loss_with_grad_path():
    weight = torch.randn(V, H, dtype=F64, requires_grad=True)
    hidden = torch.zeros(0, H, dtype=F64, requires_grad=True)
    empty = torch.zeros(0, dtype=F64)
    loss, stats = chunked_grpo_loss(hidden, weight, torch.zeros(0, dtype=torch.long), empty, empty)
    assert loss.item() == 0 and loss.grad_fn is not None
    assert all(float(v) == 0 for v in stats.values())
    g_hidden, g_weight = torch.autograd.grad(loss, [hidden, weight])
    assert g_hidden.shape == (0, H) and float(g_weight.abs().sum()) == 0


def test_chunked_shape_mismatch_raises():
    weight = torch.randn(V, H, dtype=F64)
    hidden = torch.randn(6, H, dtype=F64)
    ids, values = torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=F64)
    with pytest.raises(ValueError, match="weights"):
        chunked_grpo_loss(hidden, weight, ids, values, values[:5])
    with pytest.raises(ValueError, match="old_logp"):
        chunked_grpo_loss(hidden, weight, ids, values, values, old_logp=values[:2])
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        chunked_grpo_loss(hidden.unsqueeze(0), weight, ids, values, values)


def test_trl_sampling_flags_are_trls_grpo_defaults():
    """opsd.grpo.TRL_SAMPLING_FLAGS (docs/RESEARCH.md's untruncated sampler for a GRPO arm) are
    TRL 1.16 GRPOConfig's defaults, and the docs give the same flags."""
    grpo_config = pytest.importorskip("trl").GRPOConfig
    defaults = {f.name: f.default for f in dataclasses.fields(grpo_config)}
    flags = dict(zip(TRL_SAMPLING_FLAGS[::2], TRL_SAMPLING_FLAGS[1::2], strict=False))
    assert {k.lstrip("-"): type(defaults[k.lstrip("-")])(v) for k, v in flags.items()} == {
        "temperature": defaults["temperature"], "top_p": defaults["top_p"], "top_k": defaults["top_k"]}
    research = (Path(__file__).resolve().parents[2] / "docs" / "RESEARCH.md").read_text()
    assert f"`{' '.join(TRL_SAMPLING_FLAGS)}`" in research
