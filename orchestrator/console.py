"""The rich console stages print to (rank 0), for tables and live progress bars.

Under mpiexec rank 0 writes to a pipe, so rich would neither animate a bar nor use the terminal's
width. The local launcher sets ORCHESTRATOR_TTY=1 when the user's own stdout is a terminal.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from orchestrator.errors import OrchestratorError

# The CLI's error lines (wide enough for one line when stderr is a file or a pipe).
# Wide enough for the status table when output goes to a file or a pipe (rich would use 80).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)


def stage_console() -> Console:
    tty = os.environ.get("ORCHESTRATOR_TTY") == "1" or sys.stdout.isatty()
    return Console(highlight=False, force_terminal=tty or None, width=None if tty else 160)


def print_error(error: OrchestratorError) -> None:
    """`error` as one line on stderr (its text verbatim: `[all2all]` is not markup)."""
    err_console.print(f"[red]error:[/] {escape(str(error))}", soft_wrap=True)


def report_error(error: OrchestratorError) -> NoReturn:
    """Print `error` as one line on stderr and exit with its code."""
    print_error(error)
    sys.exit(error.exit_code)
