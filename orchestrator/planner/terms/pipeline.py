"""Pipeline point-to-point traffic and what only the end stages hold.

Stage j sends its output activation forward to j + 1 and its input gradient back to j - 1, one
message per micro-batch of workload/comm.pp_message_bytes (the rank's tokens x hidden in the
residual stream's dtype, fp32 in stage=train's engine; / tp with sequence parallelism: each TP
rank sends its shard); a send is priced on the sender (its receive is the same message).
Megatron's send/recv block the stage, so each send adds to the sender's time. With v
model chunks per stage (interleaved), each of a stage's chunks sends once, and the last stage's
chunks but the final one wrap around to stage 0 (boundary p - 1 -> 0).

A boundary is intra-node when both stages' rank blocks (tp * dp consecutive ranks each, Megatron
order) lie on one node.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.terms import FwdBwd


def boundary_intra_node(pp: int, ranks_per_stage: int, tasks_per_node: int) -> List[bool]:
    """Whether each boundary j -> j + 1 (j < pp - 1) and the wrap pp - 1 -> 0 (entry pp - 1)
    stays inside one node: stage j's first rank and stage j + 1's last share a node."""
    r, n = ranks_per_stage, tasks_per_node
    return ([(j * r) // n == ((j + 2) * r - 1) // n for j in range(pp - 1)]
            + [pp * r <= n])


def boundary_us(hardware: HardwareModel, message_bytes,
                intra: Sequence[bool]) -> np.ndarray:
    """Time (us) of one send across each boundary (see boundary_intra_node); zeros for pp = 1.
    [pp], or [pp, K] for K micro-batches' message sizes (a numpy array)."""
    pp = len(intra)
    over_micro_batches = isinstance(message_bytes, np.ndarray)
    if pp == 1:
        return np.zeros((1,) + message_bytes.shape) if over_micro_batches else np.zeros(1)
    times = [hardware.p2p_time_us(message_bytes, x, pp) for x in intra]
    if over_micro_batches:  # an empty message is priced 0.0: as long as the others
        times = np.broadcast_arrays(*times, message_bytes)[:-1]
    return np.array(times, dtype=float)


def stage_send_counts(pp: int, virtual_stages: int):
    """(forward, backward) sends per micro-batch of each stage (int arrays of length pp): each
    of a stage's v chunks sends its output on and its input's gradient back, but the model's
    last chunk (on the last stage) sends nothing forward and its first (on stage 0) nothing
    back."""
    v = virtual_stages
    fwd = np.full(pp, v)
    bwd = np.full(pp, v)
    fwd[-1] -= 1
    bwd[0] -= 1
    return fwd, bwd


def stage_sends(boundary: np.ndarray, virtual_stages: int) -> FwdBwd:
    """Send time (us per micro-batch) of each stage (stage_send_counts' sends): forward to the
    next stage over boundary j (the last stage's wrapping to stage 0), backward to the previous
    one over boundary j - 1 (stage 0's wrapping to the last). Rows are stages (boundary [pp]
    or [pp, K])."""
    v = virtual_stages  # the counts written out: the search calls this per config
    inner, wrap = v * boundary[:-1], (v - 1) * boundary[-1:]
    return FwdBwd(np.concatenate([inner, wrap]), np.concatenate([wrap, inner]))


def on_end_stages(first, last, pp: int) -> np.ndarray:
    """Per-stage array with `first` on stage 0 and `last` on stage pp - 1 (both on a single
    stage): where the embedding and the LM head live. [pp], or [pp, K] when first or last are
    K micro-batches' (numpy arrays)."""
    if isinstance(first, np.ndarray) or isinstance(last, np.ndarray):
        out = np.zeros((pp,) + np.broadcast_shapes(np.shape(first), np.shape(last)))
    else:  # the search's scalars: the cheap path
        out = np.zeros(pp)
    out[0] += first
    out[pp - 1] += last
    return out
