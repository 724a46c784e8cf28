"""Real jobs on the dev Slurm cluster (slurm/dev-cluster.sh: nodes n1, n2 on this host) via submitit."""
from __future__ import annotations

import json
import re
import subprocess
import time


from conftest import ledger, run_cli, start_cli

SLURM = ["launcher=slurm", "cluster=dev", "launcher.poll_s=0.5"]


def _wait_for(predicate, timeout_s=120, every_s=0.5, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _sacct(job_id, fields="State,NNodes,NTasks"):
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", fields],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out.split("|") if out else []


def test_sbatch_script_carries_the_cluster_config(tmp_path):
    """The generated sbatch text, checked as text (no cluster needed)."""
    import submitit
    from omegaconf import OmegaConf

    from orchestrator.config import ClusterConfig
    from orchestrator.launch.slurm import executor_parameters

    cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig), {
        "nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4, "partition": "gpu", "account": "ml",
        "qos": "high", "time_min": 30, "srun_args": ["--cpu-bind=none"],
        "sbatch_args": {"exclusive": True}, "setup": ["module load cuda"]})
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(**executor_parameters(cluster, ranks="cluster", name="orch-x", after="41"))
    text = executor._executor._make_submission_file_text("python -u -m x", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --account=ml", "#SBATCH --qos=high",
                 "#SBATCH --time=30", "#SBATCH --dependency=afterok:41",
                 "#SBATCH --kill-on-invalid-dep=yes", "#SBATCH --exclusive", "module load cuda",
                 "#SBATCH --job-name=orch-x"):
        assert line in text, line
    assert "srun --unbuffered --output" in text and "--mpi=pmi2 --cpu-bind=none" in text
    one = executor_parameters(cluster, ranks="one", name="orch-search")
    assert (one["nodes"], one["tasks_per_node"]) == (1, 1) and "gpus_per_node" not in one


def test_inventory_on_2_nodes_x_2_tasks(slurm_cluster, profiles):
    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[inventory]", *SLURM,
                   profiles_dir=profiles, check=0)
    assert "submitted Slurm job" in proc.stdout
    profile = json.loads((profiles / "dev" / "hardware.json").read_text())
    ranks = profile["inventory"]["ranks"]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    entry = ledger(profiles, "dev")["profile_hardware"]
    assert entry["state"] == "done" and entry["job_id"].isdigit()
    assert profile["provenance"]["job_id"] == entry["job_id"]
    assert _sacct(entry["job_id"], "State")[0] == "COMPLETED"


def test_missing_pmi_flag_is_explained(slurm_cluster, profiles):
    proc = run_cli("stage=noop", *SLURM, "cluster.mpi_flag='--mpi=none'", profiles_dir=profiles)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "COMM_WORLD.size == 1" in proc.stderr and "cluster.mpi_flag='--mpi=pmi2'" in proc.stderr
    assert ledger(profiles, "dev")["noop"]["state"] == "failed"


def test_wait_false_returns_at_once_and_status_reattaches(slurm_cluster, profiles):
    proc = run_cli("stage=noop", *SLURM, "wait=false", profiles_dir=profiles, check=0)
    job_id = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)
    assert ledger(profiles, "dev")["noop"]["state"] in ("pending", "running", "done")

    def noop_row_in_status():
        out = run_cli("stage=status", "cluster=dev", profiles_dir=profiles, check=0).stdout
        rows = [line for line in out.splitlines() if "│ noop " in line]
        return rows and "done" in rows[0] and rows[0]

    row = _wait_for(noop_row_in_status, what="status to report the noop job done")
    assert job_id in row
    assert ledger(profiles, "dev")["noop"]["state"] == "done"


def test_sweep_submits_one_job_per_point_with_its_own_resources(slurm_cluster, profiles):
    proc = run_cli("-m", "stage=noop", *SLURM, "wait=false", "cluster.nodes=1,2",
                   "cluster.tasks_per_node=1", profiles_dir=profiles, check=0)
    job_ids = re.findall(r"submitted Slurm job (\d+)", proc.stdout)
    assert len(job_ids) == 2, proc.stdout
    states = {j: _wait_for(lambda j=j: (s := _sacct(j)) and s[0] == "COMPLETED" and s,
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

        _wait_for(inventory_done, timeout_s=180, every_s=0.2, what="inventory done, allreduce running")
        job_id = ledger(profiles, "dev")["profile_hardware"]["job_id"]
        subprocess.run(["scancel", job_id], check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, out
    assert "cancelled" in out and "rerun the same command to resume" in out
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


def test_all_submits_an_afterok_chain(slurm_cluster, profiles):
    quick = ["profile_hardware.max_size_bytes=65536", "profile_hardware.max_time_s=0.05",
             "profile_hardware.size_step=16",
             "profile_hardware.benchmarks=[inventory,allreduce,p2p,reduce_scatter,all_gather,overlap]",
             "profile_model.seq_lens=[64,128,192]", "profile_model.max_tp=2", "search.max_tp=2"]
    proc = run_cli("stage=all", *SLURM, "wait=false", *quick, profiles_dir=profiles, check=0)
    job_ids = re.findall(r"submitted Slurm job (\d+)", proc.stdout)
    assert len(job_ids) == 3, proc.stdout
    _wait_for(lambda: all(_sacct(j, "State")[:1] == ["COMPLETED"] for j in job_ids), timeout_s=600,
              every_s=2, what="the three jobs to complete")
    for before, after in zip(job_ids, job_ids[1:]):  # afterok: each started after the last ended
        assert _sacct(after, "Start")[0] >= _sacct(before, "End")[0]
        script = next((profiles / "dev" / "runs").glob(f"*/*/submitit/{after}_submission.sh"))
        assert f"#SBATCH --dependency=afterok:{before}" in script.read_text()
    run_cli("stage=status", "cluster=dev", profiles_dir=profiles, check=0)
    entries = ledger(profiles, "dev")
    assert [entries[k]["state"] for k in ("profile_hardware", "profile_model/tiny", "search/tiny")] == ["done"] * 3
    assert (profiles / "dev" / "strategy" / "tiny.json").exists()
    # The chain recorded the hashes a later plan computes: nothing runs again.
    proc = run_cli("stage=all", *SLURM, *quick, profiles_dir=profiles, check=0)
    assert proc.stdout.count("skipping (force=true redoes it)") == 3, proc.stdout


def test_analytic_model_profile_runs_as_one_task(slurm_cluster, profiles):
    """A single-process stage (no MPI world, no process group) as a one-task job."""
    run_cli("stage=profile_model", *SLURM, "model=qwen_100b", "profile_model.plot=false",
            "profile_model.seq_lens=[4096,8192]", profiles_dir=profiles, check=0, timeout=300)
    profile = json.loads((profiles / "dev" / "model" / "qwen_100b.json").read_text())
    assert profile["source"] == "analytic"
    entry = ledger(profiles, "dev")["profile_model/qwen_100b"]
    assert entry["state"] == "done" and _sacct(entry["job_id"], "NNodes,AllocCPUS") == ["1", "1"]
