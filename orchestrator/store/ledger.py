"""The ledger: one JSON file per profiles/<cluster.name>/ that records every stage and sub-part.

Entry keys are `<stage>[/<unit>]` (e.g. `profile_hardware`, `profile_hardware/allreduce`,
`profile_model/tiny/seq256_tp2`). Each entry is a `LedgerEntry`: its state, job id, log path,
config hash and times. Every change goes through one method per concern, each of which reads,
checks and writes under a file lock (the CLI on the login node and rank 0 inside a job may write
at once) and writes atomically, so the file is never half-written and no state is decided on a
stale read:
- `launch`: a stage (and its sub-parts) is about to start: pending or running, launch fields set;
- `attach_job`: the job id and folder, once the launcher knows them (never the state);
- `transition`: the state, and with it `ended`, `error` and `summary`, along the allowed edges.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from filelock import FileLock

from orchestrator.store import read_json, write_json

LEDGER_NAME = "ledger.json"


class State(str, Enum):
    pending = "pending"
    running = "running"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"

    def __str__(self) -> str:
        return self.value


ACTIVE = (State.pending, State.running)  # a launch that has not ended

# Allowed edges. What matters most: `done` is left only by a new launch (pending/running), so a
# late failure report (a lost-job timeout, a Ctrl-C after the job finished) never undoes results
# rank 0 recorded. `failed -> done`: a job given up as lost that finished after all;
# `done -> done`: two launches of one key (sweep points) that both finished.
TRANSITIONS = {
    None: {State.pending, State.running},
    State.pending: {State.pending, State.running, State.done, State.failed, State.cancelled},
    State.running: {State.pending, State.running, State.done, State.failed, State.cancelled},
    State.failed: {State.pending, State.running, State.done, State.failed},
    State.cancelled: {State.pending, State.running, State.cancelled},
    State.done: {State.pending, State.running, State.done},
}


class LedgerError(ValueError):
    """A transition the state machine does not allow (a bug in the caller, not user input)."""


@dataclass
class LedgerEntry:
    state: State
    config_hash: Optional[str] = None
    launcher: Optional[str] = None  # the launcher that started it (re-attach goes through it)
    job_id: Optional[str] = None
    job_folder: Optional[str] = None  # slurm: submitit's folder, to re-attach from any process
    run_dir: Optional[str] = None
    log_path: Optional[str] = None
    started: Optional[float] = None  # Unix seconds
    ended: Optional[float] = None
    updated: Optional[float] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    todo: List[str] = field(default_factory=list)  # sub-parts the launch was asked to run
    summary: Optional[dict] = None  # rank 0's result of a finished stage

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "LedgerEntry":
        known = {f.name for f in dataclasses.fields(cls)}
        fields_ = {k: v for k, v in raw.items() if k in known}
        fields_["state"] = State(raw.get("state", "pending"))
        return cls(**fields_)

    @property
    def took_s(self) -> Optional[float]:
        return self.ended - self.started if self.started and self.ended else None


# Rebuilds entries from the output files of a cluster folder when the ledger is corrupt:
# (entries, the files they came from). Given by the pipeline: the ledger knows no stages.
Rebuild = Callable[[Path], Tuple[Dict[str, "LedgerEntry"], List[str]]]


class Ledger:
    def __init__(self, folder: str | Path, rebuild: Optional[Rebuild] = None):
        self.path = Path(folder) / LEDGER_NAME
        self._rebuild = rebuild
        self._lock = FileLock(str(self.path) + ".lock", timeout=60)

    # ------------------------------------------------------------------ reading
    def _read(self) -> Dict[str, LedgerEntry]:
        if not self.path.exists():
            return {}
        try:
            raw = read_json(self.path).get("entries", {})
            if not isinstance(raw, dict):
                raise ValueError("entries is not a mapping")
            return {key: LedgerEntry.from_dict(e) for key, e in raw.items()}
        except (ValueError, AttributeError, TypeError):
            return self._recover()

    def _recover(self) -> Dict[str, LedgerEntry]:
        """A corrupt ledger must not stop the user nor cost intact results: keep it aside,
        rebuild the entries from the outputs' provenance, write them, warn once on stderr."""
        kept = self.path.with_suffix(f".corrupt.{int(time.time())}")
        self.path.rename(kept)
        entries, files = self._rebuild(self.path.parent) if self._rebuild else ({}, [])
        self._write(entries)
        sys.stderr.write(f"warning: {LEDGER_NAME} was corrupt (kept as {kept.name}); rebuilt "
                         f"{len(entries)} entries from {', '.join(files) or 'no output files'}; "
                         f"intact results are reused\n")
        return entries

    def entries(self) -> Dict[str, LedgerEntry]:
        """All entries, key -> LedgerEntry. A missing ledger is an empty one."""
        return self._read()

    def get(self, key: str) -> Optional[LedgerEntry]:
        return self._read().get(key)

    def is_done(self, key: str, config_hash: str) -> bool:
        """True when `key` finished under the same config hash: a rerun may skip it."""
        entry = self.get(key)
        return entry is not None and entry.state == State.done and entry.config_hash == config_hash

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def _locked(self) -> Iterator[Dict[str, LedgerEntry]]:
        """The entries, read under the lock; written back when the block exits cleanly."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self._read()
            yield entries
            self._write(entries)

    def _write(self, entries: Dict[str, LedgerEntry]) -> None:
        write_json(self.path, {"schema_version": 1,
                               "entries": {k: e.to_dict() for k, e in entries.items()}})

    @staticmethod
    def _move(entries: Dict[str, LedgerEntry], key: str, to: State,
              from_states: Optional[Sequence[State]], now: float, **fields) -> bool:
        entry = entries.get(key)
        current = entry.state if entry else None
        if from_states is not None and current not in from_states:
            return False
        if to not in TRANSITIONS[current]:
            raise LedgerError(f"ledger entry {key}: {current} -> {to} is not allowed")
        if entry is None:
            entry = entries[key] = LedgerEntry(state=to)
        entry.state = to
        entry.updated = now
        for name, value in fields.items():
            setattr(entry, name, value)
        return True

    def transition(self, key: str, to: State | str, from_states: Optional[Iterable] = None, *,
                   error: Optional[str] = None, traceback: Optional[str] = None,
                   summary: Optional[dict] = None) -> bool:
        """Move `key` to state `to` if it is now in one of `from_states` (any state if None);
        returns whether it moved. Entering running clears `ended`/`error`; entering done, failed
        or cancelled sets `ended`; `error` is the reason either way (a note while active).
        Raises LedgerError for an edge TRANSITIONS does not allow."""
        to = State(to)
        states = None if from_states is None else tuple(State(s) for s in from_states)
        now = time.time()
        fields = self._state_fields(to, now, error, traceback, summary)
        with self._locked() as entries:
            return self._move(entries, key, to, states, now, **fields)

    @staticmethod
    def _state_fields(to: State, now: float, error, traceback, summary) -> dict:
        if to in ACTIVE:
            return {"ended": None, "error": error, "traceback": None}
        fields = {"ended": now, "error": error}
        if traceback is not None:
            fields["traceback"] = traceback
        if summary is not None:
            fields["summary"] = summary
        return fields

    def start_subpart(self, key: str, config_hash: str, log_path: str,
                      job_id: Optional[str]) -> None:
        """Rank 0 starts a sub-part: running, with the hash and job it runs under."""
        now = time.time()
        with self._locked() as entries:
            self._move(entries, key, State.running, None, now, started=now, ended=None,
                       error=None, traceback=None, config_hash=config_hash, log_path=log_path,
                       **({"job_id": job_id} if job_id else {}))

    def launch(self, key: str, subparts: Sequence[str], *, queued: bool, config_hash: str,
               launcher: str, run_dir: str) -> None:
        """Before a launch (a fast job may finish, and rank 0 mark it done, before submit
        returns): the stage pending (queued) or running, its sub-parts to run pending."""
        now = time.time()
        with self._locked() as entries:
            self._move(entries, key, State.pending if queued else State.running, None, now,
                       config_hash=config_hash, launcher=launcher, job_id=None, job_folder=None,
                       log_path=run_dir, run_dir=run_dir, started=now, ended=None, error=None,
                       traceback=None, todo=list(subparts), summary=None)
            for sub in subparts:
                self._move(entries, f"{key}/{sub}", State.pending, None, now, job_id=None,
                           config_hash=config_hash, log_path=run_dir, ended=None, error=None)

    def attach_job(self, key: str, subparts: Sequence[str], job_id: Optional[str],
                   job_folder: Optional[str]) -> None:
        """The launch's job id and folder, on the stage and the sub-parts it runs. Never the
        state: rank 0 may already have set it."""
        now = time.time()
        with self._locked() as entries:
            for k in [key] + [f"{key}/{s}" for s in subparts]:
                if k in entries:
                    entries[k].job_id = job_id
                    entries[k].updated = now
            if key in entries:
                entries[key].job_folder = job_folder

    def mark_ended(self, key: str, state: State | str, todo: Sequence[str] = (),
                   message: str = "") -> None:
        """After a launch that did not finish: the stage and its unfinished sub-parts take
        `state`, in one locked read-and-write. What is done stays done (its results are in the
        profile file and a rerun skips it), also when rank 0 marked it a moment ago."""
        state = State(state)
        if state == State.done:
            return
        now = time.time()
        still = ACTIVE + (state,)
        with self._locked() as entries:
            self._move(entries, key, state, still, now, ended=now, error=message or None)
            for sub in todo:
                self._move(entries, f"{key}/{sub}", state, still, now, ended=now)
