"""Structured configs: the typed shape of everything under conf/.

Registered in Hydra's ConfigStore as `base_config`, which conf/config.yaml lists first in its
defaults, so every group file (cluster, launcher, stage, model) merges into a typed node: a typo
or a wrong type fails at compose time with Hydra's message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from orchestrator.models.config import ModelConfig


@dataclass
class StageChoice:
    # One of orchestrator.stages.STAGES, or "all" / "status".
    name: str = "all"


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm
    mpiexec: str = "mpiexec"  # local: the MPI launcher (the mpich wheel's by default)
    mpiexec_args: List[str] = field(default_factory=list)
    poll_s: float = 1.0  # slurm: how often wait=true polls the job


@dataclass
class ClusterConfig:
    name: str = "local"
    nodes: int = 1
    tasks_per_node: int = 4
    gpus_per_node: int = 0
    backend: str = "gloo"  # gloo (CPU) | nccl (GPU, one rank per GPU)
    # What the ranks run on; the planner reads device_mem_GiB when search.memory_GiB is unset.
    device_mem_GiB: float = 0.0
    # Slurm submission only (not part of the hardware's identity, so not in config hashes).
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 60
    cpus_per_task: int = 1
    mem_GiB: Optional[float] = None  # per node; None: Slurm's default
    mpi_flag: str = "--mpi=pmi2"  # srun's PMI flag; without one MPI sees COMM_WORLD.size == 1
    srun_args: List[str] = field(default_factory=list)
    sbatch_args: Dict[str, Any] = field(default_factory=dict)  # extra #SBATCH key: value
    signal_delay_s: int = 90  # USR2 this long before the time limit (checkpoint + requeue)
    setup: List[str] = field(default_factory=list)  # shell lines run before srun (module load ...)


# Cluster fields that only say how to submit: changing them does not invalidate a profile.
SUBMISSION_ONLY_FIELDS = (
    "partition", "account", "qos", "time_min", "cpus_per_task", "mem_GiB", "mpi_flag",
    "srun_args", "sbatch_args", "signal_delay_s", "setup",
)


@dataclass
class ProfileHardwareConfig:
    # Sub-parts in order; each is a ledger entry, so a rerun redoes only what is not done.
    benchmarks: List[str] = field(default_factory=lambda: [
        "inventory", "allreduce", "p2p", "reduce_scatter", "all_gather", "all2all", "overlap"])
    source: str = "measured"  # measured | analytic (from the cluster sheet, no launch)
    min_size_bytes: int = 1024
    max_size_bytes: Optional[int] = None  # None: 64 MiB on CPU, 256 MiB on GPU
    size_step: int = 4  # multiply the size by this between points
    dtype: Optional[str] = None  # None: float32 on CPU, bfloat16 on GPU
    max_tp: int = 8  # reduce_scatter/all_gather/all2all group sizes up to min(world, max_tp)
    warmup_iters: int = 3
    min_iters: int = 5
    max_iters: int = 200
    max_time_s: float = 1.0  # per point
    stable_spread: float = 0.1  # stop when (p90 - p10) / median is below this
    export: Optional[str] = None  # galvatron: also write Galvatron's hardware files
    plot: bool = True


@dataclass
class ProfileModelConfig:
    seq_lens: List[int] = field(default_factory=list)  # empty: min/max/step below
    min_seq_len: int = 128
    max_seq_len: int = 512
    seq_len_step: int = 128
    max_tp: int = 4
    micro_batch_size: int = 1
    source: str = "auto"  # auto | measured | analytic
    device: str = "cpu"  # conf/device/<name>.yaml sheet for analytic compute time
    warmup_iters: int = 2
    iters: int = 5
    plot: bool = True


@dataclass
class SearchConfig:
    memory_GiB: Optional[float] = None  # per device; None: cluster.device_mem_GiB
    world_size: Optional[int] = None  # None: cluster.nodes * cluster.tasks_per_node
    global_batch_size: int = 8
    seq_len: Optional[int] = None  # None: model.seq_len
    max_tp: int = 8
    max_pp: int = 64
    tp_within_node: bool = True
    zero_stages: List[int] = field(default_factory=lambda: [0, 1, 2, 3])
    recompute: List[str] = field(default_factory=lambda: ["none", "selective", "full"])
    micro_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4])
    schedules: List[str] = field(default_factory=lambda: ["1f1b", "interleaved"])
    virtual_stages: List[int] = field(default_factory=lambda: [2, 4])
    reserve_GiB: float = 2.0  # allocator fragmentation / workspace kept free
    fast_mode: bool = False  # also ORCHESTRATOR_FAST_MODE=1
    top_k: int = 10
    plot: bool = True


@dataclass
class Config:
    stage: StageChoice = field(default_factory=StageChoice)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    profiles_dir: str = "profiles"
    force: bool = False  # redo stages and sub-parts even when the ledger says done
    wait: bool = True  # slurm: wait for the job; false: print the job id and return
    profile_hardware: ProfileHardwareConfig = field(default_factory=ProfileHardwareConfig)
    profile_model: ProfileModelConfig = field(default_factory=ProfileModelConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


def register_configs() -> None:
    """Register the schema; conf/config.yaml puts `base_config` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
