"""Structured configs: the typed shape of everything under conf/.

Registered in Hydra's ConfigStore as `base_config`, which conf/config.yaml lists first in its
defaults, so every group file (cluster, launcher, stage, model) merges into a typed node: a typo
or a wrong type fails at compose time with Hydra's message.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator.choices import (Backend, Dtype, HardwareExport, HardwareSource, LauncherName,
                                  Microbatching, ModelSource, Recompute, Schedule)
from orchestrator.models.config import ModelConfig
from orchestrator.profiling.hardware.benchmarks import BENCHMARKS

# The Hydra config groups ship inside the package, so a wheel install finds them too.
CONF_DIR = Path(__file__).resolve().parent / "conf"


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


# Cluster fields that only say how to submit: changing them does not invalidate a profile.
SUBMISSION_ONLY_FIELDS = (
    "partition", "account", "qos", "time_min", "cpus_per_task", "mem_GiB", "mpi_flag",
    "srun_args", "sbatch_args", "signal_delay_s", "setup",
)


@dataclass
class ProfileHardwareConfig:
    # Sub-parts in order; each is a ledger entry, so a rerun redoes only what is not done.
    benchmarks: List[str] = field(default_factory=lambda: list(BENCHMARKS))
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
    # TP degrees 1, 2, 4, ... up to max_tp; each must divide the model's heads, KV heads, FFN and
    # vocab. None: every degree the model allows, up to the world size (measured) or 8 (analytic).
    max_tp: Optional[int] = None
    micro_batch_size: int = 1
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
    tp_within_node: bool = True
    zero_stages: List[int] = field(default_factory=lambda: [0, 1, 2, 3])
    recompute: List[Recompute] = field(default_factory=lambda: list(Recompute))
    micro_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4])
    schedules: List[Schedule] = field(default_factory=lambda: list(Schedule))
    virtual_stages: List[int] = field(default_factory=lambda: [2, 4])
    # Memory kept free per device: reserve_fraction * budget + reserve_GiB (allocator
    # fragmentation, workspaces, what the planner does not count); what is left must hold the pick.
    # From train's measured peak (docs/gpu.md, "Memory reserve"): measured 31,026 MiB where the
    # planner said 21,363 (x1.452), plus ~1 GiB torch's peak does not see (CUDA context): a pick
    # predicted at P fits B when 1.452 P + 1 <= B, i.e. a reserve B - P >= 0.311 B + 0.69 GiB.
    reserve_fraction: float = 0.32  # in [0, 1)
    reserve_GiB: float = 1.0
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
    zero: Optional[int] = None  # 0: DDP-style, 1/2: sharded optimizer (and grads), 3: FSDP2
    sequence_parallel: Optional[bool] = None  # None: on when tp > 1
    micro_batch_size: Optional[int] = None  # None: 1
    num_micro_batches: Optional[int] = None  # None: global_batch_size / (dp * micro_batch_size)
    global_batch_size: Optional[int] = None  # None: the strategy's, else search.global_batch_size
    schedule: Optional[Schedule] = None  # 1f1b | interleaved
    virtual_stages: Optional[int] = None  # None: 2 for interleaved
    recompute: Optional[Recompute] = None  # the same on every stage; full: the whole stage
    layers_per_stage: Optional[List[int]] = None  # uneven pipeline split
    seq_len: Optional[int] = None  # None: the strategy's, else model.seq_len
    dtype: Optional[Dtype] = None  # None: fp32 on gloo, bf16 on nccl (fp16 adds a loss scale)
    data: Optional[str] = None  # a text file or folder (byte-level tokens); None: synthetic
    # fixed: samples of seq_len tokens; dynamic | padded | packed: variable-length samples
    # (lognormal lengths, mean length_mean, at most seq_len), split per iteration by the dynamic
    # planner (planner/dynamic.py; search.fast_mode applies) or by one of its two baselines.
    microbatching: Microbatching = Microbatching.fixed
    length_mean: Optional[int] = None  # tokens; None: seq_len / 4
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this at the last step
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # <= 0: no clipping
    log_every: int = 1
    timing_warmup_steps: int = 3  # iterations left out of the measured times
    checkpoint_every: int = 50  # steps; also at the last step and at a signal (0: only those)
    keep_checkpoints: int = 2
    load: Optional[str] = None  # start from this checkpoint folder (any layout), not from scratch
    memory_interval_s: float = 0.5  # memory sampler period (<= 0: off)
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

    Configurations are [WORLD_SIZE, PP, TP] (DP = WORLD_SIZE / (PP * TP)), as a list in
    `configs` or as one in world_size/pp/tp (which `-m` can sweep); the rest is shared.
    """

    configs: Optional[List[List[int]]] = None
    world_size: Optional[int] = None
    pp: Optional[int] = None
    tp: Optional[int] = None
    global_batch_size: int = 1024
    micro_batch_size: int = 1
    seq_len: Optional[int] = None  # None: model.seq_len
    sequence_parallel: bool = True  # with tp > 1
    schedule: Schedule = Schedule["1f1b"]
    virtual_stages: int = 2  # interleaved only
    zero: int = 0  # 0: all-reduce gradients; 1: + parameter all-gather; 2: reduce-scatter
    recompute: Recompute = Recompute.none
    layers_per_stage: Optional[List[int]] = None  # uneven pipeline split
    all_ranks: bool = False  # every rank, not one per pipeline stage (small worlds: checking)
    export: Optional[str] = None  # simai: also the SimAI/AICB workload file
    device: str = "h100"  # device sheet for compute times when no model profile covers them
    bucket_MiB: float = 25.0  # data-parallel gradient buckets (train's default)


