"""Grading one completion against a gold answer (docs/SPEC.md §5): the last \\boxed{...},
compared by normalised string form and by math-verify, in a worker process that no answer can stall.

    from opsd.grading import grade, is_correct
    grade(completion, gold, truncated=False)  # GradeResult(answer, correct, reason)

The evaluation (opsd.evaluation.evaluate) grades every sample with `grade_sample`; research code
calls `is_correct` / `grade` / `check_answer` the same way, from a script, `python -c` or a
notebook. An answer checker that fails raises GradingError, never a "wrong" grade. Imports the
standard library and opsd.answers only (math-verify runs in opsd/grading_worker.py, a
subprocess): no torch, TRL or vLLM.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from opsd.answers import extract_boxed

# math-verify's own time limit uses signals, which fail outside the main thread, and
# a thread cannot interrupt a big-integer computation that holds the GIL (an answer
# such as 9^{9^{9^{9}}}): math-verify runs in a worker process (opsd/grading_worker.py),
# killed past this limit. The worker is a plain subprocess speaking JSON lines, never
# a re-import of the caller's __main__ (multiprocessing's spawn), so grading is the
# same from any caller: a script with or without a __main__ guard, `python -`,
# `python -c`, a notebook.
MATH_VERIFY_TIMEOUT_S = 5.0
ANSWER_WORKER_START_TIMEOUT_S = 120.0  # importing math-verify (sympy) in a fresh process
ANSWER_WORKER_PATH = Path(__file__).resolve().with_name("grading_worker.py")

# How each answer was graded: the report's per-sample "graded_by" and metrics["graded_by"].
#   string_match       the normalised strings are equal (correct; math-verify not asked)
#   math_verify        math-verify's verdict
#   math_verify_error  math-verify raised on the answer (wrong)
#   timeout            math-verify overran MATH_VERIFY_TIMEOUT_S (wrong; its worker restarted)
#   no_box             no \boxed{...} to grade (reason "no_answer" or "truncated")
GRADED_BY = ("string_match", "math_verify", "math_verify_error", "timeout", "no_box")


class GradingError(RuntimeError):
    """The answer checker itself failed: its worker could not start, or died. Never
    turned into a "wrong" grade; the evaluation's command line reports it as one `error:` line."""


class GradeResult(NamedTuple):
    answer: str | None  # content of the last \boxed{...}, None if there is none
    correct: bool
    reason: str         # "correct" | "wrong_answer" | "no_answer" | "truncated"


def normalize_answer(answer: str) -> str:
    """A canonical string form for the fallback comparison and for majority
    voting: no spaces or $, no sizing/spacing commands, \\text{x} -> x,
    \\dfrac -> \\frac, no trailing period, integers without leading zeros."""
    text = answer.strip()
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\left|\\right|\\[!,;:]", "", text)
    text = re.sub(r"\s+|\$", "", text)
    text = text.rstrip(".")
    if re.fullmatch(r"[+-]?\d+", text):
        # str(int(text)) without int(), which refuses more than 4300 digits.
        digits = text.lstrip("+-").lstrip("0") or "0"
        text = ("-" if text.startswith("-") and digits != "0" else "") + digits
    return text


def check_answer(answer: str, gold: str) -> tuple[bool, str]:
    """(correct, how it was graded: one of GRADED_BY) for an extracted answer against
    the gold answer: the normalised string form first, then math-verify (either one
    accepting is enough). Raises GradingError when math-verify's worker fails."""
    gold = extract_boxed(gold) or gold.strip()
    if normalize_answer(answer) == normalize_answer(gold):
        return True, "string_match"
    try:
        return _ANSWER_WORKER.check(answer, gold, MATH_VERIFY_TIMEOUT_S), "math_verify"
    except _CheckTimeout:
        return False, "timeout"
    except _CheckFailed:  # math-verify could not handle this answer: the string comparison stands
        return False, "math_verify_error"


def answers_match(answer: str, gold: str) -> bool:
    """True when the extracted answer equals the gold answer, by math-verify or by
    the normalised string form (either one accepting is enough)."""
    return check_answer(answer, gold)[0]


class _CheckTimeout(Exception):
    """math-verify overran its limit on one answer (graded wrong)."""


class _CheckFailed(Exception):
    """math-verify raised on one answer (graded wrong)."""


