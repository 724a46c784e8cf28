"""evaluate(): one layout's Prediction (iteration time, its breakdown, memory per stage) from the
stage costs (cost_model.StageCosts, whose docstring gives the formulas), and run_parts_ms: the
parts calibration fits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Engine
from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.schedule import (simulate as simulate_schedule)
from orchestrator.planner.terms import MODE_CODES

from orchestrator.planner.cost_model import StageCosts, check_layout_for_model
from orchestrator.planner.options import (BREAKDOWN_KINDS, MEMORY_KINDS, ConfigKey,
                                          CostOptions, GiB)


@dataclass(frozen=True)
class Prediction:
    """What evaluate() predicts for one layout. Times in us, memory in bytes.

    stage_time_us[j] = stage_fwd_us[j] + stage_bwd_us[j] (one micro-batch); breakdown_us sums to
    iteration_time_us and describes the slowest stage: its compute, tp_comm, recompute and
    pp_comm over all micro-batches, the pipeline fill/drain (bubble) and the data-parallel sync
    not hidden (dp_sync_exposed, per-micro-batch ZeRO 2/3 traffic included); compute also
    holds the first stage's optimizer step (o_0). memory_bytes[j]
    maps each kind (params, grads, optim, activations, comm_buffers, reserve) and "total" to
    bytes.
    simulated_iteration_time_us: the event-driven schedule's makespan with each stage's exposed
    gradient sync and optimizer step after its own finish (None unless evaluate(simulate=True)).
    """

    layout: ParallelLayout
    iteration_time_us: float
    tokens_per_s: float
    stage_fwd_us: Tuple[float, ...]
    stage_bwd_us: Tuple[float, ...]
    stage_time_us: Tuple[float, ...]
    breakdown_us: Dict[str, float]
    memory_bytes: Tuple[Dict[str, float], ...]
    peak_memory_bytes: float
    feasible: bool
    reason: str = ""
    simulated_iteration_time_us: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict."""
        return {
            "layout": self.layout.to_dict(),
            "iteration_time_us": self.iteration_time_us,
            "tokens_per_s": self.tokens_per_s,
            "stage_fwd_us": list(self.stage_fwd_us),
            "stage_bwd_us": list(self.stage_bwd_us),
            "stage_time_us": list(self.stage_time_us),
            "breakdown_us": dict(self.breakdown_us),
            "memory_bytes": [dict(m) for m in self.memory_bytes],
            "peak_memory_bytes": self.peak_memory_bytes,
            "feasible": self.feasible,
            "reason": self.reason,
            "simulated_iteration_time_us": self.simulated_iteration_time_us,
        }


def _breakdown_us(costs: StageCosts, layout: ParallelLayout, t: np.ndarray,
                  recompute_us: np.ndarray, e0_us: float, o0_us: float,
                  iteration_us: float) -> Dict[str, float]:
    """Prediction.breakdown_us: the slowest stage k's (first on ties) compute, tp_comm,
    recompute and pp_comm over all micro-batches (compute with the first stage's optimizer step
    o0_us), the exposed data-parallel sync, and the rest of the iteration as the bubble."""
    m = layout.num_micro_batches
    k = int(np.argmax(t))
    n_k = float(layout.layers_per_stage[k])
    compute = m * (n_k * costs.compute.block.total_us + float(costs.other_compute.fwd_us[k])
                   + float(costs.other_compute.bwd_us[k])) + o0_us
    tp_comm = m * (n_k * costs.tp.layer.total_us + float(costs.other_tp.fwd_us[k])
                   + float(costs.other_tp.bwd_us[k]))
    cp_comm = m * n_k * costs.cp.layer.total_us
    recompute = m * float(recompute_us[k])
    pp_comm = m * (float(costs.sends.fwd_us[k]) + float(costs.sends.bwd_us[k]))
    dp_exposed = e0_us + m * (n_k * costs.zero_layer.total_us
                              + float(costs.other_zero.fwd_us[k])
                              + float(costs.other_zero.bwd_us[k]))
    breakdown = {"compute": compute, "tp_comm": tp_comm, "cp_comm": cp_comm, "pp_comm": pp_comm,
                 "dp_sync_exposed": dp_exposed, "recompute": recompute}
    kinds = BREAKDOWN_KINDS
    if costs.moe is not None:  # the token dispatcher's all-to-alls and ETP collectives
        breakdown["ep_comm"] = m * n_k * costs.moe_comm.layer.total_us
        kinds = BREAKDOWN_KINDS + ("ep_comm",)
    bubble = iteration_us - sum(breakdown.values())
    # No fill/drain (one stage): what is left is rounding.
    breakdown["bubble"] = 0.0 if abs(bubble) <= 1e-9 * iteration_us else bubble
    return {kind: breakdown[kind] for kind in kinds}


