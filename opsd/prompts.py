"""Every prompt template of the project, in one place so the wording can be swapped.

Functions here return plain chat messages (`[{"role": "user", "content": ...}]`)
and whether Qwen3's thinking mode is on; `PromptBuilder` applies the chat template and
tokenizes them into each role's prompt ids. Wording is the project's own (docs/SPEC.md §3).

- evaluation prompt (docs/SPEC.md §5): `{problem}` + blank line + INSTRUCTION, thinking on;
- student prompt: `paper` = `Problem: {problem}` + blank line + INSTRUCTION with
  thinking off (Qwen3 pre-fills an empty think block); `eval` = the evaluation prompt;
- teacher prompt: the problem, the privileged context between BEGIN/END markers,
  a transition instruction, INSTRUCTION; the context is chosen by OPSD_TEACHER_CONTEXT,
  whose control arms keep this template (`shuffled`: another row's solution, `answer`:
  `Final answer: ...` only) or drop it (`none`: the builder reuses the student prompt);
- reason-first prompt: the teacher first analyses the reference; the analysis is
  then appended to its context with `with_rationale`.

PromptBuilder: a row -> each role's prompt token ids. The chat template is applied as
text (`tokenize=False`, `add_generation_prompt=True`, `enable_thinking=...`), then encoded
with `add_special_tokens=False`, because the template already holds every special token.

OPSD_TEACHER_CONTEXT=none: the teacher prompt is the student prompt (same style, same
thinking setting, same ids); `teacher_thinking` and the teacher length limit do not apply.

Prompt length policy:
- the problem is never truncated;
- student prompts are never truncated; one warning if one is longer than
  `max_prompt_length`;
- a teacher (or reason-first) prompt longer than `max_teacher_prompt_length`
  has its privileged context cut: the beginning of the context is kept, tokens
  are removed from its end and `prompts.TRUNCATION_NOTE` marks the cut, so the
  rendered prompt fits. If not even the note fits, the context is dropped; if
  the prompt is still over the limit with an empty context, it keeps the full
  problem anyway and one warning is given.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

from opsd.answers import reference_answer
from opsd.config import STUDENT_PROMPTS, TEACHER_CONTEXTS

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

CONTEXT_BEGIN = "=== Reference solution (verified) ==="
CONTEXT_END = "=== End of reference ==="
TRANSITION = (
    "The reference above is correct. Make sure you understand why each of its steps "
    "holds, then solve the problem yourself: reason in your own words and arrive at "
    "the same final answer."
)

# Labels for OPSD_TEACHER_CONTEXT=both and for a reason-first analysis.
SOLUTION_LABEL = "Solution:"
TRACE_LABEL = "Detailed reasoning:"
RATIONALE_LABEL = "Analysis of the reference:"

REASON_FIRST_REQUEST = (
    "Before solving anything, analyse the reference above: explain the key idea, "
    "why each step is valid, and how the steps lead to its final answer. "
    "Do not introduce a different method."
)

# OPSD_TEACHER_CONTEXT=answer: the whole privileged context is this label and the answer.
ANSWER_LABEL = "Final answer:"
# OPSD_TEACHER_CONTEXT=shuffled: the column the data loader fills with another row's
# solution (opsd.data), so a row carries its own foreign reference.
SHUFFLED_SOLUTION = "shuffled_solution"

# Appended where the builder cut a privileged context to fit the teacher prompt.
TRUNCATION_NOTE = "[... reference truncated ...]"


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def eval_prompt(problem: str) -> str:
    return f"{problem}\n\n{INSTRUCTION}"


def eval_messages(problem: str) -> list[dict[str, str]]:
    """The evaluation prompt (docs/SPEC.md §5); rendered with thinking on."""
    return _user(eval_prompt(problem))


def student_messages(problem: str, style: str) -> list[dict[str, str]]:
    _check(style, STUDENT_PROMPTS, "student prompt style")
    if style == "eval":
        return eval_messages(problem)
    return _user(f"Problem: {problem}\n\n{INSTRUCTION}")


def student_enable_thinking(style: str) -> bool:
    """paper: thinking off (empty think block, as the released code);
    eval: thinking on, so the prompt is byte-identical to the evaluation prompt."""
    _check(style, STUDENT_PROMPTS, "student prompt style")
    return style == "eval"


def privileged_context(row: Mapping[str, object], mode: str) -> str:
    """The teacher's privileged text for OPSD_TEACHER_CONTEXT=mode. `none` has none (its
    teacher prompt is the student prompt), so asking for it is an error."""
    _check(mode, TEACHER_CONTEXTS, "teacher context")
    solution, trace = _text(row.get("solution")), _text(row.get("COT_Reason"))
    if mode == "solution":
        return solution
    if mode == "cot":
        return trace
    if mode == "both":
        return f"{SOLUTION_LABEL}\n{solution}\n\n{TRACE_LABEL}\n{trace}"
    if mode == "shuffled":
        if SHUFFLED_SOLUTION not in row:
            raise ValueError(f"teacher context shuffled: the row has no {SHUFFLED_SOLUTION!r} column "
                             "(load the data with teacher_context='shuffled')")
        return _text(row[SHUFFLED_SOLUTION])
    if mode == "answer":
        answer = reference_answer(row)
        if answer is None:
            raise ValueError("teacher context answer: the row has no 'Answer' and no \\boxed{} in its solution")
        return f"{ANSWER_LABEL} {answer}"
    raise ValueError("teacher context none: there is no privileged context; the teacher prompt is the student's")


def _reference_block(problem: str, context: str) -> str:
    return f"Problem: {problem}\n\n{CONTEXT_BEGIN}\n{context}\n{CONTEXT_END}"


def teacher_messages(problem: str, context: str) -> list[dict[str, str]]:
    return _user(f"{_reference_block(problem, context)}\n\n{TRANSITION}\n\n{INSTRUCTION}")


def reason_first_messages(problem: str, context: str) -> list[dict[str, str]]:
    """The teacher's rationalisation request (recipe `reason_first`)."""
    return _user(f"{_reference_block(problem, context)}\n\n{REASON_FIRST_REQUEST}")


