"""The ledger: one JSON file per profiles/<cluster.name>/ that records every stage and sub-part.

Entry keys are `<stage>[/<unit>]` (e.g. `profile_hardware`, `profile_hardware/allreduce`,
`profile_model/tiny/seq256_tp2`). Each entry holds its state, job id, log path, config hash and
times. Writers take a file lock (the CLI on the login node and rank 0 inside a job may write at
once) and write atomically, so the file is never half-written.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from filelock import FileLock

from orchestrator.store import read_json, write_json

STATES = ("pending", "running", "done", "failed", "cancelled")
LEDGER_NAME = "ledger.json"


class Ledger:
    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LEDGER_NAME
        self._lock = FileLock(str(self.path) + ".lock", timeout=60)

    def entries(self) -> dict:
        """All entries, key -> fields. A missing ledger is an empty one."""
        if not self.path.exists():
            return {}
        try:
            entries = read_json(self.path).get("entries", {})
            if not isinstance(entries, dict):
                raise ValueError("entries is not a mapping")
            return entries
        except (ValueError, AttributeError):
            # A corrupt ledger must not stop the user: keep it aside and start a new one.
            self.path.rename(self.path.with_suffix(f".corrupt.{int(time.time())}"))
            return {}

    def get(self, key: str) -> Optional[dict]:
        return self.entries().get(key)

    def update(self, key: str, **fields) -> dict:
        """Merge fields into the entry `key` (created if new); returns the entry."""
        state = fields.get("state")
        if state is not None and state not in STATES:
            raise ValueError(f"ledger state {state!r} is not one of {STATES}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self.entries()
            entry = entries.setdefault(key, {})
            entry.update(fields)
            entry["updated"] = time.time()
            write_json(self.path, {"schema_version": 1, "entries": entries})
        return entry

    def update_many(self, keys, **fields) -> None:
        """The same fields on many entries in one locked write."""
        keys = list(keys)
        if not keys:
            return
        with self._lock:
            entries = self.entries()
            now = time.time()
            for key in keys:
                entries.setdefault(key, {}).update(fields, updated=now)
            write_json(self.path, {"schema_version": 1, "entries": entries})

    def mark_ended(self, key: str, state: str, todo=(), message: str = "") -> None:
        """After a launch that did not finish: the stage and its unfinished sub-parts take `state`.

        Sub-parts already done stay done: their results are in the profile file, and a rerun
        skips them.
        """
        if state == "done":
            return
        entries = self.entries()
        now = time.time()
        self.update(key, state=state, ended=now, error=message or None)
        unfinished = [f"{key}/{s}" for s in todo
                      if entries.get(f"{key}/{s}", {}).get("state") != "done"]
        self.update_many(unfinished, state=state, ended=now)

    def is_done(self, key: str, config_hash: str) -> bool:
        """True when `key` finished under the same config hash: a rerun may skip it."""
        entry = self.get(key)
        return bool(entry) and entry.get("state") == "done" and entry.get("config_hash") == config_hash