def _over_budget_reason(memory: Sequence[Mapping[str, float]], budget_bytes: float) -> str:
    """Why the first stage over `budget_bytes` does not fit (its total, largest kind and the
    reserve it includes, in GiB), or "" when every stage fits."""
    for j, mem in enumerate(memory):
        if mem["total"] > budget_bytes:
            biggest = max(MEMORY_KINDS, key=lambda kind: mem[kind])
            return (f"stage {j} needs {mem['total'] / GiB:.2f} GiB > budget "
                    f"{budget_bytes / GiB:.2f} GiB (largest: {biggest} "
                    f"{mem[biggest] / GiB:.2f} GiB; reserve kept free: "
                    f"{mem['reserve'] / GiB:.2f} GiB)")
    return ""


def chunk_shares(costs: StageCosts, layout: ParallelLayout) -> np.ndarray:
    """[stage][chunk]: the share of its stage's time each model chunk takes, its layers' and,
    on the first stage's first chunk and the last stage's last, the embedding's and the LM
    head's ("other"): simulate()'s chunk_shares for a layout with short chunks (equal chunks
    are simulated at 1/v each, as the dynamic planner's execution plans are)."""
    p, v = layout.pp, layout.virtual_stages
    layer = costs.layer.fwd_us + costs.layer.bwd_us
    other = np.asarray(costs.other.fwd_us + costs.other.bwd_us, dtype=float).reshape(-1)
    times = np.array(layout.layers_per_chunk, dtype=float) * layer
    for j in range(p):
        if j == 0 or j == p - 1:
            times[j, 0 if j == 0 else -1] += other[j]
        else:
            times[j] += other[j] / v
    total = times.sum(axis=1, keepdims=True)
    return np.where(total > 0, times / np.where(total > 0, total, 1.0), 1.0 / v)


