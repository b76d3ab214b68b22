"""JSON-lines files (one JSON object per line) read with one-line errors.

Shared by the readers of training data (`opsd.data`), of saved rollouts (`opsd.research.probe`)
and of `metrics.jsonl` (`opsd.analysis.plots`); each passes its own error class and keeps its own
field checks. Blank lines are skipped; lines are numbered from 1 as an editor shows them.
Every problem is `error(message)` with a one-line message naming the file (as `name`,
the path unless given) and, for a bad line, its number:

    NAME: cannot read it as UTF-8 text (REASON)
    NAME:LINE: not valid JSON (REASON: column COLUMN)
    NAME:LINE: not a JSON object

Standard library only: a leaf module that imports no project module.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

ErrorClass = Callable[[str], Exception]


def read_text(path: str | os.PathLike, error: ErrorClass, name: str | None = None) -> str:
    """The file's text, decoded as UTF-8; a missing, unreadable or undecodable file is
    `error("NAME: cannot read it as UTF-8 text (REASON)")`."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise error(f"{_name(path, name)}: cannot read it as UTF-8 text ({reason})") from None


def parse_lines(text: str, error: ErrorClass, name: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of `text`, a JSON-lines file's
    content; `name` names the file in messages."""
    records = []
    # Lines end at "\n" only: str.splitlines() also splits at U+2028 and friends, which
    # json.dumps(ensure_ascii=False) writes raw inside strings.
    for number, line in enumerate(split_lines(text), start=1):
        if not line.strip():
            continue
        record = parse_json(line, error, name, line=number)
        if not isinstance(record, dict):
            raise error(f"{name}:{number}: not a JSON object")
        records.append((number, record))
    return records


def split_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text as an editor numbers them: split at "\n", a "\r"
    before it dropped, no empty last line for a final newline."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_jsonl(path: str | os.PathLike, error: ErrorClass, name: str | None = None) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of the JSON-lines file at `path`."""
    return parse_lines(read_text(path, error, name), error, _name(path, name))


def parse_json(text: str, error: ErrorClass, name: str, line: int | None = None):
    """json.loads(text), any failure `error("NAME:LINE: not valid JSON (REASON: column COLUMN)")`:
    LINE is `line` (the text is that line of the file) or where the parser stopped, COLUMN where
    on that line (json's own message without it reads "Unterminated string starting at"); what
    json refuses beyond syntax (a 5,000-digit number, deep nesting) has no position to give."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{name}:{line or e.lineno}: not valid JSON ({e.msg}: column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        where = f"{name}:{line}" if line else name
        raise error(f"{where}: not valid JSON ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})") from None


def _name(path: str | os.PathLike, name: str | None) -> str:
    return os.fspath(path) if name is None else name
