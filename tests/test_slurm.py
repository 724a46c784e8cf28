"""Real jobs on the dev Slurm cluster (slurm/dev-cluster.sh: nodes n1, n2 on this host) via submitit."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import ledger, run_cli, start_cli

SLURM = ["launcher=slurm", "cluster=dev", "launcher.poll_s=0.5"]


def wait_for(predicate, timeout_s=120, every_s=0.5, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def all_completed(job_ids, cluster_dir) -> bool:
    """Whether every job COMPLETED; fails at once (with the job's stderr, from the runs of
    `cluster_dir`, e.g. profiles/dev) when one ended any other way, instead of waiting out the
    timeout for a chain that can no longer finish."""
    states = [(sacct(j, "State") or ["PENDING"])[0] for j in job_ids]
    for job_id, state in zip(job_ids, states):
        if state.split()[0] in ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            logs = sorted((cluster_dir / "runs").glob(f"*/*/submitit/{job_id}_*_log.err"))
            tails = "\n".join(f"{log.name}: {log.read_text()[-2000:]}" for log in logs)
            pytest.fail(f"job {job_id} ended {state} (states {states}):\n{tails}")
    return all(state == "COMPLETED" for state in states)


def sacct(job_id, fields="State,NNodes,NTasks"):
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", fields],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out.split("|") if out else []


GOLDEN = Path(__file__).parent / "golden"


def _sbatch_text(tmp_path, ranks: str, after=None) -> str:
    """The submission file submitit writes for a fixed 2 nodes x 2 tasks cluster config, with
    the variable parts (the job folder, this Python) replaced by {folder} and {python}."""
    from omegaconf import OmegaConf

    from orchestrator.config import ClusterConfig
    from orchestrator.launch.slurm import make_executor

    cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig), {
        "nodes": 2, "tasks_per_node": 2, "gpus_per_node": 2, "partition": "gpu", "account": "ml",
        "qos": "high", "time_min": 30, "signal_delay_s": 45, "srun_args": ["--cpu-bind=none"],
        "sbatch_args": {"exclusive": True},
        "setup": ["module load cuda", "source /opt/venv/bin/activate"]})
    folder = tmp_path / "submitit"
    slurm = make_executor(cluster, folder, ranks=ranks, name="orch-x", after=after)._executor
    text = slurm._make_submission_file_text(slurm._submitit_command_str, "uid")
    return text.replace(str(folder), "{folder}").replace(shlex.quote(sys.executable), "{python}")


@pytest.mark.parametrize("name, ranks, after", [("cluster_2x2_after", "cluster", "41"),
                                                ("one_task", "one", None)])
def test_sbatch_script_matches_golden(tmp_path, name, ranks, after):
    """The whole sbatch file, as submitit's own tests check theirs (no cluster needed).
    ORCHESTRATOR_UPDATE_GOLDEN=1 rewrites tests/golden/*.sbatch after an intended change."""
    text = _sbatch_text(tmp_path, ranks, after)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("ORCHESTRATOR_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()


def test_golden_sbatch_keeps_what_the_launcher_relies_on():
    """What each golden line is there for: MPI across the tasks, the afterok chain, and a failed
    predecessor ending the chain instead of leaving it pending."""
    chain = (GOLDEN / "cluster_2x2_after.sbatch").read_text().splitlines()
    assert {"#SBATCH --dependency=afterok:41", "#SBATCH --kill-on-invalid-dep=yes",
            "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
            "#SBATCH --signal=USR2@45"} <= set(chain)
    srun = [line for line in chain if line.startswith("srun ")]
    assert srun == ["srun --unbuffered --output {folder}/%j_%t_log.out --error {folder}/%j_%t_log.err "
                    "--kill-on-bad-exit=1 --mpi=pmi2 --cpu-bind=none {python} -u -m "
                    "submitit.core._submit {folder}"]
    one = (GOLDEN / "one_task.sbatch").read_text().splitlines()
    assert {"#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"} <= set(one)
    assert not [line for line in one if "gpus" in line or "dependency" in line]


def test_inventory_on_2_nodes_x_2_tasks(slurm_cluster, profiles):
    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[inventory]", *SLURM,
                   profiles_dir=profiles, check=0)
    assert "submitted Slurm job" in proc.stdout
    # the job's output is streamed to the console without submitit's own lines (in its log)
    assert "submitit INFO" not in proc.stdout, proc.stdout
    assert "Loading pickle" in "".join(p.read_text() for p in profiles.rglob("*_0_log.out"))
    profile = json.loads((profiles / "dev" / "hardware.json").read_text())
    ranks = profile["inventory"]["ranks"]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    entry = ledger(profiles, "dev")["profile_hardware"]
    assert entry["state"] == "done" and entry["job_id"].isdigit()
    assert profile["provenance"]["job_id"] == entry["job_id"]
    assert sacct(entry["job_id"], "State")[0] == "COMPLETED"


def test_missing_pmi_flag_is_explained(slurm_cluster, profiles):
    proc = run_cli("stage=noop", *SLURM, "cluster.mpi_flag='--mpi=none'", profiles_dir=profiles)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "COMM_WORLD.size == 1" in proc.stderr and "cluster.mpi_flag='--mpi=pmi2'" in proc.stderr
    assert ledger(profiles, "dev")["noop"]["state"] == "failed"


def test_wait_false_returns_at_once_and_status_reattaches(slurm_cluster, profiles):
    proc = run_cli("stage=noop", *SLURM, "wait=false", profiles_dir=profiles, check=0)
    job_id = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)
    entry = ledger(profiles, "dev")["noop"]  # whatever its state, the job to re-attach to
    assert (entry["job_id"], entry["launcher"]) == (job_id, "slurm")
    assert entry["job_folder"].endswith("/submitit")

    def noop_row_in_status():
        out = run_cli("stage=status", "cluster=dev", profiles_dir=profiles, check=0).stdout
        rows = [line for line in out.splitlines() if "│ noop " in line]
        return rows and "done" in rows[0] and rows[0]

    row = wait_for(noop_row_in_status, what="status to report the noop job done")
    assert job_id in row
    entry = ledger(profiles, "dev")["noop"]
    assert entry["state"] == "done"
    # Rank 0 stamped when the job began to run, whether or not a poll saw it running.
    assert entry["started"] <= entry["running_since"] <= entry["ended"]


def test_sweep_submits_one_job_per_point_with_its_own_resources(slurm_cluster, profiles):
    proc = run_cli("-m", "stage=noop", *SLURM, "wait=false", "cluster.nodes=1,2",
                   "cluster.tasks_per_node=1", profiles_dir=profiles, check=0)
    job_ids = re.findall(r"submitted Slurm job (\d+)", proc.stdout)
    assert len(job_ids) == 2, proc.stdout
    states = {j: wait_for(lambda j=j: (s := sacct(j)) and s[0] == "COMPLETED" and s,
                           what=f"job {j} to complete") for j in job_ids}
    assert sorted(int(states[j][1]) for j in job_ids) == [1, 2]  # NNodes differ per point


def test_cancelled_job_then_rerun_resumes(slurm_cluster, profiles):
    # Large enough that allreduce and what follows take several seconds on the dev cluster.
    args = ["stage=profile_hardware", *SLURM, "profile_hardware.max_size_bytes=16777216",
            "profile_hardware.benchmarks=[inventory,allreduce,p2p,all2all]"]
    proc = start_cli(*args, profiles_dir=profiles)
    try:
        def inventory_done():
            e = ledger(profiles, "dev")
            return (e.get("profile_hardware/inventory", {}).get("state") == "done"
                    and e.get("profile_hardware/allreduce", {}).get("state") == "running")

        wait_for(inventory_done, timeout_s=180, every_s=0.2, what="inventory done, allreduce running")
        job_id = ledger(profiles, "dev")["profile_hardware"]["job_id"]
        subprocess.run(["scancel", job_id], check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, out
    assert "cancelled" in out and "rerun the same command to resume" in out
    assert "killed by signal" not in out  # Slurm's own SIGTERM to the tasks: the state says why
    entries = ledger(profiles, "dev")
    assert entries["profile_hardware"]["state"] == "cancelled"
    assert entries["profile_hardware/inventory"]["state"] == "done"
    assert entries["profile_hardware/allreduce"]["state"] == "cancelled"
    profile = json.loads((profiles / "dev" / "hardware.json").read_text())  # still valid
    assert len(profile["inventory"]["ranks"]) == 4 and "allreduce" not in profile["benchmarks"]

    proc = run_cli(*args, profiles_dir=profiles, check=0, timeout=600)
    assert "skipping: inventory" in proc.stdout
    entries = ledger(profiles, "dev")
    assert all(entries[f"profile_hardware/{b}"]["state"] == "done"
               for b in ("inventory", "allreduce", "p2p", "all2all"))
    assert entries["profile_hardware/inventory"]["job_id"] == job_id  # not redone
    assert entries["profile_hardware/allreduce"]["job_id"] != job_id
    profile = json.loads((profiles / "dev" / "hardware.json").read_text())
    assert set(profile["benchmarks"]) == {"allreduce", "p2p", "all2all"}
    # Two fake nodes: pipeline neighbours across n1/n2 are measured apart from those within a node.
    assert {p["layout"] for p in profile["benchmarks"]["p2p"]["points"]} == {"intra", "inter"}


def test_analytic_model_profile_runs_as_one_task(slurm_cluster, profiles):
    """A single-process stage (no MPI world, no process group) as a one-task job."""
    run_cli("stage=profile_model", *SLURM, "model=qwen_100b", "profile_model.plot=false",
            "profile_model.seq_lens=[4096,8192]", profiles_dir=profiles, check=0, timeout=300)
    profile = json.loads((profiles / "dev" / "model" / "qwen_100b.json").read_text())
    assert profile["source"] == "analytic"
    entry = ledger(profiles, "dev")["profile_model/qwen_100b"]
    assert entry["state"] == "done" and sacct(entry["job_id"], "NNodes,AllocCPUS") == ["1", "1"]


def test_one_task_job_that_fails_reports_its_error_and_exit_code(slurm_cluster, profiles):
    """A single-process stage that raises an error a user can act on (no feasible layout) inside
    a Slurm job: the CLI prints the stage's own line and exits with its code (3), not only
    "job failed" with 5."""
    analytic = ("cluster=dev", "model=qwen_100b", "profile_hardware.source=analytic",
                "profile_model.seq_lens=[4096]", "profile_hardware.plot=false",
                "profile_model.plot=false")
    run_cli("stage=profile_hardware", *analytic, profiles_dir=profiles, check=0, timeout=300)
    run_cli("stage=profile_model", *analytic, profiles_dir=profiles, check=0, timeout=300)
    proc = run_cli("stage=search", *SLURM, *analytic, "search.memory_GiB=3", "search.seq_len=4096",
                   "search.plot=false", profiles_dir=profiles, check=3, timeout=300)
    assert "no layout of qwen_100b fits" in proc.stderr, proc.stderr
    assert ledger(profiles, "dev")["search/qwen_100b"]["state"] == "failed"


def _scontrol_job(job_id) -> dict:
    """`scontrol show job` fields (JobState, Restarts, ...) of a job slurmctld still knows."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                         text=True, check=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _job_runs(job_id) -> list:
    """sacct's state of each run of a job (-D: requeued runs too), oldest first."""
    return subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", job_id, "-o", "State"],
                          capture_output=True, text=True, check=True).stdout.split()


def _follow_requeues(proc, job_id, at_requeue, release_after_s: float,
                     extend_when=None, each_poll=None) -> list:
    """Until the CLI `proc` exits: at each requeue of `job_id`, what `at_requeue()` returns
    (e.g. the ledger then), in order. Slurm holds a requeued job for its credential lifetime
    (120 s); it is released `release_after_s` after the requeue (a time-limit check), which
    decides where the next run's time-limit window falls. `extend_when()`: at the first requeue
    where it is true, the job's time limit becomes 10 minutes (as an admin extends a job), so
    the resumed run finishes however slowly a loaded machine lets it work. `each_poll()`: called
    at every poll (every 0.5 s)."""
    seen, requeued_at, extended = [], None, False
    while proc.poll() is None:
        if each_poll is not None:
            each_poll()
        job = _scontrol_job(job_id)
        if int(job["Restarts"]) > len(seen) and job["JobState"] == "PENDING":
            seen.append(at_requeue())
            requeued_at = time.monotonic()
            if extend_when is not None and not extended and extend_when():
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"],
                               check=True)
                extended = True
        if requeued_at is not None and time.monotonic() - requeued_at > release_after_s:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            requeued_at = None
        time.sleep(0.5)
    return seen


def _task_pids(job_folder) -> list:
    """A job's rank processes on this host: submitit runs each task as `python -u -m
    submitit.core._submit <job folder>` (srun's own command line holds the same words: not it)."""
    want = [b"-u", b"-m", b"submitit.core._submit", str(job_folder).encode()]
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if proc.name.isdigit() and argv[1:5] == want:
            pids.append(int(proc.name))
    return pids


def _warned_or_running(pid: int) -> bool:
    """Whether a process the test stopped has SIGUSR2 waiting (Slurm's time-limit warning; a
    stopped process keeps it pending), runs again (slurmstepd sends SIGCONT with the warning),
    or is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    warned = bool(pending & (1 << (signal.SIGUSR2 - 1)))
    return warned or not fields["State"].strip().startswith("T")


def _lock_held(lock: Path) -> bool:
    """Whether a process holds the file lock `lock` (the ledger's) now."""
    from filelock import FileLock, Timeout

    probe = FileLock(str(lock))
    try:
        probe.acquire(timeout=0)
    except Timeout:
        return True
    probe.release()
    return False


def ledger_lock(profiles) -> Path:
    """The lock file of the dev cluster's ledger under `profiles`."""
    from orchestrator.store.ledger import LEDGER_NAME

    return Path(profiles) / "dev" / f"{LEDGER_NAME}.lock"


def _stopped_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "T"
    except (OSError, IndexError):
        return True


class StallUntilWarned:
    """Called at each poll of a job with a 1-minute limit: freezes a run of it (SIGSTOP to its
    tasks, as a stalled machine would) and lets it go on when Slurm's time-limit warning comes,
    so that a run outlasts its limit without burning the CPU of a run that long.

    Slurm checks time limits every 30 s and warns (signal_delay_s=5) at the first check with at
    most 35 s left: 25 s into a run at the earliest. A run is frozen once `progress()` (read
    from the ledger) changed since its tasks started, or at FREEZE_AT_S whatever it did; never
    after SAFE_S, as a run warned already would be frozen halfway through its checkpoint and
    reach its limit (such a run is left alone, as is the rest of a frozen run's). A run frozen
    before it made progress is warned in its start-up and requeues without a checkpoint (as a
    loaded machine's can): the next one is frozen again. Once a run frozen after its own
    progress was warned (`warned`), no run is frozen any more. `entry()`: the job's ledger
    entry (its job_folder: submitit's, the tasks' command line)."""

    FREEZE_AT_S = 21
    SAFE_S = 24  # StartTime's whole seconds make the elapsed time read at most 1 s long

    def __init__(self, entry, progress, lock: Optional[Path] = None):
        self.entry, self.progress, self.lock = entry, progress, lock
        self.pids, self.seen, self.decided, self.stopped = frozenset(), None, False, []
        self.with_progress = self.warned = False

    def __call__(self) -> None:
        if self.stopped:
            if any(_warned_or_running(pid) for pid in self.stopped):
                self.release()
                self.warned = self.with_progress
            return
        entry = self.entry()
        if self.warned or not entry.get("job_id") or not entry.get("job_folder"):
            return
        pids = frozenset(_task_pids(entry["job_folder"]))
        if not pids:
            return
        if pids != self.pids:  # a new run, or more of its tasks up
            self.pids, self.seen, self.decided = pids, self.progress(), False
            return
        if self.decided:
            return
        job = _scontrol_job(entry["job_id"])
        if job["JobState"] != "RUNNING":
            return
        elapsed = (datetime.datetime.now()
                   - datetime.datetime.fromisoformat(job["StartTime"])).total_seconds()
        progressed = self.progress() != self.seen
        if elapsed >= self.SAFE_S:
            self.decided = True
        elif progressed or elapsed >= self.FREEZE_AT_S:
            self.decided, self.with_progress = True, progressed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            # Stopped once the kernel delivered it (a loaded machine may take a moment): only
            # then does "running" mean that the warning's SIGCONT came.
            wait_for(lambda: all(_stopped_or_gone(pid) for pid in pids), timeout_s=20,
                     every_s=0.05, what=f"tasks {sorted(pids)} to stop")
            self.stopped = list(pids)
            if self.lock is not None and _lock_held(self.lock):
                # frozen inside a ledger write (it holds the lock for milliseconds): the CLI's
                # own writes would wait on it and give up; let it go, freeze it at the next poll
                self.release()
                self.decided = False

    def release(self) -> None:
        """Every frozen task goes on (also when the test ends, whatever happened)."""
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped = []


PARTS = ["inventory", "allreduce", "p2p", "reduce_scatter", "all_gather", "all2all"]


def test_time_limit_requeues_and_resumes_without_redoing_done_parts(slurm_cluster, profiles):
    """A profile longer than the job's 1-minute limit: on USR2 before the limit, task 0
    checkpoints (the sub-parts not done yet) and requeues; the requeued job runs only those.

    Slurm checks time limits every 30 s and sends the signal at the first check past
    `time limit - signal_delay_s - 30 s`: with a 5 s delay, 25 to 55 s into a run. The run
    outlasts its limit because the test freezes its ranks once a part is done
    (StallUntilWarned), until the warning; frozen, they burn no CPU while they wait.
    """
    import submitit

    # Every point runs 0.25 s of wall time whatever the load (no early stop): 22 points, the
    # requeued run's few seconds.
    proc = start_cli("stage=profile_hardware", *SLURM, "cluster.time_min=1",
                     "cluster.signal_delay_s=5", f"profile_hardware.benchmarks=[{','.join(PARTS)}]",
                     "profile_hardware.max_size_bytes=4096", "profile_hardware.rel_spread=0",
                     "profile_hardware.max_time_s=0.25", "profile_hardware.max_iters=1000000",
                     "profile_hardware.plot=false", profiles_dir=profiles)

    def done_parts():  # at a requeue: the sub-parts done then, with their ledger entries
        entries = ledger(profiles, "dev")
        return {p: entries[f"profile_hardware/{p}"] for p in PARTS
                if entries.get(f"profile_hardware/{p}", {}).get("state") == "done"}

    stall = StallUntilWarned(lambda: ledger(profiles, "dev").get("profile_hardware", {}),
                             lambda: sorted(done_parts()), ledger_lock(profiles))
    try:
        job_id = wait_for(lambda: ledger(profiles, "dev").get("profile_hardware", {}).get("job_id"),
                           what="the job id in the ledger")
        # Released 8 s after a requeue, the next run starts 20 s before the next time-limit
        # check and gets the full 25-55 s window (not 25 s). After the first requeue that
        # follows some progress the limit becomes 10 minutes (an admin's extension): on a
        # loaded machine a run can spend its whole 1-minute window starting (then it requeues
        # with nothing done), and six short runs could end the job first.
        done_at_requeue = _follow_requeues(proc, job_id, done_parts, release_after_s=8,
                                           extend_when=lambda: bool(done_parts()),
                                           each_poll=stall)
        out, _ = proc.communicate(timeout=60)
    finally:
        stall.release()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert stall.warned  # the run that outlasted its limit was one the test froze
    # The job ran more than once under one id, and the CLI streamed it going back to the queue.
    assert done_at_requeue, out
    states = [line.split(": ")[1] for line in out.splitlines() if line.startswith(f"  job {job_id}: ")]
    back_in_queue = next(i for i, state in enumerate(states)
                         if i > states.index("RUNNING") and state in ("REQUEUED", "PENDING"))
    assert "RUNNING" in states[back_in_queue:] and states[-1] == "COMPLETED", states
    runs = _job_runs(job_id)
    assert runs == ["REQUEUED"] * len(done_at_requeue) + ["COMPLETED"], runs
    # The first run that got anywhere finished some parts, not all; every part is done now.
    first = next((done for done in done_at_requeue if done), {})
    assert "inventory" in first and len(first) < len(PARTS), done_at_requeue
    entries = ledger(profiles, "dev")
    assert [entries[f"profile_hardware/{p}"]["state"] for p in PARTS] == ["done"] * len(PARTS)
    assert entries["profile_hardware"]["state"] == "done"
    # A part done before a requeue was not run again: its ledger times are those of that run.
    for snapshot in done_at_requeue:
        for part, before in snapshot.items():
            after = entries[f"profile_hardware/{part}"]
            assert (after["started"], after["ended"]) == (before["started"], before["ended"]), part
    # The requeued job was given only the rest (RankJob.checkpoint rebuilt its to-do list).
    folder = entries["profile_hardware"]["job_folder"]
    requeued = submitit.SlurmJob(folder=folder, job_id=job_id).submission().function.request
    assert requeued.todo == [p for p in PARTS if p not in done_at_requeue[-1]]
    profile = json.loads((profiles / "dev" / "hardware.json").read_text())
    assert set(profile["benchmarks"]) == set(PARTS) - {"inventory"}
    assert len(profile["inventory"]["ranks"]) == 4


def _path_without_sacct(tmp_path) -> str:
    """$PATH with each folder that holds sacct replaced by links to all of it but sacct: a
    cluster without accounting, where submitit's sacct calls fail and it says UNKNOWN."""
    folders = []
    for i, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if (Path(folder) / "sacct").exists():
            links = tmp_path / f"bin{i}"
            links.mkdir()
            for exe in Path(folder).iterdir():
                if exe.name != "sacct":
                    (links / exe.name).symlink_to(exe)
            folder = str(links)
        folders.append(folder)
    return os.pathsep.join(folders)


def test_without_accounting_squeue_and_the_result_end_a_job(slurm_cluster, profiles, tmp_path):
    env = {"PATH": _path_without_sacct(tmp_path)}
    proc = run_cli("stage=noop", *SLURM, profiles_dir=profiles, env=env, check=0)
    job_id = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)
    states = [line.split(": ")[1] for line in proc.stdout.splitlines()
              if line.startswith(f"  job {job_id}: ")]
    assert "RUNNING" in states and states[-1] == "UNKNOWN", states  # squeue, then gone
    entry = ledger(profiles, "dev")["noop"]
    assert entry["state"] == "done" and entry["job_id"] == job_id

    # A job that never ran leaves no result: once squeue forgets it, status calls it failed.
    proc = run_cli("stage=noop", *SLURM, "wait=false", "force=true", "+cluster.sbatch_args.hold=true",
                   profiles_dir=profiles, env=env, check=0)
    job_id = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)
    run_cli("stage=status", "cluster=dev", profiles_dir=profiles, env=env, check=0)
    assert ledger(profiles, "dev")["noop"]["state"] == "pending"  # held: squeue lists it
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                                     text=True).stdout.strip() == "", what="squeue to drop the job")
    run_cli("stage=status", "cluster=dev", profiles_dir=profiles, env=env, check=0)
    entry = ledger(profiles, "dev")["noop"]
    assert entry["state"] == "failed" and entry["job_id"] == job_id
    assert entry["error"].startswith(f"Slurm job {job_id} ended (how is unknown: no accounting")


def test_a_cancelled_job_is_waited_for_until_its_tasks_have_ended(slurm_cluster, tmp_path):
    """Slurm calls a job CANCELLED at scancel, while its tasks still run their SIGTERM handler
    (train writes its signal checkpoint there) within KillWait: the CLI returns only after."""
    from orchestrator.launch.slurm import wait_completing

    marker = tmp_path / "handler_done"
    script = f"trap 'sleep 3; touch {marker}; exit 0' TERM; sleep 100 & wait"
    job_id = subprocess.run(["sbatch", "--parsable", "-n1", f"--chdir={tmp_path}", "--wrap", script],
                            capture_output=True, text=True, check=True).stdout.strip()
    state = lambda: (sacct(job_id, "State") or [""])[0]  # noqa: E731
    wait_for(lambda: state() == "RUNNING", what="the job to run")
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: state().startswith("CANCELLED"), what="CANCELLED")
    wait_completing(job_id, poll_s=0.2)
    assert marker.exists()
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                          text=True).stdout.strip() == ""


@pytest.mark.parametrize("stderr, killed", [
    # What srun wrote (dev cluster) after `kill -9` of task 2's rank, then its own stop of the rest.
    ("srun: error: n2: task 2: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=8.0\n"
     "srun: error: n2: task 3: Killed\nsrun: error: n1: tasks 0-1: Killed\n", [(2, 9)]),
    ("srun: error: n1: tasks 0-1,3: Segmentation fault\nsrun: error: n2: task 2: Killed\n",
     [(0, 11), (1, 11), (3, 11)]),
    ("srun: error: n1: task 1: Exited with exit code 1\nsrun: error: n1: tasks 0,2: Killed\n", []),
    ("rank 0: RuntimeError: x\n", []),
])
def test_the_tasks_srun_reports_killed_first_are_the_ones_named(stderr, killed):
    from orchestrator.launch.slurm import srun_killed

    assert srun_killed(stderr) == killed


def test_slurms_own_signals_in_a_cancelled_job_are_not_named_as_a_kill():
    """scancel (or the time limit, a preemption) stops the tasks with SIGTERM: srun reports them
    Terminated, which is not a `kill` the other ranks failed because of."""
    from orchestrator.launch.slurm import not_slurms, srun_killed

    terminated = srun_killed("srun: error: n1: tasks 0-1: Terminated\n")
    assert terminated == [(0, 15), (1, 15)]
    for state in ("CANCELLED", "PREEMPTED", "TIMEOUT"):
        assert not_slurms(state, terminated) == []
    assert not_slurms("FAILED", terminated) == terminated  # a `kill` in a job that failed
    assert not_slurms("CANCELLED", [(2, 11)]) == [(2, 11)]  # a crash is named whatever ended it


def test_a_jobs_output_reaches_the_console_in_whole_lines_without_submitits(tmp_path):
    from orchestrator.launch.slurm import _stream

    log, shown = tmp_path / "0_0_log.out", []
    log.write_bytes(b"submitit INFO (2026-11-29 01:55:06,089) - Loading pickle: x.pkl\n"
                    b"allreduce 27/27\nstep 1/3  loss 6.25")  # a line still being written
    offset = _stream(log, 0, shown.append)
    assert shown == ["allreduce 27/27\n"]
    with open(log, "ab") as f:
        f.write(" \u2713 done\nsubmitit INFO (2026-11-29 01:56:01,915) - Exiting\n"
                "submitit WARNING (2026-11-29 01:56:02,001) - Bypassing signal SIGCONT\n"
                "tail".encode())
    offset = _stream(log, offset, shown.append)
    assert shown[1:] == ["step 1/3  loss 6.25 \u2713 done\n"]
    assert _stream(log, offset, shown.append, ended=True) == log.stat().st_size
    assert shown[2:] == ["tail"]
