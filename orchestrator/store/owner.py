"""Who owns a launch (host, CLI pid) and whether that process still lives.

A pid alone is not an identity: the kernel reuses pids. The process's start time (clock ticks
after boot, field 22 of /proc/<pid>/stat) tells a reused pid apart.

Login nodes share the profiles folder but not their processes: an owner on another host cannot
be looked at from here. It stamps its launch in the ledger while it waits for it (a heartbeat,
`Ledger.heartbeat`) and counts as alive while that stamp is fresh.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# How often the owning CLI stamps the launch it waits for: each stamp is one write of the ledger
# under its lock (milliseconds), so many runs sharing a ledger barely add to its lock traffic.
HEARTBEAT_S = 10.0
# An owner on another host counts as gone once its last stamp is this old: several missed
# stamps (a loaded login node, a slow shared file system, clocks a few seconds apart), never one.
HEARTBEAT_STALE_S = 6 * HEARTBEAT_S


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

    @property
    def here(self) -> bool:
        """True when the owner runs on this host, where its process can be looked at."""
        return self.host == socket.gethostname()

    def alive(self, heartbeat: Optional[float], now: Optional[float] = None) -> bool:
        """True while the owner runs. On this host: its process (the same pid and start time).
        On another host: while its last heartbeat (Unix seconds) is younger than
        HEARTBEAT_STALE_S at `now` (default: now)."""
        if self.here:
            return pid_alive(self.pid, self.pid_start)
        now = time.time() if now is None else now
        return heartbeat is not None and now - heartbeat < HEARTBEAT_STALE_S
