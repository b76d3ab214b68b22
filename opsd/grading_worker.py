"""The answer-check worker: math-verify in a process of its own (opsd.grading's).

    python -P opsd/grading_worker.py   (started by opsd.grading._AnswerWorker, not by hand)

opsd.grading starts this file as a plain subprocess, never by re-importing the caller's
`__main__` (as multiprocessing's spawn does), so grading works the same from a script
with or without an `if __name__ == "__main__":` guard, `python -`, `python -c` or a
notebook. The parent kills it when a check overruns its time limit: a thread cannot
interrupt a big-integer computation that holds the GIL (an answer such as
9^{9^{9^{9}}}), and math-verify's own time limit uses signals, which fail outside the
main thread.

Protocol, one JSON object per line (ASCII: non-ASCII text is escaped):
    worker -> parent, once imported:  {"ready": true}
    parent -> worker:                 {"answer": "...", "gold": "..."}
    worker -> parent:                 {"ok": true, "equal": true|false}
                                      {"ok": false, "error": "ValueError: ..."}
The worker exits at the end of its input. Anything else it prints (math-verify's
messages, a traceback) goes to stderr, never into the protocol. Stdlib and math-verify
only: no torch, no project module.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys


def math_verify_equal(answer: str, gold: str) -> bool:
    """math-verify's verdict on a bare answer against a bare gold answer."""
    from math_verify import parse, verify

    silence_timeout_notice()
    # Wrapped in \boxed{} so math-verify reads the bare answer as LaTeX.
    # Gold comes first: verify() is not symmetric.
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def silence_timeout_notice() -> None:
    """math-verify warns that its timeouts are off, which is deliberate here: the
    parent enforces the time limit by killing this process."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())


class _DropTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def serve(requests, replies) -> None:
    """Answer each request line of `requests` with one line on `replies`."""
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = {"ok": True, "equal": math_verify_equal(str(request["answer"]), str(request["gold"]))}
        except Exception as exc:  # a parse failure of this answer: the parent grades it wrong
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> int:
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # the repository's own modules must not shadow math-verify's imports
    # The protocol gets its own copy of stdout; fd 1 and sys.stdout then point at
    # stderr, so that nothing else printed here can corrupt a reply.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii", newline="\n")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    if hasattr(signal, "SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us
    import math_verify  # noqa: F401  (imported before "ready", so the first check is not slower)

    silence_timeout_notice()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    serve(open(sys.stdin.fileno(), encoding="utf-8", errors="replace", closefd=False), replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
