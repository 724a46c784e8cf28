"""Shared test fixtures: run the CLI as a user would, and the dev Slurm cluster.

The Slurm fixture starts slurm/dev-cluster.sh when the cluster is not up, and FAILS (never skips)
when it cannot: Slurm behaviour is part of what the suite promises.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEV_CLUSTER = REPO / "slurm" / "dev-cluster.sh"


def run_cli(*args, profiles_dir, timeout=300, env=None, check=None, cwd=REPO):
    """`python -m orchestrator <args> profiles_dir=<dir>` in `cwd` (the repo: its conf/ is the
    site folder); profiles_dir=None leaves the default. Returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "orchestrator", *args,
           *([f"profiles_dir={profiles_dir}"] if profiles_dir is not None else [])]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check is not None and proc.returncode != check:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode} (wanted {check})\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def one_error_line(proc, code: int) -> str:
    """The CLI's stderr, asserted to be one `error:` line (no traceback) and exit `code`."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def default_sigint() -> None:
    """In a child before exec: SIGINT (and SIGHUP) back to their defaults. A suite started in
    the background of a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and Python
    then never raises KeyboardInterrupt: the tests that send Ctrl-C would hang; under `nohup`
    SIGHUP is ignored, which the CLI keeps ignoring (the tests that send it would hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start_cli(*args, profiles_dir, env=None):
    """The CLI in the background (for tests that interrupt it)."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"profiles_dir={profiles_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True,
                            preexec_fn=default_sigint)


def ledger(profiles_dir, cluster="local") -> dict:
    path = Path(profiles_dir) / cluster / "ledger.json"
    return json.loads(path.read_text())["entries"] if path.exists() else {}


@contextlib.contextmanager
def tiny_disk(folder: Path, size: str):
    """A real, small file system (tmpfs of `size`, e.g. "96k") mounted at `folder`, unmounted
    however the block ends. Mounting needs root: without it the test fails, saying so."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs at {folder} (needs root): "
                    f"{mount.stderr.strip()}")
    try:
        yield folder
    finally:  # lazy: a rank still dying may hold a file open
        subprocess.run(["umount", "--lazy", str(folder)], check=True, capture_output=True)


def fill_disk(folder: Path) -> Path:
    """Write a file in `folder` until its file system is full; returns it."""
    path = folder / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return path


# Groups that start first, longest first (from `--durations` of a full run; the order changes
# only the wall time): the Slurm tests wait on Slurm's own clocks (a 1-minute time limit, 30 s
# checks) and the modules that follow build a measured profile chain or train many layouts.
FIRST = ("slurm-train", "slurm", "test_trust_data", "test_train_cli", "test_train_engine",
         "test_profile_hardware", "test_train_microbatching", "test_profile_model",
         "test_search_stage", "test_plots", "test_trace_symmetry", "test_site_conf")


_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Groups for `pytest -n 3 --dist loadgroup --no-loadscope-reorder` (pytest-xdist; `make
    test` runs it so). The dev Slurm cluster's tests are two groups, each on one worker in
    order: the train jobs (test_train_slurm.py) and the others; its two fake nodes (4 CPUs each)
    hold two 4-task jobs at once, so the groups' waits overlap. Every other test stays with the
    rest of its module, so a module-scoped fixture is built once. Groups in FIRST start first."""
    for item in items:
        if "slurm_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.slurm)
            group = "slurm-train" if item.module.__name__ == "test_train_slurm" else "slurm"
        else:
            group = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group
    rank = {group: i for i, group in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.stash[_GROUP], len(FIRST)))  # stable


@pytest.fixture
def profiles(tmp_path):
    return tmp_path / "profiles"


# stage=all measured on 4 local ranks, small: every benchmark, two lengths, tp <= 2, two steps.
QUICK_HW = ["profile_hardware.max_size_bytes=262144", "profile_hardware.max_time_s=0.05",
            "profile_hardware.size_step=8"]
QUICK_MODEL = ["profile_model.seq_lens=[64,128]", "profile_model.max_tp=2",
               "profile_model.plot=false"]
MEASURED_CHAIN = [*QUICK_HW, *QUICK_MODEL, "search.max_tp=2", "train.steps=2", "train.plot=false"]


@pytest.fixture(scope="session")
def measured_chain(tmp_path_factory) -> Path:
    """The profiles folder of one `stage=all` with MEASURED_CHAIN (about a CPU-minute), made
    once per run even with several xdist workers (a file lock in the run's shared temp folder;
    the first worker builds it, the others wait and reuse it). Read-only: copy it to change it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # An xdist worker's temp folder is inside the run's own one; without xdist it is the run's.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "measured_chain"
    with FileLock(str(shared / "measured_chain.lock")):
        if not (folder / "complete").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed halfway
            run_cli("stage=all", *MEASURED_CHAIN, profiles_dir=folder / "profiles", check=0,
                    timeout=600)
            (folder / "complete").touch()
    return folder / "profiles"


