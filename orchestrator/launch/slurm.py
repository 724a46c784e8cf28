"""launcher=slurm: the stage's ranks in a Slurm job through submitit.

The one place that knows Slurm's flags. Resources come from the `cluster` config; every task
runs `run_rank` under `srun <cluster.mpi_flag>` so MPI sees the whole job. Job ids and the
submitit folder go into the ledger so another process can re-attach (`stage=status`).
Without accounting (`sacct` failing) the state falls back to squeue and the result files.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

from orchestrator.launch.base import LaunchResult, prepare_run_dir, read_rank0_result, unfinished
from orchestrator.runtime.request import StageRequest
from orchestrator.store.ledger import ACTIVE, State

# Slurm states after which a job will not run again by itself.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "LOST"}
# How long a job may be unknown to both sacct and squeue before we call it lost.
LOST_AFTER_S = 60.0


def executor_parameters(cluster, *, ranks: str, name: str, after: Optional[str] = None) -> dict:
    """submitit AutoExecutor parameters for a stage: every rank of the cluster, or one task."""
    one = ranks == "one"
    params = {
        "name": name,
        "nodes": 1 if one else cluster.nodes,
        "tasks_per_node": 1 if one else cluster.tasks_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "timeout_min": cluster.time_min,
        "slurm_srun_args": [cluster.mpi_flag, *cluster.srun_args] if cluster.mpi_flag else list(cluster.srun_args),
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


def squeue_state(job_id: str) -> Optional[str]:
    """The job's state from squeue, or None when squeue no longer knows it."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split()
    return states[0] if out.returncode == 0 and states else None


def job_state(job, request: Optional[StageRequest] = None) -> str:
    """Slurm state of a submitit job: sacct first, then squeue, then the result files."""
    try:
        state = job.watcher.get_state(job.job_id, mode="force")
    except Exception:  # sacct missing or failing: fall back below
        state = "UNKNOWN"
    state = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    if state != "UNKNOWN":
        return state
    queued = squeue_state(job.job_id)
    if queued:
        return queued
    if request is not None and read_rank0_result(request):
        return "COMPLETED"
    return "UNKNOWN"


def _ledger_state(slurm_state: str) -> str:
    """The ledger state of a job that did not finish well (COMPLETED with no result: failed)."""
    if slurm_state in ("CANCELLED", "PREEMPTED"):
        return "cancelled"
    return "failed"


class SlurmLauncher:
    name = "slurm"
    queued = True  # jobs wait in a queue: submit a chain first, then wait

    def __init__(self, cfg):
        self.cluster = cfg.cluster
        self.poll_s = cfg.launcher.poll_s

    def submit(self, request: StageRequest, after: Optional[str] = None):
        import submitit

        from orchestrator.runtime import run_inprocess, run_rank

        prepare_run_dir(request)
        folder = Path(request.run_dir) / "submitit"
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        ranks = request.ranks
        executor.update_parameters(**executor_parameters(
            self.cluster, ranks=ranks, name=f"orch-{request.stage}", after=after))
        # A single-task stage runs as it would here: one process, no MPI world, no process group.
        return executor.submit(run_inprocess if ranks == "one" else run_rank, request)

    def job_id(self, job) -> Optional[str]:
        return str(job.job_id)

    def job_folder(self, job) -> Optional[str]:
        return str(job.paths.folder)

    def refresh(self, ledger, key: str, entry: dict) -> None:
        """Re-attach to the job of a pending/running ledger entry and record how it ended."""
        if not entry.job_id or not entry.job_folder:
            return
        # TODO(merge): read_rank0_result/unfinished should take the run folder, not a request.
        from types import SimpleNamespace

        from orchestrator.runtime.request import result_path
        request = SimpleNamespace(run_dir=entry.run_dir, result_path=result_path(entry.run_dir))
        job = reattach(entry.job_folder, entry.job_id)
        state = job_state(job, request)
        if state == "UNKNOWN" and time.time() - (entry.started or 0) > LOST_AFTER_S:
            state = "LOST"  # neither sacct nor squeue knows it, and it left no result
        if state == "RUNNING":
            ledger.transition(key, State.running, from_states=(State.pending,))
        elif state in FINAL_STATES:
            outcome = self.outcome(job, request, state)
            if outcome.state == "done":
                ledger.transition(key, State.done, from_states=ACTIVE)
            else:  # under the lock: what rank 0 marked done meanwhile stays done
                ledger.mark_ended(key, outcome.state, entry.todo, outcome.message)

    def wait(self, job, request: StageRequest, on_state=None, on_output=None) -> LaunchResult:
        """Poll until the job ends (sacct, else squeue and result files); report how it ended.

        `on_output(text)` receives what rank 0 printed since the last poll (its progress).
        """
        state, unknown_since, offset = None, None, 0
        rank0_stdout = (job._sub_jobs[0] if getattr(job, "_sub_jobs", None) else job).paths.stdout
        while True:
            if on_output is not None and rank0_stdout.exists():
                with open(rank0_stdout, errors="replace") as f:
                    f.seek(offset)
                    text = f.read()
                    offset = f.tell()
                if text:
                    on_output(text)
            new = job_state(job, request)
            if new != state and on_state is not None:
                on_state(new)
            state = new
            if state in FINAL_STATES:
                break
            if state == "UNKNOWN":
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > LOST_AFTER_S:
                    state = "LOST"
                    break
            else:
                unknown_since = None
            time.sleep(self.poll_s)
        return self.outcome(job, request, state)

    def outcome(self, job, request: StageRequest, state: str) -> LaunchResult:
        """How a job that ended in Slurm state `state` ended for the ledger."""
        rank0 = read_rank0_result(request) or {}
        if state == "COMPLETED" and rank0.get("ok"):
            return LaunchResult("done", self.job_id(job), request.run_dir, rank0.get("result"),
                                job_folder=self.job_folder(job))
        return unfinished(_ledger_state(state), request, self.job_id(job),
                          f"Slurm job {job.job_id} ended {state}", str(job.paths.folder),
                          job_folder=self.job_folder(job))


def reattach(job_folder: str, job_id: str):
    """A submitit job object for a job submitted by another process."""
    import submitit

    return submitit.SlurmJob(folder=job_folder, job_id=job_id)
