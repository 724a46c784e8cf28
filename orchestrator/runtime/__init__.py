"""The one rank bootstrap: MPI tells each rank who it is; torch.distributed is set up from that.

`run_rank(request)` is what every rank runs, whoever launched it (mpiexec here, srun under
submitit, through `launch.slurm.RankJob`). `run_inprocess(request)` runs a single-rank stage in
the calling process.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import importlib
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from orchestrator.errors import LaunchError
from orchestrator.runtime.context import RankContext, quiet_wait
from orchestrator.runtime.request import StageRequest
from orchestrator.runtime.stage_run import StageRun
from orchestrator.store import DISK_FULL, write_json
from orchestrator.store.ledger import reserve_path
from orchestrator.startup import collector_paused
from orchestrator.store.owner import pid_alive

log = logging.getLogger("orchestrator.runtime")

# Set by the local launcher: "<pid>:<start ticks>" of the CLI the ranks must not outlive.
PARENT_ENV = "ORCHESTRATOR_PARENT_PID"
PARENT_POLL_S = 0.5
# How long a rank waits for its peers: at the rendezvous, and in each collective.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
# Set by the shell each local rank runs under (launch.local): its pid.
RANK_SHELL_ENV = "ORCHESTRATOR_RANK_SHELL"
# A peer's socket closed under a torch.distributed collective (gloo's words): the peer died.
# Its rank shell records the signal that killed it (launch/local.RANK_SHELL) within
# milliseconds; this rank's Abort must not end that shell first, or the error names this rank.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
PEER_LOST_GRACE_S = 1.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# libc, loaded once here: a forked child about to exec (subprocess's preexec_fn) must not load a
# library, which could wait forever on a lock another thread held at the fork.
_LIBC = ctypes.CDLL(None, use_errno=True)


def _job_id() -> Optional[str]:
    if "SLURM_JOB_ID" in os.environ:
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]
    return None


def _node_name() -> str:
    # Fake Slurm nodes share a host: SLURMD_NODENAME tells them apart.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def check_world_size(mpi_size: int, expected: int) -> None:
    """Fail with the fix when MPI's world is not the one the stage asked for. Every task finds
    it on its own, before any communication, so any task may record it (`every_rank`): srun
    stops the others when the first one exits, task 0 too when it is the slowest."""
    if mpi_size == expected:
        return
    ntasks = int(os.environ.get("SLURM_NTASKS", "0") or 0)
    if mpi_size == 1 and ntasks > 1:
        error = LaunchError(
            f"MPI sees COMM_WORLD.size == 1 but Slurm started {ntasks} tasks: srun lacks a PMI "
            f"flag, so every task is its own MPI world. Set cluster.mpi_flag='--mpi=pmi2' "
            f"(what the mpich wheel speaks) or your site's PMI flag.")
    else:
        error = LaunchError(f"MPI world size {mpi_size} != the {expected} ranks the stage "
                            f"needs (cluster.nodes * cluster.tasks_per_node)")
    error.every_rank = True
    raise error


def cpu_threads(hostnames: list, rank: int) -> int:
    """Intra-op threads for a CPU rank: the CPUs it may run on, shared by every rank of its
    host. Oversubscribed threads slow everything down (2 ranks x 2 threads on 2 cores made a
    step 3x slower); ranks of fake Slurm nodes share one host, so count hosts, not nodes."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (usable or 1) // hostnames.count(hostnames[rank]))


def _master_addr(hostnames: list) -> str:
    """Where rank 0's rendezvous listens, reachable from every rank.

    One host: loopback. Several: rank 0's host name as DNS knows it (not gethostbyname of it,
    which is 127.0.1.1 on stock Debian). MASTER_ADDR in the environment wins.
    """
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if len(set(hostnames)) == 1:
        return "127.0.0.1"
    return socket.getfqdn()


