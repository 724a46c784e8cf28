"""launcher=slurm: the stage's ranks in a Slurm job through submitit.

The one place that knows Slurm's flags. Resources come from the `cluster` config; every task
runs `RankJob` under `srun <cluster.mpi_flag>` so MPI sees the whole job. Job ids and the
submitit folder go into the ledger so another process can re-attach (`stage=status`).
Job states come from submitit (sacct through its watcher, the result pickles); only where
accounting is missing (sacct fails and submitit says UNKNOWN forever) squeue says whether the
job is still queued.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Optional, Tuple

import submitit

from orchestrator.choices import Ranks
from orchestrator.errors import ConfigError, LaunchError, OrchestratorError
from orchestrator.launch.base import LaunchResult, prepare_run_dir, unfinished
from orchestrator.stages import get_stage
from orchestrator.runtime import record_failure, run_inprocess, run_rank
from orchestrator.runtime.request import StageRequest
from orchestrator.store.ledger import ACTIVE, Ledger, LedgerEntry, State

log = logging.getLogger("orchestrator.launch")


class RankJob(submitit.helpers.Checkpointable):
    """What every task of a stage's job runs. On a time limit or a preemption, Slurm sends USR2
    to every task; submitit calls `checkpoint()` on task 0 only (the others ignore the signal),
    requeues the job from there and exits; the requeued job runs what `checkpoint` returned."""

    def __init__(self, request: StageRequest):
        self.request = request

    def __call__(self):
        """Rank 0's stage result (None on the other ranks)."""
        if self.request.ranks == Ranks.one:  # one process, no MPI world
            try:
                result = run_inprocess(self.request)
            except Exception as e:  # e.g. no feasible layout: its line and code reach the user
                record_failure(self.request, f"{type(e).__name__}: {e}", e)
                raise
        else:
            result = run_rank(self.request)
        # Done: a time-limit signal while this process exits must not requeue (or fail) the job.
        signal.signal(getattr(signal, f"SIG{submitit.JobEnvironment.USR_SIG}"), signal.SIG_IGN)
        return result

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """This job again, with only the sub-parts the ledger does not yet call done under the
        request's config hash (a stage without sub-parts runs again whole)."""
        ledger, r = Ledger(self.request.ledger_dir), self.request
        todo = [s for s in r.todo if not ledger.is_done(f"{r.ledger_key}/{s}", r.config_hash)]
        log.info("checkpoint: requeued with %d of %d sub-part(s) left: %s", len(todo),
                 len(r.todo), ", ".join(todo))
        return submitit.helpers.DelayedSubmission(RankJob(dataclasses.replace(r, todo=todo)))


def executor_parameters(cluster, *, ranks: str, name: str, after: Optional[str] = None) -> dict:
    """submitit AutoExecutor parameters for a stage: every rank of the cluster, or one task."""
    one = ranks == "one"
    # A task that dies before MPI can abort the others (e.g. in MPI_Init) ends the whole step
    # at once, instead of leaving its peers waiting until the time limit.
    srun_args = ["--kill-on-bad-exit=1"] + ([cluster.mpi_flag] if cluster.mpi_flag else [])
    params = {
        "name": name,
        "nodes": 1 if one else cluster.nodes,
        "tasks_per_node": 1 if one else cluster.tasks_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "timeout_min": cluster.time_min,
        "slurm_srun_args": srun_args + list(cluster.srun_args),
        "slurm_signal_delay_s": cluster.signal_delay_s,
        "slurm_additional_parameters": dict(cluster.sbatch_args),
    }
    if cluster.gpus_per_node and not one:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem_GiB:
        params["mem_gb"] = cluster.mem_GiB
    for key in ("partition", "account", "qos"):
        if getattr(cluster, key):
            params[f"slurm_{key}"] = getattr(cluster, key)
    if cluster.setup:
        params["slurm_setup"] = list(cluster.setup)
    if after:
        params["slurm_dependency"] = f"afterok:{after}"
        # Otherwise a failed predecessor leaves the rest of the chain pending forever.
        params["slurm_additional_parameters"]["kill-on-invalid-dep"] = "yes"
    return params


def make_executor(cluster, folder, *, ranks: str, name: str, after: Optional[str] = None,
                  subparts: int = 0) -> submitit.AutoExecutor:
    """The submitit executor of one stage's job, its files under `folder`. The job may time out
    and be requeued once per sub-part (at least submitit's default 3 times): each run keeps
    what it finished, so a stage of many parts gets through a short time limit."""
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                     slurm_max_num_timeout=max(3, subparts))
    executor.update_parameters(**executor_parameters(cluster, ranks=ranks, name=name, after=after))
    return executor


# What sbatch says when it cannot talk to Slurm at all (no slurm.conf, slurmctld down).
_UNREACHABLE = ("Could not establish a configuration source", "Unable to contact slurm controller",
                "Connection refused", "Unable to establish", "Unable to process configuration file")


