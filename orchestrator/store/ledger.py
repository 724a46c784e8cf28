"""The ledger: one JSON file per profiles/<cluster.name>/ that records every stage and sub-part.

Entry keys are `<stage>[/<unit>]` (e.g. `profile_hardware`, `profile_hardware/allreduce`,
`profile_model/tiny/seq256_tp2`). Each entry is a `LedgerEntry`: its state, job id, log path,
config hash and times. Every change goes through one method per concern, each of which reads,
checks and writes under a file lock (the CLI on the login node and rank 0 inside a job may write
at once) and writes atomically, so the file is never half-written and no state is decided on a
stale read:
- `launch`: a stage (and its sub-parts) is about to start: pending or running, launch fields set,
  its owner (host, CLI pid) recorded; refused while another live run has the key (alive: see
  `LedgerEntry.owner_alive`);
- `heartbeat`: while the owning CLI waits for its launch, a thread stamps the entry, so that a
  CLI on another login node sharing the folder sees the owner alive;
- `attach_job`: the job id and folder, once the launcher knows them (never the state);
- `transition`: the state, and with it `ended`, `error` and `summary`, along the allowed edges.

The lock is held for milliseconds (a read, a JSON dump, an fsync). A command that cannot take
it within LOCK_TIMEOUT_S is refused (LedgerBusy, exit 5) naming the holder, which writes who it
is beside the lock (`ledger.json.lock.holder`) each time it takes it.

A full disk must not leave a launch `running` in the ledger: beside it lies `ledger.json.reserve`,
a file of about twice the ledger's size, which only the writes that record how a launch failed
may delete to make room (`mark_ended` here, rank 0's result file in the runtime).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from filelock import FileLock, Timeout

from orchestrator.errors import LaunchError
from orchestrator.store import keep_reserve, read_json, set_aside, write_json
from orchestrator.store.owner import HEARTBEAT_S, Owner, pid_alive

LEDGER_NAME = "ledger.json"
# Room the reserve keeps beyond a copy of the ledger: rank 0's result file, rounding to blocks.
RESERVE_SLACK_BYTES = 16 * 1024
LOCAL_JOB_PREFIX = "local-"  # a local launch's job id: local-<mpiexec pid>
EXIT_WAIT_S = 10.0  # how long a launch waits for the ranks of a killed CLI to exit
# How long a write waits for the ledger's lock. A holder keeps it for milliseconds (well under a
# second on a slow shared file system, even with the heartbeats of many runs), so 10 s of
# waiting means the holder is stuck or stopped: say who it is now rather than after a minute.
LOCK_TIMEOUT_S = 10.0


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
# `cancelled -> done`: one whose stop came after its last write, or whose stage a ledger rebuilt
# mid-run called cancelled (a file still `unfinished`); `done -> done`: two launches of one key
# (sweep points) that both finished.
TRANSITIONS = {
    None: {State.pending, State.running},
    State.pending: {State.pending, State.running, State.done, State.failed, State.cancelled},
    State.running: {State.pending, State.running, State.done, State.failed, State.cancelled},
    State.failed: {State.pending, State.running, State.done, State.failed},
    State.cancelled: {State.pending, State.running, State.done, State.cancelled},
    State.done: {State.pending, State.running, State.done},
}


class LedgerError(ValueError):
    """A transition the state machine does not allow (a bug in the caller, not user input)."""


class RunInProgress(LaunchError):
    """Another live run has the stage (or one of its parts) this launch wants."""


class LedgerBusy(RunInProgress):
    """Another process holds the ledger's lock longer than a write takes (LOCK_TIMEOUT_S)."""


