"""Structured configs: the typed shape of everything under conf/.

Registered in Hydra's ConfigStore as `base_config`, which conf/config.yaml lists first in its
defaults, so every group file (cluster, launcher, stage, model) merges into a typed node: a typo
or a wrong type fails at compose time with Hydra's message.

Where the group files come from (the package's conf/, the user's site folder) is
conf_folders.py; the schema read key by key (types, spellings, the CLI's checks) is
config_keys.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.choices import (BENCHMARK_NAMES, Backend, CpComm, Dtype, Engine,
                                  HardwareExport, HardwareSource, LauncherName, Microbatching,
                                  ModelSource, Recompute, Schedule)
# CONF_DIR: the folder of the group files this schema types, asked of this module too.
from orchestrator.conf_folders import CONF_DIR, register_site_search_path  # noqa: F401
from orchestrator.limits import LimitsConfig
from orchestrator.models.config import ModelConfig


@dataclass
class StageChoice:
    # One of orchestrator.stages.STAGES, or "all" / "status".
    name: str = "all"


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.local
    mpiexec: str = "mpiexec"  # local: the MPI launcher (the mpich wheel's by default)
    mpiexec_args: List[str] = field(default_factory=list)
    poll_s: float = 1.0  # slurm: how often wait=true polls the job


@dataclass
class LinkSheetConfig:
    """Published link figures, for `profile_hardware.source=analytic` (clusters too big to profile).

    Defaults: DGX/HGX H100, NVLink 4 + NVSwitch (nccl-tests allreduce busbw ~450 GB/s), 8 x 400 Gb/s
    InfiniBand NDR per node.
    """

    intra_busbw_GBps: float = 450.0
    intra_p2p_GBps: float = 370.0
    nics_per_node: int = 8
    nic_Gbps: float = 400.0
    inter_efficiency: float = 0.9
    intra_latency_us: float = 3.0
    inter_latency_us: float = 8.0
    overlap_coe: float = 1.2
    dtype: Dtype = Dtype.bf16


@dataclass
class ClusterConfig:
    name: str = "local"
    nodes: int = 1
    tasks_per_node: int = 4
    gpus_per_node: int = 0
    backend: Backend = Backend.gloo  # nccl: one rank per GPU
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
    links: LinkSheetConfig = field(default_factory=LinkSheetConfig)


def cluster_world_size(cluster) -> int:
    """Ranks of the whole cluster: nodes x tasks per node."""
    return int(cluster.nodes) * int(cluster.tasks_per_node)


def local_cannot_reach(launcher: LauncherName, nodes: int) -> bool:
    """True when `launcher` is the local one, which runs on this machine only, and `nodes` is
    not 1."""
    return launcher == LauncherName.local and nodes != 1


# Cluster fields that only say how to submit: changing them does not invalidate a profile.
SUBMISSION_ONLY_FIELDS = (
    "partition", "account", "qos", "time_min", "cpus_per_task", "mem_GiB", "mpi_flag",
    "srun_args", "sbatch_args", "signal_delay_s", "setup",
)


@dataclass
class ProfileHardwareConfig:
    # Sub-parts in order; each is a ledger entry, so a rerun redoes only what is not done.
    benchmarks: List[str] = field(default_factory=lambda: list(BENCHMARK_NAMES))
    source: HardwareSource = HardwareSource.measured  # analytic: from cluster.links, no launch
    min_size_bytes: int = 1024
    max_size_bytes: Optional[int] = None  # None: 64 MiB on CPU, 256 MiB on GPU
    size_step: int = 4  # multiply the size by this between points
    dtype: Optional[Dtype] = None  # None: fp32 on CPU, bf16 on GPU
    max_tp: int = 8  # reduce_scatter/all_gather/all2all group sizes up to min(world, max_tp)
    max_group: Optional[int] = None  # allreduce group sizes up to this (None: the world)
    max_pp: Optional[int] = None  # p2p pipeline degrees up to this (None: the world)
    warmup_iters: int = 3
    min_iters: int = 5
    max_iters: int = 100
    max_time_s: float = 0.25  # per point (the largest sizes run min_iters anyway)
    rel_spread: float = 0.1  # stop when (p90 - p10) / median is below this (0: never early)
    export: Optional[HardwareExport] = None  # galvatron: also write Galvatron's hardware files
    plot: bool = True


@dataclass
class ProfileModelConfig:
    # Sequence lengths profiled: this list, or min_seq_len..max_seq_len by seq_len_step.
    seq_lens: List[int] = field(default_factory=list)
    min_seq_len: int = 128
    max_seq_len: Optional[int] = None  # None: model.seq_len
    seq_len_step: Optional[int] = None  # None: about 4 points from min to max (multiples of 32)
    # TP degrees 1, 2, 4, ... up to max_tp; each must divide the model's heads, KV heads and FFN
    # (the vocabulary is padded for it). None: every degree the model allows, up to the world size
    # (measured) or 8 (analytic).
    max_tp: Optional[int] = None
    micro_batch_size: int = 1
    # GPU (measured): micro-batch sizes whose parts are timed with host and device apart (tp 1;
    # sizes past the GPU's memory are left out); empty: not told apart.
    micro_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    source: ModelSource = ModelSource.auto  # analytic: FLOPs + device sheet, exact memory
    device: Optional[str] = None  # conf/device/<name>.yaml for analytic times; None: cpu (gloo), h100 (nccl)
    warmup_iters: int = 2
    iters: int = 5
    plot: bool = True


@dataclass
class SearchConfig:
    memory_GiB: Optional[float] = None  # per device; None: cluster.device_mem_GiB
    world_size: Optional[int] = None  # None: cluster.nodes * cluster.tasks_per_node
    global_batch_size: int = 8
    seq_len: Optional[int] = None  # None: model.seq_len
    # Fixed degrees (None: searched). A fixed degree wins over its bound: search.tp=4 with
    # max_tp=2 searches tp=4. pp * tp must divide the world; the rest (dp, ZeRO, SP,
    # micro-batching, schedule, recompute, partition) is searched for that pair.
    pp: Optional[int] = None
    tp: Optional[int] = None
    max_tp: int = 8  # >= 1
    max_pp: int = 64  # >= 1
    # Context parallelism (each sequence split over cp ranks) up to max_cp (None: seq_len //
    # 4096, each rank keeping at least 4K tokens; so none below 8K), in the flavours of
    # cp_comms (p2p, a2a, allgather: both engines run each).
    max_cp: Optional[int] = None  # >= 1
    cp_comms: List[CpComm] = field(default_factory=lambda: [CpComm.p2p, CpComm.a2a])  # cp > 1
    # Mixture-of-experts models (model.experts > 0): expert parallelism up to max_ep and expert
    # tensor parallelism up to max_etp, folded onto each stage's tp x cp x dp ranks; ep / etp
    # fix them (None: searched). Dense models ignore these.
    max_ep: int = 1024  # >= 1
    max_etp: int = 1  # >= 1
    ep: Optional[int] = None
    etp: Optional[int] = None
    # The busiest EP rank's token copies over the mean (>= 1), what its experts and all-to-alls
    # are priced at; None: 1.1 for model.aux_loss_coef >= 1e-2, 1.2 from 1e-3, 1.3 below, 1.0
    # with a capacity factor (workload/moe.default_imbalance). Recorded in the strategy's notes.
    moe_imbalance: Optional[float] = None
    tp_within_node: bool = True
    zero_stages: List[int] = field(default_factory=lambda: [0, 1, 2, 3])
    recompute: List[Recompute] = field(default_factory=lambda: list(Recompute))
    # None: every size that divides a data-parallel replica's batch (pruned by memory); a list
    # (e.g. [1, 2]): only those
    micro_batch_sizes: Optional[List[int]] = None
    schedules: List[Schedule] = field(default_factory=lambda: list(Schedule))
    virtual_stages: List[int] = field(default_factory=lambda: [2, 4])
    # Memory kept free per device: reserve_fraction * budget + reserve_GiB (what the planner
    # does not count); what is left must hold the pick. The planner counts every tensor byte of
    # stage=train's engine (workload/memory.py); left are the search's closed form, up to 5.0%
    # under the exact walk of the workload model, the CUDA caching allocator's slack (reserved
    # 4.3% above allocated at the peak of the one-GPU bf16 run) and what torch does not see (CUDA
    # context, cuBLAS workspace, NCCL buffers: ~1 GiB). A pick predicted at P then fits B when
    # P / 0.95 x 1.043 + 1 <= B, i.e. a reserve B - P >= 0.089 B + 0.91 GiB (docs/gpu.md).
    reserve_fraction: float = 0.10  # in [0, 1)
    reserve_GiB: float = 1.0
    # The engine the pick will run on, whose communication and memory are priced (workload/):
    # orchestrator (stage=train) or megatron (the Megatron-LM export).
    engine: Engine = Engine.orchestrator
    # Megatron-LM's overlap options, priced for engine=megatron and written into the Megatron
    # export (planner/terms/tp_comm.py, zero.py; docs/workload.md "Overlap"): null is on, as
    # Megatron-LM's published runs use them (its own command-line defaults are off).
    # stage=train's engine has none of them (no TP overlap; its own gradient sync rule).
    tp_comm_overlap: Optional[bool] = None  # --tp-comm-overlap (userbuffers; SP layouts only)
    overlap_grad_reduce: Optional[bool] = None  # --overlap-grad-reduce (bucketed gradient sync)
    overlap_param_gather: Optional[bool] = None  # --overlap-param-gather (ZeRO 1/2's all-gather)
    # A Galvatron strategy (galvatron_config_*.json) to price with our cost model and print next
    # to our best, term by term.
    compare: Optional[str] = None
    fast_mode: bool = False  # also ORCHESTRATOR_FAST_MODE=1
    top_k: int = 10
    plot: bool = True


@dataclass
class TrainConfig:
    """`stage=train`: the layout search wrote (strategy/<model>.layout.json), or an explicit one.

    Giving train.pp or train.tp makes the layout explicit (dp derived, the other fields from here
    or their defaults); otherwise the strategy's layout is used with any field set here changed.
    """

    steps: int = 30
    pp: Optional[int] = None
    tp: Optional[int] = None
    # Context parallelism: each sequence split over cp ranks; seq_len must cut into 2 * cp * tp
    # equal pieces. cp_comm: how attention reaches the other ranks' K/V, p2p (a ring of sends,
    # the default), allgather, a2a (Ulysses) or a2a+p2p (Ulysses over cp_a2a ranks, the ring
    # across; models/context_parallel.py); None: the strategy's, else p2p.
    cp: Optional[int] = None
    cp_comm: Optional[CpComm] = None
    cp_a2a: Optional[int] = None  # a2a+p2p: the all-to-all degree inside the CP group
    # Mixture-of-experts models: experts split over ep ranks (all-to-all token dispatch), each
    # expert's width over etp; the expert grid folds onto the tp x dp ranks of a stage
    # (ParallelLayout). None: the strategy's, else 1.
    ep: Optional[int] = None
    etp: Optional[int] = None
    zero: Optional[int] = None  # 0: DDP-style, 1/2: sharded optimizer (and grads), 3: FSDP2
    sequence_parallel: Optional[bool] = None  # None: on when tp > 1
    micro_batch_size: Optional[int] = None  # None: 1
    num_micro_batches: Optional[int] = None  # None: global_batch_size / (dp * micro_batch_size)
    global_batch_size: Optional[int] = None  # None: the strategy's, else search.global_batch_size
    schedule: Optional[Schedule] = None  # 1f1b | interleaved
    virtual_stages: Optional[int] = None  # None: 2 for interleaved
    recompute: Optional[Recompute] = None  # the same on every stage; full: the whole stage
    layers_per_stage: Optional[List[int]] = None  # uneven pipeline split
    # A layout file ({"layout": ..., "seq_len": ...}, the form of strategy/<model>.layout.json)
    # to train instead of the strategy's; train.* fields still change it.
    layout: Optional[str] = None
    seq_len: Optional[int] = None  # None: the strategy's, else model.seq_len
    dtype: Optional[Dtype] = None  # None: fp32 on gloo, bf16 on nccl (fp16 adds a loss scale)
    # torch.compile each block (models/compile.py): auto (on CUDA ranks, off on CPU ranks),
    # true, false; profile_model times the block the same way.
    compile: str = "auto"
    data: Optional[str] = None  # a text file or folder (byte-level tokens); None: synthetic
    # fixed: samples of seq_len tokens; dynamic | padded | packed: variable-length samples
    # (lognormal lengths, mean length_mean, at most seq_len), split per iteration by the dynamic
    # planner (planner/dynamic.py; search.fast_mode applies) or by one of its two baselines.
    microbatching: Microbatching = Microbatching.fixed
    length_mean: Optional[int] = None  # tokens; None: seq_len / 4
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this at the last step
    warmup_steps: Optional[int] = None  # <= steps; None: 5, or steps if fewer (train/lr.py)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    log_every: int = 1
    timing_warmup_steps: int = 3  # iterations left out of the measured times
    checkpoint_every: int = 50  # steps; also at the last step and at a signal (0: only those)
    keep_checkpoints: int = 2  # 0: none written, not even at the end (a timing run)
    load: Optional[str] = None  # start from this checkpoint folder (any layout), not from scratch
    memory_interval_s: float = 0.5  # memory sampler period (0: off)
    memory_GiB: Optional[float] = None  # budget for the pre-launch check; None: the cluster's
    allow_oom_risk: bool = False  # launch even when the planner says the layout does not fit
    plot: bool = True


@dataclass
class ImportConfig:
    """`stage=import import.path=<dir>`: another tool's profiles into ours (the command line's
    `import.` is this section; `import` is a Python keyword, so the schema spells it import_)."""

    path: Optional[str] = None  # the directory of files (Galvatron: hardware and/or model)
    format: str = "auto"  # auto: recognised from the files; galvatron


@dataclass
class ExportConfig:
    """`stage=export export.path=<dir>`: our profiles and strategy in another tool's files."""

    path: Optional[str] = None  # the folder to write into (made if missing)
    format: str = "galvatron"