def with_rationale(context: str, rationale: str) -> str:
    """The context with the teacher's analysis appended. A closed thinking block
    in the generated analysis is dropped (only its conclusion is kept)."""
    analysis = rationale.rsplit("</think>", 1)[-1].strip().removeprefix("<think>").strip()
    if not analysis:
        return context
    return f"{context}\n\n{RATIONALE_LABEL}\n{analysis}"


def _text(value: object) -> str:
    return "" if value is None else str(value).strip()


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(allowed)}")


# --------------------------------------------------------------------------
# Token ids: the chat template applied, each role's length policy
# --------------------------------------------------------------------------

class PromptLengthWarning(UserWarning):
    """A prompt is over its length limit (given once per builder and kind)."""


def render_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool) -> str:
    """The chat-template text of `messages` followed by the generation prompt."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )


def encode_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool) -> list[int]:
    return tokenizer.encode(render_prompt(tokenizer, messages, enable_thinking), add_special_tokens=False)


class PromptBuilder:
    """Builds the student, teacher, reason-first and evaluation prompts of a row as token
    ids, as the switches configure them (the scoring geometry is opsd.scoring's)."""

    def __init__(
        self,
        tokenizer,
        *,
        student_prompt: str = "paper",
        teacher_context: str = "solution",
        teacher_thinking: bool = False,
        max_prompt_length: int | None = None,
        max_teacher_prompt_length: int | None = None,
    ):
        _check_choice("student_prompt", student_prompt, STUDENT_PROMPTS)
        _check_choice("teacher_context", teacher_context, TEACHER_CONTEXTS)
        self.tokenizer = tokenizer
        self.student_prompt = student_prompt
        self.teacher_context = teacher_context
        self.teacher_thinking = teacher_thinking
        self.max_prompt_length = max_prompt_length
        self.max_teacher_prompt_length = max_teacher_prompt_length
        self.truncated_contexts = 0  # how many teacher/reason-first contexts were cut
        self._warned: set[str] = set()

    def student_prompt_ids(self, row: Mapping) -> list[int]:
        style = self.student_prompt
        ids = encode_prompt(self.tokenizer, student_messages(row["problem"], style), student_enable_thinking(style))
        limit = self.max_prompt_length
        if limit is not None and len(ids) > limit:
            self._warn_once("student", f"a student prompt has {len(ids)} tokens, over max_prompt_length={limit}; "
                                       "student prompts are never truncated")
        return ids

    def teacher_prompt_ids(self, row: Mapping, rationale: str | None = None) -> list[int]:
        if self.teacher_context == "none":  # the control arm: the teacher sees exactly the student's tokens
            return self.student_prompt_ids(row)
        context = privileged_context(row, self.teacher_context)
        if rationale:
            context = with_rationale(context, rationale)
        return self._fit_context(teacher_messages, row["problem"], context)

    def reason_first_prompt_ids(self, row: Mapping) -> list[int]:
        """The prompt with which the teacher writes its analysis of the reference."""
        context = privileged_context(row, self.teacher_context)
        return self._fit_context(reason_first_messages, row["problem"], context)

    def eval_prompt_ids(self, problem: str) -> list[int]:
        return encode_prompt(self.tokenizer, eval_messages(problem), enable_thinking=True)

    # -- teacher length policy

    def _fit_context(self, messages_for, problem: str, context: str) -> list[int]:
        """Token ids of `messages_for(problem, context)`, with the context cut from
        its end until the prompt fits max_teacher_prompt_length."""
        def encode(ctx: str) -> list[int]:
            return encode_prompt(self.tokenizer, messages_for(problem, ctx), self.teacher_thinking)

        ids, limit = encode(context), self.max_teacher_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        self.truncated_contexts += 1
        floor = len(encode(TRUNCATION_NOTE))  # the prompt with none of the context kept
        if floor > limit:  # drop the context, never the problem
            ids = encode("")
            if len(ids) > limit:
                self._warn_once("teacher", f"a teacher prompt has {len(ids)} tokens with an empty context, over "
                                           f"max_teacher_prompt_length={limit}; the problem is never truncated")
            return ids
        context_ids = self.tokenizer.encode(context, add_special_tokens=False)
        keep = limit - floor  # a first guess: tokens may merge differently at the seams
        while True:
            ids = encode(_truncated(self.tokenizer.decode(context_ids[:keep])))
            if len(ids) <= limit:  # always reached: keep = 0 is the TRUNCATION_NOTE prompt
                return ids
            keep = max(keep - (len(ids) - limit), 0)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, PromptLengthWarning, stacklevel=3)


def _truncated(kept: str) -> str:
    """A cut context: its kept beginning, then the note. A character split by the
    cut decodes to U+FFFD and is dropped."""
    kept = kept.rstrip("\ufffd").rstrip()
    return f"{kept}\n{TRUNCATION_NOTE}" if kept else TRUNCATION_NOTE


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; expected one of: {', '.join(allowed)}")
