"""What a dynamic (or baseline) plan is: micro-batches per rank, their order and recompute
(ExecutionPlan), and how a rank's micro-batches are priced through the event simulation
(simulate_rank, price_plan)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Microbatching, Recompute, Schedule
from orchestrator.layout import ParallelLayout
from orchestrator.planner.microbatch_costs import (MicroBatchCosts,
                                                   PricedMicroBatches)
from orchestrator.planner.schedule import simulate
from orchestrator.planner.terms import MODE_CODES


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a plan: `samples` index this data-parallel rank's sequences of the
    iteration (in the order given to the planner), each padded to `padded_len` tokens;
    `recompute` ("none" | "selective" | "full": every layer of every stage) applies to this
    micro-batch on every pipeline stage. How the samples lie in rows (one per row, or packed)
    is the plan's packed_rows."""

    samples: Tuple[int, ...]
    padded_len: int
    recompute: Recompute = Recompute.none

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def padded_tokens(self) -> int:
        return len(self.samples) * self.padded_len


# ====================================================================== the plan
@dataclass(frozen=True)
class PlanOptions:
    """pad_multiple: padded lengths are rounded up to it (and to what SP and CP cut:
    _pad_multiple);
    normal_adjustments / fast_adjustments: most recompute changes tried per rank;
    normal_order_sims / fast_order_sims: most simulations spent improving the best candidate
    order (_RankSearch.improve: DynaPipe's group orders, then moves of one micro-batch);
    exhaustive_orders: normal mode simulates every order of a rank's m micro-batches instead
    when m! is at most this (m <= 5); exact_orders / exact_nodes: under 1F1B normal mode finds
    the best order of up to this many micro-batches by branch and bound, simulating at most
    exact_nodes prefixes (the local search goes on from the best found if that runs out);
    fast_splits: fast mode splits the sorted batch only at this many + 1 evenly spread
    positions; fast_min_samples: a rank with fewer samples is planned as in normal mode but
    without the branch and bound (fast there already), and partitions with more, smaller
    micro-batches (_halved: up to small_partition_splits runs halved, or the largest cut in up
    to small_partition_splits + 1 pieces) are searched beside the partition's own."""

    pad_multiple: int = 1
    normal_adjustments: int = 64
    fast_adjustments: int = 4
    normal_order_sims: int = 64
    fast_order_sims: int = 32
    exhaustive_orders: int = 120
    exact_orders: int = 8
    exact_nodes: int = 3000
    fast_min_samples: int = 64
    small_partition_splits: int = 3
    fast_splits: int = 96  # fast-mode quality loss <= 2% at 256 sequences (the bench)