@dataclass
class TraceConfig:
    """`stage=trace`: one iteration's workload per rank at a fake world size (orchestrator/trace).

    Configurations are [WORLD_SIZE, PP, TP], [WORLD_SIZE, PP, TP, CP] (DP = WORLD_SIZE /
    (PP * TP * CP)) or, for a mixture-of-experts model, [WORLD_SIZE, PP, TP, CP, EP(, ETP)], as a
    list in `configs` or as one in world_size/pp/tp (+ cp, ep, etp; which `-m` can sweep); the
    rest is shared.
    """

    configs: Optional[List[List[int]]] = None
    world_size: Optional[int] = None
    pp: Optional[int] = None
    tp: Optional[int] = None
    global_batch_size: int = 1024
    micro_batch_size: int = 1
    seq_len: Optional[int] = None  # None: model.seq_len
    sequence_parallel: bool = True  # with tp > 1
    # Context parallelism of a configuration given as [WS, PP, TP] (a 4th entry overrides it),
    # and how attention reaches the other CP ranks' tokens (Megatron's --cp-comm-type):
    # p2p (ring), allgather, a2a (Ulysses), a2a+p2p (hierarchical).
    cp: int = 1
    cp_comm: CpComm = CpComm.p2p
    cp_a2a: int = 1  # a2a+p2p: the all-to-all degree inside the CP group (the ring over cp/it)
    # Mixture-of-experts models (model.experts > 0): expert parallelism (experts / ep per rank,
    # all-to-all token dispatch) and expert tensor parallelism (each expert's width over etp)
    # of a configuration that gives none; the expert grid folds onto a stage's tp x cp x dp ranks.
    ep: int = 1
    etp: int = 1
    schedule: Schedule = Schedule["1f1b"]
    virtual_stages: int = 2  # interleaved only
    zero: int = 0  # 0: all-reduce gradients; 1: reduce-scatter + parameter all-gather; 2: as 1, freed
    recompute: Recompute = Recompute.none
    layers_per_stage: Optional[List[int]] = None  # uneven pipeline split
    all_ranks: bool = False  # every rank, not one per pipeline stage (small worlds: checking)
    export: Optional[str] = None  # simai: also the SimAI/AICB workload file
    device: str = "h100"  # device sheet for compute times when no model profile covers them
    bucket_MiB: float = 25.0  # data-parallel gradient buckets (train's default)


