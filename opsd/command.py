"""`opsd SUBCOMMAND [ARGS ...]`: the one command (pyproject.toml's [project.scripts]).

Each subcommand is an entry point's own command line, given the rest of the arguments
unchanged and its name as `prog`: `opsd grid GRID.json --out DIR` is
`python -m opsd.research.grid GRID.json --out DIR`, and `opsd grid --help` is opsd.research.grid's help
with `opsd grid` in its usage line. `python -m ...` keeps working; train_capped.sh and
dev_eval.sh call the same code.

This module is the top of the house (tests/test_imports.py's last layer): it starts the
entry points of every layer, and imports each only when its subcommand runs, so that
`opsd --help` and `opsd config ...` load neither torch nor TRL.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from opsd.cli import exit_status


def _train(argv: list[str], prog: str) -> int:
    import opsd_train

    try:
        return opsd_train.main(argv, prog=prog)
    finally:
        opsd_train.close_process_group()  # as `python opsd_train.py` does at exit


def _eval(argv: list[str], prog: str) -> int:
    from opsd.evaluation.evaluate import main

    return main(argv, prog=prog)


def _grid(argv: list[str], prog: str) -> int:
    from opsd.research.grid import main

    return main(argv, prog=prog)


def _stats(argv: list[str], prog: str) -> int:
    from opsd.analysis.stats import main

    return main(argv, prog=prog)


def _plot(argv: list[str], prog: str) -> int:
    from opsd.analysis.plots import main

    return main(argv, prog=prog)


def _probe(argv: list[str], prog: str) -> int:
    from opsd.research.probe import main

    return main(argv, prog=prog)


def _config(argv: list[str], prog: str) -> int:
    from opsd.config import main

    return main(argv, prog=prog)


def _doctor(argv: list[str], prog: str) -> int:
    from opsd.gpu_stack import main

    return main(argv, prog=prog)


class Subcommand(NamedTuple):
    run: Callable[[list[str], str], int]
    summary: str  # its line in `opsd --help`


SUBCOMMANDS = {
    "train": Subcommand(_train, "train a LoRA student: OPSD, or the SFT / GRPO baseline"),
    "eval": Subcommand(_eval, "evaluate a checkpoint, every checkpoint of a run folder, or the base model"),
    "grid": Subcommand(_grid, "train and evaluate a grid of arms x seeds, on this machine or on SLURM"),
    "stats": Subcommand(_stats, "statistics over evaluation reports: summary, compare (a verdict), tokens"),
    "plot": Subcommand(_plot, "PNG plots of training runs: one run's curves, or several overlaid"),
    "probe": Subcommand(_probe, "score frozen rollouts under several OPSD settings, without training"),
    "config": Subcommand(_config, "check a recipe file; list the OPSD_* variables and the switches set"),
    "doctor": Subcommand(_doctor, "the installed packages against the pins (CPU or GPU stack)"),
}


def help_text() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    return "\n".join([
        "usage: opsd SUBCOMMAND [ARGS ...]",
        "",
        "On-Policy Self-Distillation: train, evaluate and compare. `opsd SUBCOMMAND --help` shows",
        "a subcommand's own options.",
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()),
        "",
        "options:",
        "  -h, --help  show this help and exit",
        "  --version   show the installed version and exit",
    ])


def run(argv: Sequence[str]) -> int:
    argv = list(argv)
    names = ", ".join(SUBCOMMANDS)
    if not argv:
        print(f"error: opsd needs a subcommand: {names} (opsd --help)", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        print(help_text())
        return 0
    if name == "--version":
        from importlib import metadata

        print(f"opsd {metadata.version('opsd')}")
        return 0
    if name not in SUBCOMMANDS:
        print(f"error: {name!r} is not an opsd subcommand; expected one of: {names}", file=sys.stderr)
        return 2
    return SUBCOMMANDS[name].run(rest, f"opsd {name}")


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: `opsd ...`; returns the exit status."""
    return exit_status(lambda: run(sys.argv[1:] if argv is None else argv))