@dataclass(frozen=True)
class ExecutionPlan:
    """One iteration's plan. micro_batches[r]: dp rank r's micro-batches in execution order;
    iteration_time_us: max over ranks of rank_time_us (simulated makespan + the stages'
    gradient sync and optimizer tail, us); stage_peak_memory_bytes[j]: stage j's peak over the
    ranks (static + in-flight activations + buffers + reserve, bytes); kind: "dynamic",
    "padded" or "packed"; mode: "normal" | "fast"; planning_ms: wall time to plan; skipped:
    (rank, index, length, reason) of each sample left out; packed_rows[r][i]: micro-batch i's
    rows as tuples of sample indices, each row one sequence of padded_len tokens (the samples
    concatenated, then padding; attention over the whole row), or () when each sample is its
    own row (padded); extra_warmup[r]: dp rank r's pipeline runs eager 1F1B with that many
    more warm-up forwards per stage (workload.order.stage_order; () or 0: plain 1F1B)."""

    micro_batches: Tuple[Tuple[MicroBatch, ...], ...]
    schedule: Schedule
    iteration_time_us: float
    rank_time_us: Tuple[float, ...]
    stage_peak_memory_bytes: Tuple[float, ...]
    memory_budget_bytes: float
    kind: Microbatching = Microbatching.dynamic
    mode: str = "normal"
    planning_ms: float = 0.0
    skipped: Tuple[Tuple[int, int, int, str], ...] = ()
    packed_rows: Tuple[Tuple[Tuple[Tuple[int, ...], ...], ...], ...] = ()
    extra_warmup: Tuple[int, ...] = ()

    def extra_warmup_of(self, rank: int) -> int:
        """dp rank `rank`'s extra warm-up forwards (0 for plain 1F1B or interleaved)."""
        return self.extra_warmup[rank] if self.extra_warmup else 0

    @property
    def feasible(self) -> bool:
        return max(self.stage_peak_memory_bytes) <= self.memory_budget_bytes

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict."""
        return {
            "micro_batches": [[{"samples": list(mb.samples), "padded_len": mb.padded_len,
                                "recompute": mb.recompute} for mb in rank]
                              for rank in self.micro_batches],
            "schedule": self.schedule, "iteration_time_us": self.iteration_time_us,
            "rank_time_us": list(self.rank_time_us),
            "stage_peak_memory_bytes": list(self.stage_peak_memory_bytes),
            "memory_budget_bytes": self.memory_budget_bytes, "kind": self.kind,
            "mode": self.mode, "planning_ms": self.planning_ms,
            "skipped": [list(x) for x in self.skipped],
            "packed_rows": [[[list(row) for row in mb] for mb in rank]
                            for rank in self.packed_rows],
            "extra_warmup": list(self.extra_warmup),
        }


@dataclass(frozen=True)
class _RankResult:
    """One rank's micro-batches priced and simulated: time (us), peak bytes per stage, and the
    eager 1F1B warm-up it was simulated with."""

    micro_batches: Tuple[MicroBatch, ...]
    time_us: float
    stage_bytes: np.ndarray
    packed_rows: Tuple[Tuple[Tuple[int, ...], ...], ...]
    extra_warmup: int = 0


def simulate_rank(costs: MicroBatchCosts, priced: PricedMicroBatches,
                  extra_warmup: int = 0) -> Tuple[float, np.ndarray]:
    """(time_us, stage_bytes[p]) of one rank running the priced micro-batches in column order
    (eager 1F1B with extra_warmup > 0): the simulated makespan plus each stage's tail after its
    own finish, and each stage's static bytes + simulated in-flight peak + the largest extra.
    With no micro-batch the simulation takes 0 us and the tail is the whole gradient sync plus
    the optimizer step."""
    layout = costs.layout
    m = priced.fwd_us.shape[1]
    sim = simulate(priced.fwd_us, priced.bwd_us, m, layout.schedule, layout.virtual_stages,
                   priced.boundary_us if layout.pp > 1 else 0.0, priced.stored_bytes,
                   extra_warmup)
    # The last backward on every stage is the last micro-batch's (chunk 0 under interleaving).
    window = priced.sync_window_us[:, -1] if m else np.zeros(layout.pp)
    time_us = float(np.max(np.array(sim.stage_finish_us) + costs.tail_us(window)))
    extra = priced.extra_bytes.max(axis=1) if m else np.zeros(layout.pp)
    return time_us, costs.static_bytes + np.maximum(np.array(sim.stage_peak_act_bytes) + extra,
                                                    costs.tail_bytes)


def _price_micro_batches(costs: MicroBatchCosts, mbs: Sequence[MicroBatch],
                         packed_rows: Sequence[Tuple]) -> PricedMicroBatches:
    """Price micro-batches as they are: packed_rows[i] micro-batch i's rows (() one per
    sample)."""
    b = [len(rows) or mb.size for mb, rows in zip(mbs, packed_rows)]
    return costs.price(b, [mb.padded_len for mb in mbs],
                       [MODE_CODES[mb.recompute] for mb in mbs])


def _make_plan(costs: MicroBatchCosts, results: Sequence[_RankResult], budget: float,
               kind: Microbatching,
               mode: str, t0: float, skipped=()) -> ExecutionPlan:
    times = tuple(r.time_us for r in results)
    peak = np.max(np.array([r.stage_bytes for r in results]), axis=0)
    extra = tuple(r.extra_warmup for r in results)
    return ExecutionPlan(micro_batches=tuple(r.micro_batches for r in results),
                         schedule=costs.layout.schedule, iteration_time_us=max(times),
                         rank_time_us=times, stage_peak_memory_bytes=tuple(peak.tolist()),
                         memory_budget_bytes=float(budget), kind=kind, mode=mode,
                         planning_ms=(time.perf_counter() - t0) * 1e3, skipped=tuple(skipped),
                         packed_rows=tuple(r.packed_rows for r in results),
                         extra_warmup=extra if any(extra) else ())


def price_plan(micro_batches_per_rank: Sequence[Sequence[MicroBatch]], costs: MicroBatchCosts,
               memory_budget_bytes: float, kind: Microbatching = Microbatching.dynamic,
               packed_rows: Optional[Sequence[Sequence[Tuple]]] = None,
               extra_warmup: Optional[Sequence[int]] = None) -> ExecutionPlan:
    """The ExecutionPlan of given micro-batches (in execution order, per dp rank; packed_rows
    and extra_warmup as ExecutionPlan's, default every sample its own row and plain 1F1B),
    priced and simulated as plan_iteration prices its own."""
    t0 = time.perf_counter()
    if packed_rows is None:
        packed_rows = [[()] * len(mbs) for mbs in micro_batches_per_rank]
    results = _price_ranks(costs, micro_batches_per_rank, packed_rows, extra_warmup)
    return _make_plan(costs, results, memory_budget_bytes, kind, "normal", t0)


def _price_ranks(costs: MicroBatchCosts, micro_batches_per_rank, packed_rows,
                 extra_warmup: Optional[Sequence[int]] = None) -> List[_RankResult]:
    """Each rank's micro-batches (and rows) priced and simulated."""
    results = []
    extra_warmup = list(extra_warmup or [0] * len(micro_batches_per_rank))
    for mbs, rows, extra in zip(micro_batches_per_rank, packed_rows, extra_warmup):
        t, mem = simulate_rank(costs, _price_micro_batches(costs, mbs, rows), extra)
        results.append(_RankResult(tuple(mbs), t, mem, tuple(tuple(r) for r in rows), extra))
    return results


def _extra_warmups(layout: ParallelLayout, m: int) -> range:
    """The eager 1F1B warm-ups worth simulating beside plain 1F1B: 1 .. min(p - 1, m - 1)
    (stage 0 can hold at most m in flight); none for one stage or the interleaved schedule."""
    if layout.schedule != Schedule["1f1b"]:
        return range(0)
    return range(1, min(layout.pp - 1, m - 1) + 1)
