"""The `opsd` command (opsd/command.py), run as the installed console script where a user runs
it: one line per subcommand in `opsd --help`, each subcommand the entry point's own command
line (the same arguments, its own help with `opsd SUB` as the program), one-line errors."""
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from opsd import command

ROOT = Path(__file__).resolve().parents[1]
# What each subcommand is (the command a note or a script may still use) and the module whose
# main it calls.
ENTRY_POINTS = {
    "train": ("opsd_train", [sys.executable, "opsd_train.py"]),
    "eval": ("opsd.evaluation.evaluate", [sys.executable, "-m", "opsd.evaluation"]),
    "grid": ("opsd.research.grid", [sys.executable, "-m", "opsd.research.grid"]),
    "stats": ("opsd.analysis.stats", [sys.executable, "-m", "opsd.analysis.stats"]),
    "plot": ("opsd.analysis.plots", [sys.executable, "-m", "opsd.analysis.plots"]),
    "probe": ("opsd.research.probe", [sys.executable, "-m", "opsd.research.probe"]),
    "config": ("opsd.config", [sys.executable, "-m", "opsd.config"]),
    "doctor": ("opsd.gpu_stack", [sys.executable, "checks/check_gpu_stack.py"]),
}


def opsd(*args: str) -> subprocess.CompletedProcess:
    """The installed console script (pip install -e . puts it beside this Python)."""
    script = Path(sysconfig.get_path("scripts")) / "opsd"
    assert script.is_file(), f"{script} is missing: pip install --no-deps --no-build-isolation -e ."
    return subprocess.run([str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})


def same_as(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY_POINTS[name][1], *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})


def test_pyproject_installs_the_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"opsd": "opsd.command:main"}
    assert set(command.SUBCOMMANDS) == set(ENTRY_POINTS)


def test_opsd_help_lists_each_subcommand_on_one_line():
    result = opsd("--help")
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "usage: opsd SUBCOMMAND [ARGS ...]"
    listed = lines[lines.index("subcommands:") + 1:lines.index("options:") - 1]
    assert [line.split()[0] for line in listed] == list(command.SUBCOMMANDS)
    assert all(len(line.split()) > 3 and line.startswith("  ") for line in listed)


def test_opsd_config_variables_is_the_modules_own():
    result = opsd("config", "variables")
    assert result.returncode == 0 and result.stdout == same_as("config", "variables").stdout
    assert result.stdout.startswith("OPSD_CLIP_MODE ")


def test_opsd_grid_help_is_research_grids_own_under_its_name():
    """The arguments go through unchanged, so subcommands opsd.research.grid gains arrive as they are."""
    result, own = opsd("grid", "--help"), same_as("grid", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: opsd grid ")
    renamed = own.stdout.replace("python -m opsd.research.grid", "opsd grid")
    assert " ".join(result.stdout.split()) == " ".join(renamed.split())
    for sub in ("status", "cancel"):  # its subcommands under the same name
        assert opsd("grid", sub, "--help").stdout.startswith(f"usage: opsd grid {sub} ")


def test_grid_help_lists_its_subcommands_one_line_each():
    """`status DIR` and `cancel DIR` take a grid folder, not a grid file: the usage shows the three
    forms and the help ends with one line for each (issue 60 item 6)."""
    for result, name in ((opsd("grid", "--help"), "opsd grid"),
                         (same_as("grid", "--help"), "python -m opsd.research.grid")):
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[:3] == [f"usage: {name} GRID --out DIR [options]", f"       {name} status DIR",
                             f"       {name} cancel DIR"]
        listed = lines[lines.index(f"subcommands ({name} SUBCOMMAND DIR; {name} SUBCOMMAND --help):") + 1:]
        assert [line.split()[:2] for line in listed] == [["status", "DIR"], ["cancel", "DIR"]]
        assert all(line.startswith("  ") and len(line.split()) > 5 for line in listed)


@pytest.mark.parametrize("args, message", [
    (["nope"], "error: 'nope' is not an opsd subcommand; expected one of: " + ", ".join(command.SUBCOMMANDS)),
    ([], "error: opsd needs a subcommand: " + ", ".join(command.SUBCOMMANDS) + " (opsd --help)"),
], ids=["unknown", "none"])
def test_a_missing_or_unknown_subcommand_is_one_line_exit_2(args, message):
    result = opsd(*args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n")


def test_opsd_doctor_is_the_stack_check(tmp_path):
    """`opsd doctor` is checks/check_gpu_stack.py: the same lines and exit status, on the install's
    own file and on the GPU stack's (which this CPU install is not: exit 1)."""
    for args in ((), ("--gpu",)):
        result, own = opsd("doctor", *args), same_as("doctor", *args)
        assert result.returncode == own.returncode and result.stdout == own.stdout
        assert result.stdout.startswith("checking the installed packages against requirements")
    assert result.returncode == 1
    result = opsd("doctor", str(tmp_path / "no.txt"))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and "no.txt" in result.stderr


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_subcommand_passes_its_arguments_and_its_name_to_the_modules_main(name, monkeypatch):
    import importlib

    module = importlib.import_module(ENTRY_POINTS[name][0])
    calls = []
    monkeypatch.setattr(module, "main", lambda argv, prog: calls.append((argv, prog)) or 7)
    args = ["status", "--out", "x y", "--", "-h"]
    assert command.main([name, *args]) == 7
    assert calls == [(args, f"opsd {name}")]


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_subcommand_help_is_the_modules_own_with_its_name(name, capsys):
    try:
        status = command.main([name, "--help"])
    except SystemExit as exit:  # argparse's --help
        status = exit.code
    assert status == 0
    assert capsys.readouterr().out.startswith(f"usage: opsd {name} ")


def test_the_help_and_config_load_neither_torch_nor_trl():
    code = ("import sys; from opsd import command; command.run(['--help']); command.run(['config', 'variables']); "
            "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "[]", result.stderr
