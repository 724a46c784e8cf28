"""The rich console stages print to (rank 0), for tables and live progress bars.

Under mpiexec rank 0 writes to a pipe, so rich would neither animate a bar nor use the terminal's
width. The local launcher sets ORCHESTRATOR_TTY=1 when the user's own stdout is a terminal.
"""
from __future__ import annotations

import os
import sys

from rich.console import Console


def stage_console() -> Console:
    tty = os.environ.get("ORCHESTRATOR_TTY") == "1" or sys.stdout.isatty()
    return Console(highlight=False, force_terminal=tty or None, width=None if tty else 160)