@dataclass
class NoopConfig:
    sleep_s: float = 0.0  # hold every rank this long (tests of a run in progress)


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
    import_: ImportConfig = field(default_factory=ImportConfig)  # `import.` on the command line
    export: ExportConfig = field(default_factory=ExportConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)


def _field_type(node: type, name: str) -> Optional[type]:
    """The type of dataclass `node`'s field `name`, Optional[X] and List[X] read as X; None when
    `node` is not a dataclass or has no such field."""
    if not dataclasses.is_dataclass(node):
        return None
    hint = typing.get_type_hints(node).get(name)
    while typing.get_origin(hint) in (typing.Union, list, List):  # Optional[X], List[X]
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def choice_type(dotted_key: str, node: type = None) -> Optional[type]:
    """The Choice enum a config key (e.g. "search.schedules") holds, alone, optional or in a
    list; None for any other key. Lets the CLI refuse a bad choice in one line before Hydra."""
    from orchestrator.choices import Choice

    head, _, rest = dotted_key.partition(".")
    hint = _field_type(node or Config, head)
    if hint is None:
        return None
    if rest:
        return choice_type(rest, hint)
    return hint if isinstance(hint, type) and issubclass(hint, Choice) else None


def _is_free_form(hint) -> bool:
    """A Dict field: any key below it is the user's (e.g. cluster.sbatch_args.<flag>)."""
    return hint in (dict, Dict) or typing.get_origin(hint) in (dict, Dict)


def schema_has_key(dotted_key: str, node: type = Config) -> bool:
    """Whether `dotted_key` (e.g. "search.max_tp") names a field of the schema, or a key inside
    one of its free-form Dict fields."""
    head, _, rest = dotted_key.partition(".")
    hint = _field_type(node, head)
    if hint is None:
        return False
    if not rest or _is_free_form(hint):
        return True
    return schema_has_key(rest, hint)


def schema_keys(node: type = Config, prefix: str = "") -> List[str]:
    """Every dotted key of the schema (sections and fields), e.g. "search", "search.max_tp"."""
    keys = []
    for f in dataclasses.fields(node):
        key = prefix + f.name
        keys.append(key)
        hint = _field_type(node, f.name)
        if dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, key + ".")
    return keys


def unknown_key_message(dotted_key: str) -> str:
    """'unknown key <key>; did you mean <closest known key>?' (or where to list the keys)."""
    import difflib

    leaf = dotted_key.rsplit(".", 1)[-1].lower()
    if dotted_key.startswith("model.") and ("expert" in leaf or "moe" in leaf):
        return (f"unknown key {dotted_key}: mixture-of-experts models are not supported yet "
                f"(profile_model, search, train and trace model dense transformers only)")
    close = difflib.get_close_matches(dotted_key, schema_keys(), n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]}?" if close
            else "`python -m orchestrator --cfg job` lists the keys")
    return user_spelling(f"unknown key {dotted_key}; {hint}")


# `import` is a Python keyword, so no dataclass field can be called that: the command line's
# `import.<key>` is the schema's `import_.<key>`. These two convert between the spellings.
def schema_spelling(override: str) -> str:
    """An override as the schema spells it (`import.path=x` -> `import_.path=x`; also with
    `+`, `++` or `~` in front)."""
    return re.sub(r"^([+~]{0,2})import\.", r"\1import_.", override)


def user_spelling(text: str) -> str:
    """An override or a message as the user spells it (`import_.` -> `import.`)."""
    return re.sub(r"(?<![\w.])import_\.", "import.", text)


def register_configs() -> None:
    """Register the schema; conf/config.yaml puts `base_config` first in its defaults."""
    from hydra.core.config_store import ConfigStore  # here: the ranks import this module too

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
