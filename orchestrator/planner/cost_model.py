"""Cost model: iteration time and per-device memory of a ParallelLayout, per stage (StageCosts;
prediction.evaluate puts a layout's stages together, options.py holds what a price is asked for).

Time of one iteration (p stages, m micro-batches, v chunks per stage):

    T = alpha * sum_j t_j + beta * max_j t_j + e_0 + o_0
    1F1B: alpha = 1, beta = m - 1;  interleaved: alpha = 1/v, beta = m - 1/v

where t_j is stage j's forward + backward time for one micro-batch (compute, tensor-parallel
communication, recompute, ZeRO 2/3 traffic not hidden, and its pipeline sends, which block the
stage as Megatron's send/recv do) and e_0 is the data-parallel gradient sync of stage 0 left
exposed after its last backward (stage 0 finishes last; the other stages' syncs are taken as
hidden in its drain), and o_0 its optimizer step after that sync: the profile's AdamW step of a
block's (and "other"'s) parameters times the stage's share, divided by dp under ZeRO >= 1 (each
rank steps its shard of the fp32 masters). For equal stages this is the textbook (m + p - 1) t and
m t + (p - 1) t / v (plus e_0 + o_0) and equals the event-driven simulation (planner/schedule.py);
for unequal stages the simulation's 1F1B makespan is never above it (pessimistic by up to ~25% for
very unbalanced stages, exact when the last stage is the slowest), and interleaved can come out up
to ~2% under it. `evaluate(..., simulate=True)` reports both. It is the objective the search
minimises exactly: a sum plus a max of per-stage terms, which a dynamic programme over pipeline
partitions can optimise.

Each term lives in planner/terms/ with its Megatron formula: compute.py (per-layer compute, / cp
with context parallelism), tp_comm.py (TP/SP collectives), cp_comm.py (context parallelism's
exposed communication by flavour: ring, Ulysses, all-gather; stage=train's engine runs the
ring and the all-gather), zero.py (ZeRO sharding, per-layer ZeRO 2/3 traffic, gradient sync),
pipeline.py (p2p sends), memory.py (activations, buffers); schedule.py has alpha, beta and the
in-flight micro-batches. Overlap: communication C beside compute W slows both by
`overlap_coe` (c >= 1), the pair taking max(W, C) + min(W, C) (c - 1); a stage's gradient sync
overlaps with the backward of its last micro-batch (recompute excluded; Megatron: in buckets,
model chunk by model chunk, and the distributed optimizer's parameter all-gather beside the
next forward, by CostOptions' overlap knobs: terms/zero.py), per-layer ZeRO 2/3 traffic with the
layer's own compute (prefetch); Megatron's --tp-comm-overlap hides TP collectives behind their
GEMMs (terms/tp_comm.py); docs/workload.md "Overlap" states every rule.

Collective times come from the hardware profile by the nodes a group spans (TP groups: ranks 1
apart, DP groups and their ZeRO traffic: tp apart, Megatron order): inside one node the intra-node
fits; across nodes the fit measured for the same nodes x members per node, else an intra-node ring
plus an inter-node ring on 1/m of the buffer (HardwareModel's docstring states the rules).
Pipeline sends use the intra- or inter-node p2p fit by whether the neighbours share a node.

Memory per device of stage j (bytes), by kind: planner/stage_memory_costs.py; the gradient sync
and optimizer step after the last backward (e_0 + o_0): planner/stage_tail_costs.py. StageCosts
inherits both.
"""
from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache
from typing import Any, List, Tuple

import numpy as np

from orchestrator.choices import Dtype, Engine, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.planner.calibration import contention_factor
# CostOptions, ConfigKey and the budget's reserve live in options.py; importable from here too
from orchestrator.planner.options import (BREAKDOWN_KINDS, MEMORY_KINDS, ConfigKey,  # noqa: F401
                                          CostOptions, GiB, budget_for_GiB,  # noqa: F401
                                          memory_reserve_GiB)  # noqa: F401
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.schedule import in_flight_micro_batches, schedule_coefficients
from orchestrator.planner.stage_memory_costs import StageMemoryCosts, engine_config
from orchestrator.planner.stage_tail_costs import StageTailCosts
from orchestrator.planner.terms import FwdBwd, as_value
from orchestrator.planner.terms.compute import (layer_compute, optimizer_step_us,
                                                other_on_stages, recompute_rerun_us)
