"""The cost model's terms, one concept per module, each a short pure function or a frozen
dataclass with a `from_...` builder that a test can check against Megatron's formulas alone:

    compute.py      per-layer forward / backward / selective-recompute time from the model profile
    tp_comm.py      tensor-parallel collectives per layer, embedding and LM head
    cp_comm.py      context parallelism's messages per layer, by flavour, exposed
    moe.py          mixture-of-experts blocks: compute, the token dispatcher, memory
    memory.py       activations per token and per stage, communication buffers
    megatron_memory.py  what a Megatron-Core layer, its loss and embedding keep (engine=megatron)
    zero.py         data parallelism: ZeRO sharding, per-layer ZeRO 2/3 traffic, gradient sync
    pipeline.py     pipeline send/recv per boundary and stage, "other" on the end stages
    ../schedule.py  schedule coefficients (alpha, beta) and in-flight micro-batches

The messages the communication terms price, with their sizes and counts, are the workload
model's (orchestrator/workload/comm.py, moe.py: one definition, checked against the real
engine); a term prices them, it does not size them. cost_model.StageCosts composes the terms
and lists what it priced (StageCosts.messages), which tests/workload/ holds equal to the
workload's per-rank list. This module holds what they share: the recompute codes, the
forward/backward pair, the pricing of a list of messages and the overlap rule.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from orchestrator.choices import Recompute

# Recompute modes and the integer codes the vectorised stage methods use.
MODE_NAMES = tuple(Recompute)  # index = the mode code the search tabulates
MODE_CODES = {mode: code for code, mode in enumerate(MODE_NAMES)}


class FwdBwd(NamedTuple):
    """A forward and a backward time in us per micro-batch (floats, or numpy arrays over the
    pipeline stages). `a + b` adds them pair by pair."""

    fwd_us: Any
    bwd_us: Any

    def __add__(self, other: "FwdBwd") -> "FwdBwd":  # type: ignore[override]
        return FwdBwd(self.fwd_us + other.fwd_us, self.bwd_us + other.bwd_us)

    @property
    def total_us(self) -> Any:
        """Forward + backward (us)."""
        return self.fwd_us + self.bwd_us


def price_comms(comms, op_us):
    """sum(count x op_us(op, bytes)) over workload Comm entries (us; floats or numpy arrays):
    the time of a list of messages that run one after the other."""
    total = 0.0
    for c in comms:
        total = total + c.count * op_us(c.op, c.bytes)
    return total


def as_value(x):
    """A float for a scalar (the search's per-layer terms stay plain floats), else the numpy
    array (the dynamic planner's terms over K micro-batches)."""
    if isinstance(x, np.ndarray) and x.ndim:
        return x.astype(float, copy=False)
    return float(x)


def overlap_extra_us(window_us, comm_us, overlap_coe: float):
    """Time (us) beyond `window_us` of compute when `comm_us` of communication runs beside it,
    both slowed by `overlap_coe` while they overlap: max(W, C) + min(W, C) (c - 1) - W. Works on
    numpy arrays."""
    w = np.asarray(window_us, dtype=float)
    c = np.asarray(comm_us, dtype=float)
    return np.maximum(w, c) + np.minimum(w, c) * (overlap_coe - 1.0) - w


def pipelined_extra_us(window_us, comm_us, overlap_coe: float, lead_share=0.0, tail_share=0.0):
    """Time (us) beyond `window_us` of compute when `comm_us` of communication is cut into
    pieces pipelined with it: the window's first `lead_share` runs before any piece can move
    (its data is not ready yet), `tail_share` of the communication runs outside the window (a
    last piece that waits for the last compute, or a first one that compute waits for), and the
    rest overlaps as overlap_extra_us prices it:
    comm x tail + overlap_extra_us(window x (1 - lead), comm x (1 - tail)).
    n pieces: lead = tail = 1/n (buckets, a pipelined reduce-scatter); lead = 1/n, tail = 0 (a
    ring exchange whose first GEMM piece is local); lead = tail = 0 (bulk: the two side by
    side). Works on numpy arrays."""
    c = np.asarray(comm_us, dtype=float)
    return c * tail_share + overlap_extra_us(np.asarray(window_us, dtype=float)
                                             * (1.0 - lead_share), c * (1.0 - tail_share),
                                             overlap_coe)
