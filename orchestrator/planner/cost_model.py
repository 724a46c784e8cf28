"""Cost model: iteration time and per-device memory of a ParallelLayout.

Time of one iteration (p stages, m micro-batches, v chunks per stage):

    T = alpha * sum_j t_j + beta * max_j t_j + e_0
    1F1B: alpha = 1, beta = m - 1;  interleaved: alpha = 1/v, beta = m - 1/v

where t_j is stage j's forward + backward time for one micro-batch (compute, tensor-parallel
communication, recompute, ZeRO 2/3 traffic not hidden, and its pipeline sends, which block the
stage as Megatron's send/recv do) and e_0 is the data-parallel gradient sync of stage 0 left
exposed after its last backward (stage 0 finishes last; the other stages' syncs are taken as
hidden in its drain). For equal stages this is the textbook (m + p - 1) t and m t + (p - 1) t / v
and equals the event-driven simulation (planner/schedule.py); for unequal stages the
simulation's 1F1B makespan is never above it (pessimistic by up to ~25% for very unbalanced
stages, exact when the last stage is the slowest), and interleaved can come out up to ~2% under
it. `evaluate(..., simulate=True)` reports both. It is
the objective the search minimises exactly: a sum plus a max of per-stage terms, which a dynamic
programme over pipeline partitions can optimise.

Communication (Megatron, bf16 activations, message 2sbh bytes = s * b * h * dtype_bytes):
- per layer with TP + SP: forward 2 all-gather + 2 reduce-scatter, backward 4 all-gather +
  2 reduce-scatter; without SP: 2 all-reduce forward, 2 backward. Full recompute reruns the
  forward's communication. Embedding and LM head add one collective each way.
- pipeline send/recv of s * b * h * dtype_bytes (/ tp with SP), intra- or inter-node by rank.
- data parallel: fp32 gradients all-reduce (ZeRO 0), or reduce-scatter of gradients + all-gather
  of bf16 parameters (ZeRO 1, Megatron's distributed optimizer) once per iteration. Sharded
  gradients (ZeRO 2/3) are reduce-scattered after every micro-batch, per layer (keeping them
  whole through gradient accumulation would undo the sharding), then ZeRO 2 all-gathers the
  parameters once; ZeRO 3 gathers each layer's parameters in forward and in backward instead.
- overlap: running communication C beside compute W slows both by `overlap_coe` (c >= 1); the
  pair takes max(W, C) + min(W, C) (c - 1). The gradient sync of a stage overlaps with the
  backward of its last micro-batch (recompute excluded); per-layer ZeRO 2/3 traffic overlaps
  with the layer's own compute (prefetch).

Memory per device of stage j (bytes), by kind: params / grads / optim from the profile's per-TP-
rank bytes (mixed-precision Adam: 2 + 4 + 12 = 18 bytes per parameter), sharded over dp by ZeRO
stage (1: optim, 2: + grads, 3: + params; stage 1 gives Megatron's 6 + 12/dp); activations =
micro-batches in flight (1F1B: min(p - j, m); interleaved: Megatron's (p - j - 1) * 2 + (v - 1) * p
+ 1 chunks of 1/v of the stage) times the stage's per-micro-batch activations for its recompute
(full recompute keeps only layer inputs), plus one layer's worth while it is recomputed, plus the
LM head's activations on the last stage; comm_buffers (ZeRO-3 prefetch of two layers, TP gather
buffer); reserve (allocator, workspace: CostOptions.reserve_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.planner.profiles import HardwareModel, ModelCost
from orchestrator.planner.schedule import simulate as simulate_schedule

GiB = float(1 << 30)
MEMORY_KINDS = ("params", "grads", "optim", "activations", "comm_buffers", "reserve")
BREAKDOWN_KINDS = ("compute", "tp_comm", "pp_comm", "bubble", "dp_sync_exposed", "recompute")

# Per token and layer, the activation bytes (per hidden unit, for 2-byte activations) that
# Megatron's sequence parallelism shards over tp and plain TP keeps whole: the 10sbh of
# layer-norm inputs and dropout masks in sbh(10 + 24/t) (no SP) vs 34sbh/t (SP); with full
# recompute only the layer input, 2sbh.
NO_SP_EXTRA_BYTES_PER_HIDDEN = {"none": 10.0, "selective": 10.0, "full": 2.0}
MODE_CODES = {"none": 0, "selective": 1, "full": 2}
MODE_NAMES = ("none", "selective", "full")


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are not part of a layout.

    other_time_first_share: share of "other" compute on the first stage (embedding lookup); the
      rest (final norm, LM head, loss) is on the last stage.
    other_memory_first_share: share of "other" params/grads/optim on the first stage (untied
      embedding and LM head are the same size: 0.5).
    reserve_bytes: memory kept free on every device (CUDA context, allocator fragmentation).
    """

    other_time_first_share: float = 0.05
    other_memory_first_share: float = 0.5
    reserve_bytes: float = 0.0


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
    schedule: str
    virtual_stages: int

    @classmethod
    def of(cls, layout: ParallelLayout) -> "ConfigKey":
        return cls(layout.world_size, layout.tp, layout.pp, layout.dp, layout.zero,
                   layout.sequence_parallel, layout.micro_batch_size, layout.num_micro_batches,
                   layout.schedule, layout.virtual_stages)

    def layout(self, layers_per_stage, recompute) -> ParallelLayout:
        return ParallelLayout(world_size=self.world_size, pp=self.pp, tp=self.tp, dp=self.dp,
                              zero=self.zero, sequence_parallel=self.sequence_parallel,
                              micro_batch_size=self.micro_batch_size,
                              num_micro_batches=self.num_micro_batches, schedule=self.schedule,
                              virtual_stages=self.virtual_stages,
                              layers_per_stage=tuple(layers_per_stage),
                              recompute=tuple(recompute))


