"""Pipeline schedules: an event-driven simulation and the closed forms it must agree with.

The simulation places every forward and backward of every micro-batch (and model chunk, for the
interleaved schedule) on its stage in the order the schedule prescribes (Megatron's 1F1B and
interleaved 1F1B) and starts each operation as soon as its stage is free and its input has
arrived. Point-to-point sends occupy the sending stage (Megatron's blocking send/recv around each
operation), so a stage's forward time includes its send to the next stage.

Closed forms (p stages, m micro-batches, equal stages of forward f and backward b, no p2p):
1F1B makespan (m + p - 1)(f + b), bubble fraction (p - 1) / m; interleaved with v chunks per
stage: m (f + b) + (p - 1)(f + b) / v, bubble fraction (p - 1) / (v m). The cost model uses
them for any stages as T = alpha * sum_j t_j + beta * max_j t_j (schedule_coefficients), and
charges each stage the activations of its peak in-flight micro-batches
(in_flight_micro_batches), both checked against the simulation in the tests.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Schedule
from orchestrator.workload.order import (interleave_group,  # noqa: F401 (defined once)
                                         stage_order)


@dataclass(frozen=True)
class ScheduleResult:
    """Times in microseconds. `stage_finish_us[j]` is when stage j ends its last operation;
    busy + idle = iteration time for every stage. `stage_peak_act_bytes[j]`: the most bytes of
    in-flight micro-batches (forward done, backward not yet) stage j holds at once, when the
    simulation was given act_bytes (else None)."""

    iteration_time_us: float
    stage_busy_us: Tuple[float, ...]
    stage_idle_us: Tuple[float, ...]
    stage_finish_us: Tuple[float, ...]
    stage_peak_act_bytes: Optional[Tuple[float, ...]] = None


def schedule_coefficients(schedule: Schedule, num_micro_batches: int,
                          virtual_stages: int = 1) -> Tuple[float, float]:
    """(alpha, beta) of T = alpha * sum_j t_j + beta * max_j t_j: 1F1B (1, m - 1), interleaved
    (1 / v, m - 1 / v). For p equal stages of time t, T = m t + (p - 1) t / v."""
    m, v = num_micro_batches, virtual_stages
    if schedule == Schedule.interleaved:
        return 1.0 / v, m - 1.0 / v
    return 1.0, float(m - 1)


def in_flight_micro_batches(schedule: Schedule, pp: int, num_micro_batches: int,
                            virtual_stages: int = 1, group: Optional[int] = None) -> np.ndarray:
    """Micro-batches whose activations stage j holds at its peak, per stage: 1F1B
    min(p - j, m); interleaved, Megatron's warm-up plus the steady state's one,
    min((p - j - 1) * 2 + (v - 1) * N + 1, m v) chunks of 1/v of the stage each, counted in
    whole stages (N = `group`, --microbatch-group-size-per-vp-stage, default p: the least,
    since Megatron takes N >= p; interleave_group)."""
    m, v = num_micro_batches, virtual_stages
    j = np.arange(pp)
    if schedule == Schedule.interleaved:
        n = pp if group is None else interleave_group(pp, m, group)
        return np.minimum((pp - j - 1) * 2 + (v - 1) * n + 1, m * v) / v
    return np.minimum(pp - j, m).astype(float)


@lru_cache(maxsize=4096)
def chunk_in_flight_pairs(pp: int, stage: int, num_micro_batches: int, virtual_stages: int,
                          chunk: int, group: Optional[int] = None) -> np.ndarray:
    """[K, 2] pairs (forwards of chunk `chunk` in flight, forwards of the stage's other chunks
    in flight) at the stage's peaks under the interleaved schedule (right after each forward,
    stage_order's walk), only those no other pair exceeds in both: a stage whose chunk `chunk`
    keeps x bytes of a micro-batch and every other chunk y holds at most max(a x + b y) over
    them (x, y >= 0). For a short end chunk (layout.stage_chunks). Read-only (cached)."""
    order = stage_order(pp, stage, num_micro_batches, Schedule.interleaved, virtual_stages,
                        group=group)
    a = b = 0
    seen = set()
    for op, c, _ in order:
        step = 1 if op == "F" else -1
        if c == chunk:
            a += step
        else:
            b += step
        if op == "F":
            seen.add((a, b))
    pairs, most_b = [], -1
    for a, b in sorted(seen, reverse=True):  # by a descending: keep b rising above the rest
        if b > most_b:
            pairs.append((a, b))
            most_b = b
    out = np.array(pairs, dtype=float).reshape(-1, 2)
    out.setflags(write=False)
    return out


def _per_micro_batch(values, rows: int, m: int, name: str) -> np.ndarray:
    """`values` as a [rows][m] float array: one value per row broadcast over the micro-batches,
    or already [rows][m]."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim == 1:
        arr = np.repeat(arr[:, None], m, axis=1)
    if arr.ndim != 2 or arr.shape != (rows, m):
        raise ValueError(f"{name} needs {rows} values or {rows} x {m} (one per micro-batch), "
                         f"got shape {np.shape(values)}")
    return arr


def _boundaries(p2p_us, p: int, m: int) -> np.ndarray:
    """p2p_us as a [p][m] array: a scalar, one value per boundary, or [boundary][micro_batch];
    p - 1 boundaries get the wrap-around (entry p - 1) as the largest boundary."""
    arr = np.asarray(p2p_us, dtype=float)
    if arr.ndim == 0:
        return np.full((p, m), float(arr))
    rows = arr.shape[0]
    if rows == p - 1:
        wrap = arr.max(axis=0, keepdims=True) if rows else np.zeros((1,) + arr.shape[1:])
        arr = np.concatenate([arr, wrap])
    if arr.shape[0] != p:
        raise ValueError(f"p2p_us needs p - 1 = {p - 1} or p = {p} values, got {rows}")
    return _per_micro_batch(arr, p, m, "p2p_us")