class _AnswerWorker:
    """One persistent opsd/grading_worker.py process that runs math-verify; killed when a
    check overruns its time limit and started again for the next one, so no answer can
    stall grading. Thread-safe (checks are serialised); killed at interpreter exit,
    and it exits by itself when its input closes. A worker that cannot start or dies
    raises GradingError."""

    def __init__(self, command: Sequence[str] | None = None):
        self._lock = threading.Lock()
        self._command = None if command is None else list(command)
        self._process = None
        self._replies = None  # queue of the worker's output lines; None marks its end
        self._stderr = None   # a temporary file: the tail goes into GradingError
        self._pid = None      # the process that started the worker (a fork must not share it)

    def command(self) -> list[str]:
        # -P: the worker's own folder (opsd/, whose modules could shadow others) is not put on sys.path
        return list(self._command) if self._command is not None else [sys.executable, "-P", str(ANSWER_WORKER_PATH)]

    def start(self) -> None:
        """Start the worker unless it runs (an evaluation checks it before sampling)."""
        with self._lock:
            self._ensure_started()

    def check(self, answer: str, gold: str, timeout_s: float) -> bool:
        with self._lock:
            self._ensure_started()
            try:
                self._process.stdin.write((json.dumps({"answer": answer, "gold": gold}) + "\n").encode("ascii"))
                self._process.stdin.flush()
            except OSError:  # a broken pipe: the worker is gone
                raise self._died(f"while checking the answer {_clip(answer, 60)!r}") from None
            try:
                line = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                self._stop()  # the next check starts a fresh worker
                raise _CheckTimeout(f"answer check took longer than {timeout_s}s") from None
            if line is None:
                raise self._died(f"while checking the answer {_clip(answer, 60)!r}")
            reply = self._decode(line, "a reply")
        if not reply.get("ok"):
            raise _CheckFailed(reply.get("error", "?"))
        return bool(reply["equal"])

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ensure_started(self) -> None:
        if self._process is not None and self._pid != os.getpid():
            self._process = self._replies = self._stderr = None  # inherited through a fork: the parent's
        if self._process is None:
            self._start()
        elif self._process.poll() is not None:
            raise self._died("while idle")

    def _start(self) -> None:
        import subprocess
        import tempfile

        command = self.command()
        self._stderr = tempfile.TemporaryFile()
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        except OSError as exc:
            self._stderr.close()
            self._stderr = None
            raise GradingError(f"the answer-check worker ({_command_text(command)}) could not start: {exc}") from None
        self._process, self._replies, self._pid = process, queue.Queue(), os.getpid()
        threading.Thread(target=_read_lines, args=(process.stdout, self._replies), daemon=True,
                         name="opsd-answer-check-reader").start()
        try:
            line = self._replies.get(timeout=ANSWER_WORKER_START_TIMEOUT_S)
        except queue.Empty:
            self._stop()
            raise GradingError(f"the answer-check worker ({_command_text(command)}) was not ready "
                               f"within {ANSWER_WORKER_START_TIMEOUT_S:.0f}s") from None
        if line is None:
            raise self._died("before it was ready")
        if self._decode(line, "its first line") != {"ready": True}:
            self._stop()
            raise GradingError(f"the answer-check worker ({_command_text(command)}) did not report ready: "
                               f"{_clip(line.decode('ascii', 'replace').strip(), 200)!r}")

    def _decode(self, line: bytes, what: str) -> dict:
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            command = self.command()
            self._stop()
            raise GradingError(f"the answer-check worker ({_command_text(command)}) wrote {what} that is not "
                               f"a JSON object: {_clip(line.decode('ascii', 'replace').strip(), 200)!r}")
        return value

    def _died(self, when: str) -> GradingError:
        """The error for a worker that ended on its own; the worker is cleaned up."""
        process = self._process
        try:
            status = process.wait(timeout=10)
        except Exception:
            status = None
        if status is None:
            how = "stopped answering"
        elif status < 0:
            how = f"was killed by signal {-status}" + (" (out of memory?)" if -status == 9 else "")
        else:
            how = f"exited with status {status}"
        detail = ""
        try:
            self._stderr.seek(0)
            lines = [text.strip() for text in self._stderr.read()[-4000:].decode("utf-8", "replace").splitlines()]
            last = [text for text in lines if text]
            detail = f": {_clip(last[-1], 300)}" if last else ""
        except Exception:
            pass
        command = self.command()
        self._stop()
        return GradingError(f"the answer-check worker ({_command_text(command)}) {how} {when}{detail}")

    def _stop(self) -> None:
        process, stderr = self._process, self._stderr
        self._process = self._replies = self._stderr = None
        if process is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(Exception):
                process.wait(timeout=10)
            for stream in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
        if stderr is not None:
            stderr.close()


def _read_lines(stream, lines: queue.Queue) -> None:
    """The reader thread of one worker: its output lines, then None at its end."""
    try:
        for line in iter(stream.readline, b""):
            lines.put(line)
    except (OSError, ValueError):  # closed by _stop
        pass
    lines.put(None)


def _command_text(command: Sequence[str]) -> str:
    import shlex

    return shlex.join(command)


_ANSWER_WORKER = _AnswerWorker()
atexit.register(_ANSWER_WORKER.close)


def grade_sample(completion: str, gold: str, truncated: bool) -> tuple[GradeResult, str]:
    """grade() and how the answer was graded (one of GRADED_BY)."""
    answer = extract_boxed(completion)
    if answer is None:
        return GradeResult(None, False, "truncated" if truncated else "no_answer"), "no_box"
    correct, graded_by = check_answer(answer, gold)
    return GradeResult(answer, correct, "correct" if correct else "wrong_answer"), graded_by


def grade(completion: str, gold: str, truncated: bool) -> GradeResult:
    """Grade one completion. A completion without a box is "truncated" when it ran
    out of tokens and "no_answer" when it stopped on its own. Raises GradingError
    when the answer checker fails (never a silent "wrong")."""
    return grade_sample(completion, gold, truncated)[0]


def is_correct(completion: str, gold: str) -> bool:
    return grade(completion, gold, truncated=False).correct


def start_answer_worker() -> None:
    """Start the answer-check worker now unless it runs, so that a checker that cannot
    start stops a run before any sampling (raises GradingError)."""
    _ANSWER_WORKER.start()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
