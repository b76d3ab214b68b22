"""Per-token attribution of the divergence (stdlib only): which completion tokens carry it.

`opsd/research/probe.py` scores frozen rollouts and hands this module one record per completion
token; here they are grouped and summarised. Nothing here touches a model, so every
number of the summary can be recomputed from the records alone (tests do).

Token groups, first match wins (a token's text is its own decoded piece; spans are found
in the completion's text, the pieces joined):
    answer      inside a `\\boxed{...}` (the command and both braces included) or the word "answer"
    digit       only digits
    operator    only operator characters (+ - * / = < > ^ and their Unicode forms), or part of a
                LaTeX operator command such as \\times, \\cdot, \\frac
    reflection  a word of REFLECTION_WORDS ("wait", "hmm", "but", ...), case and punctuation ignored
    other       everything else (words, spaces, punctuation, `$`)

First-token spike: the mean true KL at completion position 0 against the mean over all later
positions; at the prompt/completion boundary the two roles' prompts differ most recently.

Answer leak (how early the teacher gives the final answer away): for rows whose reference
answer is known, a1 is the first token of that answer (its first digit for a number). Over
the *pre-box* positions - those whose preceding completion text has not yet opened a
`\\boxed{` - at which the student did not sample a1, compare the mean probability the
teacher puts on a1 with the student's. A teacher well above the student there pushes the
answer's first token at places where the student writes something else.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from opsd.answers import BOX_OPEN, closing_brace

GROUPS = ("answer", "digit", "operator", "reflection", "other")
REFLECTION_WORDS = frozenset(
    {"wait", "hmm", "but", "however", "actually", "alternatively", "check", "verify", "recheck", "again"}
)
OPERATOR_CHARS = frozenset("+-*/=<>^×÷·±−")
_LATEX_OPERATOR = re.compile(r"\\(?:times|cdot|div|pm|frac|dfrac|sqrt|le|ge|leq|geq|neq)(?![A-Za-z])")
_PUNCTUATION = ".,;:!?\"'()"


def _spans(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Character spans [start, end) of every \\boxed{...} (to its closing brace, or the end of
    an unclosed one) and of every LaTeX operator command in `text`."""
    boxes = []
    for match in BOX_OPEN.finditer(text):
        close = closing_brace(text, match.end() - 1)
        boxes.append((match.start(), len(text) if close is None else close + 1))
    operators = [(m.start(), m.end()) for m in _LATEX_OPERATOR.finditer(text)]
    return boxes, operators


def _overlaps(start: int, end: int, spans: Iterable[tuple[int, int]]) -> bool:
    return any(start < b and a < end for a, b in spans)


def token_groups(pieces: Sequence[str]) -> list[str]:
    """The group (GROUPS) of each token of one completion, from the tokens' decoded pieces."""
    text = "".join(pieces)
    boxes, operators = _spans(text)
    groups, start = [], 0
    for piece in pieces:
        end = start + len(piece)
        bare = piece.strip()
        word = bare.lower().strip(_PUNCTUATION)
        if _overlaps(start, end, boxes) or word == "answer":
            group = "answer"
        elif bare.isdigit():
            group = "digit"
        elif (bare and set(bare) <= OPERATOR_CHARS) or (bare and _overlaps(start, end, operators)):
            group = "operator"
        elif word in REFLECTION_WORDS:
            group = "reflection"
        else:
            group = "other"
        groups.append(group)
        start = end
    return groups


def pre_box(pieces: Sequence[str]) -> list[bool]:
    """True at each position whose preceding completion text has not opened a \\boxed{."""
    flags, prefix = [], ""
    for piece in pieces:
        flags.append(BOX_OPEN.search(prefix) is None)
        prefix += piece
    return flags


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def summarize(records: Sequence[Mapping], top_tokens: int = 5) -> dict:
    """The attribution summary of per-token records (keys: position, token, group, true_kl,
    pre_box, answer_token, sampled_is_answer_token, p_teacher_answer, p_student_answer)."""
    total_kl = math.fsum(r["true_kl"] for r in records)
    groups = {}
    for name in GROUPS:
        kl = [r["true_kl"] for r in records if r["group"] == name]
        groups[name] = {
            "tokens": len(kl),
            "token_share": len(kl) / len(records) if records else None,
            "mean_true_kl": _mean(kl),
            "kl_share": math.fsum(kl) / total_kl if total_kl > 0 else None,
        }
    by_token: dict[str, list[float]] = {}
    for r in records:
        by_token.setdefault(r["token"], []).append(r["true_kl"])
    ranked = sorted(by_token.items(), key=lambda item: (-math.fsum(item[1]), item[0]))[:top_tokens]
    first = [r["true_kl"] for r in records if r["position"] == 0]
    later = [r["true_kl"] for r in records if r["position"] > 0]
    leak = [r for r in records if r["pre_box"] and r["answer_token"] is not None and not r["sampled_is_answer_token"]]
    return {
        "tokens": len(records),
        "groups": groups,
        "top_tokens": [{"token": t, "count": len(v), "total_true_kl": math.fsum(v), "mean_true_kl": _mean(v)}
                       for t, v in ranked],
        "first_token": {"positions": len(first), "mean_true_kl": _mean(first),
                        "later_positions": len(later), "later_mean_true_kl": _mean(later)},
        "answer_leak": {
            "positions": len(leak),
            "mean_p_teacher": _mean([r["p_teacher_answer"] for r in leak]),
            "mean_p_student": _mean([r["p_student_answer"] for r in leak]),
            "teacher_over_half": sum(r["p_teacher_answer"] > 0.5 for r in leak),
            "student_over_half": sum(r["p_student_answer"] > 0.5 for r in leak),
        },
    }


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def format_summary(summary: Mapping) -> str:
    """The summary as printed after the probe's table (markdown)."""
    lines = [f"Attribution over {summary['tokens']} completion tokens (baseline row):", "",
             "| token group | tokens | share of tokens | mean true_kl | share of true_kl |", "|---|---|---|---|---|"]
    for name, g in summary["groups"].items():
        lines.append(f"| {name} | {g['tokens']} | {_number(g['token_share'])} | {_number(g['mean_true_kl'])} "
                     f"| {_number(g['kl_share'])} |")
    tops = ", ".join(f"{t['token']!r} ({t['count']}x, {_number(t['total_true_kl'])})" for t in summary["top_tokens"])
    first, leak = summary["first_token"], summary["answer_leak"]
    lines += [
        "",
        f"Most total true_kl: {tops or 'none'}",
        f"First completion token: mean true_kl {_number(first['mean_true_kl'])} at position 0 "
        f"({first['positions']} rollouts) vs {_number(first['later_mean_true_kl'])} at positions >= 1",
        f"Answer leak before the box: at {leak['positions']} pre-box positions not sampling the answer's first "
        f"token, mean p_teacher {_number(leak['mean_p_teacher'])} vs p_student {_number(leak['mean_p_student'])} "
        f"(> 0.5: teacher {leak['teacher_over_half']}, student {leak['student_over_half']})",
    ]
    return "\n".join(lines)
