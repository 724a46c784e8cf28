"""Who owns a launch (host, CLI pid) and whether that process still lives.

A pid alone is not an identity: the kernel reuses pids. The process's start time (clock ticks
after boot, field 22 of /proc/<pid>/stat) tells a reused pid apart.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


def process_start_ticks(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks after boot); None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: its work has stopped
        return None
    return int(fields[19])


def pid_alive(pid: int, start_ticks: Optional[int] = None) -> bool:
    """True while process `pid` runs on this host (the same process, when `start_ticks` is
    given)."""
    now = process_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


@dataclass(frozen=True)
class Owner:
    """The process that started a launch: the CLI."""
    host: str
    pid: int
    pid_start: Optional[int]

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()))

    def alive(self) -> bool:
        """True while the owner runs. Another host's process cannot be looked at from here:
        it counts as gone."""
        return self.host == socket.gethostname() and pid_alive(self.pid, self.pid_start)