def overlap_extra_us(window_us, comm_us, overlap_coe: float):
    """Time (us) beyond `window_us` of compute when `comm_us` of communication runs beside it,
    both slowed by `overlap_coe` while they overlap. Works on numpy arrays."""
    w = np.asarray(window_us, dtype=float)
    c = np.asarray(comm_us, dtype=float)
    return np.maximum(w, c) + np.minimum(w, c) * (overlap_coe - 1.0) - w


class StageCosts:
    """Per-layer and per-stage cost terms of one ConfigKey. Every method works elementwise on numpy
    arrays (stage index j, layer count n, recompute code and k), so the search tabulates all
    stage sizes at once and evaluate() prices all stages of one layout with the same arithmetic
    (both agree to the last bit)."""

    def __init__(self, key: ConfigKey, model: ModelCost, hardware: HardwareModel, seq_len: int,
                 options: CostOptions = CostOptions()):
        self.key = key
        self.model = model
        self.options = options
        tp, pp, dp, v = key.tp, key.pp, key.dp, key.virtual_stages
        sp = key.sequence_parallel
        b = key.micro_batch_size
        s = seq_len
        self.tokens = float(s * b)
        h, dtype_bytes = model.hidden, model.dtype_bytes
        coe = hardware.overlap_coe
        self.overlap_coe = coe

        # ---- compute (us per micro-batch of b sequences)
        self.comp_f = b * model.block_fwd_us(s, tp)
        self.comp_b = b * model.block_bwd_us(s, tp)
        self.rc_sel = b * model.attention_core_fwd_us(s, tp)
        other_f = b * model.other_fwd_us(s, tp)
        other_b = b * model.other_bwd_us(s, tp)

        # ---- tensor parallel communication
        msg = self.tokens * h * dtype_bytes

        def tp_op(op: str) -> float:
            return hardware.collective_time_us(op, tp, 1, msg)

        if tp == 1:
            self.tp_f = self.tp_b = 0.0
            emb_tp_f = emb_tp_b = head_tp_f = head_tp_b = 0.0
        elif sp:
            ag, rs = tp_op("all_gather"), tp_op("reduce_scatter")
            self.tp_f = 2 * ag + 2 * rs
            self.tp_b = 4 * ag + 2 * rs
            emb_tp_f, emb_tp_b, head_tp_f, head_tp_b = rs, ag, ag, rs
        else:
            ar = tp_op("allreduce")
            self.tp_f = 2 * ar
            self.tp_b = 2 * ar
            emb_tp_f, emb_tp_b, head_tp_f, head_tp_b = ar, 0.0, 0.0, ar

        # ---- memory of one block and of "other" on this TP rank
        block, other = model.memory(tp)
        zero = key.zero
        f_param = 1.0 / dp if zero >= 3 else 1.0
        f_grad = 1.0 / dp if zero >= 2 else 1.0
        f_optim = 1.0 / dp if zero >= 1 else 1.0
        self.block_param_bytes = block.param_bytes
        self.block_grad_bytes = block.grad_bytes
        self.layer_params = block.param_bytes * f_param
        self.layer_grads = block.grad_bytes * f_grad
        self.layer_optim = block.optim_bytes * f_optim

        extra = {mode: 0.0 for mode in MODE_NAMES}
        if tp > 1 and not sp:
            for mode in MODE_NAMES:
                extra[mode] = (NO_SP_EXTRA_BYTES_PER_HIDDEN[mode] * h * (dtype_bytes / 2.0)
                               * (1.0 - 1.0 / tp))
        self.act_none = block.act_bytes_per_token_at("none", s) + extra["none"]
        self.act_sel = block.act_bytes_per_token_at("selective", s) + extra["selective"]
        self.act_full = block.act_bytes_per_token_at("full", s) + extra["full"]

        # ---- ZeRO-2/3: sharded gradients must be reduce-scattered after every micro-batch's
        # backward (accumulating them whole would undo the sharding), and ZeRO-3 also gathers
        # each layer's parameters in forward and backward; both per layer, overlapped with the
        # layer's own compute (prefetch). What is not hidden adds to the stage.
        dp_stride = tp
        self.z3_f = self.z3_b = 0.0
        if zero >= 2 and dp > 1:
            rs_layer = hardware.collective_time_us("reduce_scatter", dp, dp_stride,
                                                   block.grad_bytes)
            ag_layer = (hardware.collective_time_us("all_gather", dp, dp_stride,
                                                    block.param_bytes) if zero >= 3 else 0.0)
            if ag_layer:
                self.z3_f = float(overlap_extra_us(self.comp_f + self.tp_f, ag_layer, coe))
            self.z3_b = float(overlap_extra_us(self.comp_b + self.tp_b, ag_layer + rs_layer, coe))
        self.layer_f = self.comp_f + self.tp_f + self.z3_f
        self.layer_b = self.comp_b + self.tp_b + self.z3_b
        self.rc_full = self.comp_f + self.tp_f  # recompute reruns the forward and its TP comm

        # ---- per-stage terms (arrays of length pp): "other" and pipeline sends
        share_t = options.other_time_first_share
        share_m = options.other_memory_first_share
        first_t = np.zeros(pp)
        last_t = np.zeros(pp)
        first_t[0] = 1.0
        last_t[pp - 1] = 1.0
        first_m = first_t * share_m
        mem_share = first_m + last_t * (1.0 - share_m)
        if pp == 1:
            mem_share = np.ones(1)
        self.other_comp_f = first_t * share_t * other_f + last_t * (1.0 - share_t) * other_f
        self.other_comp_b = first_t * share_t * other_b + last_t * (1.0 - share_t) * other_b
        self.other_tp_f = first_t * emb_tp_f + last_t * head_tp_f
        self.other_tp_b = first_t * emb_tp_b + last_t * head_tp_b
        other_param = other.param_bytes * mem_share
        other_grad = other.grad_bytes * mem_share
        if zero >= 2 and dp > 1:
            rs = np.array([hardware.collective_time_us("reduce_scatter", dp, dp_stride, x)
                           for x in other_grad])
            ag = np.array([hardware.collective_time_us("all_gather", dp, dp_stride, x)
                           for x in other_param]) if zero >= 3 else np.zeros(pp)
            self.other_z3_f = overlap_extra_us(self.other_comp_f + self.other_tp_f, ag, coe)
            self.other_z3_b = overlap_extra_us(self.other_comp_b + self.other_tp_b, ag + rs, coe)
        else:
            self.other_z3_f = np.zeros(pp)
            self.other_z3_b = np.zeros(pp)
        self.other_f = self.other_comp_f + self.other_tp_f + self.other_z3_f
        self.other_b = self.other_comp_b + self.other_tp_b + self.other_z3_b
        self.other_params = other_param * f_param
        self.other_grads = other_grad * f_grad
        self.other_optim = other.optim_bytes * mem_share * f_optim
        self.other_param_bytes_full = other_param  # unsharded, what the dp sync moves
        self.other_grad_bytes_full = other_grad
        self.other_act = last_t * self.tokens * other.act_bytes_per_token_at("none", s)

        # Pipeline sends: boundary j -> j+1 (and the interleaved wrap p-1 -> 0) is intra-node
        # when both stages' rank blocks (tp * dp ranks each, Megatron order) share a node.
        p2p_bytes = self.tokens * h * dtype_bytes / (tp if sp else 1)
        block_ranks = tp * dp
        tpn = hardware.tasks_per_node
        boundary = []
        for j in range(pp):
            if j < pp - 1:
                intra = (j * block_ranks) // tpn == ((j + 2) * block_ranks - 1) // tpn
            else:
                intra = pp * block_ranks <= tpn
            boundary.append(hardware.p2p_time_us(p2p_bytes, intra, pp) if pp > 1 else 0.0)
        self.boundary_us = np.array(boundary)
        send_f = np.zeros(pp)
        send_b = np.zeros(pp)
        for j in range(pp):
            if j < pp - 1:
                send_f[j] = v * boundary[j]
            elif v > 1:
                send_f[j] = (v - 1) * boundary[pp - 1]
            if j > 0:
                send_b[j] = v * boundary[j - 1]
            elif v > 1:
                send_b[j] = (v - 1) * boundary[pp - 1]
        self.send_f = send_f
        self.send_b = send_b

        # ---- in-flight micro-batches (activation multiplier) per stage
        m = key.num_micro_batches
        j = np.arange(pp)
        if key.schedule == "interleaved":
            chunks = np.minimum((pp - j - 1) * 2 + (v - 1) * pp + 1, m * v)
            self.in_flight = chunks / v
        else:
            self.in_flight = np.minimum(pp - j, m).astype(float)

        # ---- comm buffers and reserve (bytes)
        buffers = 0.0
        if zero >= 3 and dp > 1:
            buffers += 2 * block.param_bytes  # two layers gathered (current + prefetch)
        if tp > 1:
            buffers += self.tokens * h * dtype_bytes  # one gathered activation
        self.comm_buffers = buffers
        self.reserve = float(options.reserve_bytes)

        # ---- data-parallel gradient sync of each stage (exposed part computed per stage)
        self._dp_stride = dp_stride
        self._hardware = hardware

        # ---- schedule coefficients of T = alpha * sum t + beta * max t + e_0
        if key.schedule == "interleaved":
            self.alpha = 1.0 / v
            self.beta = m - 1.0 / v
        else:
            self.alpha = 1.0
            self.beta = float(m - 1)

    # ------------------------------------------------------------------ per stage, vectorised
    def recompute_us(self, n, mode_code, k):
        """Recompute time (us per micro-batch) of a stage of n layers: selective reruns the
        attention core of every layer, full reruns the forward of k layers."""
        n = np.asarray(n, dtype=float)
        k = np.asarray(k, dtype=float)
        mode_code = np.asarray(mode_code)
        return np.where(mode_code == 1, n * self.rc_sel,
                        np.where(mode_code == 2, k * self.rc_full, 0.0))

    def stage_fwd_us(self, j: int, n):
        """Forward time (us per micro-batch) of stage j holding n layers, sends included."""
        return np.asarray(n, dtype=float) * self.layer_f + self.other_f[j] + self.send_f[j]

    def stage_bwd_us(self, j: int, n, mode_code, k, recompute_us=None):
        """Backward time (us per micro-batch) of stage j, recompute and sends included
        (`recompute_us`: recompute_us(n, mode_code, k) when the caller has it already)."""
        if recompute_us is None:
            recompute_us = self.recompute_us(n, mode_code, k)
        return (np.asarray(n, dtype=float) * self.layer_b + recompute_us
                + self.other_b[j] + self.send_b[j])

    def stage_time_us(self, j: int, n, mode_code, k):
        """t_j: forward + backward (us per micro-batch)."""
        return self.stage_fwd_us(j, n) + self.stage_bwd_us(j, n, mode_code, k)

    def activation_bytes(self, j: int, n, mode_code, k):
        """Peak activation bytes of stage j: in-flight micro-batches x stored activations, one
        layer's worth while it is recomputed, and the LM head's on the last stage."""
        n = np.asarray(n, dtype=float)
        k = np.asarray(k, dtype=float)
        mode_code = np.asarray(mode_code)
        stored = np.where(mode_code == 1, n * self.act_sel,
                          np.where(mode_code == 2, k * self.act_full + (n - k) * self.act_none,
                                   n * self.act_none))
        working = np.where(mode_code == 1, self.act_none - self.act_sel,
                           np.where(mode_code == 2, self.act_none - self.act_full, 0.0))
        return self.tokens * (self.in_flight[j] * stored + working) + self.other_act[j]

    def static_bytes(self, j: int, n):
        """(params, grads, optim) bytes of stage j holding n layers, after ZeRO sharding."""
        n = np.asarray(n, dtype=float)
        return (n * self.layer_params + self.other_params[j],
                n * self.layer_grads + self.other_grads[j],
                n * self.layer_optim + self.other_optim[j])

    def total_bytes(self, params, grads, optim, activations):
        """Sum of the memory kinds (bytes), in the one order every caller uses."""
        return params + grads + optim + activations + self.comm_buffers + self.reserve

    def memory_bytes(self, j: int, n, mode_code, k):
        """Total bytes per device of stage j: params + grads + optim + activations + buffers +
        reserve."""
        params, grads, optim = self.static_bytes(j, n)
        return self.total_bytes(params, grads, optim, self.activation_bytes(j, n, mode_code, k))

    def dp_sync_us(self, j: int, n):
        """Data-parallel sync time (us) of stage j with n layers at the end of the iteration,
        alone: fp32 gradient all-reduce (ZeRO 0), reduce-scatter of gradients + all-gather of
        bf16 parameters (ZeRO 1), the parameter all-gather only (ZeRO 2: gradients were
        reduce-scattered per micro-batch, inside the stage time), nothing (ZeRO 3)."""
        key, hw = self.key, self._hardware
        n = np.asarray(n, dtype=float)
        if key.dp == 1 or key.zero >= 3:
            return np.zeros_like(n)
        grad = n * self.block_grad_bytes + self.other_grad_bytes_full[j]
        param = n * self.block_param_bytes + self.other_param_bytes_full[j]
        if key.zero == 0:
            a, c = hw.collective_line("allreduce", key.dp, self._dp_stride)
            return a + grad * c
        a2, c2 = hw.collective_line("all_gather", key.dp, self._dp_stride)
        if key.zero == 2:
            return a2 + param * c2
        a1, c1 = hw.collective_line("reduce_scatter", key.dp, self._dp_stride)
        return (a1 + grad * c1) + (a2 + param * c2)

    def dp_exposed_us(self, j: int, n):
        """Part of stage j's gradient sync (us) not hidden under the backward of its last
        micro-batch (recompute excluded from the window)."""
        n = np.asarray(n, dtype=float)
        window = n * self.layer_b + self.other_b[j]
        return overlap_extra_us(window, self.dp_sync_us(j, n), self.overlap_coe)


