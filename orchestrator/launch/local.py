"""launcher=local: the stage's ranks on this machine with `mpiexec -n <ranks>`.

The mpich wheel from PyPI provides mpiexec, so no system MPI is needed. A single-rank stage
(e.g. search) runs in this process.

The ranks do not outlive this command: mpiexec gets SIGTERM when the CLI dies (the kernel's
parent-death signal) and every rank watches the CLI's pid (`runtime.watch_parent`), ending the
launch's process group when it is gone, also after a kill -9.

Each rank runs under a small shell that waits for it (RANK_SHELL): a rank killed by a signal
cannot say so, and mpiexec, which kills every other rank the moment one dies, names the wrong one
(the first in rank order). The shell records the signal (`launch.base.killed_text` names it).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from orchestrator.choices import Ranks
from orchestrator.errors import ConfigError
from orchestrator.launch.base import (KILLED_SUFFIX, LaunchResult, prepare_run_dir,
                                      read_rank0_result, unfinished)
from orchestrator.runtime import PARENT_ENV, RANK_SHELL_ENV, die_with_parent, run_inprocess
from orchestrator.runtime.request import StageRequest
from orchestrator.store.ledger import LOCAL_JOB_PREFIX, LedgerEntry
from orchestrator.store.owner import Owner


@dataclass
class LocalHandle:
    proc: Optional[subprocess.Popen]  # None: a single-rank stage, run in this process in wait()


# What each rank runs under: `sh -c RANK_SHELL sh <run folder> <rank command...>`. A rank that
# a signal killed ends with 128 + the signal: the shell writes the signal to rank<PMI_RANK>.signal.
# mpiexec then kills the other ranks' shells (and with them their ranks: die_with_rank_shell),
# which write nothing, so only the ranks that died first are recorded.
RANK_SHELL = (f'dir=$1; shift; {RANK_SHELL_ENV}=$$ "$@"; status=$?; '
              f'if [ "$status" -gt 128 ]; then '
              f'echo $((status - 128)) > "$dir/rank$PMI_RANK{KILLED_SUFFIX}"; fi; '
              f'exit "$status"')


def mpiexec_command(mpiexec: str, ranks: int, request_path: str | Path, extra_args=()) -> list:
    """The command line that starts `ranks` copies of the rank runtime, each under RANK_SHELL
    (its records go beside the request, in the run folder)."""
    return [mpiexec, "-n", str(ranks), *extra_args, "sh", "-c", RANK_SHELL, "sh",
            str(Path(request_path).parent), sys.executable, "-m", "orchestrator.runtime",
            str(request_path)]


# mpiexec loses a SIGTERM that arrives while it starts (its first ~10-50 ms here, seconds on a
# loaded machine) and then runs its ranks to the end: repeat it this long, then SIGKILL (hydra's
# proxies end their ranks when mpiexec is gone).
STOP_GRACE_S = 20.0


def terminate(proc: subprocess.Popen) -> None:
    """Stop a launch's mpiexec (its own process group) and wait for it to end."""
    deadline = time.monotonic() + STOP_GRACE_S
    while proc.poll() is None:
        sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the CLI dies, however it dies."""
    die_with_parent(signal.SIGTERM)


class LocalLauncher:
    name = "local"
    queued = False  # ranks start at once and end with this command

    def __init__(self, cfg):
        self.mpiexec = cfg.launcher.mpiexec
        self.extra_args = list(cfg.launcher.mpiexec_args)

    def submit(self, request: StageRequest, after: Optional[str] = None) -> LocalHandle:
        prepare_run_dir(request)
        if request.ranks == Ranks.one:
            return LocalHandle(None)
        if shutil.which(self.mpiexec) is None:
            raise ConfigError(f"launcher.mpiexec={self.mpiexec!r} not found on PATH; "
                              f"`pip install mpich` provides one")
        request_path = request.save(Path(request.run_dir) / "request.pkl")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if sys.stdout.isatty():  # rank 0's progress bars animate in the user's terminal
            env["ORCHESTRATOR_TTY"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // request.world_size)))
        owner = Owner.this_process()
        env[PARENT_ENV] = f"{owner.pid}:{owner.pid_start}"  # the ranks watch this process
        cmd = mpiexec_command(self.mpiexec, request.world_size, request_path, self.extra_args)
        # Own process group: a Ctrl-C here stops every rank, not only mpiexec.
        return LocalHandle(subprocess.Popen(cmd, env=env, start_new_session=True,
                                            preexec_fn=_die_with_parent))

    def job_id(self, handle: LocalHandle) -> Optional[str]:
        return f"{LOCAL_JOB_PREFIX}{handle.proc.pid}" if handle.proc else None

    def job_folder(self, handle) -> Optional[str]:
        return None

    def stop(self, handle: LocalHandle) -> None:
        if handle.proc is not None and handle.proc.poll() is None:
            terminate(handle.proc)  # mpiexec's last words come before the caller's error line

    def refresh(self, ledger, key: str, entry: LedgerEntry) -> None:
        """A local launch ends with the command that started it: one whose command is gone
        (killed) without recording how it ended is marked failed."""
        ledger.end_if_gone(key)

    def wait(self, handle: LocalHandle, request: StageRequest, on_state=None,
             on_output=None) -> LaunchResult:
        """Ranks print to this terminal themselves; an in-process stage runs here and now."""
        if handle.proc is None:
            # Errors a user can act on (a missing profile, no feasible layout) keep their type
            # and exit code; the caller records them in the ledger.
            result = run_inprocess(request)
            return LaunchResult("done", None, request.run_dir, result)
        try:
            rc = handle.proc.wait()
        except KeyboardInterrupt:  # the caller records the cancel and exits 130
            terminate(handle.proc)
            raise
        rank0 = read_rank0_result(request.run_dir)
        if rc == 0 and rank0 and rank0.get("ok"):
            return LaunchResult("done", self.job_id(handle), request.run_dir, rank0.get("result"))
        cause = f"killed by signal {-rc}" if rc < 0 else f"mpiexec exited with {rc}"
        return unfinished("failed", request.run_dir, self.job_id(handle), cause,
                          f"{request.run_dir}/rank*.log")
