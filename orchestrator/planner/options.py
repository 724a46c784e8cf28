"""What a price is asked for: CostOptions (engine, dtype, device, reserve, calibration), the
ConfigKey a layout's per-layer costs depend on, and the memory budget's reserve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional


from orchestrator import choices
from orchestrator.choices import Engine, Schedule
from orchestrator.layout import ParallelLayout
from orchestrator.planner.calibration import Calibration

GiB = float(1 << 30)

MEMORY_KINDS = ("params", "grads", "optim", "activations", "comm_buffers", "reserve")
BREAKDOWN_KINDS = ("compute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_sync_exposed",
                   "recompute")


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are not part of a layout.

    other_time_first_share: share of "other" compute on the first stage (embedding lookup); the
      rest (final norm, LM head, loss) is on the last stage.
    other_memory_first_share: share of "other" params/grads/optim on the first stage (untied
      embedding and LM head are the same size: 0.5).
    reserve_bytes: memory kept free on every device (CUDA context, allocator fragmentation,
      what the model profile does not count): the stage computes it by memory_reserve_GiB.
    engine: the engine whose communication and memory are priced (orchestrator/workload/):
      stage=train's ("orchestrator") or Megatron-LM's ("megatron", what the Megatron export runs).
    dtype: the compute dtype training runs in ("" = the model profile's); device: "cuda" (fused
      AdamW and RMSNorm kernels) or "cpu" (foreach AdamW's temporary, CPU norms keep more):
      the orchestrator engine's memory depends on both.
    calibration: per-cluster factors on the terms (planner/calibration.py, `stage=tune`);
      the identity by default.
    moe_imbalance: a mixture-of-experts model's busiest EP rank's token copies over the mean
      (>= 1; search.moe_imbalance); None: workload/moe.default_imbalance of the model.
    tp_comm_overlap, overlap_grad_reduce, overlap_param_gather: Megatron-LM's options of the
      same names (search.*; what the Megatron export writes): None is on, as Megatron-LM's
      published runs use them (its README's benchmark configuration; its own command-line
      defaults are off). Priced for engine "megatron" only (overlap()); stage=train's engine
      has its own fixed overlap (terms/zero.py) and no TP overlap.
    """

    other_time_first_share: float = 0.05
    other_memory_first_share: float = 0.5
    reserve_bytes: float = 0.0
    engine: Engine = Engine.orchestrator  # what runs the layout: stage=train's | megatron
    dtype: str = ""
    device: str = "cuda"
    calibration: Calibration = Calibration()
    moe_imbalance: Optional[float] = None
    tp_comm_overlap: Optional[bool] = None
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine.parse(self.engine))

    def megatron_overlap(self) -> "Overlap":
        """What Megatron-LM overlaps with these knobs (None: on), whatever engine is priced:
        what its export writes."""
        return Overlap(tp_comm=self.tp_comm_overlap is not False,
                       grad_reduce=self.overlap_grad_reduce is not False,
                       param_gather=self.overlap_param_gather is not False)

    def overlap(self) -> "Overlap":
        """What the priced engine overlaps beyond its fixed rules: Megatron-LM's knobs
        (megatron_overlap), nothing for stage=train's engine (terms/zero.py: its own rule)."""
        if self.engine == Engine.megatron:
            return self.megatron_overlap()
        return Overlap(tp_comm=False, grad_reduce=False, param_gather=False)


class Overlap(NamedTuple):
    """Megatron-LM's overlap options (terms/tp_comm.py, terms/zero.py price them):
    tp_comm: --tp-comm-overlap (userbuffers; sequence-parallel layouts only);
    grad_reduce: --overlap-grad-reduce (bucketed gradient sync in the last backward);
    param_gather: --overlap-param-gather (the distributed optimizer's all-gather in the next
      forward; only with grad_reduce, as Megatron-LM requires)."""

    tp_comm: bool
    grad_reduce: bool
    param_gather: bool



def memory_reserve_GiB(budget_GiB: float, reserve_fraction: float, reserve_GiB: float) -> float:
    """Memory kept free per device (GiB) out of a `budget_GiB` budget: reserve_fraction * budget +
    reserve_GiB (search.* keys; what the planner does not count grows with the model, see
    docs/gpu.md "Memory reserve"). Search and train's pre-launch check both use it."""
    return reserve_fraction * budget_GiB + reserve_GiB


def budget_for_GiB(own_GiB: float, reserve_fraction: float, reserve_GiB: float) -> float:
    """The smallest budget (GiB) whose reserve (memory_reserve_GiB) leaves `own_GiB` for the
    model: (own + reserve_GiB) / (1 - reserve_fraction)."""
    return (own_GiB + reserve_GiB) / (1.0 - reserve_fraction)


@dataclass(frozen=True)
class ConfigKey:
    """A layout minus its pipeline partition and recompute: what fixes the per-layer costs."""

    world_size: int
    tp: int
    pp: int
    dp: int
    zero: int
    sequence_parallel: bool
    micro_batch_size: int
    num_micro_batches: int
    schedule: Schedule
    virtual_stages: int
    cp: int = 1
    cp_comm: choices.CpComm = choices.CpComm.p2p  # (CpComm here is the term, terms/cp_comm)
    cp_a2a: int = 1
    ep: int = 1
    etp: int = 1

    # The layout's derived degrees, as ParallelLayout defines them (its properties).
    stage_ranks = ParallelLayout.stage_ranks
    replicas = ParallelLayout.replicas
    replica_group = ParallelLayout.replica_group
    edp = ParallelLayout.edp

    @classmethod
    def of(cls, layout: ParallelLayout) -> "ConfigKey":
        return cls(layout.world_size, layout.tp, layout.pp, layout.dp, layout.zero,
                   layout.sequence_parallel, layout.micro_batch_size, layout.num_micro_batches,
                   layout.schedule, layout.virtual_stages, layout.cp, layout.cp_comm,
                   layout.cp_a2a, layout.ep, layout.etp)

    def layout(self, layers_per_stage, recompute) -> ParallelLayout:
        return ParallelLayout(world_size=self.world_size, pp=self.pp, tp=self.tp, dp=self.dp,
                              zero=self.zero, sequence_parallel=self.sequence_parallel,
                              micro_batch_size=self.micro_batch_size,
                              num_micro_batches=self.num_micro_batches, schedule=self.schedule,
                              virtual_stages=self.virtual_stages, cp=self.cp,
                              cp_comm=self.cp_comm, cp_a2a=self.cp_a2a, ep=self.ep,
                              etp=self.etp, layers_per_stage=tuple(layers_per_stage),
                              recompute=tuple(recompute))
