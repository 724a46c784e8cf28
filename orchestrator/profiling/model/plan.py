"""What profile_model runs: the source (measured or analytic), sequence lengths, TP degrees and
device sheet, validated against the model and the cluster before anything is launched.

A point is one (sequence length, TP degree), named `seq<S>_tp<T>` (a ledger sub-part); a
mixture-of-experts model adds the sub-part `moe` (its FFN's parts, profiling/model/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


from orchestrator.config import cluster_world_size
from orchestrator.errors import ConfigError
from orchestrator.limits import check_profile_points
from orchestrator.models.config import ModelConfig, validate_model
from orchestrator.profiling.model import analytic
from orchestrator.models.config import dense_twin
from orchestrator.profiling.model.moe import MoeCase, moe_cases

SEQ_ROUND = 32  # default sweep lengths are multiples of this (sequence parallelism splits them)
ANALYTIC_MAX_TP = 8  # default largest TP degree when nothing runs: one node of 8 GPUs


@dataclass(frozen=True)
class ProfilePlan:
    """The points to profile (sequence lengths x TP degrees), where their numbers come from and
    why."""

    source: str  # measured | analytic
    reason: str  # why that source (printed)
    seq_lens: Tuple[int, ...]
    tps: Tuple[int, ...]
    device: str  # device sheet name (conf/device/<device>.yaml)
    # A mixture-of-experts model's FFN parts (sub-part MOE_PART, profiling/model/moe.py); () dense.
    moe_cases: Tuple[MoeCase, ...] = ()

    def points(self) -> List[Tuple[int, int]]:
        """(seq_len, tp) in run order: TP degree outermost (one set of groups at a time)."""
        return [(s, t) for t in self.tps for s in self.seq_lens]

    def subparts(self) -> List[str]:
        """The ledger sub-parts: a point_name per point, then MOE_PART for a MoE model."""
        return [point_name(s, t) for s, t in self.points()] + ([MOE_PART] if self.moe_cases
                                                               else [])


MOE_PART = "moe"  # the sub-part timing a MoE model's FFN parts


def point_name(seq_len: int, tp: int) -> str:
    """The sub-part name of a point: "seq<seq_len>_tp<tp>"."""
    return f"seq{seq_len}_tp{tp}"


def parse_point(name: str) -> Tuple[int, int]:
    """(seq_len, tp) from a point_name."""
    seq, tp = name.split("_")
    return int(seq[len("seq"):]), int(tp[len("tp"):])


def sweep_seq_lens(pm, model_seq_len: int) -> List[int]:
    """Sequence lengths to profile: profile_model.seq_lens, else min..max by step (max: the
    model's seq_len), the max always included; without a step, 4 evenly spaced lengths (the
    inner two multiples of 32)."""
    if pm.seq_lens:
        return sorted({int(s) for s in pm.seq_lens})
    lo, hi = _length_range(pm, model_seq_len)
    step = pm.seq_len_step
    if step is None:  # 4 evenly spaced lengths, inner ones rounded to multiples of SEQ_ROUND
        inner = [lo + i * (hi - lo) / 3 for i in (1, 2)]
        return sorted({lo, hi, *(max(SEQ_ROUND, round(x / SEQ_ROUND) * SEQ_ROUND) for x in inner)})
    if step < 1:
        raise ConfigError(f"profile_model.seq_len_step({step}) must be >= 1")
    seqs = list(range(lo, hi + 1, int(step)))
    if seqs[-1] != hi:
        seqs.append(hi)
    return seqs


def _length_range(pm, model_seq_len: int) -> Tuple[int, int]:
    """(shortest, longest) length of profile_model's min..max sweep."""
    hi = int(pm.max_seq_len or model_seq_len)
    return min(int(pm.min_seq_len), hi), hi


def seq_len_count(pm, model_seq_len: int) -> int:
    """How many lengths sweep_seq_lens lists, without listing them (a step of 1 over a long
    model would list millions)."""
    if pm.seq_lens or pm.seq_len_step is None or pm.seq_len_step < 1:
        return len(set(pm.seq_lens)) or 4
    lo, hi = _length_range(pm, model_seq_len)
    lengths = range(lo, hi + 1, int(pm.seq_len_step))
    return len(lengths) + (lengths[-1] != hi)


def _is_gpu(cfg) -> bool:
    return cfg.cluster.backend == "nccl"


def _gpu_reachable(cfg) -> bool:
    """Whether ranks launched for this cluster would see a GPU: always under Slurm (the nodes
    decide), with the local launcher only if this machine has one."""
    if not _is_gpu(cfg) or cfg.launcher.name != "local":
        return True
    import torch

    return torch.cuda.is_available()


def _default_device(cfg) -> str:
    """The device sheet when profile_model.device is unset: a sheet named in the cluster's name
    (dgx_a100 -> a100), else cpu for a gloo cluster and h100 for an nccl one."""
    if not _is_gpu(cfg):
        return "cpu"
    cluster = str(cfg.cluster.name).lower()
    named = [d for d in analytic.device_sheets() if d != "cpu" and d in cluster]
    return named[0] if named else "h100"


