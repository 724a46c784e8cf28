"""Shared test fixtures: run the CLI as a user would, and the dev Slurm cluster.

The Slurm fixture starts slurm/dev-cluster.sh when the cluster is not up, and FAILS (never skips)
when it cannot: Slurm behaviour is part of what the suite promises.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEV_CLUSTER = REPO / "slurm" / "dev-cluster.sh"


def run_cli(*args, profiles_dir, timeout=300, env=None, check=None):
    """`python -m orchestrator <args> profiles_dir=<dir>` in the repo; returns CompletedProcess."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"profiles_dir={profiles_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check is not None and proc.returncode != check:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode} (wanted {check})\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def start_cli(*args, profiles_dir, env=None):
    """The CLI in the background (for tests that interrupt it)."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"profiles_dir={profiles_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True)


def ledger(profiles_dir, cluster="local") -> dict:
    path = Path(profiles_dir) / cluster / "ledger.json"
    return json.loads(path.read_text())["entries"] if path.exists() else {}


@pytest.fixture
def profiles(tmp_path):
    return tmp_path / "profiles"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running dev Slurm cluster (2 fake nodes, accounting); sets SLURM_CONF for the tests."""
    status = subprocess.run(["bash", str(DEV_CLUSTER), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        start = subprocess.run(["bash", str(DEV_CLUSTER), "start"], capture_output=True, text=True,
                               timeout=900)
        if start.returncode != 0:
            pytest.fail(f"the dev Slurm cluster did not start (slurm/dev-cluster.sh start):\n"
                        f"{start.stdout[-3000:]}\n{start.stderr[-3000:]}")
    env_line = subprocess.run(["bash", str(DEV_CLUSTER), "env"], capture_output=True, text=True,
                              check=True).stdout
    for line in env_line.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            os.environ[key] = value.strip().strip('"').strip("'")
    return os.environ.get("SLURM_CONF")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, body, world_size: int, port: int, out) -> None:
    """One spawned rank: a gloo process group, body(rank, out), its traceback into out."""
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        body(rank, out)
        dist.barrier()
    except BaseException:
        out[f"error on rank {rank}"] = traceback.format_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawn_ranks(body, world_size: int) -> dict:
    """Run body(rank, out) on `world_size` processes (torch.multiprocessing) joined in a gloo
    process group; the dict the ranks filled. A rank that failed put its traceback under
    "error on rank <r>": every such traceback fails the calling test."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        try:
            mp.spawn(_rank_main, args=(body, world_size, free_port(), out), nprocs=world_size)
        except mp.ProcessRaisedException:
            pass
        result = dict(out)
    errors = [v for k, v in result.items() if isinstance(k, str) and k.startswith("error")]
    assert not errors, "\n".join(errors)
    return result