# ====================================================================== prediction
@dataclass(frozen=True)
class Prediction:
    """What evaluate() predicts for one layout. Times in us, memory in bytes.

    stage_time_us[j] = stage_fwd_us[j] + stage_bwd_us[j] (one micro-batch); breakdown_us sums to
    iteration_time_us and describes the slowest stage: its compute, tp_comm, recompute and
    pp_comm over all micro-batches, the pipeline fill/drain (bubble) and the data-parallel sync
    not hidden (dp_sync_exposed, per-micro-batch ZeRO 2/3 traffic included). memory_bytes[j]
    maps each kind (params, grads, optim, activations, comm_buffers, reserve) and "total" to
    bytes.
    simulated_iteration_time_us: the event-driven schedule's makespan with each stage's exposed
    gradient sync after its own finish (None unless evaluate(simulate=True)).
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


def check_layout_for_model(layout: ParallelLayout, model: ModelCost) -> None:
    """Raise LayoutError when the layout cannot hold this model (layer count, head split)."""
    layout.check_model_layers(model.layers, model.name)
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        raise LayoutError(f"tp({layout.tp}) must divide heads({model.heads}) and "
                          f"kv_heads({model.kv_heads}) of {model.name}")


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
    seq_len = int(seq_len or model_cost.seq_len)
    if seq_len < 1:
        raise LayoutError(f"seq_len must be >= 1, got {seq_len}")
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
    totals = costs.total_bytes(params, grads, optim, acts)  # = memory_bytes
    fwd, bwd, times = f_arr.tolist(), b_arr.tolist(), t.tolist()
    memory = [{"params": float(params[i]), "grads": float(grads[i]), "optim": float(optim[i]),
               "activations": float(acts[i]), "comm_buffers": float(costs.comm_buffers),
               "reserve": costs.reserve, "total": float(totals[i])} for i in range(p)]
    e0 = float(costs.dp_exposed_us(0, layout.layers_per_stage[0]))
    iteration = float(costs.alpha * t.sum() + costs.beta * t.max() + e0)

    # Breakdown over the slowest stage k (first on ties).
    k = int(np.argmax(t))
    n_k = float(layout.layers_per_stage[k])
    compute = m * (n_k * (costs.comp_f + costs.comp_b)
                   + float(costs.other_comp_f[k]) + float(costs.other_comp_b[k]))
    tp_comm = m * (n_k * (costs.tp_f + costs.tp_b) + float(costs.other_tp_f[k])
                   + float(costs.other_tp_b[k]))
    recompute = m * float(rc_arr[k])
    pp_comm = m * (float(costs.send_f[k]) + float(costs.send_b[k]))
    dp_exposed = e0 + m * (n_k * (costs.z3_f + costs.z3_b) + float(costs.other_z3_f[k])
                           + float(costs.other_z3_b[k]))
    breakdown = {"compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm,
                 "dp_sync_exposed": dp_exposed, "recompute": recompute}
    bubble = iteration - sum(breakdown.values())
    # No fill/drain (one stage): what is left is rounding.
    breakdown["bubble"] = 0.0 if abs(bubble) <= 1e-9 * iteration else bubble
    breakdown = {kind: breakdown[kind] for kind in BREAKDOWN_KINDS}

    peak = max(mem["total"] for mem in memory)
    feasible, reason = True, ""
    if memory_budget_bytes is not None:
        for j, mem in enumerate(memory):
            if mem["total"] > memory_budget_bytes:
                biggest = max(MEMORY_KINDS, key=lambda kind: mem[kind])
                feasible = False
                reason = (f"stage {j} needs {mem['total'] / GiB:.2f} GiB > budget "
                          f"{memory_budget_bytes / GiB:.2f} GiB (largest: {biggest} "
                          f"{mem[biggest] / GiB:.2f} GiB)")
                break

    simulated = None
    if simulate:
        boundary = list(costs.boundary_us)
        # The schedule adds the sends itself: give it the stage times without them.
        sim = simulate_schedule([f - costs.send_f[j] for j, f in enumerate(fwd)],
                                [bw - costs.send_b[j] for j, bw in enumerate(bwd)],
                                m, layout.schedule, layout.virtual_stages,
                                boundary if p > 1 else 0.0)
        simulated = max(sim.stage_finish_us[j]
                        + float(costs.dp_exposed_us(j, layout.layers_per_stage[j]))
                        for j in range(p))
    tokens = layout.global_batch_size * seq_len
    return Prediction(layout=layout, iteration_time_us=iteration,
                      tokens_per_s=tokens / (iteration * 1e-6) if iteration > 0 else float("inf"),
                      stage_fwd_us=tuple(fwd), stage_bwd_us=tuple(bwd),
                      stage_time_us=tuple(times), breakdown_us=breakdown,
                      memory_bytes=tuple(memory), peak_memory_bytes=peak, feasible=feasible,
                      reason=reason, simulated_iteration_time_us=simulated)
