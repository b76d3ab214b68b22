"""Grading one completion against a gold answer (opsd.grading, opsd/grading_worker.py), never silently wrong.

The last \\boxed{} is the answer; it is right when its normalised string form or math-verify
accepts it. math-verify runs in opsd/grading_worker.py, started as a plain subprocess: grading
gives the same verdicts from every kind of caller (no re-import of the caller's __main__), no
answer stalls it (a timeout is wrong and restarts the worker), and a checker that cannot start
or dies raises GradingError instead of grading "wrong". The fake workers (tests/answer_workers.py)
speak the JSON-lines protocol without math-verify, so those checks take no sympy import."""
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from answer_workers import fake_worker, installed_workers

from opsd import grading
from opsd.answers import extract_boxed
from opsd.grading import GradingError, answers_match, check_answer, grade, is_correct, normalize_answer

ROOT = Path(__file__).resolve().parents[2]

# The grading a caller does: two answers only math-verify accepts, one wrong answer.
GRADING = textwrap.dedent("""\
    print("MARK: started", flush=True)
    from opsd.grading import check_answer, is_correct
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


# ---------------------------------------------------------------- extraction

@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{204}.", "204"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),                   # nested braces
    (r"\boxed{\sqrt{\frac{a}{b}}} and more text", r"\sqrt{\frac{a}{b}}"),
    (r"\boxed {42}", "42"),                                      # space before the brace
    (r"\fbox{17}", "17"),
    (r"first \boxed{7} \boxed{204}", "204"),                     # two boxes close together: the last
    (r"\boxed{7}\boxed{204}", "204"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                          # escaped set braces are literal
    (r"\boxed{ 12 }", "12"),
    (r"\[ \boxed{\text{(B)}} \] Therefore B.", r"\text{(B)}"),
    ("no box at all", None),
    (r"\boxed{12", None),                                        # never closed (truncated)
    (r"\boxed{5} then \boxed{\frac{1}{2}", None),                # the last box is unbalanced
    (r"put your answer within \boxed{}", None),                  # empty box
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ---------------------------------------------------------------- answer comparison

@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{204}", "204", True),
    (r"\boxed{033}", "33", True),                                # leading zeros
    (r"\boxed{33}", "033", True),
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", True),
    (r"\boxed{\tfrac12}", "1/2", True),
    (r"\boxed{-7}", "-7", True),
    (r"\boxed{-7}", "7", False),
    (r"\boxed{7} \boxed{204}", "204", True),
    (r"\boxed{7} \boxed{204}", "7204", False),                   # not joined into 7204
    (r"\boxed{\text{(B)}}", "(B)", True),
    (r"\boxed{10 \text{ cm}}", "10", True),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),             # tuples
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True),                      # sets
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{5.}", "5", True),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{3}", "4", False),
    ("The answer is 204.", "204", False),                        # no box, no credit
    (r"\boxed{204", "204", False),
    (r"\boxed{204}", r"\boxed{204}", True),                      # boxed gold
])
def test_is_correct(completion, gold, expected):
    assert is_correct(completion, gold) is expected


@pytest.mark.parametrize("raw, normal", [
    ("$033$", "33"), (r"\left(1,\ 2\right)", r"(1,\2)"), (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\text{ yes }", "yes"), ("-0012", "-12"), (r"5\!000.", "5000"), ("  x + 1 ", "x+1"),
])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_grade_reasons():
    assert grade(r"... \boxed{12}", "12", truncated=False) == ("12", True, "correct")
    assert grade(r"... \boxed{13}", "12", truncated=False) == ("13", False, "wrong_answer")
    assert grade("thinking that never ends", "12", truncated=True) == (None, False, "truncated")
    assert grade("I give up.", "12", truncated=False) == (None, False, "no_answer")
    # a truncated completion that did box an answer is graded on it
    assert grade(r"\boxed{12} wait, let me re", "12", truncated=True) == ("12", True, "correct")


def test_is_correct_in_worker_threads():
    """math-verify's own signal timeout fails outside the main thread; ours must not."""
    cases = [(rf"\boxed{{\frac{{{i}}}{{2}}}}", str(i / 2), True) for i in range(1, 25)]
    cases += [(rf"\boxed{{{i + 1}}}", str(i), False) for i in range(24)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda case: is_correct(case[0], case[1]), cases))
    assert results == [expected for _, _, expected in cases]


def test_answer_check_time_limit(monkeypatch):
    """The documented case: a power tower that math-verify evaluates as a big integer
    (holding the GIL, so no thread can stop it) costs the time limit and is wrong."""
    is_correct("\\boxed{1}", "2")  # the worker is up (its start is not part of the limit)
    started = time.monotonic()
    assert is_correct(r"\boxed{9^{9^{9^{9}}}}", "5") is False
    assert time.monotonic() - started < grading.MATH_VERIFY_TIMEOUT_S + 2
    assert answers_match("033", "33") is True                 # the string fallback still decides
    assert is_correct(r"\boxed{\frac{1}{2}}", "0.5") is True   # the restarted worker grades again


PATHOLOGICAL = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{(10^{10^{10}})!}",
    r"\boxed{" + "1" * 5000 + "}",                             # more digits than int() accepts
]


def test_pathological_answers_are_wrong_within_a_bounded_time(monkeypatch):
    monkeypatch.setattr(grading, "MATH_VERIFY_TIMEOUT_S", 1.0)
    is_correct("\\boxed{1}", "2")
    started = time.monotonic()
    results = [grade(text, "5", truncated=False) for text in PATHOLOGICAL]
    elapsed = time.monotonic() - started
    assert [r.correct for r in results] == [False] * len(PATHOLOGICAL)
    assert all(r.reason == "wrong_answer" for r in results)
    # each costs at most the limit plus a worker restart (importing math-verify)
    assert elapsed < len(PATHOLOGICAL) * 8, elapsed
    assert is_correct(r"\boxed{204}", "204") and not is_correct(r"\boxed{7}", "8")


# ---------------------------------------------------------------- a checker that fails

@pytest.fixture
def use_worker(monkeypatch):
    """Install an answer checker running `command` for the test; closed after it."""
    yield from installed_workers(monkeypatch)


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
        grade(r"\boxed{\frac{1}{2}}", "0.5", truncated=False)
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
    monkeypatch.setattr(grading, "MATH_VERIFY_TIMEOUT_S", 0.5)
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

