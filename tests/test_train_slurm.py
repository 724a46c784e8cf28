"""stage=train on the dev Slurm cluster (2 fake nodes, gloo) through submitit: a run cancelled
with scancel resumes the same loss trajectory, a run longer than its 1-minute time limit is
signalled, requeued and finishes by itself, and a PP sweep compares its points.

Explicit layouts (train.pp, train.tp) need no profiles; seq_len 64 keeps the steps short. One
task per node (2 ranks, one on each node): every rank a job starts costs ~3 CPU-s before its
first step (torch), and the suite shares 2 cores; TP and 4-rank layouts train locally
(test_train_cli.py, test_train_engine.py).
"""
from __future__ import annotations

import csv
import json
import re
import subprocess

import pytest

from conftest import ledger, run_cli, start_cli
from test_slurm import (SLURM, StallUntilWarned, _follow_requeues, _job_runs, ledger_lock,
                        wait_for)

TRAIN = ["stage=train", "model=tiny", "train.seq_len=64", "train.plot=false",
         "cluster.tasks_per_node=1"]
# Each layout's own ledger key, named as its summary (2 ranks: pp2 is dp1, pp1 is dp2).
PP2_KEY = "train/tiny/pp2-tp1-dp1-zero0-mbs1x8-1f1b"
PP1_KEY = "train/tiny/pp1-tp1-dp2-zero0-mbs1x4-1f1b"
RUN_S = 480  # one 24-step pp2 Slurm run, on a loaded machine


def _summaries(profiles) -> dict:
    """Every train summary of the dev cluster's tiny model, by file name."""
    folder = profiles / "dev" / "train" / "tiny"
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _only_summary(profiles) -> dict:
    (summary,) = _summaries(profiles).values()
    return summary


def _losses(summary) -> list:
    """The summary's losses in step order; the steps must be 1..train.steps, none missing."""
    steps = sorted(int(k) for k in summary["losses"])
    assert steps == list(range(1, summary["steps"] + 1)), steps
    return [summary["losses"][str(s)] for s in steps]


def _checkpoint_steps(profiles) -> list:
    """Steps of the complete checkpoints (step_*/complete.json) of the tiny model's runs."""
    folder = profiles / "dev" / "train" / "tiny"
    return sorted(int(p.parent.name.removeprefix("step_"))
                  for p in folder.glob("*.ckpt/step_*/complete.json"))


def _signal_checkpoints(profiles) -> list:
    """Checkpoints written on a signal (not the every-100-steps ones)."""
    return [s for s in _checkpoint_steps(profiles) if s % 100]


def _noted_steps(notes, pattern: str) -> list:
    """The step number in each note that matches `pattern` (one group: the step)."""
    return [int(m.group(1)) for n in notes if (m := re.search(pattern, n))]


RESUMED = r"^resumed from .*step_\d+ \(step (\d+)\)$"
SIGNALLED = r"^warning: SIGUSR2: checkpoint at step (\d+) written; stopping"


@pytest.mark.timeout(1200)  # three Slurm train jobs, one after the other
def test_scancel_then_rerun_continues_the_same_loss_trajectory(slurm_cluster, tmp_path):
    """pp2 over 2 nodes: cancelled once a checkpoint past step 8 exists; the rerun of the same
    command resumes from the last checkpoint and every step's loss is that of an uninterrupted
    run."""
    args = [*TRAIN, *SLURM, "train.pp=2", "train.tp=1", "train.steps=24",
            "train.checkpoint_every=4"]
    reference, profiles = tmp_path / "reference", tmp_path / "profiles"
    run_cli(*args, profiles_dir=reference, check=0, timeout=RUN_S)
    proc = start_cli(*args, profiles_dir=profiles)
    try:
        wait_for(lambda: [s for s in _checkpoint_steps(profiles) if s >= 8], timeout_s=240,
                  every_s=0.2, what="a checkpoint at step 8 or later")
        seen = max(_checkpoint_steps(profiles))
        job_id = ledger(profiles, "dev")[PP2_KEY]["job_id"]
        subprocess.run(["scancel", job_id], check=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, out
    # it returned once the ranks had ended (their SIGTERM checkpoint written, within KillWait)
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                          text=True).stdout.strip() == ""
    assert "cancelled" in out and "rerun the same command" in out, out
    assert ledger(profiles, "dev")[PP2_KEY]["state"] == "cancelled"
    assert not _summaries(profiles)

    run_cli(*args, profiles_dir=profiles, check=0, timeout=RUN_S)
    entry = ledger(profiles, "dev")[PP2_KEY]
    assert entry["state"] == "done" and entry["job_id"] != job_id
    resumed = _only_summary(profiles)
    # From the last checkpoint: at least the one seen; SIGTERM's own one when the ranks wrote
    # it before the kill (they have KillWait, 5 s, after the job is already CANCELLED).
    (resumed_from,) = _noted_steps(resumed["notes"], RESUMED)
    assert seen <= resumed_from < 24
    sigterm = r"^warning: SIGTERM: checkpoint at step (\d+) written; stopping"
    assert _noted_steps(resumed["notes"], sigterm) in ([], [resumed_from]), resumed["notes"]
    uninterrupted = _only_summary(reference)
    assert not [n for n in uninterrupted["notes"] if n.startswith("resumed")]
    assert _losses(resumed) == pytest.approx(_losses(uninterrupted), rel=1e-5)
    assert resumed["layout"] == uninterrupted["layout"]


