"""What a search config may ask, checked before anything runs (ConfigError, exit 2; InvalidLayout
for degrees these ranks or this model cannot hold, which a sweep skips), the planner's
SearchSpace it describes, and the planner's InfeasibleError said back in `search.*` keys."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from orchestrator.config import cluster_world_size
from orchestrator.errors import ConfigError, InvalidLayout

GiB = 2**30


def search_space(cfg):
    """The planner's SearchSpace from the `search` config section (and the cluster's defaults)."""
    from orchestrator.planner import SearchSpace
    from orchestrator.planner.search import auto_max_cp
    from orchestrator.train.plan import engine_options

    s = cfg.search
    memory_GiB = _memory_GiB(cfg)
    options = dataclasses.replace(engine_options(cfg, _reserve_GiB(cfg) * GiB),
                                  moe_imbalance=s.moe_imbalance)
    return SearchSpace(
        world_size=s.world_size or cluster_world_size(cfg.cluster),
        memory_budget_bytes=memory_GiB * GiB, global_batch_size=s.global_batch_size,
        seq_len=s.seq_len or cfg.model.seq_len, max_tp=s.max_tp, max_pp=s.max_pp,
        max_cp=s.max_cp or auto_max_cp(s.seq_len or cfg.model.seq_len),
        cp_comms=tuple(s.cp_comms),
        tp_within_node=s.tp_within_node, zero_stages=tuple(s.zero_stages),
        recompute=tuple(s.recompute),
        micro_batch_sizes=None if s.micro_batch_sizes is None else tuple(s.micro_batch_sizes),
        schedules=tuple(s.schedules), virtual_stages=tuple(s.virtual_stages),
        fast_mode=bool(s.fast_mode), top_k=s.top_k, pp=s.pp, tp=s.tp,
        max_ep=s.max_ep, max_etp=s.max_etp, ep=s.ep, etp=s.etp, options=options)


def _memory_GiB(cfg) -> float:
    """The per-device budget (GiB): search.memory_GiB when given, else the cluster's."""
    s = cfg.search
    return cfg.cluster.device_mem_GiB if s.memory_GiB is None else s.memory_GiB


def _reserve_GiB(cfg) -> float:
    """Memory kept free per device (GiB): search.reserve_fraction x budget + search.reserve_GiB."""
    from orchestrator.planner.cost_model import memory_reserve_GiB

    s = cfg.search
    return memory_reserve_GiB(_memory_GiB(cfg), s.reserve_fraction, s.reserve_GiB)


def _check_memory(cfg) -> None:
    s = cfg.search
    if s.memory_GiB is not None and s.memory_GiB <= 0:
        raise ConfigError(f"search.memory_GiB({s.memory_GiB}) must be > 0 (leave it unset to "
                          f"use cluster.device_mem_GiB={cfg.cluster.device_mem_GiB})")
    memory = _memory_GiB(cfg)
    if not memory or memory <= 0:
        raise ConfigError(f"search needs a memory budget per device: set search.memory_GiB "
                          f"(cluster {cfg.cluster.name!r} has "
                          f"device_mem_GiB={cfg.cluster.device_mem_GiB})")
    if not 0 <= s.reserve_fraction < 1:
        raise ConfigError(f"search.reserve_fraction({s.reserve_fraction}) must be in [0, 1): the "
                          f"share of the budget kept free")
    if s.reserve_GiB < 0:
        raise ConfigError(f"search.reserve_GiB({s.reserve_GiB}) must be >= 0")
    reserve = _reserve_GiB(cfg)
    if reserve >= memory:
        raise ConfigError(f"search.reserve_fraction({s.reserve_fraction}) x {memory} GiB + "
                          f"search.reserve_GiB({s.reserve_GiB}) = {reserve:g} GiB kept free must "
                          f"be below the {memory} GiB per device (search.memory_GiB)")