@dataclass
class TuneConfig:
    """`stage=tune`: after search, train its `top_k` best layouts and (controls) the best pure-dp,
    tp-heavy and pp-heavy layouts for a few steps each, fit the cluster's calibration to what
    they measured, and make the measured fastest the layout stage=train trains."""

    top_k: int = 3  # the predicted best layouts to run (>= 1)
    controls: bool = True  # also the best of each other family (pure dp, tp-heavy, pp-heavy)
    steps: int = 10  # train steps per candidate
    timing_warmup_steps: int = 3  # of them, left out of the measured time
    min_runs: int = 3  # successful runs needed to fit the factors (else uncalibrated)
    plot: bool = True


@dataclass
class NoopConfig:
    sleep_s: float = 0.0  # hold every rank this long (tests of a run in progress)


@dataclass
class InitConfig:
    """`stage=init`, on a Slurm login node: conf/cluster/<name>.yaml written from what Slurm says
    (into the site folder), then a check of the cluster with it (docs/stages/init.md)."""

    name: Optional[str] = None  # the file's and the cluster's name; None: Slurm's ClusterName
    partition: Optional[str] = None  # None: the default partition
    nodes: Optional[int] = None  # None: the partition's idle nodes
    tasks_per_node: Optional[int] = None  # None: one per GPU; CPU nodes: min(CPUs, 4)
    account: Optional[str] = None  # sbatch --account, where the site wants one
    setup: List[str] = field(default_factory=list)  # cluster.setup: shell lines before srun
    max_time_min: int = 60  # cluster.time_min: the partition's MaxTime, at most this
    preflight: bool = True  # check the cluster once the file is written
    preflight_only: bool = False  # only check the cluster that cluster=<name> names
    preflight_nodes: int = 2  # nodes of the check job (at most cluster.nodes)
    preflight_time_min: int = 5  # the check job's time limit: a hung MPI start-up ends then


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
    train: TrainConfig = field(default_factory=TrainConfig)
    noop: NoopConfig = field(default_factory=NoopConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    init: InitConfig = field(default_factory=InitConfig)
    import_: ImportConfig = field(default_factory=ImportConfig)  # `import.` on the command line
    export: ExportConfig = field(default_factory=ExportConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # bounds on work (limits.py)


def register_configs() -> None:
    """Register the schema (conf/config.yaml puts `base_config` first in its defaults) and the
    site folder's place in Hydra's search path (once per process)."""
    from hydra.core.config_store import ConfigStore  # here: the ranks import this module too

    ConfigStore.instance().store(name="base_config", node=Config)
    register_site_search_path()
