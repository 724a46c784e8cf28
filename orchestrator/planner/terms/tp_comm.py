"""Tensor-parallel communication per micro-batch, priced from the workload model's messages.

Which collectives each engine issues per layer, for the embedding and the LM head, and what a
full recompute reruns (orchestrator/workload/tp.py), and what each of them moves
(workload/comm.tp_messages: a layer activation of the rank's tokens x hidden, its gathers of
norm outputs and the gradients that come back to them in the residual stream's dtype, which is
stage=train's weights' (bf16 under bf16, fp32 under fp32 and fp16's autocast); the vocab-parallel loss's three all-reduces of one
fp32 value per token) are the workload model's, one definition checked against the real engine;
this module only prices them on a group of tp consecutive ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.bandwidth import benchmark_of
from orchestrator.planner.profiles import HardwareModel
from orchestrator.planner.terms import FwdBwd, price_comms
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
                      latency_factor: float = 1.0, bandwidth_factor: float = 1.0) -> "TpComm":
        """Price `messages` (workload/comm.tp_messages; sizes floats or numpy arrays) on a group
        of `tp` consecutive ranks (Megatron rank order); a collective's latency and its time per
        byte times the cluster's calibrated factors."""
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
        return cls(layer=FwdBwd(us(messages.layer_fwd), us(messages.layer_bwd)),
                   embedding=FwdBwd(us(messages.embedding_fwd), us(messages.embedding_bwd)),
                   head=FwdBwd(us(messages.head_fwd), us(messages.head_bwd)),
                   recompute_us=us(messages.recompute))