def sbatch_error(stderr: str) -> OrchestratorError:
    """sbatch's refusal (its error lines) as one line: ConfigError when Slurm is not reachable
    (what to set), else LaunchError naming the cause and the settings that make the request."""
    lines = [re.sub(r"^sbatch: (error|fatal): ", "", line.strip())
             for line in stderr.splitlines() if line.strip()]
    if any(marker in stderr for marker in _UNREACHABLE):
        conf = os.environ.get("SLURM_CONF")
        return ConfigError(f"Slurm is not reachable (sbatch: {lines[-1]}); set SLURM_CONF to the "
                           f"cluster's slurm.conf (now {conf or 'unset'}) and check that "
                           f"slurmctld is up")
    return LaunchError(f"sbatch refused the job: {'; '.join(lines)}. Check cluster.partition, "
                       f"cluster.nodes, cluster.tasks_per_node, cluster.mem_GiB, "
                       f"cluster.time_min and cluster.sbatch_args")


def squeue_state(job_id: str) -> Optional[str]:
    """The job's state as squeue lists it, "" when squeue no longer lists it (the job ended),
    None when squeue itself failed (no answer either way)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # a job id slurmctld forgot is an error too
        return "" if "Invalid job id" in out.stderr else None
    states = out.stdout.split()
    return states[0] if states else ""


# How long a job's ranks may take to end after Slurm called it ended: its KillWait (30 s by
# default) and the epilog, with room to spare.
COMPLETING_LIMIT_S = 180.0


def wait_completing(job_id: str, poll_s: float, limit_s: float = COMPLETING_LIMIT_S) -> None:
    """Wait while squeue lists the job COMPLETING. Slurm calls a cancelled, preempted or timed
    out job ended at once, but its ranks run on through KillWait, writing their signal
    checkpoint: a rerun started meanwhile began from the checkpoint before it."""
    deadline = time.monotonic() + limit_s
    while squeue_state(job_id) == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(poll_s)


def job_state(job: submitit.SlurmJob) -> Tuple[str, bool]:
    """(Slurm state, whether Slurm has ended the job) of a one-task submitit job (or task 0).

    sacct through submitit's watcher (one forced call), and the watcher's own test of a final
    state; rank 0's result pickle appears before that, while the job still runs. Without
    accounting sacct fails and submitit says UNKNOWN forever: then squeue, which lists a job
    until it ends.
    """
    state = (job.get_info(mode="force").get("State") or "UNKNOWN").split()[0]  # "CANCELLED by 0"
    if state != "UNKNOWN":
        return state, job.watcher.is_done(job.job_id, mode="cache")
    queued = squeue_state(job.job_id)
    return (queued or "UNKNOWN"), queued == ""


# srun's line for tasks that ended badly: "srun: error: n2: task 2: Killed", "... tasks 0-1,3:
# Terminated", "... task 1: Exited with exit code 1". With --kill-on-bad-exit its first such line
# names the tasks that ended first; it stops the others after it, which get lines of their own.
_SRUN_BAD_EXIT = re.compile(r"^srun: error: \S+: tasks? ([\d,-]+): (.+)$", re.MULTILINE)
_SIGNAL_OF_TEXT = {signal.strsignal(s): int(s) for s in signal.Signals}


def srun_killed(stderr: str) -> List[Tuple[int, int]]:
    """(rank, signal) of the tasks a signal killed in srun's first bad-exit line of `stderr`
    (the batch script's stderr, where srun reports); [] when the first tasks to end exited
    on their own (their error is in their logs)."""
    first = _SRUN_BAD_EXIT.search(stderr)
    if first is None or first.group(2).strip() not in _SIGNAL_OF_TEXT:
        return []
    number = _SIGNAL_OF_TEXT[first.group(2).strip()]
    ranks = []
    for part in first.group(1).split(","):
        low, _, high = part.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return [(rank, number) for rank in ranks]


# Job states in which Slurm itself signalled the tasks (scancel, a preemption, the time limit:
# SIGTERM, then SIGKILL after KillWait).
SLURM_ENDED = ("CANCELLED", "PREEMPTED", "TIMEOUT")
SLURM_SIGNALS = (int(signal.SIGTERM), int(signal.SIGKILL))


def not_slurms(state: str, killed: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The (rank, signal) of `killed` that Slurm did not send itself: in a job that ended
    `state` CANCELLED, PREEMPTED or TIMEOUT its SIGTERM and SIGKILL are how it stopped the tasks
    (the state says why), not a `kill` that the other ranks failed because of."""
    if state not in SLURM_ENDED:
        return killed
    return [(rank, sig) for rank, sig in killed if sig not in SLURM_SIGNALS]


def _ledger_state(slurm_state: str) -> str:
    """The ledger state of a job that did not finish well (COMPLETED with no result: failed)."""
    if slurm_state in ("CANCELLED", "PREEMPTED"):
        return "cancelled"
    return "failed"


class SlurmLauncher:
    name = "slurm"
    queued = True  # jobs wait in a queue: submit a chain first, then wait

    def __init__(self, cfg):
        missing = [c for c in ("sbatch", "srun", "squeue") if shutil.which(c) is None]
        if missing:
            raise ConfigError(f"launcher=slurm: {', '.join(missing)} not found on PATH; run on "
                              f"a Slurm login node or put Slurm's commands on PATH "
                              f"(launcher=local runs without Slurm)")
        conf = os.environ.get("SLURM_CONF")
        if conf and not Path(conf).is_file():  # else sbatch retries it for 60 s, then fails
            raise ConfigError(f"SLURM_CONF={conf}: no such file; set it to the cluster's "
                              f"slurm.conf, or unset it for Slurm's own default")
        self.cluster = cfg.cluster
        self.poll_s = cfg.launcher.poll_s

    def submit(self, request: StageRequest, after: Optional[str] = None) -> submitit.Job:
        """The submitted job; LaunchError (exit 5) when sbatch refuses it, ConfigError (exit 2)
        when Slurm cannot be reached."""
        prepare_run_dir(request)
        executor = make_executor(self.cluster, Path(request.run_dir) / "submitit",
                                 ranks=request.ranks,
                                 name=f"orch-{request.stage}", after=after,
                                 subparts=max(len(request.todo),
                                              get_stage(request.stage).requeues))
        try:  # submitit copies sbatch's stderr to ours: it is in the one-line error instead
            with contextlib.redirect_stderr(io.StringIO()):
                return executor.submit(RankJob(request))
        except submitit.core.utils.FailedJobError as e:  # sbatch exited non-zero
            raise sbatch_error(str(e)) from None

    def job_id(self, job) -> Optional[str]:
        return str(job.job_id)

    def job_folder(self, job) -> Optional[str]:
        return str(job.paths.folder)

    def stop(self, job) -> None:
        job.cancel(check=False)

    def refresh(self, ledger, key: str, entry: LedgerEntry) -> None:
        """Re-attach to the job of a pending/running ledger entry and record how it ended."""
        if not entry.job_id or not entry.job_folder:
            return
        job = submitit.SlurmJob(folder=entry.job_folder, job_id=entry.job_id)  # task 0
        state, ended = job_state(job)
        if not ended:
            if state == "RUNNING":
                ledger.transition(key, State.running, from_states=(State.pending,))
            return
        outcome = self.outcome(job, entry.run_dir, state)
        if outcome.state == "done":
            ledger.transition(key, State.done, from_states=ACTIVE)
        else:  # under the lock: what rank 0 marked done meanwhile stays done
            ledger.mark_ended(key, outcome.state, entry.todo, outcome.message)

    def wait(self, job, request: StageRequest, on_state=None, on_output=None) -> LaunchResult:
        """Poll until the job ends, also across requeues; report how it ended.

        `on_state(state)` hears each change of the Slurm state, `on_output(text)` what rank 0
        printed since the last poll (its progress).
        """
        rank0 = job.task(0)
        state, offset = None, 0
        while True:
            if on_output is not None:
                offset = _stream(rank0.paths.stdout, offset, on_output)
            new, ended = job_state(rank0)
            if new != state and on_state is not None:
                on_state(new)
            state = new
            if ended:
                break
            time.sleep(self.poll_s)
        if state != "COMPLETED":
            wait_completing(job.job_id, self.poll_s)
        if on_output is not None:
            _stream(rank0.paths.stdout, offset, on_output, ended=True)
        return self.outcome(job, request.run_dir, state)

    def outcome(self, job, run_dir: str, state: str) -> LaunchResult:
        """How a job that ended (in Slurm state `state`) ended for the ledger: done when rank 0
        returned (submitit pickled its return value), else failed or cancelled, with rank 0's
        error line."""
        rank0 = job.task(0)
        folder = self.job_folder(job)
        # exception() waits a while for a COMPLETED job's pickle (a slow shared file system).
        returned = state == "COMPLETED" or rank0.paths.result_pickle.exists()
        if returned and rank0.exception() is None:
            return LaunchResult("done", self.job_id(job), run_dir, rank0.result(),
                                job_folder=folder)
        how = state if state != "UNKNOWN" else "(how is unknown: no accounting, sacct failed)"
        try:
            killed = srun_killed(Path(rank0.paths.stderr).read_text(errors="replace"))
        except OSError:  # no log (a job that never started)
            killed = []
        return unfinished(_ledger_state(state), run_dir, self.job_id(job),
                          f"Slurm job {job.job_id} ended {how}", folder, job_folder=folder,
                          killed=not_slurms(state, killed))


# submitit's own lines in a job's output (its start, the pickle it loads, its exit, the signals
# it passes on, "Bypassing signal SIGCONT" after a scancel): they stay in the job's log, the
# user's console shows what the stage printed.
_SUBMITIT_LINE = (b"submitit INFO (", b"submitit WARNING (")


def _stream(path: Path, offset: int, on_output, ended: bool = False) -> int:
    """Hand the whole lines `path` gained since `offset` (byte offset) to `on_output`, less
    submitit's own; returns the new offset. Until the job `ended`, a line still being written
    waits for its end (a line is kept or dropped whole)."""
    if not path.exists():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    if not ended:
        data = data[:data.rfind(b"\n") + 1]
    offset += len(data)
    shown = b"".join(line for line in data.splitlines(keepends=True)
                     if not line.startswith(_SUBMITIT_LINE))
    if shown:
        on_output(shown.decode(errors="replace"))
    return offset