def evaluate(layout: ParallelLayout, model_cost: ModelCost, hardware: HardwareModel,
             seq_len: Optional[int] = None, memory_budget_bytes: Optional[float] = None,
             options: CostOptions = CostOptions(), simulate: bool = False,
             _costs: Optional[StageCosts] = None) -> Prediction:
    """Predict iteration time (us), per-stage times, breakdown and per-stage memory (bytes) of
    `layout` for one iteration of `seq_len`-token sequences (default: the model profile's).

    feasible is False (with a reason naming the stage and the numbers) when a stage needs more
    than `memory_budget_bytes`; with no budget every layout is feasible. simulate=True also runs
    the event-driven schedule (slower: O(p m v) Python steps)."""
    check_layout_for_model(layout, model_cost)
    if options.engine != Engine.megatron:
        layout.check_equal_chunks()  # short end chunks are Megatron-LM's
    seq_len = int(seq_len or model_cost.seq_len)
    if seq_len < 1:
        raise LayoutError(f"seq_len must be >= 1, got {seq_len}")
    layout.check_sequence(seq_len)
    key = ConfigKey.of(layout)
    costs = _costs if _costs is not None else StageCosts(key, model_cost, hardware, seq_len,
                                                         options)
    p, m = layout.pp, layout.num_micro_batches
    j = np.arange(p)
    n = np.array(layout.layers_per_stage, dtype=float)
    codes = np.array([MODE_CODES[mode] for mode, _ in layout.recompute])
    ks = np.array([k for _, k in layout.recompute], dtype=float)
    rc_arr = costs.recompute_us(n, codes, ks)
    f_arr = costs.stage_fwd_us(j, n)
    b_arr = costs.stage_bwd_us(j, n, codes, ks, rc_arr)
    t = f_arr + b_arr  # = stage_time_us, bit for bit
    params, grads, optim = costs.static_bytes(j, n)
    acts = costs.activation_bytes(j, n, codes, ks)
    totals = costs.total_bytes(j, params, grads, optim, acts)  # = memory_bytes
    fwd, bwd, times = f_arr.tolist(), b_arr.tolist(), t.tolist()
    memory = [{"params": float(params[i]), "grads": float(grads[i]), "optim": float(optim[i]),
               "activations": float(acts[i]), "comm_buffers": float(costs.comm_buffers[i]),
               "reserve": costs.reserve, "total": float(totals[i])} for i in range(p)]
    e0 = float(costs.dp_exposed_us(0, layout.layers_per_stage[0]))
    o0 = float(costs.optimizer_us(0, layout.layers_per_stage[0]))
    iteration = float(costs.alpha * t.sum() + costs.beta * t.max() + e0 + o0)

    breakdown = _breakdown_us(costs, layout, t, rc_arr, e0, o0, iteration)
    peak = max(mem["total"] for mem in memory)
    reason = (_over_budget_reason(memory, memory_budget_bytes)
              if memory_budget_bytes is not None else "")
    simulated = None
    if simulate:
        # The schedule adds the sends itself: give it the stage times without them.
        sim = simulate_schedule(list(f_arr - costs.sends.fwd_us),
                                list(b_arr - costs.sends.bwd_us), m, layout.schedule,
                                layout.virtual_stages, list(costs.boundary_us) if p > 1 else 0.0,
                                chunk_shares=(chunk_shares(costs, layout)
                                              if layout.short_chunks else None))
        simulated = max(sim.stage_finish_us[j]
                        + float(costs.tail_us(j, layout.layers_per_stage[j]))
                        for j in range(p))
    tokens = layout.global_batch_size * seq_len
    return Prediction(layout=layout, iteration_time_us=iteration,
                      tokens_per_s=tokens / (iteration * 1e-6) if iteration > 0 else float("inf"),
                      stage_fwd_us=tuple(fwd), stage_bwd_us=tuple(bwd),
                      stage_time_us=tuple(times), breakdown_us=breakdown,
                      memory_bytes=tuple(memory), peak_memory_bytes=peak, feasible=not reason,
                      reason=reason, simulated_iteration_time_us=simulated)


def run_parts_ms(layout: ParallelLayout, model_cost: ModelCost, hardware: HardwareModel,
                 seq_len: int, options: CostOptions = CostOptions()) -> Dict[str, float]:
    """The parts of an iteration stage=train measures, as this model predicts them (ms):
    "iteration", "compute/<j>" (stage j's forward/backward work over all micro-batches, TP
    collectives in, pipeline sends out), and the first stage's "dp_sync_exposed" (the gradient
    sync left after its last backward) and "optimizer" (its step and the ZeRO parameter
    all-gather after it, as train times them); planner/calibration.py fits factors to them."""
    costs = StageCosts(ConfigKey.of(layout), model_cost, hardware, int(seq_len), options)
    pred = evaluate(layout, model_cost, hardware, seq_len=seq_len, options=options, _costs=costs)
    m = layout.num_micro_batches
    n0 = layout.layers_per_stage[0]
    # train times the ZeRO all-gather of the stepped parameters with the optimizer step
    _, after = costs.dp_sync_parts_us(0, n0)
    exposed = float(costs.dp_exposed_us(0, n0))
    parts = {"iteration": pred.iteration_time_us / 1e3,
             "dp_sync_exposed": (exposed - float(after)) / 1e3,
             "optimizer": (float(costs.optimizer_us(0, n0)) + float(after)) / 1e3}
    for j, t in enumerate(pred.stage_time_us):
        sends = float(costs.sends.fwd_us[j] + costs.sends.bwd_us[j])
        parts[f"compute/{j}"] = m * (t - sends) / 1e3
    return parts
