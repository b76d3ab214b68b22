"""Every prompt template of the project, in one place so the wording can be swapped.

Functions here return plain chat messages (`[{"role": "user", "content": ...}]`)
and whether Qwen3's thinking mode is on; `data_collator` applies the chat
template and tokenizes. Wording is the project's own (docs/SPEC.md §3).

- evaluation prompt (docs/SPEC.md §5): `{problem}` + blank line + INSTRUCTION, thinking on;
- student prompt: `paper` = `Problem: {problem}` + blank line + INSTRUCTION with
  thinking off (Qwen3 pre-fills an empty think block); `eval` = the evaluation prompt;
- teacher prompt: the problem, the privileged context between BEGIN/END markers,
  a transition instruction, INSTRUCTION; the context is chosen by OPSD_TEACHER_CONTEXT,
  whose control arms keep this template (`shuffled`: another row's solution, `answer`:
  `Final answer: ...` only) or drop it (`none`: the collator reuses the student prompt);
- reason-first prompt: the teacher first analyses the reference; the analysis is
  then appended to its context with `with_rationale`.
"""
from __future__ import annotations

from typing import Mapping

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

# Appended where the collator cut a privileged context to fit the teacher prompt.
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
