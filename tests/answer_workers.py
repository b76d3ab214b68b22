"""Answer-check workers for the grading tests (tests/opsd/test_grading.py, tests/evaluation/test_metrics.py):
fake workers that speak opsd/grading_worker.py's JSON-lines protocol without math-verify (no sympy
import), installed in place of opsd.grading's own worker for one test."""
import sys
import textwrap
from pathlib import Path

from opsd import grading


def fake_worker(body: str, tmp_path: Path) -> list[str]:
    """A worker command: after the `ready` line, `body` runs once per request line
    (`request` holds it, `reply(obj)` answers). Each start appends a line to starts.txt."""
    script = tmp_path / "fake_worker.py"
    script.write_text(textwrap.dedent("""\
        import json, os, sys, time
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "starts.txt"), "a") as f:
            f.write("start\\n")

        def reply(obj):
            sys.stdout.write(json.dumps(obj) + "\\n")
            sys.stdout.flush()

        reply({"ready": True})
        for line in sys.stdin:
            request = json.loads(line)
    """) + textwrap.indent(textwrap.dedent(body), "    "))
    return [sys.executable, str(script)]


def installed_workers(monkeypatch):
    """The body of a `use_worker` fixture: yields install(command), which puts an answer checker
    running `command` in place of opsd.grading's for the test; every one is closed after it."""
    workers = []

    def install(command):
        worker = grading._AnswerWorker(command)
        workers.append(worker)
        monkeypatch.setattr(grading, "_ANSWER_WORKER", worker)
        return worker

    yield install
    for worker in workers:
        worker.close()