def _rendezvous_store(comm, rank: int, size: int, hostnames: list):
    """The TCPStore every rank meets at: (store, its address, its port).

    Rank 0 opens it on a port the OS picks and keeps it bound (a port picked, released, then
    bound again could be taken in between); MPI tells the other ranks the port. When rank 0
    cannot open it, every rank raises instead of waiting for a store that will not come.
    """
    import torch.distributed as dist

    if rank == 0:
        addr = _master_addr(hostnames)
        try:
            # wait_for_workers=False: the others learn the port only after this returns.
            store = dist.TCPStore(host_name=addr, port=0, world_size=size, is_master=True,
                                  timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
            endpoint = (addr, store.port, None)
        except Exception as e:  # told to every rank below, then raised here too
            store, endpoint = None, (addr, None, f"{type(e).__name__}: {e}")
    quiet_wait(comm)  # the others wait while rank 0 opens the store
    addr, port, error = comm.bcast(endpoint if rank == 0 else None, root=0)
    if error is not None:
        raise LaunchError(f"rank 0 could not open the torch.distributed rendezvous on {addr}: "
                          f"{error}. Set MASTER_ADDR to an address of rank 0's host that every "
                          f"rank can reach.")
    if rank != 0:
        store = dist.TCPStore(host_name=addr, port=port, world_size=size, is_master=False,
                              timeout=RENDEZVOUS_TIMEOUT)
    return store, addr, port


# MPICH's shared memory between the ranks of a host: a file in /dev/shm (`mpich_shm_<id>_<node>`)
# that only MPI_Finalize removes, so every run that ends otherwise (an abort, a Ctrl-C, a kill)
# left 4 MiB of a login node's memory behind.
_MPICH_SHM = re.compile(r"/dev/shm/mpich_\S+")


def forget_shm_names() -> list:
    """Unlink the /dev/shm files MPICH mapped into this process; returns their paths.

    Call once MPI_Init has returned: every rank of the host has then mapped the segment (MPICH
    returns from it only once each of them has), and MPICH looks a segment up by its name only
    to map it. The memory stays while a rank maps it and goes with the last of them,
    however they end; only files this process maps are touched, never another run's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return []
    paths = sorted(set(_MPICH_SHM.findall(maps)))
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:  # a peer of this host was first
            pass
    return paths


def bootstrap(world_size: int, backend: str = "gloo", torch_distributed: bool = True,
              job_id: Optional[str] = None) -> RankContext:
    """Join MPI, check the world size, and initialise torch.distributed on this rank.

    Sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT) so code written for torchrun runs unchanged.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    forget_shm_names()
    rank, size = comm.Get_rank(), comm.Get_size()
    check_world_size(size, world_size)

    quiet_wait(comm)  # ranks start at different times on a loaded machine
    # One exchange tells every rank where all ranks run: node (fake Slurm nodes share a host) and host.
    node_names, hostnames = map(list, zip(*comm.allgather((_node_name(), socket.gethostname()))))
    order = list(dict.fromkeys(node_names))  # nodes in order of their first rank
    node_of_rank = [order.index(n) for n in node_names]
    node_rank = node_of_rank[rank]
    local_rank = node_of_rank[:rank].count(node_rank)
    local_world_size = node_of_rank.count(node_rank)

    context = dict(rank=rank, world_size=size, local_rank=local_rank,
                   local_world_size=local_world_size, node_rank=node_rank, num_nodes=len(order),
                   node_name=node_names[rank], node_of_rank=node_of_rank, hostnames=hostnames,
                   job_id=job_id or _job_id(), comm=comm)
    if not torch_distributed:
        return RankContext(backend="none", device_spec=None, **context)

    import torch
    import torch.distributed as dist

    store, addr, port = _rendezvous_store(comm, rank, size, hostnames)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(node_rank),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))

    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("cluster.backend=nccl but this rank sees no GPU; use backend=gloo "
                              "or request GPUs (cluster.gpus_per_node)")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(hostnames, rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=RENDEZVOUS_TIMEOUT)
    return RankContext(backend=backend, device_spec=device, **context)


def die_with_parent(sig: int) -> bool:
    """Have the kernel send this process `sig` when its parent dies, however it dies; returns
    False when the parent is already gone (the call came too late to cover it)."""
    expected = os.getppid()
    _LIBC.prctl(_PR_SET_PDEATHSIG, sig)
    return os.getppid() == expected


def die_with_rank_shell() -> None:
    """A local rank: die with the shell that waits for it (launch.local), which mpiexec kills
    with every other rank when one fails; exit at once if that shell is already gone."""
    shell = os.environ.get(RANK_SHELL_ENV)
    if shell and not (die_with_parent(signal.SIGKILL) and os.getppid() == int(shell)):
        os._exit(1)


