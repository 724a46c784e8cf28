"""A SIGTERM or SIGHUP to the CLI stops it as a Ctrl-C does.

`kill <pid>` (what a refused second run says to do), `timeout`, a batch system ending the shell
the CLI runs in: each sends SIGTERM; a closed terminal or a dropped ssh connection, SIGHUP.
Python's default for them ends the process at once, with no line and no ledger entry, so its
launch stayed `running` until the next command marked it failed ("the run's processes are
gone"). Raised as a KeyboardInterrupt instead, they take the Ctrl-C path: the launch's ranks are
stopped, the ledger says cancelled, one line says what to rerun (where a terminal is left to
read it), and the exit code is 128 + the signal. A SIGHUP ignored (`nohup`) stays ignored.
"""
from __future__ import annotations

import signal

_signal_name = "Ctrl-C"
_exit_code = 130


def _terminated(signum, frame):
    global _signal_name, _exit_code
    _signal_name, _exit_code = signal.Signals(signum).name, 128 + signum
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """In the CLI's main thread, before anything is launched: SIGTERM, and SIGHUP unless it
    is ignored (`nohup`: the command is meant to outlive its terminal)."""
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _terminated)


def interrupted_by() -> str:
    """What stopped the command: "Ctrl-C", or "SIGTERM" / "SIGHUP" once one arrived."""
    return _signal_name


def interrupted_exit_code() -> int:
    """130 for a Ctrl-C, 143 for a SIGTERM, 129 for a SIGHUP (128 + the signal, as a shell
    reports it)."""
    return _exit_code
