"""The launcher interface and what a launch reports."""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Protocol, Tuple

from orchestrator.runtime.request import StageRequest, result_path
from orchestrator.store import read_json
from orchestrator.store.ledger import LedgerEntry


@dataclass
class LaunchResult:
    state: str  # done | failed | cancelled | submitted (wait=false)
    job_id: Optional[str]
    log_path: str
    result: Any = None  # rank 0's summary when done
    message: str = ""
    job_folder: Optional[str] = None  # slurm: submitit's folder, to re-attach
    exit_code: Optional[int] = None  # the error's own exit code, when a rank raised one


class Launcher(Protocol):
    name: str
    queued: bool  # True: submit returns before the job starts (a batch queue)

    def submit(self, request: StageRequest, after: Optional[str] = None) -> Any:
        """Start the stage's ranks (after job `after` succeeded, if given); returns a handle."""

    def job_id(self, handle) -> Optional[str]:
        """The id the ledger records for this launch."""

    def job_folder(self, handle) -> Optional[str]:
        """Where another process can re-attach to the launch, if it can."""

    def wait(self, handle, request: StageRequest, on_state=None, on_output=None) -> LaunchResult:
        """Block until the launch ends; report how. `on_state(state)` hears each change of the
        job's state, `on_output(text)` what rank 0 printed (where the ranks do not print to
        this terminal themselves). A Ctrl-C propagates as KeyboardInterrupt (the caller
        records the cancel and exits 130), after stopping ranks that end with this command."""

    def stop(self, handle) -> None:
        """End a launch the ledger cannot follow (its entry could not be written): local ranks
        are stopped and waited for, a Slurm job is cancelled."""

    def refresh(self, ledger, key: str, entry: LedgerEntry) -> None:
        """Re-attach to a launch the ledger still calls pending/running; record how it ended
        (local: a launch whose command is gone, failed)."""


def prepare_run_dir(request: StageRequest) -> None:
    """A fresh run folder: no result file (nor record of a killed rank) from an earlier launch
    can be mistaken for this one's."""
    Path(request.run_dir).mkdir(parents=True, exist_ok=True)
    Path(request.result_path).unlink(missing_ok=True)
    for old in Path(request.run_dir).glob(f"rank*{KILLED_SUFFIX}"):
        old.unlink(missing_ok=True)


# A rank killed by a signal cannot say so itself: what waits for it writes rank<N>.signal in the
# run folder, holding the signal's number (launch.local's rank shell).
KILLED_SUFFIX = ".signal"
# What usually sends a signal that kills a rank, for the message.
_SIGNAL_CAUSES = {signal.SIGKILL: "`kill -9` or the out-of-memory killer",
                  signal.SIGSEGV: "a crash; its log has the stack", signal.SIGBUS: "a crash",
                  signal.SIGABRT: "an abort in native code; its log has the stack",
                  signal.SIGTERM: "a `kill`", signal.SIGINT: "an interrupt"}


def killed_ranks(run_dir: str) -> List[Tuple[int, int]]:
    """(rank, signal) of each rank of a launch that a signal killed, by rank."""
    found = []
    for path in Path(run_dir).glob(f"rank*{KILLED_SUFFIX}"):
        rank = re.fullmatch(rf"rank(\d+){re.escape(KILLED_SUFFIX)}", path.name)
        try:
            found.append((int(rank.group(1)), int(path.read_text())))
        except (AttributeError, OSError, ValueError):  # another file, or a record cut short
            continue
    return sorted(found)


def killed_text(run_dir: str, killed: List[Tuple[int, int]]) -> str:
    """'rank 2 was killed by signal 9 (SIGKILL: ...); its log: <run_dir>/rank2.log' for each
    (rank, signal) of `killed` ('' if none): the ranks the others failed because of."""
    lines = []
    for rank, number in killed:
        try:
            sig = signal.Signals(number)
            why = f"{sig.name}" + (f": {_SIGNAL_CAUSES[sig]}" if sig in _SIGNAL_CAUSES else "")
        except ValueError:
            why = "an unknown signal"
        lines.append(f"rank {rank} was killed by signal {number} ({why}); its log: "
                     f"{Path(run_dir) / f'rank{rank}.log'}")
    return "; ".join(lines)


def unfinished(state: str, run_dir: str, job_id: Optional[str], cause: str, logs: str,
               job_folder: Optional[str] = None,
               killed: Optional[List[Tuple[int, int]]] = None) -> LaunchResult:
    """A launch (whose run folder is `run_dir`) that did not finish: first the ranks a signal
    killed (`killed`, by default the run folder's records: the other ranks' errors follow from
    theirs), then `cause`, with rank 0's own error line and the exit code of its error (e.g. 3:
    no feasible layout) when it wrote them."""
    rank0 = read_rank0_result(run_dir) or {}
    detail = f": {rank0['error']}" if rank0.get("error") else ""
    named = killed_text(run_dir, killed_ranks(run_dir) if killed is None else killed)
    first = f"{named}; " if named else ""
    return LaunchResult(state, job_id, run_dir, message=f"{first}{cause}{detail}; logs: {logs}",
                        job_folder=job_folder, exit_code=rank0.get("exit_code"))


def read_rank0_result(run_dir: str) -> Optional[dict]:
    """Rank 0's result file in a launch's run folder, written when the stage finished on every
    rank (or, with the error, when rank 0 failed)."""
    path = result_path(run_dir)
    if not path.exists():
        return None
    try:
        return read_json(path)
    except ValueError:
        return None
