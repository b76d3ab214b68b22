"""What every `python -m ...` command line of the project shares (standard library only).

`exit_status(main)` runs a CLI's main and turns a reader that closed the output early
(`python -m opsd.config check recipe.env | head`) into a quiet exit instead of a
BrokenPipeError traceback.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

# The status a shell reports for a process that SIGPIPE ended (`yes | head`); Python ignores
# SIGPIPE and raises BrokenPipeError instead, which this turns back into the usual status.
CLOSED_OUTPUT_STATUS = 128 + signal.SIGPIPE


def exit_status(main: Callable[[], int | None]) -> int:
    """main()'s exit status; CLOSED_OUTPUT_STATUS, silently, when stdout was closed under it.
    stdout is flushed here, so output still buffered at the end fails inside the guard too."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout once more at exit, which would print "Exception ignored ...
        # BrokenPipeError": point the file descriptor at /dev/null first (the recipe of the
        # Python docs, library/signal.html "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return CLOSED_OUTPUT_STATUS
    return 0 if status is None else status
