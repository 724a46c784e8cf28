"""Data parallelism: what ZeRO shards, its per-layer traffic, and the gradient sync.

Data-parallel groups are `dp` ranks `tp` apart (Megatron rank order). Sharding by ZeRO stage:
1 the optimizer states (Megatron's distributed optimizer: 2 + 4 + 12/dp = 6 + 12/dp bytes per
parameter with mixed-precision Adam, 18 without), 2 also the gradients, 3 also the parameters.

Traffic, engine "megatron" (Megatron-LM's distributed optimizer):
- once per iteration, after the last backward: fp32 gradients all-reduced (ZeRO 0), or
  reduce-scattered + bf16 parameters all-gathered (ZeRO 1); ZeRO 2 only all-gathers the
  parameters and ZeRO 3 syncs nothing there;
- per micro-batch and layer: sharded gradients (ZeRO 2/3) are reduce-scattered after every
  backward (keeping them whole through gradient accumulation would undo the sharding), and ZeRO 3
  all-gathers each layer's parameters in forward and again in backward, overlapped with the
  layer's own compute (prefetch).

When Megatron's once-per-iteration sync runs (megatron/core/distributed/: DDP, ParamAndGradBuffer,
the pipeline schedules' no_sync / grad_sync_func / param_sync_func), by its knobs (CostOptions):
- `overlap_grad_reduce`: gradients are grouped in buckets of max(40M, 1M x dp) parameters
  (megatron_bucket_count; on the first pipeline stage, whose sync is the one left exposed) and
  a bucket's reduce-scatter (all-reduce without the distributed optimizer) is launched as soon
  as its gradients are ready, in the LAST micro-batch's backward only (no_sync holds every
  earlier one back: is_last_microbatch), one model chunk at a time under interleaving. So the
  first stage's chunk 0 (its first layers and the embedding, the last backward of the
  iteration) syncs beside that backward in buckets (the last bucket's after it:
  overlapped_sync_us), and its later chunks beside the >= pp - 1 chunk backwards the stage
  still runs after them. Off: one synchronous sync after the backward (exposed).
- `overlap_param_gather` (the distributed optimizer, ZeRO 1/2; needs overlap_grad_reduce):
  the updated bf16 parameters are all-gathered bucket by bucket in the next iteration's
  forward (a forward pre-hook waits for a bucket and launches the next), the first bucket
  before the first layer; under interleaving chunk 0's and 1's are launched at the start, the
  later chunks' pp micro-batches ahead. The first stage's chunk 0 gathers beside its first
  micro-batch's forward (overlapped_sync_us), the later chunks beside the pp - 1 forwards
  after it. Off: the all-gather runs synchronously in the optimizer step (exposed).
Both go into e_0 (cost_model): the first stage's sync left exposed.

Engine "orchestrator" (stage=train: train/grads.py, FSDP2; workload/comm.py lists each message,
checked against the real engine): gradients are fp32, parameters are gathered in the weights'
dtype (bf16 under bf16, as Megatron's; fp32 under fp32 and fp16); during the last
micro-batch's backward each gradient bucket is all-reduced (ZeRO 0/1) or reduce-scattered
(ZeRO 2), and ZeRO 3 reduce-scatters each unit's gradients (and, without a pipeline, every
earlier micro-batch's beside its backward: the shards accumulate); after the optimizer step ZeRO
1/2 all-gather the updated parameters (nothing to overlap it with); ZeRO 3 all-gathers each
unit's parameters in forward and in backward per micro-batch without a pipeline, once per
iteration with one (kept gathered).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np

from orchestrator.bandwidth import benchmark_of
from orchestrator.choices import Engine
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.terms import FwdBwd, overlap_extra_us, pipelined_extra_us
from orchestrator.workload.comm import Comm


@dataclass(frozen=True)
class ZeroSharding:
    """Fraction of the parameters, gradients and optimizer states a data-parallel rank keeps."""

    params: float
    grads: float
    optim: float

    @classmethod
    def of(cls, zero: int, dp: int) -> "ZeroSharding":
        """1/dp for what ZeRO stage `zero` shards, 1 for the rest."""
        return cls(params=1.0 / dp if zero >= 3 else 1.0, grads=1.0 / dp if zero >= 2 else 1.0,
                   optim=1.0 / dp if zero >= 1 else 1.0)

    def shard(self, param_bytes, grad_bytes, optim_bytes) -> Tuple[Any, Any, Any]:
        """(params, grads, optim) bytes one rank keeps of a part holding these (works on
        numpy arrays)."""
        return param_bytes * self.params, grad_bytes * self.grads, optim_bytes * self.optim


def collective_us(hardware: HardwareModel, op: str, group_size: int, stride: int, size_bytes):
    """Time (us) of the workload op `op` (all_reduce, all_gather, reduce_scatter) on a group of
    `group_size` ranks `stride` apart for a per-rank buffer of `size_bytes` (a float or a numpy
    array); 0 for an empty buffer or a group of one."""
    alpha_us, us_per_byte = hardware.collective_line(benchmark_of(op), group_size, stride)
    return (alpha_us + size_bytes * us_per_byte) * (size_bytes > 0)


@dataclass(frozen=True)
class ZeroTraffic:
    """Per micro-batch ZeRO 2/3 traffic of one part (us, floats or per-stage arrays):
    gather_us, the parameter all-gather (ZeRO 3) run in forward and again in backward;
    reduce_scatter_us, the gradient reduce-scatter (ZeRO 2 and 3) run in backward. active is
    False when nothing moves per micro-batch (ZeRO 0/1 or dp = 1)."""

    gather_us: Any
    reduce_scatter_us: Any
    active: bool = True
    gather_bwd_us: Any = None  # the backward's all-gather when it differs (None: gather_us)

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, zero: int, dp: int, tp: int, param_bytes,
                      grad_bytes, engine: Engine = Engine.megatron, pp: int = 1,
                      num_micro_batches: int = 1) -> "ZeroTraffic":
        """Price the per-micro-batch traffic of a part holding `param_bytes` / `grad_bytes`
        unsharded (the engine's own dtypes)."""
        if engine == Engine.orchestrator:
            if zero < 3 or dp == 1:
                return cls(gather_us=0.0, reduce_scatter_us=0.0, active=False)
            gather = collective_us(hardware, "all_gather", dp, tp, param_bytes)
            if zero3_gathers(engine, pp, num_micro_batches) == 1:  # the first forward's
                return cls(gather_us=gather / num_micro_batches, reduce_scatter_us=0.0,
                           gather_bwd_us=0.0)
            # every micro-batch's gradients reduce-scattered but the last's (the sync's)
            scatter = collective_us(hardware, "reduce_scatter", dp, tp, grad_bytes)
            return cls(gather_us=gather,
                       reduce_scatter_us=scatter * (num_micro_batches - 1) / num_micro_batches)
        if zero < 2 or dp == 1:
            return cls(gather_us=0.0, reduce_scatter_us=0.0, active=False)
        return cls(gather_us=(collective_us(hardware, "all_gather", dp, tp, param_bytes)
                              if zero >= 3 else 0.0),
                   reduce_scatter_us=collective_us(hardware, "reduce_scatter", dp, tp,
                                                   grad_bytes))

    def exposed(self, window: FwdBwd, overlap_coe: float) -> FwdBwd:
        """What sticks out (us) of the forward and backward `window` (the part's compute and
        TP communication) when the traffic runs beside it."""
        if not self.active:
            return FwdBwd(window.fwd_us * 0.0, window.bwd_us * 0.0)
        gather_bwd = self.gather_us if self.gather_bwd_us is None else self.gather_bwd_us
        return FwdBwd(overlap_extra_us(window.fwd_us, self.gather_us, overlap_coe),
                      overlap_extra_us(window.bwd_us, gather_bwd + self.reduce_scatter_us,
                                       overlap_coe))


def sync_ops(engine: Engine, zero: int) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(during the last backward, after the optimizer step): the ops of the once-per-iteration
    data-parallel sync, each on the stage's gradients ("reduce_scatter", "all_reduce") or its
    parameters ("all_gather"). Ours: ZeRO 0 all-reduces the gradient buckets, ZeRO 1, 2 and 3
    reduce-scatter them, ZeRO 1/2 all-gather the stepped parameters after. Megatron's, all
    during: all-reduce (ZeRO 0), reduce-scatter + all-gather (1), all-gather (2), none (3)."""
    if engine == Engine.orchestrator:
        during = ("all_reduce",) if zero == 0 else ("reduce_scatter",)
        return during, ("all_gather",) if zero in (1, 2) else ()
    return {0: ("all_reduce",), 1: ("reduce_scatter", "all_gather"), 2: ("all_gather",),
            3: ()}[zero], ()


def zero3_gathers(engine: Engine, pp: int, num_micro_batches: int) -> int:
    """How often ZeRO 3 all-gathers each unit's parameters per iteration: in forward and again
    in backward for every micro-batch, but once per iteration under our engine's pipeline
    (FSDP2 keeps them gathered, torchtitan's choice)."""
    if engine == Engine.orchestrator and pp > 1:
        return 1
    return 2 * num_micro_batches


def zero_messages(engine: Engine, zero: int, pp: int, num_micro_batches: int, group: str,
                  param_bytes: float, grad_bytes: float, units,
                  params_dtype: str = "bf16") -> List[Comm]:
    """The data-parallel messages of one iteration the planner prices for a stage holding
    `param_bytes` / `grad_bytes` unsharded over `group` (workload Comm entries, counts per
    iteration; `units`: (parameter, gradient) bytes of each part priced on its own, a layer or
    the rest): sync_ops' and, with ZeRO 3 (Megatron's: ZeRO 2 and 3), the per-micro-batch
    traffic of each unit. Gradients are fp32, parameters gathered in `params_dtype` (ours: the
    weights' dtype, workload/states.weight_dtype; Megatron's bf16)."""
    m = num_micro_batches
    orchestrator = engine == Engine.orchestrator
    params_dt = params_dtype
    during, after = sync_ops(engine, zero)

    def one(op: str, phase: str, count: int, params: float, grads: float) -> Comm:
        gathered = op == "all_gather"
        return Comm(op, group, params if gathered else grads, params_dt if gathered else "fp32",
                    phase, count, "parameters" if gathered else "gradients")
    out = ([one(op, "bwd", 1, param_bytes, grad_bytes) for op in during]
           + [one(op, "step", 1, param_bytes, grad_bytes) for op in after])
    if zero == 3:
        gathers = zero3_gathers(engine, pp, m)
        out += [one("all_gather", "fwd", gathers, params, 0.0) for params, _ in units]
    if not orchestrator and zero >= 2:  # Megatron reduce-scatters after every backward
        out += [one("reduce_scatter", "bwd", m, 0.0, grads) for _, grads in units]
    elif zero == 3 and zero3_gathers(engine, pp, m) > 1 and m > 1:
        # ours without a pipeline: also every earlier micro-batch's (the last's is the sync)
        out += [one("reduce_scatter", "bwd", m - 1, 0.0, grads) for _, grads in units]
    return out


def dp_sync_parts_us(hardware: HardwareModel, zero: int, dp: int, tp: int, grad_bytes,
                     param_bytes, engine: Engine = Engine.megatron):
    """(during the last backward, after the optimizer step): the data-parallel sync (us) of a
    stage holding `grad_bytes` of gradients and `param_bytes` of parameters unsharded
    (sync_ops' ops; Megatron's all during)."""
    if engine != Engine.orchestrator:
        return (dp_sync_us(hardware, zero, dp, tp, grad_bytes, param_bytes),
                np.zeros_like(grad_bytes))
    if dp == 1:
        return np.zeros_like(grad_bytes), np.zeros_like(grad_bytes)
    during, after = sync_ops(engine, zero)

    def us(ops):
        total = np.zeros_like(grad_bytes)
        for op in ops:
            total = total + collective_us(hardware, op, dp, tp, param_bytes if op == "all_gather"
                                          else grad_bytes)
        return total
    return us(during), us(after)


def megatron_sync_parts_us(hardware: HardwareModel, zero: int, dp: int, tp: int, grad_bytes,
                           param_bytes):
    """(gradients, parameters): Megatron's once-per-iteration data-parallel sync (us) of a part
    holding `grad_bytes` / `param_bytes` unsharded, split into its gradient collective (all-
    reduce at ZeRO 0, reduce-scatter at ZeRO 1) and its parameter all-gather (ZeRO 1, 2): the
    ops of sync_ops on a group of `dp` ranks `tp` apart; zeros for dp = 1 or ZeRO 3."""
    grads, params = np.zeros_like(grad_bytes), np.zeros_like(grad_bytes)
    if dp == 1:
        return grads, params
    for op in sync_ops(Engine.megatron, zero)[0]:
        if op == "all_gather":
            params = params + collective_us(hardware, op, dp, tp, param_bytes)
        else:
            grads = grads + collective_us(hardware, op, dp, tp, grad_bytes)
    return grads, params


# Megatron's default DDP bucket: max(40M, 1M x dp) parameters (distributed_data_parallel.py:
# larger data-parallel groups get larger buckets so each rank's piece stays bandwidth-bound)
MEGATRON_BUCKET_MIN_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP_RANK = 1_000_000


def megatron_bucket_count(params, dp: int):
    """How many gradient buckets Megatron's DDP cuts `params` parameters into (>= 1; numpy
    arrays work): ceil(params / max(40M, 1M x dp))."""
    size = max(MEGATRON_BUCKET_MIN_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP_RANK * dp)
    return np.maximum(np.ceil(np.asarray(params, dtype=float) / size), 1.0)


def overlapped_sync_us(first_us, rest_us, first_window_us, rest_window_us, buckets,
                       overlap_coe: float):
    """Time (us) a bucketed sync adds beyond the compute it runs beside (module docstring):
    the model chunk at the window's edge (`first_us` of it beside `first_window_us`, in
    `buckets` buckets: the first bucket's compute before any, one bucket's collective outside:
    pipelined_extra_us with lead = tail = 1 / buckets) and the stage's other chunks (`rest_us`
    beside `rest_window_us`, added on: pessimistic when it spills). Numpy arrays work."""
    share = 1.0 / np.asarray(buckets, dtype=float)
    return (overlap_extra_us(rest_window_us, rest_us, overlap_coe)
            + pipelined_extra_us(first_window_us, first_us, overlap_coe, share, share))


def dp_sync_us(hardware: HardwareModel, zero: int, dp: int, tp: int, grad_bytes, param_bytes):
    """Megatron's data-parallel sync (us) at the end of the iteration of a stage holding
    `grad_bytes` of gradients and `param_bytes` of parameters unsharded (numpy arrays of the
    same shape): all-reduce (ZeRO 0), reduce-scatter + all-gather (ZeRO 1), all-gather (ZeRO 2),
    nothing (ZeRO 3 or dp = 1). The dp group is `dp` ranks `tp` apart, priced by the nodes it
    spans."""
    total = np.zeros_like(grad_bytes)
    if dp == 1:
        return total
    for op in sync_ops(Engine.megatron, zero)[0]:
        total = total + collective_us(hardware, op, dp, tp,
                                      param_bytes if op == "all_gather" else grad_bytes)
    return total