from orchestrator.planner.terms.cp_comm import CpComm
from orchestrator.planner.terms.memory import tp_buffer_bytes, zero_buffer_bytes
from orchestrator.planner.terms.moe import MoeComm, MoeParams, moe_imbalance
from orchestrator.planner.terms.pipeline import (boundary_intra_node, boundary_us,
                                                 on_end_stages, stage_send_counts, stage_sends)
from orchestrator.planner.terms.tp_comm import TpComm, gemm_shares
from orchestrator.planner.terms.zero import ZeroSharding, ZeroTraffic, zero_messages
from orchestrator.workload.comm import (Comm, cp_messages, layer_activation_bytes,
                                        pp_message_bytes, residual_dtype, times, tp_messages)
from orchestrator.workload.stage_memory import StageNumels
from orchestrator.workload.moe import moe_messages, tokens_per_rank
from orchestrator.workload.states import weight_dtype

# A layer's messages depend on a few scalars that many configs of a search share (tokens per
# rank, flavour, dtype): each list built once (Comm tuples are immutable). Sizes over K
# micro-batches (numpy arrays, at()) are built each time.
def _tp_priced(hardware: HardwareModel, tp: int, latency_factor: float,
               bandwidth_factor: float, gemm_fwd_us, shares, overlap_coe: float, mlp: bool,
               *message_args) -> Tuple[Any, TpComm]:
    """(tp_messages(*message_args), their TpComm on `hardware`): configs that differ only in
    pp, dp or ZeRO share both. gemm_fwd_us None: every collective exposed; else Megatron's
    userbuffers beside the block's GEMMs (TpComm.from_hardware's overlap)."""
    messages = tp_messages(*message_args)
    overlap = None if gemm_fwd_us is None else (gemm_fwd_us, shares, overlap_coe, mlp)
    return messages, TpComm.from_hardware(hardware, tp, messages, latency_factor,
                                          bandwidth_factor, overlap)


_MESSAGES = {_tp_priced: lru_cache(maxsize=4096)(_tp_priced),
             cp_messages: lru_cache(maxsize=4096)(cp_messages),
             moe_messages: lru_cache(maxsize=4096)(moe_messages)}


def _messages(build, *args):
    """build(*args), from the cache when every argument is hashable (no numpy array)."""
    if any(isinstance(a, np.ndarray) for a in args):
        return build(*args)
    return _MESSAGES[build](*args)
def check_layout_for_model(layout: ParallelLayout, model: ModelCost) -> None:
    """Raise LayoutError when the layout cannot hold this model (layer count, head split,
    experts over ep and etp)."""
    layout.check_model_layers(model.layers, model.name)
    layout.check_heads(model.heads, model.kv_heads, model.name)
    moe = model.moe
    layout.check_experts(moe.experts if moe else 0, moe.width if moe else 1, model.name)


def _joint_traffic(dense: ZeroTraffic, experts: ZeroTraffic) -> ZeroTraffic:
    """The dense part's and the experts' per-micro-batch ZeRO traffic, one after the other."""
    if not experts.active:
        return dense
    if not dense.active:
        return experts

    def bwd(t):
        return t.gather_us if t.gather_bwd_us is None else t.gather_bwd_us
    return ZeroTraffic(gather_us=dense.gather_us + experts.gather_us,
                       reduce_scatter_us=dense.reduce_scatter_us + experts.reduce_scatter_us,
                       gather_bwd_us=bwd(dense) + bwd(experts))