@dataclass
class LedgerEntry:
    state: State
    config_hash: Optional[str] = None
    launcher: Optional[str] = None  # the launcher that started it (re-attach goes through it)
    job_id: Optional[str] = None
    job_folder: Optional[str] = None  # slurm: submitit's folder, to re-attach from any process
    run_dir: Optional[str] = None
    log_path: Optional[str] = None
    started: Optional[float] = None  # Unix seconds: launched (a Slurm job: submitted)
    running_since: Optional[float] = None  # a queued launch: when it was first seen running
    ended: Optional[float] = None
    updated: Optional[float] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    todo: List[str] = field(default_factory=list)  # sub-parts the launch was asked to run
    summary: Optional[dict] = None  # rank 0's result of a finished stage
    host: Optional[str] = None  # the launch's owner: the CLI that started it
    pid: Optional[int] = None
    pid_start: Optional[int] = None  # the CLI's start time (clock ticks): tells a reused pid
    progress: Optional[str] = None  # how far a running stage is (train: "step 12/30, loss 3.2")
    heartbeat: Optional[float] = None  # the owner's last stamp (Unix seconds): see owner.py

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
        """How long it ran: from when a queued job was seen running (an afterok chain's last
        job waits in the queue for the others), else from its launch."""
        since = self.running_since or self.started
        return self.ended - since if since and self.ended else None

    @property
    def owner(self) -> Optional[Owner]:
        return Owner(self.host, self.pid, self.pid_start) if self.pid else None

    @property
    def local_launch_pid(self) -> Optional[int]:
        """A local launch's mpiexec pid (its ranks' process group), from the job id."""
        if self.launcher == "local" and (self.job_id or "").startswith(LOCAL_JOB_PREFIX):
            return int(self.job_id[len(LOCAL_JOB_PREFIX):])
        return None

    @property
    def slurm_job(self) -> bool:
        """True for a launch that Slurm follows: its job, not its CLI, says whether it runs."""
        return self.launcher == "slurm" and bool(self.job_id)

    def owner_alive(self, now: Optional[float] = None) -> bool:
        """True while the launch goes on, the one test of it (the claim, `stage=status`, the
        wait for a killed run's ranks): its Slurm job is queued or running (a Slurm entry still
        active after `refresh_ledger` is one: the job outlives the CLI), or its CLI runs (on
        this host, its process; on another, while its heartbeat is fresh)."""
        if self.slurm_job:
            return True
        return self.owner is not None and self.owner.alive(self.heartbeat, now)

    def elsewhere(self) -> Optional[str]:
        """The other host whose CLI runs this active launch, None if none (or a Slurm job)."""
        active = self.state in ACTIVE and self.owner is not None and not self.slurm_job
        return self.host if active and not self.owner.here else None

    def state_text(self) -> str:
        """The state as `stage=status` shows it: `running on <host>` for another host's run."""
        host = self.elsewhere()
        return f"{self.state.value} on {host}" if host else self.state.value

    def busy_message(self, key: str) -> str:
        """The one line that refuses a second run of `key` while this launch goes on."""
        if self.slurm_job:
            who, stop = f"Slurm job {self.job_id}", f"`scancel {self.job_id}`"
        else:
            at = time.strftime("%H:%M:%S", time.localtime(self.started)) if self.started else "?"
            job = f"; job {self.job_id}" if self.job_id else ""
            who = f"pid {self.pid} on host {self.host}, started {at}{job}"
            stop = f"`kill {self.pid}`" + (f" on {self.host}" if self.elsewhere() else "")
        return f"{key} is already running ({who}); wait for it or stop it ({stop})"


# Rebuilds entries from the output files of a cluster folder when the ledger is corrupt:
# (entries, the files they came from). Given by the pipeline: the ledger knows no stages.
Rebuild = Callable[[Path], Tuple[Dict[str, "LedgerEntry"], List[str]]]


def reserve_path(folder: str | Path) -> Path:
    """The ledger's reserve in a cluster folder (see the module's docstring)."""
    return Path(folder) / f"{LEDGER_NAME}.reserve"


