"""The single-host dev Slurm cluster (slurm/dev-cluster.sh) does what the Slurm launcher relies on.

These tests use a running cluster; they do not start one (that takes root and installs packages).
Start it first with `sudo slurm/dev-cluster.sh start`; the tests find it through $SLURM_CONF, else
through `slurm/dev-cluster.sh env`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_CLUSTER = REPO_ROOT / "slurm" / "dev-cluster.sh"
START_HINT = f"start it with: sudo {DEV_CLUSTER.relative_to(REPO_ROOT)} start"


def _slurm_conf() -> str:
    """Returns the path of the dev cluster's slurm.conf: $SLURM_CONF, else what the script says."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    line = subprocess.run(
        ["bash", str(DEV_CLUSTER), "env"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return line.removeprefix("export SLURM_CONF=")


@pytest.fixture(scope="module")
def slurm_env(slurm_cluster) -> dict[str, str]:
    """Environment for Slurm commands; fails (not skips) when the dev cluster is not up."""
    # Inherited SLURM_* variables (a test run inside an allocation) would steer srun into that job.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = _slurm_conf()
    if not Path(env["SLURM_CONF"]).is_file():
        pytest.fail(f"no Slurm config at {env['SLURM_CONF']}: the dev cluster is not set up; "
                    f"{START_HINT}")
    try:
        sinfo = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"],
            env=env, capture_output=True, text=True, timeout=20,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"sinfo failed ({exc}); {START_HINT}")
    states = dict(line.split() for line in sinfo.stdout.splitlines() if line.strip())
    usable = {"idle", "mixed", "allocated", "completing"}
    if sinfo.returncode != 0 or not {"n1", "n2"} <= {n for n, s in states.items() if s in usable}:
        pytest.fail(
            f"the dev Slurm cluster is not up (sinfo rc={sinfo.returncode}, nodes {states}, "
            f"{sinfo.stderr.strip()}); {START_HINT}"
        )
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_status_says_up_and_env_points_at_the_running_cluster(slurm_env):
    # The script's state folder is the one holding the slurm.conf the cluster runs with.
    env = {**slurm_env, "ORCH_SLURM_PREFIX": str(Path(slurm_env["SLURM_CONF"]).parent.parent)}
    status = _run(["bash", str(DEV_CLUSTER), "status"], env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "dev cluster is up" in status.stdout
    printed = _run(["bash", str(DEV_CLUSTER), "env"], env).stdout.strip()
    assert printed == f"export SLURM_CONF={slurm_env['SLURM_CONF']}"


RANK_REPORT = (
    "import json, os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
    "print(json.dumps({'rank': c.Get_rank(), 'size': c.Get_size(), "
    "'node': os.environ['SLURMD_NODENAME'], 'sum': c.allreduce(c.Get_rank())}))"
)


def test_srun_pmi2_gives_one_mpi_world_across_both_nodes(slurm_env):
    result = _run(
        ["srun", "-N2", "-n4", "--ntasks-per-node=2", "--mpi=pmi2", "-t", "1",
         sys.executable, "-c", RANK_REPORT],
        slurm_env,
    )
    assert result.returncode == 0, result.stderr
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert {r["size"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {0 + 1 + 2 + 3}
    assert {r["node"] for r in ranks} == {"n1", "n2"}


def test_srun_without_mpi_flag_gives_singleton_worlds(slurm_env):
    # The cluster keeps MpiDefault=none like most real ones: a launcher that forgets --mpi=pmi2
    # gets size-1 worlds, which it must detect (COMM_WORLD.size != SLURM_NTASKS).
    result = _run(["srun", "-N1", "-n2", "-t", "1", sys.executable, "-c", RANK_REPORT], slurm_env)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["size"] for r in ranks] == [1, 1]


def _sacct_state(job_id: str, env: dict[str, str], timeout_s: float = 15) -> tuple[str, str]:
    """Returns (State, ExitCode) of the job as sacct reports it, once it reports a final state."""
    deadline = time.monotonic() + timeout_s
    state, exit_code = "", ""
    while time.monotonic() < deadline:
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], env).stdout
        if out.strip():
            state, exit_code = out.strip().splitlines()[-1].split("|")
            if state not in {"PENDING", "RUNNING", "COMPLETING"}:
                break
        time.sleep(0.5)
    return state, exit_code


def test_sbatch_job_is_accounted_completed(slurm_env, tmp_path):
    result = _run(
        ["sbatch", "--parsable", "--wait", "-t", "1", "-o", str(tmp_path / "%j.out"),
         "--wrap", "echo hello from $SLURMD_NODENAME"],
        slurm_env,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    assert _sacct_state(job_id, slurm_env) == ("COMPLETED", "0:0")
    assert (tmp_path / f"{job_id}.out").read_text().startswith("hello from n")


def test_failed_sbatch_job_is_accounted_failed_with_its_exit_code(slurm_env, tmp_path):
    result = _run(
        ["sbatch", "--parsable", "--wait", "-t", "1", "-o", str(tmp_path / "%j.out"),
         "--wrap", "exit 3"],
        slurm_env,
    )
    assert result.returncode == 3, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    assert _sacct_state(job_id, slurm_env) == ("FAILED", "3:0")


def test_request_larger_than_the_cluster_is_rejected_at_submit(slurm_env):
    # EnforcePartLimits=ALL: without it this job would pend forever and a waiting launcher hang.
    result = _run(["sbatch", "--parsable", "-N3", "-t", "1", "--wrap", "true"], slurm_env)
    assert result.returncode == 1
    assert result.stderr.strip() == ("sbatch: error: Batch job submission failed: "
                                     "Node count specification invalid"), result.stderr