def _check_degrees(cfg) -> None:
    """Bounds >= 1 (ConfigError); fixed pp/tp that tile the world, split the heads and fit the
    layers (InvalidLayout: a layout these ranks or this model cannot hold, which a sweep skips,
    as a train sweep does)."""
    s, model = cfg.search, cfg.model
    for key in ("max_tp", "max_pp", "max_cp", "pp", "tp"):
        value = getattr(s, key)
        if value is not None and value < 1:
            raise ConfigError(f"search.{key}({value}) must be >= 1")
    world = s.world_size or cluster_world_size(cfg.cluster)
    pp, tp = s.pp or 1, s.tp or 1
    if world % (pp * tp):
        key = "search.pp" if s.pp and world % pp else "search.tp"
        raise InvalidLayout(f"{key}: pp({pp}) * tp({tp}) = {pp * tp} does not divide the "
                            f"{world} devices of the search")
    if s.pp is not None and s.pp > model.layers:
        raise InvalidLayout(f"search.pp({s.pp}) > the {model.layers} layers of model={model.name}")
    if s.tp is not None and (model.heads % s.tp or model.kv_heads % s.tp):
        raise InvalidLayout(f"search.tp({s.tp}) must divide model={model.name}'s heads"
                            f"({model.heads}) and kv_heads({model.kv_heads})")
    _check_experts(cfg)
    if s.tp is not None and s.tp_within_node and cfg.cluster.tasks_per_node % s.tp:
        raise InvalidLayout(f"search.tp({s.tp}) must divide cluster.tasks_per_node"
                            f"({cfg.cluster.tasks_per_node}) (or set search.tp_within_node=false)")


def _check_experts(cfg) -> None:
    """The model's MoE fields (models/config.validate_moe) and the expert degrees asked for:
    ConfigError (a bound) or InvalidLayout (degrees this model cannot hold) naming the numbers,
    before anything runs."""
    from orchestrator.models.config import expert_width, is_moe, validate_moe

    s, model = cfg.search, cfg.model
    for key in ("max_ep", "max_etp", "ep", "etp"):
        value = getattr(s, key)
        if value is not None and value < 1:
            raise ConfigError(f"search.{key}({value}) must be >= 1")
    if s.moe_imbalance is not None and not s.moe_imbalance >= 1:
        raise ConfigError(f"search.moe_imbalance({s.moe_imbalance}) must be >= 1: the busiest "
                          f"expert-parallel rank's load over the mean (null: from "
                          f"model.aux_loss_coef)")
    try:
        validate_moe(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not is_moe(model):
        if (s.ep or 1) * (s.etp or 1) > 1:
            raise InvalidLayout(f"search.ep({s.ep}) / search.etp({s.etp}) need a mixture-of-"
                                f"experts model; model={model.name} is dense (model.experts 0)")
        return
    if s.ep is not None and model.experts % s.ep:
        raise InvalidLayout(f"search.ep({s.ep}) must divide model.experts({model.experts}) of "
                            f"model={model.name}: each EP rank holds experts / ep of them")
    if s.etp is not None and expert_width(model) % s.etp:
        raise InvalidLayout(f"search.etp({s.etp}) must divide the expert FFN width "
                            f"({expert_width(model)}) of model={model.name}")


def _check_overlap(cfg) -> None:
    """Megatron-LM's overlap knobs: for search.engine=megatron only, and
    overlap_param_gather only with overlap_grad_reduce (Megatron-LM refuses it without)."""
    from orchestrator.train.plan import OVERLAP_KNOBS

    s = cfg.search
    given = [key for key in OVERLAP_KNOBS if getattr(s, key) is not None]
    if given and str(s.engine) != "megatron":
        raise ConfigError(f"search.{given[0]} is Megatron-LM's option: set search.engine=megatron "
                          f"(stage=train's engine, search.engine={s.engine}, has no TP overlap and "
                          f"its own gradient sync; see docs/workload.md \"Overlap\")")
    if s.overlap_param_gather and s.overlap_grad_reduce is False:
        raise ConfigError("search.overlap_param_gather=true needs search.overlap_grad_reduce "
                          "(Megatron-LM's --overlap-param-gather requires --overlap-grad-reduce)")


def validate(cfg):
    """The planner's SearchSpace for this config; ConfigError for what cannot be searched."""
    s = cfg.search
    _check_memory(cfg)
    _check_overlap(cfg)
    if (not s.schedules or not s.recompute or not s.zero_stages
            or s.micro_batch_sizes is not None and not s.micro_batch_sizes):
        raise ConfigError("search.schedules, recompute, zero_stages and micro_batch_sizes must "
                          "each allow at least one value (micro_batch_sizes=null: every size "
                          "that divides a replica's batch)")
    if s.world_size is not None and s.world_size < 1:
        raise ConfigError(f"search.world_size({s.world_size}) must be >= 1")
    bad = [z for z in s.zero_stages if z not in (0, 1, 2, 3)]
    if bad:
        raise ConfigError(f"search.zero_stages: unknown {bad}; allowed: [0, 1, 2, 3]")
    if s.global_batch_size < 1 or any(m < 1 for m in s.micro_batch_sizes or ()):
        raise ConfigError(f"search.global_batch_size({s.global_batch_size}) and "
                          f"search.micro_batch_sizes({list(s.micro_batch_sizes)}) must be >= 1")
    _check_degrees(cfg)
    if s.compare is not None and not Path(s.compare).expanduser().is_file():
        raise ConfigError(f"search.compare={s.compare}: no such file (a Galvatron strategy, "
                          f"galvatron_config_*.json)")
    try:  # what the planner itself refuses, before anything is launched
        return search_space(cfg)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"search: {e}") from None


