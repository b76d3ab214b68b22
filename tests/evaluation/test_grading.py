"""Grading that is never silently wrong (evaluation.evaluate's answer checker, opsd/grading_worker.py).

math-verify runs in opsd/grading_worker.py, started as a plain subprocess: grading gives
the same verdicts from every kind of caller (no re-import of the caller's __main__),
a checker that cannot start or dies raises GradingError instead of grading "wrong",
a timeout is wrong and restarts the worker, and the report counts how each answer
was graded. The fake workers below speak the JSON-lines protocol without math-verify,
so these checks take no sympy import."""
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from evaluation import evaluate
from evaluation.evaluate import GradingError, check_answer, is_correct

ROOT = Path(__file__).resolve().parents[2]

# The grading a caller does: two answers only math-verify accepts, one wrong answer.
GRADING = textwrap.dedent("""\
    print("MARK: started", flush=True)
    from evaluation.evaluate import check_answer, is_correct
    results = [is_correct("\\\\boxed{\\\\frac{1}{2}}", "0.5"), is_correct("\\\\boxed{10^{2}}", "100"),
               is_correct("\\\\boxed{3}", "4"), check_answer("10^{2}", "100")[1]]
    print("RESULT " + json.dumps(results), flush=True)
""")
EXPECTED = [True, True, False, "math_verify"]


def _contexts(tmp_path: Path) -> dict[str, list]:
    """(argv, stdin) of each calling context, all running GRADING."""
    body = "import json\n" + GRADING
    guarded = tmp_path / "guarded.py"
    guarded.write_text("import json\n\ndef main():\n" + textwrap.indent(GRADING, "    ")
                       + '\n\nif __name__ == "__main__":\n    main()\n')
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(body)
    # A notebook: the code runs by exec() in a __main__ module that has no __file__.
    notebook = tmp_path / "notebook_kernel.py"
    notebook.write_text(textwrap.dedent(f"""\
        import sys, types
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile({body!r}, "<ipython-input-1>", "exec"), main.__dict__)
    """))
    return {
        "guarded script": ([str(guarded)], None),
        "guard-less script": ([str(unguarded)], None),
        "python -": (["-"], body),
        "python -c": (["-c", body], None),
        "notebook (exec under a fake __main__)": ([str(notebook)], None),
    }


CONTEXTS = ["guarded script", "guard-less script", "python -", "python -c", "notebook (exec under a fake __main__)"]


@pytest.mark.parametrize("context", CONTEXTS)
def test_same_verdicts_from_every_calling_context(context, tmp_path):
    argv, stdin = _contexts(tmp_path)[context]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines.count("MARK: started") == 1, proc.stdout  # the caller's code ran exactly once
    results = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT ")]
    assert results == [EXPECTED], proc.stdout + proc.stderr[-2000:]


# ---------------------------------------------------------------- a checker that fails

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


@pytest.fixture
def use_worker(monkeypatch):
    """Install an answer checker running `command` for the test; closed after it."""
    workers = []

    def install(command):
        worker = evaluate._AnswerWorker(command)
        workers.append(worker)
        monkeypatch.setattr(evaluate, "_ANSWER_WORKER", worker)
        return worker

    yield install
    for worker in workers:
        worker.close()


@pytest.mark.parametrize("command, message", [
    ([sys.executable, "-m", "no_such_grading_worker_module"], "exited with status 1 before it was ready: "
                                                              ".*No module named"),
    (["false"], "exited with status 1 before it was ready"),
    (["/nonexistent/python3", "opsd/grading_worker.py"], "could not start"),
    ([sys.executable, "-c", "print('hello')"], "did not report ready|not a JSON object"),
])
def test_a_worker_that_cannot_start_raises(command, message, use_worker):
    use_worker(command)
    with pytest.raises(GradingError, match=message):
        is_correct(r"\boxed{\frac{1}{2}}", "0.5")
    with pytest.raises(GradingError):                        # and again: never a "wrong" grade
        evaluate.grade(r"\boxed{\frac{1}{2}}", "0.5", truncated=False)
    assert is_correct(r"\boxed{033}", "33") is True          # the string match needs no worker
    assert check_answer("033", "33") == (True, "string_match")


@pytest.mark.parametrize("body, message", [
    ("sys.exit(3)", "exited with status 3 while checking the answer"),
    ("os.kill(os.getpid(), 9)", "killed by signal 9"),
    ("sys.stderr.write('Fatal Python error: boom\\n'); sys.stderr.flush(); os._exit(1)",
     "exited with status 1 while checking .*: Fatal Python error: boom"),
    ("reply('not an object')", "not a JSON object"),
])
def test_a_worker_that_dies_raises(body, message, use_worker, tmp_path):
    use_worker(fake_worker(body, tmp_path))
    with pytest.raises(GradingError, match=message):
        check_answer(r"\frac{1}{2}", "0.5")


