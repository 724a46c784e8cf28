"""Context parallelism's communication per layer and micro-batch, by flavour (Megatron-Core's
`--cp-comm-type`).

p2p, the ring:

A CP rank holds s / cp tokens (2 balanced chunks, models/context_parallel.py) and computes
1 / cp of the layer; its attention walks a ring of cp steps, each computing on the keys and
values it holds while it sends them on and receives the next rank's. Per step one message of
the rank's K and V: 2 x b x (s / cp) x (kv_heads / tp) x head_dim x dtype_bytes; backward moves
K and V and their gradients, twice that. The cp - 1 sends of a pass run beside the attention of
the steps after the first; what they do not hide (the hardware profile's overlap rule) is
exposed. A hop crosses nodes when the CP group (stride tp) spans more than one.

allgather (Llama 3's, stage=train's): the whole sequence's K and V all-gathered over the CP
group before the attention core (2 x b x s x kv_heads / tp x head_dim elements), their gradients
reduce-scattered in the backward, priced from the profile's all_gather / reduce_scatter fits for
the group, not overlapped.

a2a (DeepSpeed's Ulysses): before the attention core an all-to-all over the CP group turns each
of Q, K and V from s / cp tokens x all of the rank's heads into all s tokens x 1 / cp of them, and
one after it turns the output back: 4 per layer forward (Q and the output of b x s / cp x h / tp
elements, K and V of b x s / cp x kv_heads / tp x head_dim), 4 more for their gradients backward,
priced from the hardware profile's all2all fit for the group (cp ranks, stride tp), not
overlapped (the attention needs them first).

a2a+p2p (hierarchical, Megatron's --hierarchical-context-parallel-sizes a cp/a): Ulysses'
all-to-alls inside groups of a consecutive CP ranks (stride tp, a node's when tp x a fits one:
the same four messages each way over a ranks), then the ring over the cp / a groups (stride
tp x a): cp / a steps, each message the rank's K/V of a x s / cp tokens and kv_heads / (tp x a)
heads, as large as the plain ring's; it crosses nodes when the CP group does. Heads and KV heads
must divide over tp x a.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner.profiles import HardwareModel
from orchestrator.planner.terms import FwdBwd, as_value, overlap_extra_us

# Attention's backward (flash: recomputes the scores, then dQ, dK, dV) against its forward.
ATTENTION_BWD_OVER_FWD = 2.5


def cp_kv_message_bytes(tokens: float, kv_heads: int, head_dim: int, tp: int,
                        dtype_bytes: int) -> float:
    """One ring step's forward message: this rank's K and V (`tokens`: its b x s / cp)."""
    return 2.0 * tokens * (kv_heads / tp) * head_dim * dtype_bytes


def cp_group_intra_node(tp: int, cp: int, tasks_per_node: int) -> bool:
    """Whether a CP group (cp ranks, stride tp, Megatron order tp-cp-dp-pp) fits in one node."""
    return tp * cp <= tasks_per_node


@dataclass(frozen=True)
class CpComm:
    """Exposed context-parallel communication (us per micro-batch) of one layer, forward and
    backward, for one flavour; zero for cp = 1. `hop_us`: one forward message (a ring step, the
    first all-to-all, the all-gather)."""

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
        return cls(FwdBwd(as_value(fwd), as_value(bwd)), as_value(hop_us))

    @classmethod
    def all_to_all(cls, hardware: HardwareModel, cp: int, tp: int, tokens: float, heads: int,
                   kv_heads: int, head_dim: int, dtype_bytes: int) -> "CpComm":
        """Ulysses' four all-to-alls each way; `tokens`: this rank's (b x s / cp)."""
        if cp == 1:
            return cls(FwdBwd(0.0, 0.0), 0.0)
        q_bytes = tokens * heads / tp * head_dim * dtype_bytes
        kv_bytes = tokens * kv_heads / tp * head_dim * dtype_bytes

        def a2a_us(size):
            return hardware.collective_time_us("all2all", cp, tp, size)
        one_way = 2 * a2a_us(q_bytes) + 2 * a2a_us(kv_bytes)
        return cls(FwdBwd(one_way, one_way), a2a_us(q_bytes))

    @classmethod
    def hierarchical(cls, hardware: HardwareModel, cp: int, a2a: int, tp: int, tokens: float,
                     heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                     attention_fwd_us: float, overlap_coe: float) -> "CpComm":
        """a2a+p2p: Ulysses over `a2a` ranks, the ring over cp / a2a (module doc); `tokens` and
        `attention_fwd_us` this rank's, as for the ring."""
        inner = cls.all_to_all(hardware, a2a, tp, tokens, heads, kv_heads, head_dim,
                               dtype_bytes)
        ring = cls.from_hardware(
            hardware, cp // a2a, cp_kv_message_bytes(tokens, kv_heads, head_dim, tp, dtype_bytes),
            attention_fwd_us, cp_group_intra_node(tp, cp, hardware.tasks_per_node), overlap_coe)
        return cls(inner.layer + ring.layer, ring.hop_us)

    @classmethod
    def all_gather(cls, hardware: HardwareModel, cp: int, tp: int, tokens: float,
                   kv_heads: int, head_dim: int, dtype_bytes: int) -> "CpComm":
        """K and V gathered forward, their gradients reduce-scattered backward; `tokens`: this
        rank's (b x s / cp)."""
        if cp == 1:
            return cls(FwdBwd(0.0, 0.0), 0.0)
        gathered = 2.0 * tokens * cp * kv_heads / tp * head_dim * dtype_bytes
        fwd = hardware.collective_time_us("all_gather", cp, tp, gathered)
        bwd = hardware.collective_time_us("reduce_scatter", cp, tp, gathered)
        return cls(FwdBwd(fwd, bwd), fwd)
