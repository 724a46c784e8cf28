"""What a stage sees on its rank: who it is, where it runs, and how to talk to the other ranks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

# The longest a waiting rank sleeps between two looks at its peers (adds at most this to a sync).
QUIET_POLL_MAX_S = 0.002


def quiet_wait(comm) -> None:
    """Return once every rank of `comm` has called this, sleeping while it waits.

    MPICH polls at full speed inside a blocking collective, so ranks waiting for a slower peer
    (rank 0 writing results, a late start) each burn a core; with more ranks than cores (a local
    run, a shared node) that spin slows the very rank they wait for. A non-blocking barrier
    tested with a growing sleep waits without it; the collective that follows is then quick.
    """
    request = comm.Ibarrier()
    sleep_s = 1e-4
    while not request.Test():
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, QUIET_POLL_MAX_S)


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    node_name: str
    node_of_rank: List[int]  # node_rank of every global rank (intra/inter-node decisions)
    hostnames: List[str]  # the host of every global rank (provenance, rendezvous)
    backend: str  # gloo | nccl | none (a single in-process rank without torch.distributed)
    # torch.device, or a name ("cpu") made one on first read: an in-process stage (search, an
    # analytic profile) that never reads it does not import torch (1.6 s of every CLI call).
    device_spec: Any
    job_id: Optional[str] = None
    comm: Any = field(default=None, repr=False)  # mpi4py COMM_WORLD, None in-process

    @property
    def device(self):
        if isinstance(self.device_spec, str):
            import torch

            self.device_spec = torch.device(self.device_spec)
        return self.device_spec

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> Optional[list]:
        """Every rank's obj, in rank order, on rank 0 (None elsewhere), over MPI."""
        if self.comm is None:
            return [obj]
        quiet_wait(self.comm)
        return self.comm.gather(obj, root=0)

    def bcast(self, obj):
        """Rank 0's obj on every rank, over MPI."""
        if self.comm is None:
            return obj
        quiet_wait(self.comm)
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        if self.comm is not None:
            quiet_wait(self.comm)