def test_a_worker_that_died_while_idle_raises(use_worker, tmp_path):
    worker = use_worker(fake_worker('reply({"ok": True, "equal": True})', tmp_path))
    assert is_correct(r"\boxed{\frac{1}{2}}", "0.5") is True
    worker._process.kill()
    worker._process.wait()
    with pytest.raises(GradingError, match="while idle"):
        is_correct(r"\boxed{\frac{1}{2}}", "0.5")


def test_math_verify_error_is_a_wrong_answer(use_worker, tmp_path):
    use_worker(fake_worker('reply({"ok": False, "error": "ValueError: cannot parse"})', tmp_path))
    assert check_answer(r"\frac{1}{2}", "0.5") == (False, "math_verify_error")


def test_a_timeout_is_wrong_and_restarts_the_worker(use_worker, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "MATH_VERIFY_TIMEOUT_S", 0.5)
    worker = use_worker(fake_worker("""\
        if request["answer"] == "hang":
            time.sleep(60)
        reply({"ok": True, "equal": request["answer"] == "yes"})
    """, tmp_path))
    assert check_answer("yes", "0") == (True, "math_verify")
    assert check_answer("hang", "0") == (False, "timeout")
    assert worker._process is None                            # killed
    assert check_answer("yes", "0") == (True, "math_verify")  # a fresh worker grades again
    assert check_answer("no", "0") == (False, "math_verify")
    assert (tmp_path / "starts.txt").read_text().count("start") == 2


def test_the_real_worker_speaks_json_lines():
    """opsd/grading_worker.py's protocol: one ready line, then one reply line per request;
    nothing else on stdout."""
    requests = [{"answer": r"\frac{1}{2}", "gold": "0.5"}, {"answer": "3", "gold": "4"},
                {"answer": "é", "gold": "é"}]
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "opsd" / "grading_worker.py")], capture_output=True,
                          timeout=300, input="".join(json.dumps(r) + "\n" for r in requests).encode())
    assert proc.returncode == 0, proc.stderr[-2000:]
    replies = [json.loads(line) for line in proc.stdout.decode("ascii").splitlines()]
    assert replies[0] == {"ready": True}
    assert replies[1:3] == [{"ok": True, "equal": True}, {"ok": True, "equal": False}]
    assert len(replies) == 1 + len(requests) and replies[3]["ok"] in (True, False)


# ---------------------------------------------------------------- the report's counts

def test_the_report_counts_how_answers_were_graded(use_worker, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "MATH_VERIFY_TIMEOUT_S", 0.5)
    use_worker(fake_worker("""\
        if request["answer"] == "hang":
            time.sleep(60)
        if request["answer"] == "bad":
            reply({"ok": False, "error": "ValueError: cannot parse"})
        else:
            reply({"ok": True, "equal": request["answer"] == "0.50"})
    """, tmp_path))
    texts = [r"\boxed{033}", r"\boxed{0.50}", r"\boxed{7}", r"\boxed{hang}", r"\boxed{bad}", "no box", "trunc"]
    completions = [types.SimpleNamespace(ids=list(range(i + 1)), truncated=text == "trunc")
                   for i, text in enumerate(texts)]
    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[len(ids) - 1])
    record = evaluate.grade_problem(0, {"problem": "p", "answer": "33"}, completions, tokenizer)
    samples = record["samples"]
    assert [s["graded_by"] for s in samples] == ["string_match", "math_verify", "math_verify", "timeout",
                                                 "math_verify_error", "no_box", "no_box"]
    assert [s["correct"] for s in samples] == [True, True, False, False, False, False, False]
    assert [s["reason"] for s in samples][-2:] == ["no_answer", "truncated"]

    metrics = evaluate.summarize([record], k=len(texts))
    assert metrics["graded_by"] == {"string_match": 1, "math_verify": 2, "math_verify_error": 1, "timeout": 1,
                                    "no_box": 2}
    assert metrics["num_correct"] == 2 and metrics["no_answer_rate"] == pytest.approx(100 * 2 / 7)
    # counts of answers each method decided, not of correct ones (1 + 2 graded, 2 of them correct)
    assert evaluate.format_grading(metrics) == (
        "graded by: string match 1 answer, math-verify 2 answers (of 7 samples); "
        "graded wrong: math-verify error 1, timed out 1; no \\boxed{} to grade: 2")
    assert evaluate.format_grading({"graded_by": {"string_match": 104, "math_verify": 136, "math_verify_error": 0,
                                                  "timeout": 0, "no_box": 0}}) == (
        "graded by: string match 104 answers, math-verify 136 answers (of 240 samples)")
    # a sample of a report written before "graded_by" existed
    old = {**samples[0]}
    del old["graded_by"]
    assert evaluate.graded_by_counts([old])["unrecorded"] == 1


def test_the_command_line_stops_on_a_failing_checker(use_worker, tmp_path, capsys):
    use_worker([sys.executable, "-m", "no_such_grading_worker_module"])
    status = evaluate.main(["base", "--preset", "tiny", "--backend", "transformers",
                            "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: the answer-check worker"), err
    assert "No module named" in err[0]
    assert not (tmp_path / "out").exists()  # stopped before sampling: nothing written
