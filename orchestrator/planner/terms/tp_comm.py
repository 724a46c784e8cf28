"""Tensor-parallel communication per micro-batch (Megatron).

Every collective moves the layer's activation, s * b * h * dtype_bytes (2sbh bytes in bf16):
- with sequence parallelism, per transformer layer: forward 2 all-gather + 2 reduce-scatter
  (before / after attention and MLP), backward 4 all-gather + 2 reduce-scatter (the two extra
  all-gathers re-gather the inputs that sequence parallelism keeps sharded for the weight
  gradients); the embedding reduce-scatters its output and the LM head all-gathers its input
  (and the reverse in backward);
- without: 2 all-reduce forward (g after attention and MLP), 2 backward (f); the embedding
  all-reduces its output in forward, the LM head its input gradient in backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner.profiles import HardwareModel
from orchestrator.planner.terms import FwdBwd


def tp_message_bytes(seq_len: int, micro_batch_size: int, hidden: int,
                     dtype_bytes: int) -> float:
    """Bytes of one layer activation of a micro-batch: s * b * h * dtype_bytes."""
    return float(seq_len * micro_batch_size) * hidden * dtype_bytes


@dataclass(frozen=True)
class TpComm:
    """Tensor-parallel communication time (us per micro-batch) of one layer, of the embedding
    and of the LM head; all zero for tp = 1."""

    layer: FwdBwd
    embedding: FwdBwd
    head: FwdBwd

    @classmethod
    def from_times(cls, sequence_parallel: bool, all_gather_us: float,
                   reduce_scatter_us: float, allreduce_us: float) -> "TpComm":
        """Count Megatron's collectives (module docstring), given one of each priced."""
        ag, rs, ar = all_gather_us, reduce_scatter_us, allreduce_us
        if sequence_parallel:
            return cls(layer=FwdBwd(2 * ag + 2 * rs, 4 * ag + 2 * rs),
                       embedding=FwdBwd(rs, ag), head=FwdBwd(ag, rs))
        return cls(layer=FwdBwd(2 * ar, 2 * ar), embedding=FwdBwd(ar, 0.0),
                   head=FwdBwd(0.0, ar))

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, tp: int, sequence_parallel: bool,
                      message_bytes: float) -> "TpComm":
        """Price the collectives on a group of `tp` consecutive ranks (Megatron rank order)."""
        if tp == 1:
            zero = FwdBwd(0.0, 0.0)
            return cls(layer=zero, embedding=zero, head=zero)

        def op_us(op: str) -> float:
            return hardware.collective_time_us(op, tp, 1, message_bytes)

        if sequence_parallel:
            return cls.from_times(True, op_us("all_gather"), op_us("reduce_scatter"), 0.0)
        return cls.from_times(False, 0.0, 0.0, op_us("allreduce"))