class Ledger:
    def __init__(self, folder: str | Path, rebuild: Optional[Rebuild] = None):
        self.path = Path(folder) / LEDGER_NAME
        self.reserve = reserve_path(folder)
        self._rebuild = rebuild
        self._lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)
        self._holder = Path(self._lock.lock_file + ".holder")

    # ------------------------------------------------------------------ reading
    def _read(self) -> Dict[str, LedgerEntry]:
        if not self.path.exists():
            return {}
        try:
            raw = read_json(self.path)["entries"]  # `{}` is not an empty ledger: one lost
            if not isinstance(raw, dict):
                raise ValueError("entries is not a mapping")
            return {key: LedgerEntry.from_dict(e) for key, e in raw.items()}
        except (ValueError, AttributeError, TypeError, KeyError):
            return self._recover()

    def _recover(self) -> Dict[str, LedgerEntry]:
        """A corrupt ledger must not stop the user nor cost intact results: keep it aside,
        rebuild the entries from the outputs' provenance, write them, warn once on stderr."""
        kept = set_aside(self.path, tag="corrupt")  # two in one second: both kept
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
    def _locked(self, spend_reserve: bool = False) -> Iterator[Dict[str, LedgerEntry]]:
        """The entries, read under the lock; written back when the block exits cleanly (on a
        full disk, with `spend_reserve`, by deleting the reserve)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._held():
            entries = self._read()
            yield entries
            self._write(entries, spend_reserve)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The ledger's lock, with who holds it written beside it; LedgerBusy (exit 5) naming
        the holder when another process keeps it past LOCK_TIMEOUT_S."""
        try:
            self._lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise LedgerBusy(self._busy_message()) from None
        try:
            try:  # best effort (a full disk): it only ever names the holder in an error
                self._holder.write_text(f"{socket.gethostname()} {os.getpid()} {time.time()}\n")
            except OSError:
                pass
            yield
        finally:
            self._lock.release()

    def _busy_message(self) -> str:
        """Why a write is refused: the lock's holder (as it recorded itself) and since when."""
        try:
            host, pid, since = self._holder.read_text().split()
            if host == socket.gethostname() and not pid_alive(int(pid)):
                raise ValueError("the last holder recorded has ended: another holds it now")
            held = (f"by pid {pid} on host {host} since "
                    f"{time.strftime('%H:%M:%S', time.localtime(float(since)))} "
                    f"({time.time() - float(since):.0f} s ago)")
            stop = f"`kill {pid}`" + ("" if host == socket.gethostname() else f" on {host}")
        except (OSError, ValueError):  # none recorded, or a write of it cut short
            held = "by a process that did not record itself"
            stop = f"it holds {self._lock.lock_file}"
        return (f"{self.path} is locked {held}: a write holds it for milliseconds, so that "
                f"process is stuck or stopped; retry in a moment, or end it ({stop})")

    def _write(self, entries: Dict[str, LedgerEntry], spend_reserve: bool = False) -> None:
        write_json(self.path, {"schema_version": 1,
                               "entries": {k: e.to_dict() for k, e in entries.items()}},
                   reserve=self.reserve if spend_reserve else None)
        keep_reserve(self.reserve, 2 * self.path.stat().st_size + RESERVE_SLACK_BYTES)

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
        if current is State.pending and to is State.running:
            entry.running_since = now
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

    def set_progress(self, key: str, text: str) -> None:
        """Rank 0 of a running stage: how far it is, for `stage=status` from another shell."""
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is not None:
                entry.progress = text
                entry.updated = time.time()

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
        returns): the stage pending (queued) or running, owned by this process, its sub-parts
        to run pending. Raises RunInProgress (exit 5) while another live run has `key` or a
        part of it; a launch whose processes are gone is marked failed and taken over.
        Refresh Slurm entries first (`refresh_ledger`): an active one counts as queued."""
        owner = Owner.this_process()
        self._wait_for_killed_runs(key, owner)
        now = time.time()
        with self._locked() as entries:  # the check and the claim in one locked step
            self._claim(entries, key, owner, now)
            self._move(entries, key, State.pending if queued else State.running, None, now,
                       config_hash=config_hash, launcher=launcher, job_id=None, job_folder=None,
                       log_path=run_dir, run_dir=run_dir, started=now, running_since=None,
                       ended=None, error=None, traceback=None, todo=list(subparts),
                       summary=None, progress=None,
                       host=owner.host, pid=owner.pid, pid_start=owner.pid_start, heartbeat=now)
            for sub in subparts:  # started when it starts (start_subpart): a part this run
                # never reached has no start, not the last run's
                self._move(entries, f"{key}/{sub}", State.pending, None, now, job_id=None,
                           config_hash=config_hash, log_path=run_dir, started=None,
                           running_since=None, ended=None, error=None)

    def _others(self, entries: Dict[str, LedgerEntry], key: str, owner: Owner):
        """Active launches of `key`, of a part of it or of what it is part of, owned by
        another process (one CLI's own launches of one key, a sweep's points, do not clash)."""
        for k, e in entries.items():
            related = k == key or k.startswith(key + "/") or key.startswith(k + "/")
            if related and e.state in ACTIVE and e.pid is not None and e.owner != owner:
                yield k, e

    def _wait_for_killed_runs(self, key: str, owner: Owner) -> None:
        """The ranks of a killed CLI stop within a second or two (they watch it): wait for
        them, up to EXIT_WAIT_S, so a rerun never runs beside them."""
        deadline = time.monotonic() + EXIT_WAIT_S
        for _, e in self._others(self._read(), key, owner):
            pid = e.local_launch_pid if e.owner.here else None  # another host's: not ours to see
            while pid and not e.owner_alive() and pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def _claim(self, entries: Dict[str, LedgerEntry], key: str, owner: Owner, now: float):
        for k, e in list(self._others(entries, key, owner)):
            if e.owner_alive(now):
                raise RunInProgress(e.busy_message(k))
            self._end(entries, k, State.failed, e.todo, gone_reason(e, now), now,
                      ended=last_seen(e, now))

    def end_if_gone(self, key: str) -> bool:
        """Mark `key` failed if it is still active but its processes are gone (its CLI was
        killed); returns whether it did. Checked under the lock: a new launch of `key` by a
        live CLI is never touched."""
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is None or entry.state not in ACTIVE or entry.pid is None:
                return False
            now = time.time()
            if entry.owner_alive(now):
                return False
            self._end(entries, key, State.failed, entry.todo, gone_reason(entry, now), now,
                      ended=last_seen(entry, now))
            return True

    @contextlib.contextmanager
    def heartbeat(self, key: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
        """While the block runs (the owning CLI waits for its launch of `key`), a thread stamps
        the entry every `every_s`: a CLI on another host, which cannot see this process, takes
        the launch as alive while the stamp is fresh. The stamps stop with the block (a Ctrl-C
        too) and with the process (a kill: a daemon thread)."""
        owner, stop = Owner.this_process(), threading.Event()
        beats = Ledger(self.path.parent, self._rebuild)  # filelock's locks are per thread

        def beat() -> None:
            while not stop.wait(every_s):
                try:
                    beats._stamp(key, owner)
                except (OSError, RunInProgress):  # a full disk, a busy lock: the next one may do
                    pass

        thread = threading.Thread(target=beat, name=f"heartbeat {key}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()  # no stamp after the block, nor a thread left while the CLI forks

    def _stamp(self, key: str, owner: Owner) -> None:
        """The heartbeat of `key`, if it is still active and `owner`'s launch."""
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is not None and entry.state in ACTIVE and entry.owner == owner:
                entry.heartbeat = time.time()

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
        profile file and a rerun skips it), also when rank 0 marked it a moment ago. On a full
        disk it spends the reserve to be written."""
        state = State(state)
        if state == State.done or self._already_ended(key, state, todo):
            return
        with self._locked(spend_reserve=True) as entries:  # also on a full disk
            self._end(entries, key, state, todo, message, time.time())

    def _already_ended(self, key: str, state: State, todo: Sequence[str]) -> bool:
        """True when rank 0 already recorded this end (on a full disk, before the launcher
        looks): writing it again could only fail."""
        entries = self._read()
        entry = entries.get(key)
        if entry is None or entry.state != state or entry.ended is None:
            return False
        return not any(entries[f"{key}/{sub}"].state in ACTIVE for sub in todo
                       if f"{key}/{sub}" in entries)

    def _end(self, entries: Dict[str, LedgerEntry], key: str, state: State, todo: Sequence[str],
             message: str, now: float, ended: Optional[float] = None) -> None:
        """`ended`: when the launch ended, if not `now` (a gone run's last sign of life)."""
        still = ACTIVE + (state,)
        ended = now if ended is None else ended
        self._move(entries, key, state, still, now, ended=ended, error=message or None)
        for sub in todo:
            self._move(entries, f"{key}/{sub}", state, still, now, ended=ended)


def last_seen(entry: LedgerEntry, now: float) -> float:
    """When a launch whose owner is gone last showed life (its owner's heartbeat, its last
    update, its start; `now` if it has none): its end, so that its `took` does not run on until
    the command that noticed it (a status a day later)."""
    stamps = [t for t in (entry.heartbeat, entry.updated, entry.started) if t]
    return min(now, max(stamps)) if stamps else now


def gone_reason(entry: LedgerEntry, now: float) -> str:
    """Why a launch whose owner is gone (at `now`) was marked failed."""
    again = "rerun its command to resume"
    if entry.owner is None or entry.owner.here:
        return f"the run's processes are gone (pid {entry.pid}); {again}"
    silent_s = now - (entry.heartbeat or entry.started or now)
    return (f"the run on host {entry.host} (pid {entry.pid}) sent no heartbeat for "
            f"{silent_s:.0f} s; {again}")
