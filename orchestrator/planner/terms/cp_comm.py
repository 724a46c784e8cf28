"""Context parallelism's communication per layer and micro-batch, by flavour (Megatron-Core's
`--cp-comm-type`), priced from the workload model's messages (workload/comm.cp_messages: what
each flavour moves, how often, and what a recompute reruns; checked against the real engine).

p2p, the ring: a CP rank holds s / cp tokens (2 balanced chunks, models/context_parallel.py) and
computes 1 / cp of the layer; its attention walks a ring of cp steps, each computing on the keys
and values it holds while it sends them on and receives the next rank's: cp - 1 hops of its K
and V forward; backward cp - 1 again and cp of their gradients (2cp - 1); a selective or full
recompute reruns the forward's cp - 1 first. The hops of a pass run beside the attention of
the steps after the first (backward: ATTENTION_BWD_OVER_FWD times the forward's); what they do
not hide (the hardware profile's overlap rule) is exposed. A hop is priced once, on the sender
(its receive is the same message), and crosses nodes when the CP group (stride tp) spans more
than one.

allgather (Llama 3's, stage=train's): the whole sequence's K and V all-gathered over the CP
group before the attention core, their gradients reduce-scattered in the backward, priced from
the profile's all_gather / reduce_scatter fits for the group, not overlapped.

a2a (DeepSpeed's Ulysses): all-to-alls over the CP group for Q, K, V (to a head split) and the
output (back to the sequence split), forward and for their gradients backward, priced from the
hardware profile's all2all fit for the group (cp ranks, stride tp), not overlapped (the
attention needs them first).

a2a+p2p (hierarchical, Megatron's --hierarchical-context-parallel-sizes a cp/a): Ulysses'
all-to-alls inside groups of a consecutive CP ranks (stride tp, a node's when tp x a fits one),
then the ring over the cp / a groups (stride tp x a), each message as large as the plain
ring's; it crosses nodes when the CP group does. Heads and KV heads must divide over tp x a.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.bandwidth import benchmark_of
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.terms import FwdBwd, as_value, overlap_extra_us
from orchestrator.workload.comm import CpMessages

# Attention's backward (flash: recomputes the scores, then dQ, dK, dV) against its forward.
ATTENTION_BWD_OVER_FWD = 2.5


def cp_group_intra_node(tp: int, cp: int, tasks_per_node: int) -> bool:
    """Whether a CP group (cp ranks, stride tp, Megatron order tp-cp-dp-pp) fits in one node."""
    return tp * cp <= tasks_per_node


@dataclass(frozen=True)
class CpComm:
    """Exposed context-parallel communication (us per micro-batch) of one layer, forward and
    backward, and what the backward's rerun of the forward adds under selective recompute (the
    attention core's messages) and under full recompute; zero for cp = 1. `hop_us`: one ring
    hop (0 without a ring)."""

    layer: FwdBwd
    selective_rerun_us: float = 0.0
    full_rerun_us: float = 0.0
    hop_us: float = 0.0

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, messages: CpMessages, cp: int, cp_a2a: int,
                      tp: int, attention_fwd_us: float, overlap_coe: float) -> "CpComm":
        """Price `messages` (workload/comm.cp_messages) of a layout with `cp` CP ranks (`cp_a2a`
        of them per all-to-all group under a2a+p2p) `tp` apart; `attention_fwd_us`: this rank's
        attention core forward for its share (1 / cp of the whole sequence's), which the ring's
        hops run beside."""
        if not messages.fwd:
            return cls(FwdBwd(0.0, 0.0))
        sizes = {"cp": cp, "cp_a2a": cp_a2a, "cp_ring": cp // max(1, cp_a2a)}
        intra = cp_group_intra_node(tp, cp, hardware.tasks_per_node)
        hops = [c for c in messages.fwd if c.op == "send"]
        hop_us = as_value(hardware.p2p_time_us(hops[0].bytes, intra, 2)) if hops else 0.0
        ring = sizes[hops[0].group] if hops else 1
        hidden_us = attention_fwd_us * (ring - 1) / ring  # the first step: the rank's own K/V

        def collective_us(op: str, size, group: str):
            return hardware.collective_time_us(benchmark_of(op), sizes[group], tp, size)

        def exposed_us(comms, window_us) -> float:
            sends, others = 0, 0.0
            for c in comms:
                if c.op == "send":
                    sends += c.count
                elif c.op != "recv":  # a receive is its send's message, priced on the sender
                    others += c.count * collective_us(c.op, c.bytes, c.group)
            ring_us = (overlap_extra_us(window_us, sends * hop_us, overlap_coe) if sends
                       else 0.0)
            return as_value(others + ring_us)

        fwd = exposed_us(messages.fwd, hidden_us)
        selective = exposed_us(messages.selective_rerun, hidden_us)
        # most flavours rerun the same messages under both recomputes (cp_messages shares them)
        full = (selective if messages.full_rerun is messages.selective_rerun
                else exposed_us(messages.full_rerun, hidden_us))
        return cls(FwdBwd(fwd, exposed_us(messages.bwd, ATTENTION_BWD_OVER_FWD * hidden_us)),
                   selective_rerun_us=selective, full_rerun_us=full, hop_us=hop_us)