def test_time_limit_signal_checkpoints_requeues_and_finishes(slurm_cluster, profiles):
    """A run longer than its 1-minute limit: USR2 before the limit, every rank checkpoints at
    the same step, task 0 hands over to submitit (requeue), the other task (on the other node)
    exits quietly; the requeued job resumes from that checkpoint and finishes: complete losses,
    the ledger done.

    Slurm checks time limits every 30 s and signals at the first check with at most
    signal_delay_s + 30 s left: with 5 s, 25 to 55 s into a run (20 s would leave 10 to 40 s,
    about the start-up of the ranks here). 40 steps take a few seconds: the run outlasts its
    limit because the test freezes its ranks after a step (StallUntilWarned, test_slurm.py)
    until the warning; frozen, they burn no CPU while they wait.
    """
    steps = 40
    proc = start_cli(*TRAIN, *SLURM, "train.pp=1", "train.tp=1", f"train.steps={steps}",
                     "train.checkpoint_every=100",
                     "cluster.time_min=1", "cluster.signal_delay_s=5", profiles_dir=profiles)
    stall = StallUntilWarned(lambda: ledger(profiles, "dev").get(PP1_KEY, {}),
                             lambda: ledger(profiles, "dev")[PP1_KEY]["progress"],
                             ledger_lock(profiles))
    try:
        job_id = wait_for(lambda: ledger(profiles, "dev").get(PP1_KEY, {}).get("job_id"),
                           what="the job id in the ledger")
        # Once a run has checkpointed on the signal, the job gets 10 minutes: the resumed run
        # finishes even on a loaded machine.
        at_requeue = _follow_requeues(proc, job_id, lambda: ledger(profiles, "dev")[PP1_KEY],
                                      release_after_s=5,  # the ledger entry at each requeue
                                      extend_when=lambda: _signal_checkpoints(profiles),
                                      each_poll=stall)
        out, _ = proc.communicate(timeout=60)
    finally:
        stall.release()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert stall.warned  # the run that outlasted its limit was one the test froze
    assert at_requeue and _job_runs(job_id) == ["REQUEUED"] * len(at_requeue) + ["COMPLETED"]
    # Nothing was marked failed when the ranks stopped: the stage stays running for the rerun.
    assert all(e["state"] in ("running", "pending") and e["error"] is None for e in at_requeue)
    entry = ledger(profiles, "dev")[PP1_KEY]
    assert (entry["state"], entry["job_id"], entry["error"]) == ("done", job_id, None)
    states = [line.split(": ")[1] for line in out.splitlines()
              if line.startswith(f"  job {job_id}: ")]
    back = [s for s in states[states.index("RUNNING"):] if s in ("REQUEUED", "PENDING")]
    assert back and states[-1] == "COMPLETED", states  # the CLI streamed the requeue

    summary = _only_summary(profiles)
    losses = _losses(summary)
    assert losses[-1] < losses[0]
    # A signal during the training loop leaves a note in the checkpoint it wrote; one during a
    # run's start-up only requeues (submitit's own handler), the next run resumes as well.
    signalled = _noted_steps(summary["notes"], SIGNALLED)
    assert 1 <= len(signalled) <= len(at_requeue), summary["notes"]
    assert 0 < signalled[0] < steps
    resumed = _noted_steps(summary["notes"], RESUMED)
    assert signalled[0] in resumed and set(resumed) <= set(signalled) | {100, 200, 300}, resumed


def test_pp_sweep_writes_a_summary_per_point_and_one_table(slurm_cluster, profiles):
    """`-m ... train.pp=1,2` on Slurm: one job per point, each point's own summary
    (<tag>@pp=<pp>.json), one table comparing measured iteration times."""
    proc = run_cli("-m", *TRAIN, *SLURM, "train.pp=1,2", "train.tp=1", "train.steps=5",
                   profiles_dir=profiles, check=0, timeout=600)
    summaries = _summaries(profiles)
    assert len(summaries) == 2, list(summaries)
    job_ids = set()
    for pp in (1, 2):
        (name,) = [n for n in summaries if n.endswith(f"@pp={pp}.json")]
        summary = summaries[name]
        layout = summary["layout"]
        assert (layout["pp"], layout["tp"], layout["dp"]) == (pp, 1, 2 // pp)
        assert len(_losses(summary)) == 5 and summary["measured"]["iteration_ms"] > 0
        entry = ledger(profiles, "dev")[f"train/tiny/{name[:-len('.json')]}"]
        assert entry["state"] == "done" and entry["job_id"] == summary["provenance"]["job_id"]
        job_ids.add(entry["job_id"])
    assert len(job_ids) == 2  # a job per point

    (sweep_dir,) = (profiles / "dev" / "multirun").iterdir()
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").open()))
    assert [r["point"] for r in rows] == ["train.pp=1", "train.pp=2"]
    assert [r["state"] for r in rows] == ["done", "done"]
    assert all(float(r["measured ms"]) > 0 and float(r["tokens/s"]) > 0
               and float(r["measured peak GiB"]) > 0 and r["job id"] in job_ids for r in rows)
    assert ["pp1" in rows[0]["layout"], "pp2" in rows[1]["layout"]] == [True, True]
    assert "measured ms" in proc.stdout  # the table on the console
