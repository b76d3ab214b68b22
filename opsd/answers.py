"""Final answers (stdlib only): the last `\\boxed{...}` of a text and a row's reference answer.

Shared by grading (`opsd.grading`), data validation (`opsd.data`), the answer-only teacher
context (`prompts`, OPSD_TEACHER_CONTEXT=answer) and the probe's answer-leak measure, so
they all read an answer the same way. A leaf module: it imports nothing of the project.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

# `\boxed{`, `\boxed {` and `\fbox{`; the match ends on the opening brace.
BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces matched.
    None when there is no box, the last one is never closed, or it is empty."""
    openings = list(BOX_OPEN.finditer(text))
    if not openings:
        return None
    content = braced_content(text, openings[-1].end() - 1)
    if content is None or not content.strip():
        return None
    return content.strip()


def closing_brace(text: str, open_at: int) -> int | None:
    """Index of the brace matching the one at `open_at`, None if it is never closed.
    Escaped braces (\\{ \\}) are literal set braces, not grouping."""
    depth, i = 0, open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def braced_content(text: str, open_at: int) -> str | None:
    """The text between the brace at `open_at` and its matching closing brace."""
    close = closing_brace(text, open_at)
    return None if close is None else text[open_at + 1:close]


def answer_text(answer: object) -> str:
    """204 -> "204"; 204.0 -> "204" (an integer stored as float); strings stripped."""
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    return str(answer).strip()


def reference_answer(row: Mapping[str, object]) -> str | None:
    """A training row's final answer: its `Answer` column when present and not empty,
    else the last \\boxed{} of its `solution`; None when it has neither."""
    answer = row.get("Answer")
    if answer is not None and answer_text(answer):
        return answer_text(answer)
    solution = row.get("solution")
    return extract_boxed(solution) if isinstance(solution, str) else None
