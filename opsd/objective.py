"""The run's objective: chosen once, when the trainer starts, from the loss type and the
loss implementation (docs/SPEC.md §2).

An objective is `objective(student_hidden, teacher_hidden, batch, head) -> (loss, stats)`:
the hidden states are [B, C, H] at the completion positions, `batch` is the student's
`opsd.scoring.ScoringBatch` (which completion tokens are real, their ids) and `head` is the
LM head. The per-step code calls it without looking at the config again.

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

from opsd.chunked_loss import chunked_divergence_loss, chunked_nll_loss, chunked_tinker_loss
from opsd.loss import DivergenceConfig, divergence_loss, nll_loss, tinker_loss
from opsd.scoring import ScoringBatch, select_completion_tokens

# The config's `loss_type`: opsd (the distillation loss) or sft (the supervised control arm).
LOSS_TYPES = ("opsd", "sft")
# The config's `loss_implementation` once resolved (`auto` is resolved with the engine:
# opsd.train_config.resolve_engine_defaults).
IMPLEMENTATIONS = ("chunked", "logits")

Objective = Callable[[torch.Tensor, torch.Tensor, ScoringBatch, torch.nn.Module],
                     tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ObjectiveSettings:
    """What the objective needs from the config, typed, built once (`objective_settings`)."""

    objective: str  # divergence, tinker or sft: a key of BUILDERS with the implementation
    implementation: str  # chunked (hidden states, chunk by chunk) or logits ([B, C, V] at once)
    divergence: DivergenceConfig  # beta, temperature, clip, clip mode, top-k of the loss
    chunk_size: int
    compile: bool  # torch.compile the chunked divergence's per-chunk math


def objective_settings(args) -> ObjectiveSettings:
    """The objective's settings from a resolved OPSDConfig (opsd.train_config)."""
    if args.loss_type == "sft":
        objective = "sft"
    else:
        objective = "tinker" if args.use_tinker_loss else "divergence"
    divergence = DivergenceConfig(beta=args.beta, temperature=args.temperature, clip=args.jsd_token_clip,
                                  clip_mode=args.clip_mode, top_k=args.top_k_loss)
    return ObjectiveSettings(objective=objective, implementation=args.loss_implementation, divergence=divergence,
                             chunk_size=args.loss_chunk_size, compile=bool(args.compile_loss))


def make_objective(args) -> Objective:
    """The run's objective (see the module docstring) for a resolved OPSDConfig."""
    settings = objective_settings(args)
    return BUILDERS[settings.objective, settings.implementation](settings)


def _tokens(*values: torch.Tensor, batch: ScoringBatch) -> list[torch.Tensor]:
    """Each [B, C, ...] -> [N, ...]: the real completion tokens only."""
    return [select_completion_tokens(v, batch) for v in values]


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The LM head's weight or bias as one ordinary tensor. Under FSDP2 it may be a DTensor (a
    shard per GPU), which the chunked loss's matmuls cannot take: gathered here once per
    micro-batch, not once per chunk. Frozen under LoRA; were it trained, the gather's backward
    would hand each GPU its shard's gradient."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# The chunked implementations form the logits chunk by chunk, never [B, C, V] at once.

def chunked_divergence(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):
        student, teacher = _tokens(student, teacher, batch=batch)
        return chunked_divergence_loss(student, teacher, _whole(head.weight), config=s.divergence,
                                       chunk_size=s.chunk_size, lm_head_bias=_whole(head.bias), compile=s.compile)
    return objective


def chunked_tinker(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):
        student, teacher, ids = _tokens(student, teacher, batch.completion_ids, batch=batch)
        return chunked_tinker_loss(student, teacher, _whole(head.weight), ids, temperature=s.divergence.temperature,
                                   chunk_size=s.chunk_size, lm_head_bias=_whole(head.bias))
    return objective


def chunked_sft(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):  # cross-entropy on the reference solution
        student, teacher, ids = _tokens(student, teacher, batch.completion_ids, batch=batch)
        return chunked_nll_loss(student, teacher, _whole(head.weight), ids, chunk_size=s.chunk_size,
                                lm_head_bias=_whole(head.bias))
    return objective


# The logits implementations: full [B, C, V] logits for both roles (the released-style path).

def logits_divergence(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):
        return divergence_loss(head(student), head(teacher), batch.completion_mask.bool(), config=s.divergence)
    return objective


def logits_tinker(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):
        return tinker_loss(head(student), head(teacher), batch.completion_ids, batch.completion_mask.bool(),
                           temperature=s.divergence.temperature)
    return objective


def logits_sft(s: ObjectiveSettings) -> Objective:
    def objective(student, teacher, batch, head):
        return nll_loss(head(student), head(teacher), batch.completion_ids, batch.completion_mask.bool())
    return objective


BUILDERS: dict[tuple[str, str], Callable[[ObjectiveSettings], Objective]] = {
    ("divergence", "chunked"): chunked_divergence,
    ("divergence", "logits"): logits_divergence,
    ("tinker", "chunked"): chunked_tinker,
    ("tinker", "logits"): logits_tinker,
    ("sft", "chunked"): chunked_sft,
    ("sft", "logits"): logits_sft,
}