def plan_profile(cfg) -> ProfilePlan:
    """Validate profile_model against the model and the cluster; what the stage will run.

    Raises ConfigError with the model's own message for a shape that cannot be split over a TP
    degree, and names the setting to change otherwise.
    """
    pm = cfg.profile_model
    model = cfg.model
    try:
        validate_model(model)
    except ValueError as e:
        raise ConfigError(f"model={model.name}: {e}") from None
    for key in ("micro_batch_size", "iters", "min_seq_len"):
        if getattr(pm, key) < 1:
            raise ConfigError(f"profile_model.{key}({getattr(pm, key)}) must be >= 1")
    if int(pm.warmup_iters) < 0:
        raise ConfigError(f"profile_model.warmup_iters({pm.warmup_iters}) must be >= 0")
    if pm.max_seq_len is not None and not 1 <= pm.max_seq_len <= model.seq_len:
        raise ConfigError(f"profile_model.max_seq_len({pm.max_seq_len}) must be >= 1 and <= "
                          f"model.seq_len({model.seq_len}) of model={model.name}")
    check_profile_points(cfg.limits, seq_len_count(pm, model.seq_len),  # before listing them
                         f"profile_model.seq_len_step={pm.seq_len_step}" if pm.seq_len_step
                         else "profile_model.seq_lens")
    seqs = sweep_seq_lens(pm, model.seq_len)
    if any(s < 1 or s > model.seq_len for s in seqs):
        raise ConfigError(f"profile_model.seq_lens {seqs}: lengths must be >= 1 and <= "
                          f"model.seq_len({model.seq_len}) of model={model.name}")
    device = pm.device or _default_device(cfg)
    sheet = analytic.load_device_sheet(device)
    analytic.peak_flops(sheet, model.dtype)  # the sheet must know the model's dtype
    source, reason = analytic.choose_source(
        pm.source, dense_twin(model), max(seqs), int(pm.micro_batch_size), _is_gpu(cfg),
        float(cfg.cluster.device_mem_GiB), int(cfg.cluster.tasks_per_node),
        gpu_reachable=_gpu_reachable(cfg))
    if source == "measured" and _is_gpu(cfg) and not _gpu_reachable(cfg):
        raise ConfigError("profile_model.source=measured on a GPU cluster (backend nccl) with "
                          "launcher=local, but this machine has no GPU: use launcher=slurm, "
                          "or profile_model.source=analytic")
    world = cluster_world_size(cfg.cluster)
    if pm.max_tp is not None:
        tps = _requested_tps(model, seqs, int(pm.max_tp), source, world)
    else:
        cap = world if source == "measured" else ANALYTIC_MAX_TP
        tps = [tp for tp in _powers_of_two(cap)
               if (source == "analytic" or world % tp == 0) and _fits_tp(model, seqs, tp)]
    return ProfilePlan(source=source, reason=reason, seq_lens=tuple(seqs), tps=tuple(tps),
                       device=device,
                       moe_cases=tuple(moe_cases(model, seqs, tps, int(pm.micro_batch_size))))


def _requested_tps(model: ModelConfig, seqs: List[int], max_tp: int, source: str,
                   world: int) -> List[int]:
    """TP degrees 1, 2, 4, ... up to profile_model.max_tp; ConfigError naming the setting to
    change when one cannot split the model, a length or (measured) the cluster's ranks."""
    if max_tp < 1:
        raise ConfigError(f"profile_model.max_tp({max_tp}) must be >= 1")
    if source == "measured" and max_tp > world:
        raise ConfigError(f"profile_model.max_tp({max_tp}) > the cluster's {world} ranks: "
                          f"measured TP groups need that many ranks; lower max_tp or use "
                          f"profile_model.source=analytic")
    tps = _powers_of_two(max_tp)
    for tp in tps:
        try:  # the shape first (a length tp divides), then each profiled length
            validate_model(analytic.model_for_point(model, tp), tp)
        except ValueError as e:
            raise ConfigError(f"profile_model.max_tp={max_tp} with model={model.name}: {e}; "
                              f"lower profile_model.max_tp") from None
        bad = [s for s in seqs if s % tp]
        if bad:
            raise ConfigError(f"profile_model: sequence lengths {bad} are not divisible by "
                              f"tp({tp}) (sequence parallelism splits them); change "
                              f"profile_model.seq_lens or lower profile_model.max_tp")
    bad = [tp for tp in tps if world % tp] if source == "measured" else []
    if bad:
        raise ConfigError(f"TP degrees {bad} do not divide the cluster's {world} ranks: "
                          f"groups of tp ranks must tile the world")
    return tps


def _powers_of_two(cap: int) -> List[int]:
    tps, tp = [], 1
    while tp <= cap:
        tps.append(tp)
        tp *= 2
    return tps


def _fits_tp(model: ModelConfig, seqs: List[int], tp: int) -> bool:
    try:
        for s in seqs:
            validate_model(analytic.model_for_point(model, s), tp)
        return True
    except ValueError:
        return False