def check_work(cfg, space) -> None:
    """ConfigError (exit 2, before anything runs) when the layouts of `space` may walk more
    micro-batches per iteration than limits.max_micro_batches (limits.check_search)."""
    from orchestrator.limits import check_search

    check_search(cfg.limits, cfg.search, cfg.model, space.world_size, space.max_cp)


def infeasible_advice(err, cfg) -> str:
    """The planner's InfeasibleError said in `search.*` config keys, with a command that gives
    the memory (or batch) the closest layout needs: its own peak plus the reserve of the larger
    budget (budget_for_GiB)."""
    from orchestrator.commands import rerun_command
    from orchestrator.planner.cost_model import budget_for_GiB

    s = cfg.search
    keys = {field: f"search.{'memory_GiB' if field == 'memory_budget_bytes' else field}"
            for field in err.relax}
    relax = dict(err.relax)
    if err.needed_bytes is None:
        advice = "; ".join(f"{keys[field]} {how}" for field, how in relax.items())
        rejected = getattr(err, "rejected", None)
        why = (" (rejected: " + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()))
               + ")" if rejected else "")
        shape = (f"; tp_splits_heads: a TP degree must divide model.heads({cfg.model.heads}), "
                 f"model.kv_heads({cfg.model.kv_heads}) and model.ffn({cfg.model.ffn})"
                 if rejected and rejected.get("tp_splits_heads") else "")
        return (f"no (pp, tp, dp, micro-batch) combination divides search.global_batch_size"
                f"({s.global_batch_size}) on {search_space(cfg).world_size} devices{why}"
                f"{shape}. Relax: {advice}")
    reserve = _reserve_GiB(cfg)
    own_GiB = err.needed_bytes / GiB - reserve
    needed_GiB = math.ceil(budget_for_GiB(own_GiB, s.reserve_fraction, s.reserve_GiB) * 100) / 100
    if "memory_budget_bytes" in relax:
        relax["memory_budget_bytes"] = f">= {needed_GiB:.2f} GiB"
    advice = "; ".join(f"{keys[field]} {how}" for field, how in relax.items())
    fix = rerun_command("search", f"search.memory_GiB={needed_GiB}")
    return (f"no layout of {cfg.model.name} fits search.memory_GiB={_memory_GiB(cfg)} per device "
            f"with {reserve:.2f} GiB of it kept free (search.reserve_fraction={s.reserve_fraction}"
            f" x budget + search.reserve_GiB={s.reserve_GiB}); the closest, "
            f"{err.closest.describe()}, needs {own_GiB:.2f} GiB + that reserve. Relax: {advice}. "
            f"E.g.: {fix}")
