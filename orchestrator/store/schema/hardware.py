"""hardware.json: the cluster, its ranks, benchmark points and alpha-beta fits, overlap."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from orchestrator.choices import Dtype, LinkLayout, Op
from orchestrator.store.schema.header import PartMade, Profile
from orchestrator.records import FieldError, Record, doc


@dataclass(kw_only=True)
class ClusterSummary(Record):
    """The cluster profiled: what the profile claims to be (schema/identity.py says which
    fields every reader compares with its own cluster config, and why the others are not)."""

    name: str = doc("cluster.name", default="cluster")
    nodes: int = doc("nodes profiled", default=1)
    tasks_per_node: int = doc("ranks per node (GPUs per node on a GPU cluster)")
    world_size: Optional[int] = doc("ranks in all; nodes x tasks_per_node when absent",
                                    default=None)
    backend: Optional[str] = doc("torch.distributed backend: gloo | nccl", default=None)
    gpus_per_node: Optional[int] = doc("GPUs per node, 0 on CPU", default=None)

    def __post_init__(self) -> None:
        if self.world_size is None:
            self.world_size = self.nodes * self.tasks_per_node

    def check(self, path: str) -> None:
        if self.tasks_per_node < 1:
            raise FieldError(f"{path}.tasks_per_node", f"must be >= 1, got {self.tasks_per_node}")


@dataclass(kw_only=True)
class InventoryRank(Record):
    """One rank's host and devices (sizes in GiB)."""

    KEEP_NONE = True

    rank: int = doc("global rank")
    host: str = doc("hostname")
    node: Optional[str] = doc("node name (Slurm's, else the host)", default=None)
    node_rank: Optional[int] = doc("index of the node", default=None)
    local_rank: Optional[int] = doc("rank within the node", default=None)
    cpu_model: Optional[str] = doc("CPU model", default=None)
    cpu_count: Optional[int] = doc("CPUs of the host", default=None)
    mem_GiB: Optional[float] = doc("host memory", default=None)
    gpu_model: Optional[str] = doc("GPU model, null on CPU", default=None)
    gpu_mem_GiB: Optional[float] = doc("GPU memory, null on CPU", default=None)
    torch: Optional[str] = doc("torch version", default=None)
    nccl: Optional[str] = doc("NCCL version, null without CUDA", default=None)
    mpi: Optional[str] = doc("MPI library version", default=None)
    extras: Dict[str, Any] = doc("other facts (cpus_usable, ...)", default_factory=dict)


@dataclass(kw_only=True)
class Inventory(Record):
    ranks: List[InventoryRank] = doc("one record per rank", default_factory=list)


@dataclass(kw_only=True)
class BenchPoint(Record):
    """One message size on one group shape. Every rank agrees on the per-sample time (max over
    ranks), so all ranks report the same numbers."""

    op: Op = doc("the collective or p2p")
    group_size: int = doc("ranks per group (p2p: pp, the pipeline depth)")
    layout: LinkLayout = doc("group placement")
    size_bytes: int = doc("per-rank buffer, nccl-tests convention: allreduce/all2all input, "
                          "all_gather output, reduce_scatter input")
    dtype: Dtype = doc("element type of the buffer")
    time_us_median: float = doc("median time per call, us")
    time_us_p10: float = doc("10th percentile, us")
    time_us_p90: float = doc("90th percentile, us")
    algbw_GBps: float = doc("size_bytes / time, GB/s (1 GB = 1e9 B)")
    busbw_GBps: float = doc("algbw x nccl-tests' factor for the op")
    iters: int = doc("calls timed (short messages repeat back to back inside one sample, as "
                     "nccl-tests does); 0 for points computed from fits")


@dataclass(kw_only=True)
class AlphaBetaFit(Record):
    """time_us(size_bytes) = alpha_us + size_bytes / (algbw_GBps * 1e3)."""

    op: Op = doc("the collective or p2p")
    group_size: int = doc("ranks per group (p2p: pp)")
    layout: LinkLayout = doc("group placement")
    alpha_us: float = doc("latency, us")
    algbw_GBps: float = doc("asymptotic algorithm bandwidth, GB/s")
    max_rel_err: Optional[float] = doc("largest relative error over the points; null where "
                                       "Galvatron keeps one number")

    def check(self, path: str) -> None:
        if self.algbw_GBps <= 0:
            raise FieldError(f"{path}.algbw_GBps", f"must be > 0, got {self.algbw_GBps}")


@dataclass(kw_only=True)
class Benchmark(Record):
    points: List[BenchPoint] = doc("measured (or, analytic, computed) points", default_factory=list)
    fits: List[AlphaBetaFit] = doc("one fit per (op, layout, group_size)", default_factory=list)


@dataclass(kw_only=True)
class Overlap(Record):
    """A matmul and an allreduce alone and together."""

    compute_slowdown: Optional[float] = doc("matmul time together / alone; null from Galvatron")
    comm_slowdown: Optional[float] = doc("allreduce time together / alone; null from Galvatron")
    overlap_coe: float = doc("the larger slowdown, >= 1 (Galvatron's overlap_coe)")


@dataclass(kw_only=True)
class HardwareBenchmarks(Record):
    """One section per benchmark run; absent when not run."""

    allreduce: Optional[Benchmark] = doc("group sizes 2, 4, ..., world, consec and strided",
                                         default=None)
    p2p: Optional[Benchmark] = doc("pipeline neighbours for pp = 2, 4, ..., intra and inter",
                                   default=None)
    reduce_scatter: Optional[Benchmark] = doc("consecutive groups up to max_tp", default=None)
    all_gather: Optional[Benchmark] = doc("consecutive groups up to max_tp", default=None)
    all2all: Optional[Benchmark] = doc("consecutive groups up to max_tp", default=None)
    overlap: Optional[Overlap] = doc("compute/communication overlap", default=None)

    def sections(self) -> Iterator[Tuple[str, Benchmark]]:
        """(name, benchmark) of the point-and-fit sections present."""
        for op in Op:
            bench = getattr(self, op.value)
            if bench is not None:
                yield op.value, bench

    def fits(self) -> Iterator[AlphaBetaFit]:
        """Every alpha-beta fit of every section."""
        for _, bench in self.sections():
            yield from bench.fits


@dataclass(kw_only=True)
class HardwareProfile(Profile):
    """profiles/<cluster.name>/hardware.json (written by profile_hardware)."""

    KIND = "hardware"
    kind: str = doc("this file's kind", default="hardware")
    PRODUCER = "profile_hardware"

    cluster: ClusterSummary = doc("the cluster profiled")
    inventory: Optional[Inventory] = doc("ranks' hosts and devices; empty for analytic "
                                         "profiles", default=None)
    benchmarks: HardwareBenchmarks = doc("points and fits per benchmark, overlap")
    parts: Optional[Dict[str, PartMade]] = doc(
        "per sub-part (inventory, each benchmark): the settings it "
                                     "was made under", default=None)
    sheet: Optional[Dict[str, Any]] = doc("analytic only: the link figures the numbers come "
                                          "from (LinkSheet)", default=None)
