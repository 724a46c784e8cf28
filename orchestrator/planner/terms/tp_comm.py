"""Tensor-parallel communication per micro-batch, priced from the workload model's messages.

Which collectives each engine issues per layer, for the embedding and the LM head, and what a
full recompute reruns (orchestrator/workload/tp.py), and what each of them moves
(workload/comm.tp_messages: a layer activation of the rank's tokens x hidden, its gathers of
norm outputs and the gradients that come back to them in the residual stream's dtype, which is
stage=train's weights' (bf16 under bf16, fp32 under fp32 and fp16's autocast); the vocab-parallel loss's three all-reduces of one
fp32 value per token) are the workload model's, one definition checked against the real engine;
this module only prices them on a group of tp consecutive ranks.

Overlap with the GEMMs (userbuffer_layer_us): Megatron-LM's `--tp-comm-overlap` (Transformer
Engine's userbuffers, sequence parallelism only) runs each layer collective beside the GEMM that
consumes or produces it, in TE's default methods (transformer_engine's initialize_ub): forward,
the gathers before qkv and fc1 as a ring exchange in tp pieces (the local piece's GEMM first:
lead 1/tp, nothing after) and the reduce-scatters after proj and fc2 pipelined in 4 pieces (the
first GEMM piece before any, the last piece's reduce-scatter after the GEMM: lead = tail = 1/4);
backward, the gathers of the output gradients of fc2 and proj as a ring exchange beside their
dgrad GEMMs, and for qkv and fc1 in bulk: the input's gather beside the dgrad GEMM, the dgrad's
reduce-scatter beside the wgrad GEMM (side by side, nothing pipelined); a full recompute's
rerun as the forward. Each GEMM (dgrad and wgrad alike) takes the block's linear time x its
share of the block's multiply-adds (gemm_shares). The embedding's and LM head's collectives are
not userbuffers (exposed), nor are a MoE block's experts (TE turns it off for them: a MoE
block's fc1/fc2 collectives stay exposed). Our engine (stage=train, DTensor) has no such
overlap: every collective is priced exposed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from orchestrator.bandwidth import benchmark_of
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.terms import FwdBwd, as_value, pipelined_extra_us, price_comms
from orchestrator.workload.comm import TpMessages


@dataclass(frozen=True)
class TpComm:
    """Tensor-parallel communication time (us per micro-batch) of one layer, of the embedding
    and of the LM head (the vocab-parallel loss's all-reduces included), and what a layer
    recomputed in full reruns in backward; all zero for tp = 1."""

    layer: FwdBwd
    embedding: FwdBwd
    head: FwdBwd
    recompute_us: object = 0.0

    @classmethod
    def zero(cls, like=0.0) -> "TpComm":
        nothing = FwdBwd(like * 0.0, like * 0.0)
        return cls(layer=nothing, embedding=nothing, head=nothing, recompute_us=like * 0.0)

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, tp: int, messages: TpMessages,
                      latency_factor: float = 1.0, bandwidth_factor: float = 1.0,
                      overlap=None) -> "TpComm":
        """Price `messages` (workload/comm.tp_messages; sizes floats or numpy arrays) on a group
        of `tp` consecutive ranks (Megatron rank order); a collective's latency and its time per
        byte times the cluster's calibrated factors. `overlap`: None (every collective
        exposed), or (gemm_fwd_us, gemm_shares, overlap_coe, mlp) for Megatron's userbuffers
        (sequence-parallel messages: userbuffer_layer_us prices a layer and its full
        recompute's rerun)."""
        if tp == 1:
            return cls.zero(messages.layer_fwd[0].bytes if messages.layer_fwd else 0.0)

        lines = {}  # op -> (latency, time per byte), calibrated: looked up once per op

        def op_us(op: str, size):
            if op not in lines:
                alpha_us, us_per_byte = hardware.collective_line(benchmark_of(op), tp, 1)
                lines[op] = alpha_us * latency_factor, us_per_byte * bandwidth_factor
            alpha_us, us_per_byte = lines[op]
            return (alpha_us + size * us_per_byte) * (size > 0)  # nothing to move: no latency

        def us(comms):
            return price_comms(comms, op_us)
        layer = FwdBwd(us(messages.layer_fwd), us(messages.layer_bwd))
        recompute_us = us(messages.recompute)
        if overlap is not None:  # Megatron's userbuffers: what the GEMMs do not hide
            gemm_fwd_us, shares, overlap_coe, mlp = overlap
            counts = [op_counts(comms) for comms in (messages.layer_fwd, messages.layer_bwd)]
            if counts != [UB_FWD, UB_BWD]:
                raise ValueError(f"userbuffers overlap Megatron's sequence-parallel layer "
                                 f"({UB_FWD} forward, {UB_BWD} backward), got {counts}")

            def one(comms):  # the time of one collective of each op of the list
                return {c.op: op_us(c.op, c.bytes) for c in comms}
            fwd, bwd = userbuffer_layer_us(one(messages.layer_fwd), one(messages.layer_bwd),
                                           gemm_fwd_us, shares, tp, overlap_coe, mlp)
            layer = FwdBwd(as_value(fwd), as_value(bwd))
            recompute_us = as_value(userbuffer_layer_us(one(messages.recompute), {},
                                                        gemm_fwd_us, shares, tp, overlap_coe,
                                                        mlp).fwd_us)
        return cls(layer=layer,
                   embedding=FwdBwd(us(messages.embedding_fwd), us(messages.embedding_bwd)),
                   head=FwdBwd(us(messages.head_fwd), us(messages.head_bwd)),
                   recompute_us=recompute_us)


# Transformer Engine's userbuffer pieces (module docstring): a reduce-scatter pipelined with its
# GEMM in UB_PIPELINE_SPLITS pieces (TE's default num_splits for "pipeline"); a ring exchange in
# tp pieces.
UB_PIPELINE_SPLITS = 4
# The collectives of a layer they overlap (Megatron's sequence-parallel layer, workload/tp.py)
UB_FWD = {"all_gather": 2, "reduce_scatter": 2}
UB_BWD = {"all_gather": 4, "reduce_scatter": 2}


def op_counts(comms) -> Dict[str, int]:
    """How many collectives of each op a list of Comm holds (an op may have several entries:
    the backward's gradients and its re-gathers)."""
    counts: Dict[str, int] = {}
    for c in comms:
        counts[c.op] = counts.get(c.op, 0) + c.count
    return counts


def gemm_shares(hidden: int, ffn: int, heads: int, kv_heads: int) -> Tuple[float, ...]:
    """(qkv, proj, fc1, fc2): each GEMM's share of a Llama-style block's multiply-adds per
    token (GQA qkv h x (h + 2 kv_heads x head_dim), proj h x h, SwiGLU fc1 h x 2 ffn, fc2 ffn x
    h), which sum to 1."""
    head_dim = hidden // heads
    macs = (hidden * (hidden + 2 * kv_heads * head_dim), hidden * hidden, 2 * hidden * ffn,
            ffn * hidden)
    total = float(sum(macs))
    return tuple(m / total for m in macs)


def userbuffer_layer_us(fwd_us: Dict[str, object], bwd_us: Dict[str, object], gemm_fwd_us,
                        shares: Tuple[float, ...], tp: int, overlap_coe: float,
                        mlp: bool = True) -> FwdBwd:
    """A layer's TP communication (us per micro-batch) left exposed by Megatron's userbuffers
    (module docstring): `fwd_us` / `bwd_us` map "all_gather" and "reduce_scatter" to the time of
    one such collective of the layer (forward: 2 of each; backward: 4 gathers, 2 reduce-scatters;
    an empty map: none), `gemm_fwd_us` is the block's linear (GEMM) forward time, `shares` the
    (qkv, proj, fc1, fc2) shares of it (gemm_shares); mlp=False leaves fc1's and fc2's
    collectives exposed (a MoE block's experts). Floats or numpy arrays."""
    qkv, proj, fc1, fc2 = (gemm_fwd_us * share for share in shares)
    ring, pipe = (1.0 / tp, 0.0), (1.0 / UB_PIPELINE_SPLITS, 1.0 / UB_PIPELINE_SPLITS)
    bulk = (0.0, 0.0)

    def exposed(times, pairs):
        total = 0.0
        for op, gemm, (lead, tail), overlapped in pairs:
            comm = times.get(op, 0.0)
            total = total + (pipelined_extra_us(gemm, comm, overlap_coe, lead, tail)
                             if overlapped else comm)
        return total
    ag, rs = "all_gather", "reduce_scatter"
    fwd = exposed(fwd_us, ((ag, qkv, ring, True), (rs, proj, pipe, True),
                           (ag, fc1, ring, mlp), (rs, fc2, pipe, mlp)))
    bwd = exposed(bwd_us, ((ag, fc2, ring, mlp), (ag, proj, ring, True),
                           (ag, fc1, bulk, mlp), (rs, fc1, bulk, mlp),
                           (ag, qkv, bulk, True), (rs, qkv, bulk, True)))
    return FwdBwd(fwd, bwd)
