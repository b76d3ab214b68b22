"""opsd/run_log.py's console lines beside tqdm progress bars (the trainer's bar)."""
import io
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The trainer's situation: transformers' bar on stderr (tqdm.auto), our lines on stdout.
SCRIPT = """
import sys
from tqdm.auto import tqdm
from opsd.run_log import print_line
bar = tqdm(total=8, mininterval=0)
for step in range(1, 4):
    bar.update(1)
    print_line(f"[OPSD kl] step={step} loss=1")
bar.close()
"""


def test_lines_stand_on_their_own_lines_in_a_log_file(tmp_path):
    """`train_capped.sh > log 2>&1`: no terminal to clear the bar on, so each `[OPSD kl]` line is
    a whole line of the log (tqdm.write left the bar's text at its start, after a carriage return)."""
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              timeout=60)
    assert proc.returncode == 0
    lines = log.read_bytes().decode().split("\n")
    assert [line for line in lines if "[OPSD kl]" in line] == [f"[OPSD kl] step={i} loss=1" for i in (1, 2, 3)]
    assert any("3/8" in line for line in lines)  # the bar goes on below the lines


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_bar_is_cleared_and_redrawn_below_the_line(monkeypatch):
    from tqdm.auto import tqdm

    from opsd.run_log import print_line

    screen = Terminal()  # stdout and stderr on one terminal
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    bar = tqdm(total=8, mininterval=0, file=sys.stderr)
    bar.update(2)
    before = screen.getvalue()
    print_line("[OPSD kl] step=2 loss=1")
    after = screen.getvalue()[len(before):]
    bar.close()
    cleared, rest = after.split("[OPSD kl] step=2 loss=1\n")
    assert cleared.endswith("\r") and cleared.strip() == ""  # the bar's line wiped, back to column 0
    assert "2/8" in rest  # redrawn under the line