def simulate(fwd_us, bwd_us, num_micro_batches: int, schedule: Schedule = Schedule["1f1b"],
             virtual_stages: int = 1, p2p_us=0.0, act_bytes=None,
             extra_warmup: int = 0, chunk_shares=None,
             group: Optional[int] = None) -> ScheduleResult:
    """Simulate one iteration; returns times in us (and peak in-flight bytes per stage).

    fwd_us, bwd_us: stage j's forward and backward time for one micro-batch over all its layers
    (each of the v chunks takes 1/v of it), one value per stage or [stage][micro_batch] for
    micro-batches of different sizes. p2p_us: time of one activation (or gradient) send across
    boundary j -> j+1, a scalar, one value per boundary (length p - 1, or p where entry p-1 is
    the interleaved wrap-around from the last stage to the first; by default the largest
    boundary), or [boundary][micro_batch]. A send occupies the sending stage right after the
    operation. act_bytes [stage][micro_batch]: bytes a micro-batch's forward leaves stored on
    the stage until its backward (each chunk holds 1/v); the result then has
    stage_peak_act_bytes. extra_warmup: eager 1F1B's extra warm-up forwards (stage_order).
    chunk_shares [stage][chunk]: the share of the stage's forward and backward time (and
    act_bytes) each of its v chunks takes (default 1/v each; short chunks, layout.stage_chunks,
    take less). group: the interleaved schedule's micro-batches per round (stage_order's; default
    p). With no micro-batches every time is 0."""
    p = len(fwd_us)
    if len(bwd_us) != p or p < 1:
        raise ValueError(f"need one forward and one backward time per stage, got "
                         f"{len(fwd_us)} and {len(bwd_us)}")
    m, v = num_micro_batches, virtual_stages
    fwd = _per_micro_batch(fwd_us, p, m, "fwd_us").tolist()
    bwd = _per_micro_batch(bwd_us, p, m, "bwd_us").tolist()
    boundary = _boundaries(p2p_us, p, m).tolist()
    shares = (np.full((p, v), 1.0 / v) if chunk_shares is None
              else np.asarray(chunk_shares, dtype=float))
    if shares.shape != (p, v):
        raise ValueError(f"chunk_shares needs {p} x {v} values (stage x chunk), got shape "
                         f"{shares.shape}")
    act = (None if act_bytes is None
           else _per_micro_batch(act_bytes, p, m, "act_bytes")[:, None, :] * shares[:, :, None])
    share = shares.tolist()
    last_virtual = p * v - 1

    def duration(kind: str, stage: int, chunk: int, mb: int) -> float:
        base = (fwd[stage][mb] if kind == "F" else bwd[stage][mb]) * share[stage][chunk]
        vs = chunk * p + stage  # virtual stage index along the model
        if kind == "F" and vs < last_virtual:
            return base + boundary[stage][mb]  # send to stage + 1 (or wrap to stage 0)
        if kind == "B" and vs > 0:
            return base + boundary[(stage - 1) % p][mb]  # send back to stage - 1 (or wrap)
        return base

    orders = [stage_order(p, s, m, schedule, v, extra_warmup, group) for s in range(p)]
    end = {}  # (kind, virtual stage, micro_batch) -> end time
    free = [0.0] * p
    busy = [0.0] * p
    nxt = [0] * p
    # Stages that might be able to start their next op; a stage is re-checked when it finishes
    # an op or when an op another stage waits on completes.
    work = deque(range(p))
    queued = [True] * p
    while work:
        s = work.popleft()
        queued[s] = False
        while nxt[s] < len(orders[s]):
            kind, chunk, mb = orders[s][nxt[s]]
            vs = chunk * p + s
            if kind == "F":
                dep = ("F", vs - 1, mb) if vs > 0 else None
            else:
                dep = ("B", vs + 1, mb) if vs < last_virtual else ("F", vs, mb)
            if dep is not None and dep not in end:
                break
            start = max(free[s], end[dep] if dep is not None else 0.0)
            d = duration(kind, s, chunk, mb)
            end[(kind, vs, mb)] = start + d
            free[s] = start + d
            busy[s] += d
            nxt[s] += 1
            # Wake the stages whose next op may depend on this one.
            for other in ((s + 1) % p, (s - 1) % p):
                if not queued[other]:
                    queued[other] = True
                    work.append(other)
    if any(nxt[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError("pipeline schedule deadlocked; this is a bug in stage_order")
    total = max(free)
    peaks = None if act is None else tuple(_peak_in_flight(orders[s], act[s]) for s in range(p))
    return ScheduleResult(iteration_time_us=total, stage_busy_us=tuple(busy),
                          stage_idle_us=tuple(total - b for b in busy),
                          stage_finish_us=tuple(free), stage_peak_act_bytes=peaks)


def _peak_in_flight(order: Sequence[Tuple[str, int, int]], chunk_bytes: np.ndarray) -> float:
    """Most bytes held at once by a stage running `order`: a forward stores its chunk's bytes
    of its micro-batch (chunk_bytes [chunk][micro_batch]) until the matching backward frees
    them (ops on one stage never overlap)."""
    live = peak = 0.0
    for kind, chunk, mb in order:
        live += chunk_bytes[chunk][mb] if kind == "F" else -chunk_bytes[chunk][mb]
        peak = max(peak, live)
    return float(peak)