class StageCosts(StageMemoryCosts, StageTailCosts):
    """The cost terms (planner/terms/) of one ConfigKey, composed per layer and per stage.

    Per layer (floats, us per micro-batch): `compute`, `tp` and `zero_layer` (ZeRO 2/3 traffic
    not hidden) as forward/backward pairs, their sum `layer`, and `full_recompute_us`. Per stage
    (arrays of length pp): the "other" part's `other_compute`, `other_tp`, `other_zero` and sum
    `other`, the pipeline `sends`, `in_flight` micro-batches, and the memory of "other". Every
    method works elementwise on numpy arrays (stage index j, layer count n, recompute code and
    k), so the search tabulates all stage sizes at once and evaluate() prices all stages of one
    layout with the same arithmetic (both agree to the last bit).

    at(b, s) evaluates the same terms for K micro-batches of their own shapes (the dynamic
    planner's, planner/microbatch_costs.py): every term of the micro-batch's shape (what
    _price_micro_batch sets) becomes an array, [K] per layer and [pp, K] per stage."""

    def __init__(self, key: ConfigKey, model: ModelCost, hardware: HardwareModel, seq_len: int,
                 options: CostOptions = CostOptions()):
        self.key = key
        self.hardware = hardware
        self.model, self.options = model, options
        self.engine = options.engine
        # Megatron-LM runs short end chunks (--pipeline-model-parallel-layout); stage=train
        # builds equal ones (ParallelLayout.check_equal_chunks)
        self.short_ends = self.engine == Engine.megatron and key.virtual_stages > 1
        # The messages' dtypes (workload/comm.py): the compute dtype training runs in, and the
        # residual stream's (our engine's weights': fp32 under fp16's autocast).
        self.compute_dtype = Dtype.parse(options.dtype or model.dtype)
        self.residual_dtype = residual_dtype(self.engine, self.compute_dtype)
        # the dtype ZeRO all-gathers parameters in: ours its weights', Megatron's bf16
        self._gathered_dtype = (weight_dtype(self.compute_dtype).value
                                if self.engine == Engine.orchestrator else "bf16")
        self.overlap_coe = hardware.overlap_coe
        self.overlap = options.overlap()  # Megatron's overlap knobs (terms/tp_comm, zero)
        self._block, self._other = block, other = model.memory(key.tp)
        self.block_param_bytes = block.param_bytes
        self.block_grad_bytes = block.grad_bytes
        # A MoE model (terms/moe.py): every block priced as a MoE block, its bytes split into
        # the dense part (reduced and ZeRO-sharded over dp x cp) and its routed experts' shards
        # (over edp), from the profiled block's bytes per parameter.
        self.moe = model.moe
        self.imbalance = moe_imbalance(model, options)
        self.expert_param_bytes = self.expert_grad_bytes = 0.0
        if self.moe is not None:
            counts = MoeParams.of(model, self.moe, key.tp, key.ep, key.etp)
            per_param = [getattr(block, kind) / counts.block0
                         for kind in ("param_bytes", "grad_bytes", "optim_bytes")]
            self.block_param_bytes, self.block_grad_bytes = (per_param[0] * counts.dense,
                                                             per_param[1] * counts.dense)
            self.expert_param_bytes, self.expert_grad_bytes = (per_param[0] * counts.experts,
                                                               per_param[1] * counts.experts)
            expert_optim_bytes = per_param[2] * counts.experts
            dense_optim_bytes = per_param[2] * counts.dense
        # "Other" bytes per stage, unsharded (what ZeRO traffic and the dp sync move): the
        # embedding's share on the first stage, the LM head's on the last.
        share = options.other_memory_first_share
        share = on_end_stages(share, 1.0 - share, key.pp) if key.pp > 1 else np.ones(1)
        self.other_param_bytes = other.param_bytes * share
        self.other_grad_bytes = other.grad_bytes * share
        other_optim_bytes = other.optim_bytes * share
        # The orchestrator engine's memory is workload/memory.py's closed form (every byte it
        # holds, checked against real steps); Megatron's is what Megatron-Core's layer keeps
        # (terms/megatron_memory.py) with the profile's states.
        # Its data-parallel traffic moves fp32 gradients of the exact shapes and parameters in
        # the weights' dtype (workload/states.weight_dtype: bf16 under bf16, else fp32).
        # Built on the first memory question (engine_memory): a config its time bound prunes
        # never asks one; its parameter counts are all the traffic needs.
        self._engine_memory = None
        self._engine_memory_args = ((key, model, block, seq_len, options)
                                    if self.engine == Engine.orchestrator else None)
        if self._engine_memory_args is not None:
            numels = StageNumels.of(engine_config(model, seq_len), key)
            weight = float(weight_dtype(self.compute_dtype).bytes)
            self.block_param_bytes = weight * numels.layer
            self.block_grad_bytes = 4.0 * numels.layer
            self.other_param_bytes = weight * numels.other
            self.other_grad_bytes = 4.0 * numels.other
            if self.moe is not None:
                self.expert_param_bytes = weight * numels.expert
                self.expert_grad_bytes = 4.0 * numels.expert
        self.calibration = options.calibration
        # ZeRO >= 1: each data-parallel rank steps 1/dp of the masters (1/(dp x cp) with CP).
        self.block_optim_us, self.other_optim_us = optimizer_step_us(key, model, options)
        # How much slower (or faster) compute runs with this schedule's ranks busy at once than
        # in the profile (planner/calibration.py), times the cluster's calibrated factor.
        self.contention = contention_factor(model.concurrency, key.pp, key.num_micro_batches,
                                            key.virtual_stages)

        self.in_flight = in_flight_micro_batches(key.schedule, key.pp, key.num_micro_batches,
                                                 key.virtual_stages)
        self._price_micro_batch(seq_len, key.micro_batch_size)
        sharding = ZeroSharding.of(key.zero, key.replicas)
        self.layer_static = sharding.shard(block.param_bytes, block.grad_bytes, block.optim_bytes)
        if self.moe is not None:
            dense = sharding.shard(self.block_param_bytes, self.block_grad_bytes,
                                   dense_optim_bytes)
            experts = ZeroSharding.of(key.zero, key.edp).shard(
                self.expert_param_bytes, self.expert_grad_bytes, expert_optim_bytes)
            self.layer_static = tuple(d + e for d, e in zip(dense, experts))
        self.other_static = sharding.shard(self.other_param_bytes, self.other_grad_bytes,
                                           other_optim_bytes)
        self._zero_buffers = zero_buffer_bytes(key.zero, key.replicas, block.param_bytes)
        self._comm_buffers = np.full(key.pp, self._zero_buffers + self.tp_buffer)
        self.reserve = float(options.reserve_bytes)
        # T = alpha * sum_j t_j + beta * max_j t_j + e_0
        self.alpha, self.beta = schedule_coefficients(key.schedule, key.num_micro_batches,
                                                      key.virtual_stages)

    def _price_micro_batch(self, seq_len, micro_batch_size) -> None:
        """Every term of the micro-batch's shape (b = micro_batch_size sequences of seq_len
        tokens): per layer, per stage, the sends, the activations and the TP buffer; floats, or
        arrays over K micro-batches (at())."""
        key, model = self.key, self.model
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        # A CP rank holds s / cp of each sequence (its tokens), a 1 / cp share of every layer.
        self.tokens = as_value(seq_len * micro_batch_size) / key.cp
        # Megatron's TP buffer: one gathered activation of the residual stream
        tp_bytes = layer_activation_bytes(self.tokens, model.hidden, self.residual_dtype)
        self._price_layer(model, seq_len, micro_batch_size)
        self._price_other(self.options.other_time_first_share)
        self._price_sends(model)
        self.tp_buffer = tp_buffer_bytes(key.tp, tp_bytes)
        # Our engine's activations are its memory model's (engine_memory, workload/memory.py)
        if self.engine == Engine.megatron:
            self._megatron_activations(model, seq_len, micro_batch_size)

    def at(self, micro_batch_size, seq_len) -> "StageCosts":
        """This config's costs for K micro-batches of their own shapes: micro_batch_size[k]
        sequences (rows) of seq_len[k] tokens (numpy arrays), each split over the CP ranks as
        the layout's own. The same terms (_price_micro_batch) as arrays, [K] per layer and
        [pp, K] per stage (so stage methods take j = arange(pp) and n as a column [pp, 1]);
        what does not depend on the micro-batch (states, gradient sync, optimizer step,
        in-flight counts, the engine's memory model) is this one's."""
        _ = self.engine_memory  # built once here, shared by every copy
        out = copy.copy(self)
        out._price_micro_batch(np.asarray(seq_len, dtype=np.int64),
                               np.asarray(micro_batch_size, dtype=float))
        return out

    def _per_stage(self, values: np.ndarray) -> np.ndarray:
        """A per-stage array [pp] as a column [pp, 1] when the terms are over micro-batches
        (at()), so it broadcasts against their [pp, K] terms; itself otherwise."""
        if not isinstance(self.tokens, np.ndarray):
            return values
        return np.reshape(values, (-1,) + (1,) * self.tokens.ndim)

    def _price_layer(self, model: ModelCost, seq_len: int, micro_batch_size) -> None:
        """Time per layer: compute, TP and CP communication, the MoE dispatcher, ZeRO 2/3
        traffic sticking out of them; what selective and full recompute rerun."""
        key = self.key
        cal = self.calibration
        # a MoE block on the busiest rank (terms/compute.layer_compute, which trace reads too)
        self.compute = layer_compute(model, key, seq_len, micro_batch_size, self.imbalance,
                                     self.contention * cal.compute, self.engine)
        # The messages are the workload model's (workload/comm.py, moe.py); the terms price them
        # and messages() lists them.
        # Megatron's --tp-comm-overlap (sequence parallelism only): the block's GEMMs hide
        # what they can of its collectives (terms/tp_comm.userbuffer_layer_us)
        gemm_fwd_us = shares = None
        if self.overlap.tp_comm and key.sequence_parallel and key.tp > 1:
            gemm_fwd_us = as_value(model.block_linear_us(seq_len, key.tp, micro_batch_size
                                                         / key.cp)[0]
                                   * self.contention * cal.compute)
            shares = gemm_shares(model.hidden, model.ffn, model.heads, model.kv_heads)
        self.tp_messages, self.tp = _messages(
            _tp_priced, self.hardware, key.tp, cal.tp_latency, cal.tp_bandwidth, gemm_fwd_us,
            shares, self.overlap_coe, self.moe is None, self.engine, key.sequence_parallel,
            self.tokens, model.hidden, self.compute_dtype)
        self.cp_messages = _messages(cp_messages, key.cp_comm, key.cp, key.cp_a2a, self.tokens,
                                     model.heads, model.kv_heads, model.hidden // model.heads,
                                     key.tp, self.compute_dtype, self.engine)
        self.cp = CpComm.from_hardware(self.hardware, self.cp_messages, key.cp, key.cp_a2a,
                                       key.tp, self.compute.selective_recompute_us,
                                       self.overlap_coe)
        window = self.compute.block + self.tp.layer + self.cp.layer
        traffic = ZeroTraffic.from_hardware(self.hardware, key.zero, key.replicas, key.tp,
                                            self.block_param_bytes, self.block_grad_bytes,
                                            self.engine, key.pp, key.num_micro_batches)
        if self.moe is not None:
            # the dispatcher, exposed; the experts' ZeRO traffic over edp beside the dense's
            self.moe_messages = _messages(
                moe_messages, tokens_per_rank(seq_len, micro_batch_size, key.tp, key.cp),
                self.moe, key.ep, key.etp, self.engine, self.compute_dtype, self.imbalance)
            self.moe_comm = MoeComm.from_hardware(self.hardware, self.moe_messages, key.ep,
                                                  key.etp).scaled(self.calibration.ep_comm)
            window = window + self.moe_comm.layer
            traffic = _joint_traffic(traffic, ZeroTraffic.from_hardware(
                self.hardware, key.zero, key.edp, key.ep * key.etp, self.expert_param_bytes,
                self.expert_grad_bytes, self.engine, key.pp, key.num_micro_batches))
        exposed = traffic.exposed(window, self.overlap_coe)
        dp = self.calibration.dp_sync
        self.zero_layer = FwdBwd(as_value(exposed.fwd_us) * dp, as_value(exposed.bwd_us) * dp)
        self.layer = window + self.zero_layer
        # selective reruns the attention core and the CP messages it needs again; full reruns
        # the forward, the TP collectives the engine repeats (workload.tp) and the CP and
        # dispatcher messages of the forward
        self.selective_recompute_us = (self.compute.selective_recompute_us
                                       + self.cp.selective_rerun_us)
        self.full_recompute_us = (self.compute.full_rerun_us + self.tp.recompute_us
                                  + self.cp.full_rerun_us)
        if self.moe is not None:
            self.full_recompute_us = self.full_recompute_us + self.moe_comm.layer.fwd_us

    def _price_other(self, time_first_share: float) -> None:
        """Time per stage of "other": compute split between the first and the last stage, the
        embedding's and LM head's TP collectives, their ZeRO 2/3 traffic."""
        pp = self.key.pp
        self.other_compute = other_on_stages(self.compute.other, time_first_share, pp)
        self.other_tp = FwdBwd(on_end_stages(self.tp.embedding.fwd_us, self.tp.head.fwd_us, pp),
                               on_end_stages(self.tp.embedding.bwd_us, self.tp.head.bwd_us, pp))
        traffic = ZeroTraffic.from_hardware(self.hardware, self.key.zero, self.key.replicas,
                                            self.key.tp, self._per_stage(self.other_param_bytes),
                                            self._per_stage(self.other_grad_bytes), self.engine,
                                            self.key.pp, self.key.num_micro_batches)
        window = self.other_compute + self.other_tp
        exposed = traffic.exposed(window, self.overlap_coe)
        dp = self.calibration.dp_sync
        self.other_zero = FwdBwd(exposed.fwd_us * dp, exposed.bwd_us * dp)
        self.other = window + self.other_zero

    def _price_sends(self, model: ModelCost) -> None:
        """Pipeline send time per boundary and per stage."""
        key = self.key
        self.p2p_bytes = pp_message_bytes(self.tokens, model.hidden, key.tp,
                                          key.sequence_parallel, self.residual_dtype)
        intra = boundary_intra_node(key.pp, key.stage_ranks,
                                    self.hardware.tasks_per_node)
        self.boundary_us = (boundary_us(self.hardware, self.p2p_bytes, intra)
                            * self.calibration.p2p)
        self.sends = stage_sends(self.boundary_us, key.virtual_stages)

    # ------------------------------------------------------------------ what it priced
    def messages(self, j: int, n: int, mode: Recompute = Recompute.none,
                 k: int = 0) -> List[Comm]:
        """Every message this model prices for a rank of stage j holding n layers (recompute
        `mode`, k of them in full), in one iteration: workload Comm entries with their counts
        per iteration (the pipeline's receives too, priced on the sender). The same objects the
        terms price, so tests/workload/ can hold them equal to workload.comm.rank_comms of the
        stage's ranks. Not priced: the per-step scalars (gradient norm, loss) and the SP norm
        weights' gradient all-reduces (workload/comm.UNPRICED: tiny, latency only)."""
        key = self.key
        m, pp, v = key.num_micro_batches, key.pp, key.virtual_stages
        mode = Recompute.parse(mode)
        full = k if mode == Recompute.full else 0
        selective = n if mode == Recompute.selective else 0
        out: List[Comm] = []
        if key.tp > 1:
            tp = self.tp_messages
            out += times(tp.layer_fwd + tp.layer_bwd, n * m) + times(tp.recompute, full * m)
            if j == 0:
                out += times(tp.embedding_fwd + tp.embedding_bwd, m)
            if j == pp - 1:
                out += times(tp.head_fwd + tp.head_bwd, m)
        cp = self.cp_messages
        out += (times(cp.fwd + cp.bwd, n * m) + times(cp.selective_rerun, selective * m)
                + times(cp.full_rerun, full * m))
        if self.moe is not None:
            moe = self.moe_messages
            out += times(moe.fwd + moe.bwd, n * m) + times(
                tuple(dataclasses.replace(c, phase="bwd") for c in moe.fwd), full * m)
        if pp > 1:
            sends_fwd, sends_bwd = stage_send_counts(pp, v)
            size, dt = self.p2p_bytes, self.residual_dtype.value
            # what stage j receives is what its neighbours send it
            for op, peer, phase, count in (
                    ("send", "next", "fwd", sends_fwd[j]), ("recv", "prev", "fwd",
                                                            sends_fwd[j - 1]),
                    ("send", "prev", "bwd", sends_bwd[j]), ("recv", "next", "bwd",
                                                            sends_bwd[(j + 1) % pp])):
                out.append(Comm(op, "pp", size, dt, phase, int(count) * m,
                                "activations" if phase == "fwd" else "activation gradients",
                                peer))
        out += self._dp_messages(j, n)
        return [c for c in out if c.count > 0]

    def _dp_messages(self, j: int, n: int) -> List[Comm]:
        """The data-parallel messages messages() lists (terms/zero.py's pricing): the dense
        part over the dp x cp replicas, a MoE model's experts over edp."""
        key = self.key
        other = (float(self.other_param_bytes[j]), float(self.other_grad_bytes[j]))
        layer = (self.block_param_bytes, self.block_grad_bytes)
        parts = [(key.replica_group, key.replicas,
                  [layer] * n + ([other] if other[0] else []))]
        if self.moe is not None:
            parts.append(("edp", key.edp, [(self.expert_param_bytes, self.expert_grad_bytes)] * n))
        return [c for group, size, units in parts if size > 1
                for c in zero_messages(self.engine, key.zero, key.pp, key.num_micro_batches,
                                       group, sum(u[0] for u in units),
                                       sum(u[1] for u in units), units,
                                       self._gathered_dtype)]

    # ------------------------------------------------------------------ per stage, vectorised
    def recompute_us(self, n, mode_code, k):
        """Recompute time (us per micro-batch) of a stage of n layers: selective reruns the
        attention core of every layer (and the CP messages it needs), full reruns the forward
        of k layers."""
        return recompute_rerun_us(n, mode_code, k, self.selective_recompute_us,
                                  self.full_recompute_us, self.calibration.recompute)

    def stage_fwd_us(self, j: int, n, sends: bool = True):
        """Forward time (us per micro-batch) of stage j holding n layers, sends included
        (sends=False: without them, as the event simulation takes it)."""
        out = np.asarray(n, dtype=float) * self.layer.fwd_us + self.other.fwd_us[j]
        return out + self.sends.fwd_us[j] if sends else out

    def stage_bwd_us(self, j: int, n, mode_code, k, recompute_us=None, sends: bool = True):
        """Backward time (us per micro-batch) of stage j, recompute and sends included
        (`recompute_us`: recompute_us(n, mode_code, k) when the caller has it already;
        sends=False: without the sends)."""
        if recompute_us is None:
            recompute_us = self.recompute_us(n, mode_code, k)
        out = (np.asarray(n, dtype=float) * self.layer.bwd_us + recompute_us
               + self.other.bwd_us[j])
        return out + self.sends.bwd_us[j] if sends else out

    def stage_time_us(self, j: int, n, mode_code, k):
        """t_j: forward + backward (us per micro-batch)."""
        return self.stage_fwd_us(j, n) + self.stage_bwd_us(j, n, mode_code, k)
