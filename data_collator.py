"""The collator: dataset rows -> the student's and the teacher's inputs (the fork's
data_collator.py, built on this repository's method library).

`OPSDCollator` is the one object the trainer (opsd_trainer.py) asks for what each role sees:
- the prompts, as the switches configure them (`OPSD_STUDENT_PROMPT`, `OPSD_TEACHER_CONTEXT`,
  `teacher_thinking`, the length limits): `opsd.prompts.PromptBuilder` renders each row's
  student, teacher and reason-first prompt with the chat template into token ids;
- the padding geometry `OPSD_PAD_SIDE` switches: `opsd.scoring.build_scoring_batch` pads a
  role's prompts and the shared completions into its forward's batch (right, released: pads
  between prompt and completion; left: one contiguous prompt -> completion), every completion
  starting at the same column in both roles (docs/SPEC.md §3).

To change the prompts of both roles, edit the templates in opsd/prompts.py (`student_messages`,
`teacher_messages`, `privileged_context`) or give a switch a new value (README "To change X,
edit Y"); to change the padding geometry, opsd/scoring.py's `build_scoring_batch`. The trainer
builds nothing of either itself: it builds this collator once, from its config
(`OPSDCollator.from_config`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opsd.prompts import PromptBuilder
from opsd.scoring import ScoringBatch, build_scoring_batch

if TYPE_CHECKING:
    from opsd.train_config import OPSDConfig


def prompt_builder(tokenizer, args: OPSDConfig) -> PromptBuilder:
    """Each role's prompt builder, as the config's switches and length limits set it."""
    return PromptBuilder(
        tokenizer,
        student_prompt=args.student_prompt,
        teacher_context=args.teacher_context,
        teacher_thinking=args.teacher_thinking,
        max_prompt_length=args.max_prompt_length,
        max_teacher_prompt_length=args.max_teacher_prompt_length,
    )


@dataclass(frozen=True)
class OPSDCollator:
    """Rows -> each role's prompt token ids; prompts + completions -> each role's scoring batch."""

    prompts: PromptBuilder
    pad_id: int
    pad_side: str  # OPSD_PAD_SIDE: "right" (released) or "left"
    pad_to_multiple_of: int | None = None  # masked pads after the last completion column (compiled layers)

    @classmethod
    def from_config(cls, tokenizer, args: OPSDConfig) -> OPSDCollator:
        return cls(prompt_builder(tokenizer, args), pad_id=tokenizer.pad_token_id, pad_side=args.pad_side,
                   pad_to_multiple_of=args.pad_to_multiple_of)

    def student_prompts(self, rows: Sequence[Mapping]) -> list[list[int]]:
        """The prompt the student samples its completion from and is scored on, one per row."""
        return [self.prompts.student_prompt_ids(row) for row in rows]

    def teacher_prompts(self, rows: Sequence[Mapping],
                        rationales: Sequence[str | None] | None = None) -> list[list[int]]:
        """The teacher's prompt (the privileged context included), one per row; with reason_first,
        each row's analysis of the reference (`rationales`) is appended to its context."""
        rationales = [None] * len(rows) if rationales is None else rationales
        return [self.prompts.teacher_prompt_ids(row, rationale=r) for row, r in zip(rows, rationales, strict=True)]

    def reason_first_prompts(self, rows: Sequence[Mapping]) -> list[list[int]]:
        """reason_first: the prompt that asks the teacher to analyse the reference, one per row."""
        return [self.prompts.reason_first_prompt_ids(row) for row in rows]

    def scoring_batch(self, prompt_ids: Sequence[Sequence[int]],
                      completion_ids: Sequence[Sequence[int]]) -> ScoringBatch:
        """One role's forward inputs: its prompts and the completions, padded by OPSD_PAD_SIDE's
        geometry (`pad_side`)."""
        return build_scoring_batch(prompt_ids, completion_ids, pad_id=self.pad_id, pad_side=self.pad_side,
                                   pad_to_multiple_of=self.pad_to_multiple_of)
