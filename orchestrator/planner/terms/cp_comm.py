"""Context parallelism's ring (Megatron-Core's `--cp-comm-type p2p`), per layer and micro-batch.

A CP rank holds s / cp tokens (2 balanced chunks, models/context_parallel.py) and computes
1 / cp of the layer; its attention walks a ring of cp steps, each computing on the keys and
values it holds while it sends them on and receives the next rank's. Per step one message of
the rank's K and V: 2 x b x (s / cp) x (kv_heads / tp) x head_dim x dtype_bytes; backward moves
K and V and their gradients, twice that. The cp - 1 sends of a pass run beside the attention of
the steps after the first; what they do not hide (the hardware profile's overlap rule) is
exposed. A hop crosses nodes when the CP group (stride tp) spans more than one.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner.profiles import HardwareModel
from orchestrator.planner.terms import FwdBwd, overlap_extra_us

# Attention's backward (flash: recomputes the scores, then dQ, dK, dV) against its forward.
ATTENTION_BWD_OVER_FWD = 2.5


def cp_kv_message_bytes(tokens: float, kv_heads: int, head_dim: int, tp: int, cp: int,
                        dtype_bytes: int) -> float:
    """One ring step's forward message: this rank's K and V (tokens = b x s of a micro-batch)."""
    return 2.0 * tokens / cp * (kv_heads / tp) * head_dim * dtype_bytes


def cp_group_intra_node(tp: int, cp: int, tasks_per_node: int) -> bool:
    """Whether a CP group (cp ranks, stride tp, Megatron order tp-cp-dp-pp) fits in one node."""
    return tp * cp <= tasks_per_node


@dataclass(frozen=True)
class CpComm:
    """Exposed ring time (us per micro-batch) of one layer, forward and backward; zero for
    cp = 1. `hop_us`: one forward send (the backward's is twice as long)."""

    layer: FwdBwd
    hop_us: float

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, cp: int, message_bytes: float,
                      attention_fwd_us: float, intra_node: bool,
                      overlap_coe: float) -> "CpComm":
        """`attention_fwd_us`: this rank's attention core forward for its share (1 / cp of the
        whole sequence's), which the ring's sends run beside."""
        if cp == 1:
            return cls(FwdBwd(0.0, 0.0), 0.0)
        hop_us = hardware.p2p_time_us(message_bytes, intra_node, 2)
        hidden_steps = (cp - 1) / cp  # the first step computes on the rank's own K/V
        fwd = overlap_extra_us(attention_fwd_us * hidden_steps, (cp - 1) * hop_us, overlap_coe)
        bwd = overlap_extra_us(ATTENTION_BWD_OVER_FWD * attention_fwd_us * hidden_steps,
                               (cp - 1) * 2.0 * hop_us, overlap_coe)
        return cls(FwdBwd(float(fwd), float(bwd)), float(hop_us))
