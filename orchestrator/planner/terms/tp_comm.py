"""Tensor-parallel communication per micro-batch, priced from the workload model's counts.

Every collective moves the layer's activation, s * b * h * dtype_bytes (2sbh bytes in bf16),
except the vocab-parallel loss's three all-reduces of one fp32 value per token (s * b * 4). Which
collectives each engine issues per layer, for the embedding and the LM head, and what a full
recompute reruns, is orchestrator/workload/tp.py's (one definition, checked against the real
engine); this module only prices them.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.bandwidth import benchmark_of
from orchestrator.choices import Engine
from orchestrator.planner.profiles import HardwareModel
from orchestrator.planner.terms import FwdBwd, as_value
from orchestrator.workload.tp import TpCounts, priced_us, tp_counts

LOSS_VALUE_BYTES = 4  # the vocab-parallel loss reduces one fp32 value per token, thrice


def tp_message_bytes(seq_len: int, micro_batch_size: int, hidden: int,
                     dtype_bytes: int) -> float:
    """Bytes of one layer activation of a micro-batch: s * b * h * dtype_bytes (floats, or
    numpy arrays over micro-batches)."""
    return as_value(seq_len * micro_batch_size) * hidden * dtype_bytes


@dataclass(frozen=True)
class TpComm:
    """Tensor-parallel communication time (us per micro-batch) of one layer, of the embedding
    and of the LM head (the vocab-parallel loss's all-reduces included), and what a layer
    recomputed in full
    reruns in backward; all zero for tp = 1."""

    layer: FwdBwd
    embedding: FwdBwd
    head: FwdBwd
    recompute_us: object = 0.0

    @classmethod
    def from_times(cls, counts: TpCounts, op_us: dict, loss_all_reduce_us=0.0) -> "TpComm":
        """Price `counts` given one of each op priced (op_us: {"all_gather", "reduce_scatter",
        "all_reduce"} -> us, floats or numpy arrays) and one loss all-reduce's time."""
        op_us = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, **op_us}
        return cls(layer=FwdBwd(priced_us(counts.layer_fwd, op_us),
                                priced_us(counts.layer_bwd, op_us)),
                   embedding=FwdBwd(priced_us(counts.embedding_fwd, op_us),
                                    priced_us(counts.embedding_bwd, op_us)),
                   head=FwdBwd(priced_us(counts.head_fwd, op_us)
                               + counts.loss_all_reduce * loss_all_reduce_us,
                               priced_us(counts.head_bwd, op_us)),
                   recompute_us=priced_us(counts.recompute, op_us))

    @classmethod
    def zero(cls, like=0.0) -> "TpComm":
        nothing = FwdBwd(like * 0.0, like * 0.0)
        return cls(layer=nothing, embedding=nothing, head=nothing, recompute_us=like * 0.0)

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, tp: int, sequence_parallel: bool,
                      message_bytes, engine: Engine = Engine.orchestrator,
                      loss_bytes=0.0, latency_factor: float = 1.0,
                      bandwidth_factor: float = 1.0) -> "TpComm":
        """Price `engine`'s collectives on a group of `tp` consecutive ranks (Megatron rank
        order) for layer messages of `message_bytes` and loss all-reduces of `loss_bytes` (fp32,
        one value per token; floats or numpy arrays); a collective's latency and its time per
        byte times the cluster's calibrated factors."""
        counts = tp_counts(engine, sequence_parallel)
        if tp == 1:
            return cls.zero(message_bytes)

        def op_us(op: str, size):
            alpha_us, us_per_byte = hardware.collective_line(op, tp, 1)
            alpha_us, us_per_byte = alpha_us * latency_factor, us_per_byte * bandwidth_factor
            return (alpha_us + size * us_per_byte) * (size > 0)  # nothing to move: no latency

        ops = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
        return cls.from_times(counts, {op: op_us(benchmark_of(op), message_bytes)
                                       for op in ops},
                              op_us(benchmark_of("all_reduce"), loss_bytes))
