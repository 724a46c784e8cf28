"""The search's space: what SearchSpace allows, and every config (tp, pp, dp, cp, ep, ZeRO, micro-batch
size, schedule, ...) of it that divisibility, the model and the cluster permit, with the reason
each other one is rejected. The exact search (search.py) optimises partitions and recompute
per config."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


from orchestrator import errors
from orchestrator.choices import CpComm, Engine, Recompute, Schedule
from orchestrator.planner.cost_model import ConfigKey, CostOptions
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.terms import MODE_NAMES



@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from. Memory in bytes per device, sequences for the batch."""

    world_size: int
    memory_budget_bytes: float
    global_batch_size: int
    seq_len: int
    max_tp: int = 8
    max_pp: int = 64
    tp_within_node: bool = True
    zero_stages: Tuple[int, ...] = (0, 1, 2, 3)
    recompute: Tuple[Recompute, ...] = tuple(Recompute)
    # None: every size that divides a replica's batch (micro_batch_sizes_for)
    micro_batch_sizes: Optional[Tuple[int, ...]] = None
    schedules: Tuple[Schedule, ...] = tuple(Schedule)
    virtual_stages: Tuple[int, ...] = (2, 4)
    sequence_parallel: Tuple[bool, ...] = (True, False)
    fast_mode: bool = False
    top_k: int = 10
    options: CostOptions = CostOptions()
    pp: Optional[int] = None  # fixed degrees (None: searched); a fixed one ignores max_pp/max_tp
    tp: Optional[int] = None
    # Context parallelism: cp up to max_cp (divisors of the world / tp), in the flavours
    # cp_comms the engine runs (options.engine: Megatron-LM's all four; stage=train's p2p,
    # allgather and a2a; a2a+p2p at every all-to-all degree). search.max_cp's default is
    # auto_max_cp(seq_len).
    max_cp: int = 1
    cp_comms: Tuple[CpComm, ...] = (CpComm.p2p, CpComm.a2a)
    # Mixture-of-experts models (ModelCost.moe): expert parallelism ep up to max_ep and expert
    # tensor parallelism etp up to max_etp, folded onto each stage's tp x cp x dp ranks
    # (ep x etp dividing them, ep the experts, etp the expert width); fixed ep / etp (None:
    # searched) win over their bounds. Ignored for dense models (ep = etp = 1).
    max_ep: int = 1024
    max_etp: int = 1
    ep: Optional[int] = None
    etp: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("zero_stages", "recompute", "micro_batch_sizes", "schedules",
                     "virtual_stages", "sequence_parallel", "cp_comms"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.world_size < 1 or self.global_batch_size < 1 or self.seq_len < 1:
            raise errors.ConfigError(
                f"search space needs world_size, global_batch_size and seq_len >= 1, got "
                f"{self.world_size}, {self.global_batch_size}, {self.seq_len}")
        if self.memory_budget_bytes <= 0:
            raise errors.ConfigError(f"memory_budget_bytes must be > 0, got "
                                     f"{self.memory_budget_bytes}")
        bad = [m for m in self.recompute if m not in MODE_NAMES]
        if bad or not self.recompute:
            raise errors.ConfigError(f"recompute modes must be a non-empty subset of "
                                     f"{MODE_NAMES}, got {self.recompute}")
        bad = [c for c in self.cp_comms if c not in tuple(CpComm)]
        if bad or not self.cp_comms:
            raise errors.ConfigError(f"cp_comms must be a non-empty subset of {tuple(CpComm)}, "
                                     f"got {self.cp_comms}")
        for name in ("max_ep", "max_etp", "ep", "etp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise errors.ConfigError(f"{name}({value}) must be >= 1")
        bad = [s for s in self.schedules if s not in tuple(Schedule)]
        if bad or not self.schedules:
            raise errors.ConfigError(f"schedules must be a non-empty subset of "
                                     f"{tuple(Schedule)}, got {self.schedules}")
        # As members: the configs and layouts the search builds carry them.
        for name, kind in (("recompute", Recompute), ("schedules", Schedule),
                           ("cp_comms", CpComm)):
            object.__setattr__(self, name, tuple(kind(v) for v in getattr(self, name)))


# ====================================================================== configs
def _divisors(n: int) -> List[int]:
    """The divisors of n, ascending (pairs up to sqrt(n): a world of 10**9 devices stays fast)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def micro_batch_sizes_for(space: SearchSpace, per_replica: int) -> List[int]:
    """The micro-batch sizes searched for a replica of `per_replica` sequences: the space's
    list when it has one, as given (a size not dividing them is rejected later, as the user
    asked for it), else every divisor of `per_replica` (mbs 8 of 8 included: on a GPU the
    largest that fits is often the fastest). Sizes that cannot fit are pruned by the search's
    memory bound, not here."""
    if space.micro_batch_sizes is None:
        return _divisors(per_replica)
    return list(space.micro_batch_sizes)


def _degree_allowed(degree: int, fixed: Optional[int], bound: int) -> bool:
    """A fixed degree wins over its bound: only it is allowed, even above the bound."""
    return degree == fixed if fixed is not None else degree <= bound


# Auto max_cp: each CP rank keeps at least this many tokens of a sequence (Llama 3 ran 128K at
# CP16, 8K per rank; at 128K, cp32 (4K) still prices faster for qwen_100b, with a third of the
# recompute: bench/long_context.py; shorter shares leave the ring little attention to hide
# its sends behind).
MIN_CP_TOKENS = 4096


def auto_max_cp(seq_len: int) -> int:
    """search.max_cp when not given: seq_len // MIN_CP_TOKENS, at least 1 (no CP below 8K)."""
    return max(1, seq_len // MIN_CP_TOKENS)


def enumerate_configs(model: ModelCost, hardware: HardwareModel, space: SearchSpace,
                      rejected: Dict[str, int]) -> List[ConfigKey]:
    """All configs of the space that pass the divisibility rules; counts the others in
    `rejected` by reason."""
    def reject(reason: str, count: int = 1) -> None:
        rejected[reason] = rejected.get(reason, 0) + count

    W, L = space.world_size, model.layers
    schedules = space.schedules[:1] if space.fast_mode else space.schedules
    moe = model.moe
    all2all_profiled = any(op == "all2all" for op, _ in hardware.measured)
    configs = []
    for tp in _divisors(W):
        if not _degree_allowed(tp, space.tp, space.max_tp):
            continue
        # The model's shape first, as validate_model splits it (heads, KV heads, FFN columns;
        # the vocabulary is padded to a multiple of tp, models/config.vocab_rows): no profile
        # helps; profile_model refuses such a TP degree.
        if model.heads % tp or model.kv_heads % tp or model.ffn % tp:
            reject("tp_splits_heads")
            continue
        if tp not in model.tps:
            reject("tp_not_profiled")
            continue
        if space.tp_within_node and (tp > hardware.tasks_per_node
                                     or hardware.tasks_per_node % tp):
            reject("tp_crosses_node")
            continue
        for cp in _divisors(W // tp):
            if cp > space.max_cp:
                continue
            if cp > 1 and space.seq_len % (2 * cp * tp):
                reject("cp_splits_sequence")
                continue
            for cp_comm, a2a in _cp_flavours(space.cp_comms if cp > 1 else (CpComm.p2p,), cp):
                # Ulysses' share of the heads
                split = {CpComm.a2a: cp, CpComm["a2a+p2p"]: a2a}.get(cp_comm, 1)
                if model.heads % (tp * split) or model.kv_heads % (tp * split):
                    reject("cp_a2a_splits_heads")
                    continue
                if split > 1 and not all2all_profiled:
                    reject("cp_a2a_not_profiled")
                    continue
                for pp in _divisors(W // (tp * cp)):
                    if not _degree_allowed(pp, space.pp, space.max_pp):
                        continue
                    if pp > L:
                        reject("pp_exceeds_layers")
                        continue
                    grids = _expert_grids(moe, space, tp * cp * (W // (tp * cp * pp)), reject,
                                          all2all_profiled)
                    configs += _batch_configs(space, schedules, L, W, tp, (cp, cp_comm, a2a),
                                              pp, reject, grids, moe is not None)
    return configs


def _expert_grids(moe, space: SearchSpace, stage_ranks: int, reject,
                  all2all_profiled: bool = True) -> List[Tuple[int, int]]:
    """(ep, etp) of every expert grid that folds onto a stage's `stage_ranks` = tp x cp x dp
    ranks: ep x etp dividing them, ep the experts, etp the expert width; [(1, 1)] for a dense
    model."""
    if moe is None:
        return [(1, 1)]
    grids = []
    for ep in _divisors(stage_ranks):
        if not _degree_allowed(ep, space.ep, space.max_ep):
            continue
        if moe.experts % ep:
            reject("ep_splits_experts")
            continue
        if ep > 1 and not all2all_profiled:
            reject("ep_a2a_not_profiled")
            continue
        for etp in _divisors(stage_ranks // ep):
            if not _degree_allowed(etp, space.etp, space.max_etp):
                continue
            if moe.width % etp:
                reject("etp_splits_expert_ffn")
                continue
            grids.append((ep, etp))
    return grids


def _cp_flavours(cp_comms, cp: int):
    """(cp_comm, cp_a2a) of each flavour for `cp` ranks: a2a+p2p once per all-to-all degree a,
    1 < a < cp dividing cp (none for cp < 4); the others with cp_a2a 1."""
    for cp_comm in cp_comms:
        if cp_comm == CpComm["a2a+p2p"]:
            yield from ((cp_comm, a) for a in _divisors(cp) if 1 < a < cp)
        else:
            yield cp_comm, 1


def _batch_configs(space: SearchSpace, schedules, L: int, W: int, tp: int, context, pp: int,
                   reject, grids=((1, 1),), moe: bool = False) -> List[ConfigKey]:
    """The configs of one (tp, (cp, cp_comm, cp_a2a), pp): micro-batching, schedule, SP,
    ZeRO and, for a MoE model, the expert grids (ep, etp)."""
    cp, cp_comm, a2a = context
    configs = []
    dp = W // (tp * cp * pp)
    if space.global_batch_size % dp:
        reject("batch_not_divisible")
        return configs
    per_replica = space.global_batch_size // dp
    for mbs in micro_batch_sizes_for(space, per_replica):
        if per_replica % mbs:
            reject("batch_not_divisible")
            continue
        m = per_replica // mbs
        if 1 < pp and m < pp and space.options.engine == Engine.orchestrator:
            reject("fewer_micro_batches_than_stages")  # torch's pipeline schedules refuse it
            continue
        scheds = []
        for sched in schedules:
            if sched == Schedule["1f1b"]:
                scheds.append((sched, 1))
                continue
            # Megatron-LM runs short end chunks (layout.stage_chunks): L need not split into
            # equal chunks, and the two ends may hold v - 1 layers
            short = space.options.engine == Engine.megatron
            for v in space.virtual_stages:
                if (v < 2 or pp < 2 or m % pp or (L % v and not short)
                        or pp * v - (2 if short else 0) > L):
                    reject("interleave_not_divisible")
                    continue
                scheds.append((Schedule.interleaved, v))
        for sp in space.sequence_parallel:
            if sp and tp == 1:
                continue
            if moe and tp > 1 and not sp:
                reject("moe_needs_sp")  # each TP rank routes its own sequence shard
                continue
            zeros = space.zero_stages if dp * cp > 1 else (0,)
            for zero in dict.fromkeys(zeros):
                for sched, v in scheds:
                    for ep, etp in grids:
                        if (moe and zero == 3 and etp > 1
                                and space.options.engine == Engine.orchestrator):
                            # stage=train: FSDP shards an expert split over one dim only
                            reject("engine_moe_zero3_etp")
                            continue
                        if (zero == 3 and (pp > 1 or ep > 1)
                                and space.options.engine == Engine.megatron):
                            # Megatron-LM's ZeRO 3 (--use-torch-fsdp2) refuses pipeline and
                            # expert parallelism (arguments.py): its export could not run it
                            reject("engine_megatron_zero3_pp_ep")
                            continue
                        configs.append(ConfigKey(W, tp, pp, dp, zero, sp, mbs, m, sched, v, cp,
                                                 cp_comm, a2a, ep, etp))
    return configs


# ====================================================================== per-config tables
