"""The run's objective: chosen once, when the trainer starts, from the loss type and the
loss implementation (docs/SPEC.md §2).

An objective is `objective(student_hidden, teacher_hidden, batch, head, rewards) -> (loss,
stats)`: the hidden states are [B, C, H] at the completion positions (the teacher's None for
GRPO, which has no teacher; with GRPO's KL they are the reference's), `batch` is the student's
`opsd.scoring.ScoringBatch` (which completion tokens are real, their ids), `head` is the LM
head and `rewards` the micro-batch's `RowRewards` (GRPO's advantages; None for the others).
The per-step code calls it without looking at the config again.

`BUILDERS` maps (objective, implementation) to the function that builds it from the typed
`ObjectiveSettings`; a new objective is one per-token function in `opsd.loss` (with its
chunked wrapper in `opsd.chunked_loss`), one builder per implementation here and its name in
`LOSS_TYPES`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from opsd.chunked_loss import chunked_divergence_loss, chunked_grpo_loss, chunked_nll_loss, chunked_tinker_loss
from opsd.grpo import grpo_loss, per_token_advantages, sampled_log_probs, token_weights
from opsd.loss import DivergenceConfig, compute_dtype, divergence_loss, nll_loss, tinker_loss
from opsd.scoring import ScoringBatch, select_completion_tokens

# The config's `loss_type`: opsd (the distillation loss), sft (the supervised control arm) or
# grpo (the RL baseline: rewards from the grader, no teacher).
LOSS_TYPES = ("opsd", "sft", "grpo")
# The config's `loss_implementation` once resolved (`auto` is resolved with the engine:
# opsd.train_config.resolve_engine_defaults).
IMPLEMENTATIONS = ("chunked", "logits")

@dataclass(frozen=True)
class RowRewards:
    """GRPO's per-row inputs of one micro-batch, on the device: each row's advantage [B] and
    dapo's normaliser (the generation batch's completion tokens per micro-batch and process)."""

    advantages: torch.Tensor
    num_items: torch.Tensor


Objective = Callable[[torch.Tensor, torch.Tensor | None, ScoringBatch, torch.nn.Module, RowRewards | None],
                     tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class GRPOSettings:
    loss_type: str  # TRL's: grpo, bnpo, dr_grpo, dapo (opsd.grpo.token_weights)
    epsilon_low: float
    epsilon_high: float | None
    max_completion_length: int  # dr_grpo's normaliser
    beta: float = 0.0  # TRL's GRPO beta: the k3 KL to the reference (the adapter disabled); 0 = no reference forward
    bias_correction_kl: bool = True  # TRL's use_bias_correction_kl: the KL times the importance ratio (opsd.grpo)


@dataclass(frozen=True)
class ObjectiveSettings:
    """What the objective needs from the config, typed, built once (`objective_settings`)."""

    objective: str  # divergence, tinker, sft or grpo: a key of BUILDERS with the implementation
    implementation: str  # chunked (hidden states, chunk by chunk) or logits ([B, C, V] at once)
    divergence: DivergenceConfig  # beta, temperature, clip, clip mode, top-k of the loss
    chunk_size: int
    compile: bool  # torch.compile the chunked divergence's per-chunk math
    grpo: GRPOSettings | None = None
    sft_teacher_diagnostics: bool = False  # SFT: run the teacher's forward for the true-KL diagnostics
    eos_token_ids: tuple[int, ...] = ()  # OPSD: log both roles' log-prob of the sampled EOS (`eos_log_probs`)

    @property
    def uses_teacher(self) -> bool:
        """Whether the trainer runs the second (no-grad) forward: the teacher's (SFT only for its
        diagnostics), or for GRPO with a KL the reference's (the student's prompt, the adapter disabled)."""
        if self.objective == "grpo":
            return bool(self.grpo.beta)
        return self.objective != "sft" or self.sft_teacher_diagnostics


def objective_settings(args, eos_token_ids=()) -> ObjectiveSettings:
    """The objective's settings from a resolved OPSDConfig (opsd.train_config); `eos_token_ids`
    (the tokenizer's) turn on OPSD's EOS diagnostics."""
    if args.loss_type in ("sft", "grpo"):
        objective = args.loss_type
    else:
        objective = "tinker" if args.use_tinker_loss else "divergence"
    divergence = DivergenceConfig(beta=args.beta, temperature=args.temperature, clip=args.jsd_token_clip,
                                  clip_mode=args.clip_mode, top_k=args.top_k_loss)
    grpo = None
    if objective == "grpo":
        grpo = GRPOSettings(loss_type=args.grpo_loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
                            max_completion_length=args.max_completion_length, beta=args.grpo_beta,
                            bias_correction_kl=args.grpo_use_bias_correction_kl)
    return ObjectiveSettings(objective=objective, implementation=args.loss_implementation, divergence=divergence,
                             chunk_size=args.loss_chunk_size, compile=bool(args.compile_loss), grpo=grpo,
                             sft_teacher_diagnostics=bool(args.sft_teacher_diagnostics),
                             eos_token_ids=tuple(eos_token_ids))


def build_objective(settings: ObjectiveSettings) -> Objective:
    """The objective `settings` describe (see the module docstring); OPSD's (divergence, tinker)
    with its EOS diagnostics when `eos_token_ids` are given."""
    objective = BUILDERS[settings.objective, settings.implementation](settings)
    if settings.objective in ("divergence", "tinker") and settings.eos_token_ids:
        objective = with_eos_log_probs(objective, settings)
    return objective


def _tokens(*values: torch.Tensor | None, batch: ScoringBatch) -> list[torch.Tensor | None]:
    """Each [B, C, ...] -> [N, ...]: the real completion tokens only (None stays None: no teacher)."""
    return [None if v is None else select_completion_tokens(v, batch) for v in values]


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The LM head's weight or bias as one ordinary tensor. Under FSDP2 it may be a DTensor (a
    shard per GPU), which the chunked loss's matmuls cannot take: gathered here once per
    micro-batch, not once per chunk. Frozen under LoRA; were it trained, the gather's backward
    would hand each GPU its shard's gradient."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# The chunked implementations form the logits chunk by chunk, never [B, C, V] at once.

def chunked_divergence(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head, rewards=None):
        student, teacher = _tokens(student, teacher, batch=batch)
        return chunked_divergence_loss(student, teacher, _whole(head.weight), config=s.divergence,
                                       chunk_size=s.chunk_size, lm_head_bias=_whole(head.bias), compile=s.compile)
    return objective


def chunked_tinker(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head, rewards=None):
        student, teacher, ids = _tokens(student, teacher, batch.completion_ids, batch=batch)
        return chunked_tinker_loss(student, teacher, _whole(head.weight), ids, temperature=s.divergence.temperature,
                                   chunk_size=s.chunk_size, lm_head_bias=_whole(head.bias))
    return objective


def chunked_sft(s: ObjectiveSettings) -> Objective:
    # Cross-entropy on the reference solution; the teacher (None unless sft_teacher_diagnostics) feeds
    # only the true-KL diagnostics.
    def objective(student, teacher, batch, head, rewards=None):
        student, teacher, ids = _tokens(student, teacher, batch.completion_ids, batch=batch)
        return chunked_nll_loss(student, teacher, _whole(head.weight), ids, chunk_size=s.chunk_size,
                                lm_head_bias=_whole(head.bias))
    return objective


# The logits implementations: full [B, C, V] logits for both roles (the released-style path).

def logits_divergence(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head, rewards=None):
        return divergence_loss(head(student), head(teacher), batch.completion_mask.bool(), config=s.divergence)
    return objective


def logits_tinker(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head, rewards=None):
        return tinker_loss(head(student), head(teacher), batch.completion_ids, batch.completion_mask.bool(),
                           temperature=s.divergence.temperature)
    return objective


def logits_sft(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head, rewards=None):
        return nll_loss(head(student), None if teacher is None else head(teacher), batch.completion_ids,
                        batch.completion_mask.bool())
    return objective


# GRPO: the student's sampled-token log-probs, weighted per token by grpo_loss_type
# (opsd.grpo.token_weights) and by each row's advantage. With a KL (beta > 0) the "teacher"
# hidden states are the reference's (the trainer's no-grad forward of the student's prompt with
# the adapter disabled), read only for the reference log-probs of the sampled tokens.


@torch.no_grad()
def reference_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                        temperature: float, chunk_size: int) -> torch.Tensor:
    """log softmax((h W^T + b) / T)[ids] for hidden [N, H], chunk by chunk (never [N, V] at once)."""
    out = []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = torch.nn.functional.linear(hidden[start:start + chunk_size], weight, bias)
        out.append(sampled_log_probs(logits, ids[start:start + chunk_size], temperature)[0])
    return torch.cat(out) if out else hidden.new_zeros(0)

def chunked_grpo(s: ObjectiveSettings) -> Objective:
    g = s.grpo

    def objective(student, teacher, batch, head, rewards=None):
        mask = batch.completion_mask.to(compute_dtype(student))  # float32 weights for bf16 states, float64 for float64
        weights = token_weights(mask, g.loss_type, g.max_completion_length, rewards.num_items)
        advantages = per_token_advantages(rewards.advantages.to(weights.dtype), mask)
        student, ids, advantages, weights = _tokens(student, batch.completion_ids, advantages, weights, batch=batch)
        ref_logp = None
        if g.beta:
            (reference,) = _tokens(teacher, batch=batch)
            ref_logp = reference_log_probs(reference, _whole(head.weight), _whole(head.bias), ids,
                                           s.divergence.temperature, s.chunk_size)
        return chunked_grpo_loss(student, _whole(head.weight), ids, advantages, weights,
                                 temperature=s.divergence.temperature, epsilon_low=g.epsilon_low,
                                 epsilon_high=g.epsilon_high, ref_logp=ref_logp, beta=g.beta,
                                 bias_correction_kl=g.bias_correction_kl,
                                 chunk_size=s.chunk_size, lm_head_bias=_whole(head.bias))
    return objective


def logits_grpo(s: ObjectiveSettings) -> Objective:
    g = s.grpo

    def objective(student, teacher, batch, head, rewards=None):
        mask = batch.completion_mask.to(compute_dtype(student))
        ref_logp = None
        if g.beta:
            with torch.no_grad():
                ref_logp = sampled_log_probs(head(teacher), batch.completion_ids, s.divergence.temperature)[0]
        return grpo_loss(head(student), batch.completion_ids, mask, rewards.advantages,
                         loss_type=g.loss_type, temperature=s.divergence.temperature, epsilon_low=g.epsilon_low,
                         epsilon_high=g.epsilon_high, max_completion_length=g.max_completion_length,
                         num_items=rewards.num_items, ref_logp=ref_logp, beta=g.beta,
                         bias_correction_kl=g.bias_correction_kl)
    return objective


# OPSD's EOS diagnostics (docs/OUTPUTS.md, "The teacher's length preference"): at each completion
# that the student ended with EOS, both roles' log-probability of that EOS token, from the hidden
# states the step already has: one [B, H] x [H, V] product per role, B rows against the loss's N.

EOS_STAT_KEYS = ("teacher_eos_logp", "student_eos_logp")


@torch.no_grad()
def eos_log_probs(student: torch.Tensor, teacher: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor],
                  eos_token_ids: tuple[int, ...], temperature: float) -> dict[str, torch.Tensor]:
    """Means over the rows whose last real completion token is an EOS (the student stopped there)
    of log softmax(project(h) / T)[that token], h each role's hidden state [B, C, H] at that
    position; NaN when no row ended with EOS (left out when the step is logged). Device ops only:
    nothing waits for the GPU."""
    mask = completion_mask.long()
    last = (mask.sum(1) - 1).clamp(min=0)  # completions are left-aligned in [B, C]
    rows = torch.arange(mask.shape[0], device=mask.device)
    token = completion_ids[rows, last]
    ended = mask.sum(1) > 0
    # Compared with each id as a Python number: a tensor of the ids made here would be a blocking copy.
    ended = ended & torch.stack([token == eos for eos in eos_token_ids]).any(0)
    out = {}
    for key, hidden in zip(EOS_STAT_KEYS, (teacher, student), strict=True):
        logits = project(hidden[rows, last].detach())
        logp = torch.log_softmax(logits.to(compute_dtype(logits)) / temperature, -1)
        logp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        # where, not a product: a row that did not end may give its last token -inf, and -inf * 0 is NaN
        out[key] = torch.where(ended, logp, 0.0).sum() / ended.sum()  # 0 / 0 = NaN without an EOS-ended row
    return out


def with_eos_log_probs(objective: Objective, s: ObjectiveSettings) -> Objective:
    """`objective` whose stats also hold `eos_log_probs` (EOS_STAT_KEYS), at the loss's temperature."""
    def project(head):
        if s.implementation == "logits":  # ZeRO-3: calling the head gathers its partitioned weight
            return head
        return lambda h: torch.nn.functional.linear(h, _whole(head.weight), _whole(head.bias))

    def with_eos(student, teacher, batch, head, rewards=None):
        loss, stats = objective(student, teacher, batch, head, rewards)
        eos = eos_log_probs(student, teacher, batch.completion_ids, batch.completion_mask, project(head),
                            s.eos_token_ids, s.divergence.temperature)
        return loss, {**stats, **eos}
    return with_eos


BUILDERS: dict[tuple[str, str], Callable[[ObjectiveSettings], Objective]] = {
    ("divergence", "chunked"): chunked_divergence,
    ("divergence", "logits"): logits_divergence,
    ("tinker", "chunked"): chunked_tinker,
    ("tinker", "logits"): logits_tinker,
    ("sft", "chunked"): chunked_sft,
    ("sft", "logits"): logits_sft,
    ("grpo", "chunked"): chunked_grpo,
    ("grpo", "logits"): logits_grpo,
}