def watch_parent() -> None:
    """Local ranks: when the CLI that launched them is gone (killed, even with -9), end the
    launch's process group (mpiexec and every rank) so no rank runs on and writes the ledger.
    Not under Slurm: there the job outlives the CLI on purpose (wait=false)."""
    pid, _, start = os.environ.get(PARENT_ENV, "").partition(":")
    if not pid:
        return
    start_ticks = int(start) if start.isdigit() else None

    def watch():
        while pid_alive(int(pid), start_ticks):
            time.sleep(PARENT_POLL_S)
        log.error("the orchestrator command (pid %s) is gone; stopping this launch", pid)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _setup_logging(request: StageRequest, rank: int) -> None:
    Path(request.run_dir).mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(Path(request.run_dir) / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    root = logging.getLogger("orchestrator")
    root.setLevel(logging.INFO)
    # The rank's log only: a stage run in the CLI's own process (one task, e.g. an analytic
    # profile) would also print each line through Hydra's console handler, beside its own.
    root.propagate = False
    for old in [h for h in root.handlers if getattr(h, "orchestrator_rank_log", False)]:
        root.removeHandler(old)  # one log file per launch, also when tests run stages in-process
        old.close()
    handler.orchestrator_rank_log = True
    root.addHandler(handler)


def _run_stage(request: StageRequest, ctx: RankContext):
    from orchestrator.commands import set_user_overrides
    from orchestrator.stages import get_stage

    set_user_overrides(request.plan.user_overrides)  # the fix commands the stage's errors print
    spec = get_stage(request.stage)
    run = StageRun(request, ctx)
    result = spec.run(ctx, run)
    if ctx.is_root:
        run.finish(result)
        write_json(request.result_path, {"ok": True, "result": result, "job_id": ctx.job_id,
                                         "ended": time.time()})
    return result


def record_failure(request: StageRequest, message: str, error: BaseException,
                   disk_full: bool = False) -> None:
    """Rank 0's error line and exit code in the result file: the launcher shows the user this
    line (and exits with the error's own code), not only "job failed". On a full disk the
    ledger's reserve makes room (store.ledger): rank 0 then marks the ledger entry failed
    itself first, while the room is there (the ranks' logs would fill it before the launcher
    gets to it), and the small result file goes in what the reserve left."""
    if disk_full:
        from orchestrator.store.ledger import Ledger, State

        try:
            Ledger(request.ledger_dir).mark_ended(request.ledger_key, State.failed,
                                                  request.todo, message)
        except OSError:
            pass  # the launcher tries again and says so when it cannot
    write_json(request.result_path, {"ok": False, "error": message, "ended": time.time(),
                                     "exit_code": getattr(error, "exit_code", None)},
               reserve=reserve_path(request.ledger_dir))


def _as_file_error(error: BaseException, request: StageRequest, rank: int) -> BaseException:
    """An OSError on a file the stage writes (a full disk, a read-only folder) as the CLI words
    it: the file, the cause, and on a full disk the room the stage needs (rank 0 estimates it);
    any other error as it is."""
    if not isinstance(error, OSError) or not error.filename:
        return error
    from orchestrator.errors import file_error
    from orchestrator.stages import disk_need_text

    full = error.errno in DISK_FULL and rank == 0
    need = disk_need_text([request.stage], request.config) if full else ""
    return file_error(error, request.config.profiles_dir, need)


def _import_for_stage(stage: str) -> None:
    from orchestrator.stages import get_stage

    for module in get_stage(stage).rank_imports:
        importlib.import_module(module)


def run_rank(request: StageRequest):
    """Run the stage on this rank (every rank calls this); rank 0 returns the stage's result.

    On an error the rank logs it and aborts the whole MPI job, so no rank waits forever in a
    collective for a peer that is gone.
    """
    rank = int(os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "0")))
    _setup_logging(request, rank)
    # A crash inside torch's or gloo's C++ code (a segfault) leaves every thread's Python stack
    # on the rank's stderr (its log), instead of only "task 0: Segmentation fault" from srun.
    faulthandler.enable(all_threads=True)
    if request.launcher == "local":
        watch_parent()
    ctx = None
    try:
        with collector_paused():  # a short dp4 train on tiny: 25% less CPU
            ctx = bootstrap(request.world_size, request.backend,
                            request.torch_distributed, request.job_id)
            _import_for_stage(request.stage)
        log.info("rank %d/%d on %s (node %d, local rank %d), backend %s", ctx.rank,
                 ctx.world_size, ctx.node_name, ctx.node_rank, ctx.local_rank, ctx.backend)
        result = _run_stage(request, ctx)
        ctx.barrier()
        if ctx.backend != "none":
            import torch.distributed as dist

            dist.destroy_process_group()
        return result if ctx.is_root else None
    except SystemExit:
        # submitit's signal handler on task 0 (the job is checkpointed and requeued, RankJob;
        # the requeued job overwrites what this one left), or a stage stopping on SIGTERM
        # (train's checkpoint), which a scancel sends too: not a failure of the rank.
        log.warning("rank %d: stopped by a signal from Slurm (a time limit or a preemption "
                    "requeues the job, a scancel ends it)", rank)
        raise
    except BaseException as e:
        error = _as_file_error(e, request, rank)
        msg = f"rank {rank}: {type(error).__name__}: {error}"
        log.error("%s\n%s", msg, traceback.format_exc())
        print(msg, file=sys.stderr, flush=True)
        if rank == 0 or getattr(error, "every_rank", False):  # the same line from any task
            try:
                record_failure(request, msg, error,
                               disk_full=getattr(e, "errno", None) in DISK_FULL)
            except OSError as unwritten:  # still abort: the other ranks must not wait for us
                print(f"rank 0: {unwritten}; the launcher reports the exit code only",
                      file=sys.stderr, flush=True)
        if ctx is not None and ctx.world_size > 1:
            if any(words in str(e) for words in PEER_LOST):
                time.sleep(PEER_LOST_GRACE_S)
            ctx.comm.Abort(1)
        raise


def run_inprocess(request: StageRequest):
    """Run a single-rank stage here, without MPI or torch.distributed (e.g. search)."""
    _setup_logging(request, 0)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      num_nodes=1, node_name=_node_name(), node_of_rank=[0],
                      hostnames=[socket.gethostname()], backend="none",
                      device_spec="cpu", job_id=_job_id())
    return _run_stage(request, ctx)
