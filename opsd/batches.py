"""The trainer's batches, one type per arm (opsd_trainer.py's arms build them): the rows of a
generation batch or micro-batch as token lists, unpadded (each micro-batch is padded to its own
longest row when it is scored, opsd.scoring).

- `DistillBatch` (OPSD, and SFT): each row's completion is scored under two prompts, the
  student's (with gradients) and the teacher's (the privileged context, no gradients).
- `GRPOBatch`: the student's prompt and completion, the row's advantage and dapo's normaliser.
  No teacher prompt: GRPO has no teacher; its KL's reference (with `grpo_beta`) scores the
  student's own prompt, which the arm says, not a field.

TRL's buffering (`DistillationTrainer._prepare_inputs`) shuffles a generation batch and splits it
into micro-batches as a dict: a batch crosses it as one (`to_dict`, then `from_dict` on each
micro-batch), the only place a batch is a dict.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Self

import torch

# The first value of a batch's dict: TRL's shuffle_sequence_dict and split_tensor_dict read the
# number of rows from the first value, which must be a tensor (the rows' completion lengths).
SIZE_KEY = "completion_lengths"


@dataclass
class RolloutBatch:
    """The fields every arm's batch has: B rows of the student's prompt and its completion."""

    student_prompt_ids: list[list[int]]
    completion_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.completion_ids)

    def to_dict(self) -> dict:
        """The batch as TRL's buffering takes it: the completion lengths first (SIZE_KEY)."""
        lengths = torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)
        return {SIZE_KEY: lengths, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls, values: dict) -> Self:
        """The batch `to_dict` gave (or a shuffled, split part of it)."""
        return cls(**{k: v for k, v in values.items() if k != SIZE_KEY})


@dataclass
class DistillBatch(RolloutBatch):
    """OPSD's and SFT's rows: the completion (sampled, or the reference solution) with the
    student's prompt and the teacher's (the privileged context, with reason_first's analysis)."""

    teacher_prompt_ids: list[list[int]]


@dataclass
class GRPOBatch(RolloutBatch):
    """GRPO's rows: the student's samples with each row's group-normalised advantage [B] and dapo's
    normaliser (0-d: the generation batch's completion tokens per process and micro-batch)."""

    advantages: torch.Tensor
    num_items: torch.Tensor