@pytest.fixture
def chain(measured_chain, tmp_path) -> Path:
    """A copy of the measured chain's profiles folder, the test's own."""
    copy = tmp_path / "profiles"
    shutil.copytree(measured_chain, copy)
    return copy


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


# A rank waits this long for its peers (rendezvous, each collective): generous, as the machine
# may be loaded by other jobs; a rank whose peer died still fails instead of hanging.
RANK_TIMEOUT_S = 300.0
# The whole spawn, under pytest-timeout's 600 s (setup.cfg), so a hung launch fails here with the
# ranks named rather than from the plugin's alarm.
SPAWN_TIMEOUT_S = 540.0
# What spawn_ranks' fork server imports before it forks a rank: what the ranks' bodies use. The
# server starts with the environment of the first spawn_ranks call in a worker (the variables
# spawn_ranks sets are the same every time), and its ranks share nothing else with it.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
                      "orchestrator.train.engine")


def _rank_main(rank: int, body, world_size: int, store_path: str, out) -> None:
    """One spawned rank: a gloo process group met through a FileStore, body(rank, out), its
    traceback into out."""
    import datetime
    import faulthandler
    import traceback

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a rank killed by a signal says where it was
    torch.set_num_threads(1)  # the ranks share the machine's 2 cores
    try:
        timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        body(rank, out)
        dist.barrier()
    except BaseException:
        # Written before the group closes: the peers' "connection closed" errors come after it.
        out[f"error on rank {rank}"] = traceback.format_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(body, world_size: int, check: bool = True,
                timeout_s: float = SPAWN_TIMEOUT_S) -> dict:
    """Run body(rank, out) on `world_size` processes (torch.multiprocessing) joined in a gloo
    process group; returns the dict the ranks filled. `body` must be picklable (a module-level
    function, or a functools.partial of one).

    The ranks meet through a FileStore in a fresh temporary folder (no port to pick, so no port
    another process can take first). A rank that raised puts its traceback under
    "error on rank <r>", in the order the ranks failed (the first is the cause, the others
    usually its echo). A rank that died without one (a signal, os._exit), or ranks still running
    after `timeout_s` (then killed), give a line under "error", first. With check=True (the
    default) any error fails the calling test with every message; check=False returns them.
    """
    import multiprocessing
    import shutil
    import tempfile
    import time

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks' own links stay on loopback
    store_dir = tempfile.mkdtemp(prefix="spawn_ranks_")
    # Each rank is forked from a server that imported torch once per xdist worker: a fresh
    # interpreter per rank ("spawn") spent ~3 CPU-s importing it, most of a small test.
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            context = mp.start_processes(
                _rank_main, args=(body, world_size, os.path.join(store_dir, "store"), out),
                nprocs=world_size, join=False, start_method="forkserver")
            spawn_error = None
            deadline = time.monotonic() + timeout_s
            try:
                while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                        spawn_error = (f"ranks {running} of {world_size} still running after "
                                       f"{timeout_s:.0f} s; killed")
                        break
            except ProcessException as e:  # a rank raised, or died (a signal, os._exit)
                if f"error on rank {e.error_index}" not in out.keys():
                    spawn_error = str(e)  # else that rank's own traceback says it better
            finally:
                for process in context.processes:  # none outlives the spawn, whatever happened
                    if process.is_alive():
                        process.kill()
                    process.join()
            result = dict(out)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if spawn_error:
        result = {"error": spawn_error, **result}
    if check:
        errors = [f"{k}: {v}" for k, v in result.items() if str(k).startswith("error")]
        assert not errors, "\n".join(errors)
    return result
