"""Execution plans for variable-length batches (DynaPipe-style dynamic micro-batching).

plan_iteration() splits each data-parallel rank's batch into micro-batches, orders them and
picks each one's recompute, priced by the cost model's terms (planner/microbatch_costs.py) and
the event simulation (planner/schedule.py); padded_plan() and packed_plan() are the two fixed
baselines, priced the same way.

Partition (exact): a micro-batch is a contiguous run of the length-sorted batch, either padded
to its longest or packed into rows (ExecutionPlan.packed_rows), whichever is faster
(microbatch_costs.price_candidates); the objective sum_i t_i + c max_i t_i (t_i: the bottleneck
stage's forward + backward of micro-batch i, c = (p - 1) / v: the fill and drain) is minimised
by a dynamic programme over split points for each candidate bound tau on the max (sum under
t_i <= tau, plus c tau), thresholds refined until no gap between them can win (fast mode: 16
spread thresholds). A micro-batch is allowed when, with the stage's worst-case in-flight count
of copies of it, every stage fits the budget; it takes the fastest recompute that does. Then
order candidates and recompute adjustments go through the simulation, whose in-flight peak is
the memory the plan reports (and keeps under the budget); the order is searched
(_RankSearch.improve) under plain 1F1B and eager 1F1B (more warm-up forwards where memory
allows), and for a few micro-batches made exact by branch and bound (planner/order_search.py).
"""
from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Microbatching, Recompute, Schedule
from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import GiB
from orchestrator.planner.lockstep import align, lockstep_groups
from orchestrator.planner.microbatch_costs import (Candidates, MicroBatchCosts,
                                                   PricedMicroBatches, pack_rows, padded_length,
                                                   price_candidates)
from orchestrator.planner.profiles import HardwareModel, ModelCost
from orchestrator.planner.order_search import best_order, problem_of
from orchestrator.planner.schedule import simulate
from orchestrator.planner.terms import MODE_CODES, MODE_NAMES


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


# ====================================================================== partition
def _min_sum(t_us: np.ndarray, taus: np.ndarray, groups: int):
    """For each bound tau: the least sum of t over partitions of [0, n) into runs with t <= tau
    whose count is a multiple of `groups` (dp[T, n + 1, groups], state = count mod groups).
    Returns (sums[T], dp)."""
    n = t_us.shape[0] - 1
    dp = np.full((len(taus), n + 1, groups), np.inf)
    dp[:, 0, 0] = 0.0
    by_end = t_us.T  # by_end[j, i] = t[i, j]: the runs ending at j, contiguous
    one_more = (np.arange(groups) - 1) % groups  # a run more: count mod groups + 1
    for j in range(1, n + 1):
        finite = np.flatnonzero(np.isfinite(by_end[j, :j]))
        if not len(finite):
            continue
        lo = finite[0]  # long runs do not fit memory: skip them
        t = by_end[j, lo:j]
        masked = np.where(t[None, :] <= taus[:, None], t[None, :], np.inf)
        best = (dp[:, lo:j, :] + masked[:, :, None]).min(axis=1)
        dp[:, j, :] = best[:, one_more]
    return dp[:, n, 0], dp


def _spread(first: int, last: int, count: int) -> List[int]:
    """Up to `count` indices evenly spread over [first, last], both ends included."""
    return sorted(set(np.linspace(first, last, max(1, min(count, last - first + 1)))
                      .round().astype(int).tolist()))


def _token_splits(sorted_padded: np.ndarray, count: int) -> np.ndarray:
    """At most 2 * (count + 1) split positions in [0, n]: cuts into runs of about equal tokens
    (long samples get positions of their own, short ones are grouped) and evenly spread ones."""
    prefix = np.concatenate([[0], np.cumsum(sorted_padded)])
    cuts = np.searchsorted(prefix, np.linspace(0, prefix[-1], count + 1), side="left")
    # And evenly by count, so runs of many short samples can still be split.
    return np.unique(np.concatenate([cuts, _spread(0, len(sorted_padded), count + 1)]))


def _open_intervals(sums: np.ndarray, taus: np.ndarray, fill_drain: float,
                    best: float) -> List[Tuple[float, int, int]]:
    """(lower bound, a, b) of each gap between evaluated thresholds a < b that could still beat
    `best`: sums only fall as tau grows, so inside (a, b) the objective is at least
    sums[b] + fill_drain * taus[a + 1]."""
    done = np.flatnonzero(~np.isnan(sums))
    gaps = []
    for a, b in zip(done, done[1:]):
        if b - a > 1:
            lower = sums[b] + fill_drain * taus[a + 1]
            if lower < best:
                gaps.append((float(lower), int(a), int(b)))
    return sorted(gaps)


def partition(cands: Candidates, fill_drain: float, groups: int = 1, batch: int = 16,
              fast: bool = False) -> Tuple[float, List[Tuple[int, int]]]:
    """Minimum of sum_i t_i + fill_drain * max_i t_i over partitions of the sorted batch into
    runs [i, j) (count a multiple of `groups`); returns (objective_us, runs), (inf, []) when no
    partition fits. The bound tau on the max is searched over the candidate times: `batch`
    spread thresholds first, then the gaps whose lower bound can still win, until none is left
    (exact). fast: the first `batch` thresholds only."""
    t = cands.t_us
    n = t.shape[0] - 1
    if n == 0:
        return 0.0, []
    finite = np.unique(t[np.isfinite(t)])
    # Every sample k sits in some run [i, j) with i <= k < j: the max is at least the fastest.
    later = np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1]  # later[i, j]: min over j' >= j
    floor = np.minimum.accumulate(later[:n, 1:], axis=0)[np.arange(n), np.arange(n)].max()
    taus = finite[finite >= floor] if fill_drain > 0 else finite[-1:]
    if not len(taus):
        return np.inf, []
    sums = np.full(len(taus), np.nan)
    best, best_k, best_dp = np.inf, -1, None
    pick = _spread(0, len(taus) - 1, batch)
    while pick:
        found, dp = _min_sum(t, taus[pick], groups)
        sums[pick] = found
        objective = found + fill_drain * taus[pick]
        k = int(np.argmin(objective))
        if objective[k] < best:
            best, best_k, best_dp = float(objective[k]), pick[k], dp[k]
        if fast:
            break
        gaps = _open_intervals(sums, taus, fill_drain, best)
        share = max(1, batch // max(1, len(gaps)))
        pick = sorted({x for _, a, b in gaps[:batch] for x in _spread(a + 1, b - 1, share)})
    if best_k < 0:
        return np.inf, []
    return best, _backtrack(t, taus[best_k], groups, best_dp)


def _backtrack(t_us: np.ndarray, tau: float, groups: int,
               dp: np.ndarray) -> List[Tuple[int, int]]:
    """The runs of the least-sum partition under bound tau (dp: _min_sum's for tau)."""
    masked = np.where(t_us <= tau, t_us, np.inf)
    runs, j, c = [], t_us.shape[0] - 1, 0
    while j > 0:
        prev = (c - 1) % groups
        i = int(np.argmin(dp[:j, prev] + masked[:j, j]))
        runs.append((i, j))
        j, c = i, prev
    return runs[::-1]


# ====================================================================== order and recompute
def order_candidates(runs: Sequence[Tuple[int, int]]) -> List[List[int]]:
    """Orders of the runs (indices into `runs`, which ascend in length) to simulate: as
    partitioned, longest first, shortest first then the longest, and long/short alternating
    (DynaPipe-style: a long micro-batch's backward hides under short forwards). No one order
    wins often enough (up to ~10% apart under pp4), so fast mode tries them too."""
    m = len(runs)
    ascending = list(range(m))
    if m <= 1:
        return [ascending]
    alternating = [x for pair in zip(ascending[::-1], ascending) for x in pair][:m]
    seen, orders = set(), []
    for order in (ascending, ascending[::-1], ascending[-1:] + ascending[:-1],
                  list(dict.fromkeys(alternating))):
        if tuple(order) not in seen:
            seen.add(tuple(order))
            orders.append(order)
    return orders


class _RankSearch:
    """Order and recompute of one rank's runs (rows[r] rows of row_len[r] tokens) through the
    simulation. The three recompute modes of every run are priced once; a candidate is
    (order, modes), simulated with the schedule's extra warm-up `self.extra` (eager 1F1B)."""

    def __init__(self, costs: MicroBatchCosts, rows: np.ndarray, row_len: np.ndarray,
                 budget: float):
        self.costs, self.budget = costs, budget
        m = len(rows)
        self.all_modes = costs.price(np.tile(rows, 3), np.tile(row_len, 3),
                                     np.repeat(np.arange(3), m))
        self.m = m
        self.extra = 0

    def run(self, order: Sequence[int], modes: Sequence[int]) -> Tuple[float, np.ndarray]:
        columns = [mode * self.m + r for r, mode in zip(order, (modes[r] for r in order))]
        return simulate_rank(self.costs, self.all_modes.take(columns), self.extra)

    def adjust(self, order, modes: List[int], steps: int):
        """Add recompute while a stage is over the budget (the run with the most stored bytes
        on that stage first), then relax it where that fits and is faster; at most `steps`
        simulations. Returns (time_us, stage_bytes, modes)."""
        time_us, mem = self.run(order, modes)
        stored = self.all_modes.stored_bytes
        while steps > 0 and (mem > self.budget).any():
            stage = int(np.argmax(mem - self.budget))
            open_runs = [r for r in range(self.m) if modes[r] < 2]
            if not open_runs:
                break
            r = max(open_runs, key=lambda x: stored[stage, modes[x] * self.m + x])
            modes[r] += 1
            time_us, mem = self.run(order, modes)
            steps -= 1
        t_all = self.all_modes.stage_time_us.max(axis=0)

        def saving_us(r: int) -> float:
            return t_all[r + self.m * modes[r]] - t_all[r + self.m * (modes[r] - 1)]

        relax = sorted((r for r in range(self.m) if modes[r] > 0), key=saving_us, reverse=True)
        for r in relax:
            if steps <= 0 or (mem > self.budget).any():
                break
            trial = list(modes)
            trial[r] -= 1
            t_try, mem_try = self.run(order, trial)
            steps -= 1
            if t_try < time_us and (mem_try <= self.budget).all():
                time_us, mem, modes = t_try, mem_try, trial
        return time_us, mem, modes

    def _time_of(self, r: int, modes: Sequence[int]) -> float:
        """Run r's forward + backward on its slowest stage, in its recompute mode."""
        column = modes[r] * self.m + r
        return float((self.all_modes.fwd_us[:, column] + self.all_modes.bwd_us[:, column]).max())

    def key(self, time_us: float, mem: np.ndarray) -> Tuple[float, float]:
        """What an order is judged by: its excess over the budget first, then its time."""
        return max(0.0, float((mem - self.budget).max())), time_us

    def exact(self, order: List[int], modes: List[int], time_us: float, mem: np.ndarray,
              max_runs: int, node_limit: int):
        """Under 1F1B with at most max_runs runs, the best order of the runs (recompute kept)
        over plain 1F1B and every eager warm-up, by branch and bound (planner/order_search.py)
        from `order` under self.extra (exact unless it runs out of its node_limit prefixes);
        self.extra becomes the best one's. Returns (order, time_us, mem)."""
        if self.costs.layout.schedule != Schedule["1f1b"] or not 1 < self.m <= max_runs:
            return order, time_us, mem
        key = self.key(time_us, mem)
        # every extra warm-up, the current one first (its order is the incumbent)
        extras = [self.extra] + [e for e in [0, *_extra_warmups(self.costs.layout, self.m)]
                                 if e != self.extra]
        priced = self.all_modes.take([modes[r] * self.m + r for r in range(self.m)])
        costs = self.costs
        common = dict(stored_bytes=priced.stored_bytes,
                      tail_us=np.array([costs.tail_us(priced.sync_window_us[:, c])
                                        for c in range(self.m)]),
                      static_bytes=costs.static_bytes, extra_bytes=priced.extra_bytes.max(axis=1),
                      tail_bytes=costs.tail_bytes, budget_bytes=self.budget)
        problems = [problem_of(priced.fwd_us, priced.bwd_us,
                               priced.boundary_us if costs.layout.pp > 1 else None,
                               extra_warmup=extra, **common) for extra in extras]
        found = best_order(problems, list(order), key, node_limit)
        extra, self.extra = self.extra, extras[found.problem]
        t, mm = self.run(found.order, modes)
        if self.key(t, mm) < key:
            return list(found.order), t, mm
        self.extra = extra
        return order, time_us, mem

    def improve(self, order: List[int], modes: List[int], time_us: float, mem: np.ndarray,
                sims: int, exhaustive: int = 0):
        """A better order of the same runs (recompute kept per run): every order when there are
        at most max(sims, exhaustive) of them, else DynaPipe's group orders and then a
        first-improvement local search moving one run to another place (which covers swapping
        neighbours), until no move helps or `sims` simulations are spent; the memory check
        stays exact for every order tried. Returns (order, time_us, mem)."""
        best = (self.key(time_us, mem), list(order), time_us, mem)
        if math.factorial(self.m) <= max(sims, exhaustive):
            for trial in itertools.permutations(range(self.m)):
                t, mm = self.run(trial, modes)
                if self.key(t, mm) < best[0]:
                    best = (self.key(t, mm), list(trial), t, mm)
            return best[1:]
        # DynaPipe's seeds: the runs in 3 groups by time (short, middle, long), every order of
        # the groups, each group ascending or descending
        by_time = sorted(range(self.m), key=lambda r: self._time_of(r, modes))
        cut = [len(by_time) * k // 3 for k in range(4)]
        groups = [by_time[cut[k]:cut[k + 1]] for k in range(3)]
        for perm in itertools.permutations(range(3)):
            for direction in (1, -1):
                trial = [r for g in perm for r in groups[g][::direction]]
                if sims <= 0:
                    break
                t, mm = self.run(trial, modes)
                sims -= 1
                if self.key(t, mm) < best[0]:
                    best = (self.key(t, mm), trial, t, mm)
        improved = True
        while improved and sims > 0:
            improved = False
            current = best[1]
            for i, j in itertools.product(range(self.m), repeat=2):
                if j in (i, i - 1) or sims <= 0:  # no move, or a swap the pair (j, i) makes
                    continue
                trial = current[:i] + current[i + 1:]
                trial.insert(j, current[i])
                t, mm = self.run(trial, modes)
                sims -= 1
                if self.key(t, mm) < best[0]:
                    best = (self.key(t, mm), trial, t, mm)
                    improved = True
                    break
        return best[1:]


# ====================================================================== plan_iteration
def _fast_mode(fast_mode: Optional[bool]) -> bool:
    """fast_mode, or when None ORCHESTRATOR_FAST_MODE=1 as for the layout search."""
    if fast_mode is not None:
        return bool(fast_mode)
    return os.environ.get("ORCHESTRATOR_FAST_MODE", "") not in ("", "0")


def _pad_multiple(layout: ParallelLayout, options: PlanOptions) -> int:
    """Padded lengths are multiples of pad_multiple, of tp under sequence parallelism, and of
    2 x cp x tp under context parallelism (a sequence cut into 2 cp equal chunks, each split
    over tp: layout.check_sequence)."""
    multiple = options.pad_multiple
    if layout.sequence_parallel:
        multiple = math.lcm(multiple, layout.tp)
    if layout.cp > 1:
        multiple = math.lcm(multiple, 2 * layout.cp * layout.tp)
    return multiple


def _bad_samples(lengths_per_rank, costs: MicroBatchCosts, budget: float, max_seq_len: int,
                 multiple: int) -> List[Tuple[int, int, int, str]]:
    """(rank, index, length, reason) of every sample no plan can hold: not in
    [1, max_seq_len], or over the budget alone with full recompute."""
    bad = []
    for rank, lengths in enumerate(lengths_per_rank):
        lengths = np.asarray(lengths, dtype=np.int64)
        for index in np.flatnonzero((lengths < 1) | (lengths > max_seq_len)):
            bad.append((rank, int(index), int(lengths[index]),
                        f"length not in [1, max_seq_len={max_seq_len}]"))
        ok = np.flatnonzero((lengths >= 1) & (lengths <= max_seq_len))
        if not len(ok):
            continue
        alone = costs.alone_bytes(costs.price(np.ones(len(ok)),
                                              padded_length(lengths[ok], multiple, max_seq_len),
                                              np.full(len(ok), 2))).max(axis=0)
        for index, need in zip(ok[alone > budget], alone[alone > budget]):
            bad.append((rank, int(index), int(lengths[index]),
                        f"needs {need / GiB:.2f} GiB alone with full recompute > budget "
                        f"{budget / GiB:.2f} GiB"))
    return sorted(bad)


def _plan_rank(costs: MicroBatchCosts, lengths: np.ndarray, indices: np.ndarray, budget: float,
               max_seq_len: int, multiple: int, fast: bool, options: PlanOptions) -> _RankResult:
    """Partition, order and recompute of one rank's samples (indices into its batch). A
    partition found under the in-flight rule can still be over in the simulation when its
    largest extras and stored bytes come from different runs: the partition is then redone
    under a budget lowered by the excess (up to 8 times)."""
    layout = costs.layout
    exact = not fast  # fast mode skips the branch and bound at any size
    fast = fast and len(indices) >= options.fast_min_samples
    sort = np.argsort(lengths[indices], kind="stable")
    ordered = indices[sort]
    padded = padded_length(lengths[ordered], multiple, max_seq_len)
    groups = layout.pp if layout.schedule == Schedule.interleaved else 1
    fill_drain = (layout.pp - 1) / layout.virtual_stages
    steps = options.fast_adjustments if fast else options.normal_adjustments
    dp_budget = budget
    # Few samples: the partition's objective (sum + fill/drain x max) is a rough guide to the
    # simulated time (the fill and drain are those of the first and last micro-batches, which
    # can be small), so partitions with more, smaller micro-batches (_halved) are searched
    # too, and the simulation picks.
    splits = options.small_partition_splits if len(indices) < options.fast_min_samples else 0
    for attempt in range(8):
        if attempt:  # over the budget: fast mode's adjustment bound gives way to the budget
            steps = options.normal_adjustments
        cands = price_candidates(costs, lengths[ordered], padded, dp_budget, max_seq_len,
                                 _token_splits(padded, options.fast_splits) if fast else None)
        best, seen = None, set()
        objective, first = partition(cands, fill_drain, groups, fast=fast)
        variants = [first] if np.isfinite(objective) else []
        if variants and groups == 1:
            variants += _halved(cands, first, splits)
        for index, grid_runs in enumerate(variants):
            if tuple(grid_runs) in seen:
                continue
            seen.add(tuple(grid_runs))
            # the variants get fast mode's order search (the branch and bound below still
            # makes the winner's order exact where it is short)
            found = _order_and_recompute(costs, cands, grid_runs, budget, steps,
                                         fast or index > 0, options)
            if best is None or found[0].key(*found[1][1:]) < best[0].key(*best[1][1:]):
                best = found + (grid_runs,)
        if best is None:
            raise ConfigError(f"no micro-batch split of {len(ordered)} samples fits "
                              f"{layout.schedule} with pp={layout.pp} (interleaved needs a "
                              f"multiple of pp micro-batches): use schedule=1f1b or more samples")
        search, (order, time_us, mem), modes, grid_runs = best
        runs = [(int(cands.bounds[a]), int(cands.bounds[c])) for a, c in grid_runs]
        if exact:  # the better schedule's order: exact where few (branch and bound)
            order, time_us, mem = search.exact(order, modes, time_us, mem,
                                               options.exact_orders, options.exact_nodes)
        if search.extra:  # plain 1F1B where the extra warm-up gains nothing
            extra, search.extra = search.extra, 0
            plain = search.run(order, modes)
            if search.key(*plain) > search.key(time_us, mem):
                search.extra = extra
            else:
                time_us, mem = plain
        if (mem <= budget).all():
            break
        dp_budget -= float((mem - budget).max())
    mbs, packed = [], []
    for r in order:
        (i, j), (a, c) = runs[r], grid_runs[r]
        samples = tuple(int(x) for x in ordered[i:j])
        row_len = int(cands.row_len[a, c])
        mbs.append(MicroBatch(samples, row_len, MODE_NAMES[modes[r]]))
        packed.append(_rows_of(samples, lengths, row_len) if cands.rows[a, c] < j - i else ())
    return _RankResult(tuple(mbs), time_us, mem, tuple(packed), search.extra)


def _halved(cands, grid_runs, count: int) -> List[List[Tuple[int, int]]]:
    """Partitions with more, smaller micro-batches, where every piece fits the budget: the k
    runs of the most samples each cut in two (k = 1 .. count), and the run of the most samples
    cut in 3 .. count + 1 pieces of about equal sample counts."""
    if not grid_runs:
        return []
    bounds = cands.bounds
    size = [int(bounds[c] - bounds[a]) for a, c in grid_runs]
    largest = sorted(range(len(grid_runs)), key=lambda r: -size[r])

    def pieces(a: int, c: int, k: int) -> List[Tuple[int, int]]:
        cuts = sorted({a, c, *np.linspace(a, c, k + 1).round().astype(int).tolist()})
        return list(zip(cuts, cuts[1:]))

    wanted = [{r: 2 for r in largest[:k]} for k in range(1, count + 1)]
    wanted += [{largest[0]: k} for k in range(3, count + 2)]
    out = []
    for cut_into in wanted:
        runs = []
        for r, (a, c) in enumerate(grid_runs):
            runs += pieces(a, c, min(cut_into.get(r, 1), c - a))
        if len(runs) > len(grid_runs) and all(np.isfinite(cands.t_us[a, c]) for a, c in runs):
            out.append(runs)
    return out


def _order_and_recompute(costs: MicroBatchCosts, cands, grid_runs, budget: float, steps: int,
                         fast: bool, options: PlanOptions):
    """The order, recompute and schedule (plain or eager 1F1B) of one partition's runs:
    (search, (order, time_us, mem), modes), search.extra the warm-up chosen."""
    layout = costs.layout
    search = _RankSearch(costs, np.array([cands.rows[a, c] for a, c in grid_runs]),
                         np.array([cands.row_len[a, c] for a, c in grid_runs]), budget)
    runs = [(int(cands.bounds[a]), int(cands.bounds[c])) for a, c in grid_runs]
    best = None
    for order in order_candidates(runs):
        modes = [int(cands.mode[a, c]) for a, c in grid_runs]
        time_us, mem, modes = search.adjust(order, modes, steps)
        if best is None or (time_us, mem.max() > budget) < (best[0], best[1].max() > budget):
            best = (time_us, mem, modes, order)
    # Eager 1F1B: more micro-batches in flight where memory allows; each extra warm-up from
    # the best candidate's order, recompute re-adjusted to its memory. Plain 1F1B's best is
    # improved too, so the plan is never worse than without the eager schedules.
    eager = None
    for extra in _extra_warmups(layout, len(runs)):
        search.extra = extra
        found = search.adjust(best[3], list(best[2]), steps)
        if eager is None or search.key(*found[:2]) < search.key(*eager[:2]):
            eager = found + (best[3], extra)
    sims = options.fast_order_sims if fast else options.normal_order_sims
    exhaustive = 0 if fast else options.exhaustive_orders
    starts = [best + (0,)] + ([eager] if eager is not None else [])
    if fast:  # only the better schedule's order is searched
        starts = [min(starts, key=lambda x: search.key(x[0], x[1]))]
    found = None
    for time_us, mem, modes, order, extra in starts:
        search.extra = extra
        result = search.improve(order, modes, time_us, mem, sims, exhaustive)
        if found is None or search.key(*result[1:]) < search.key(*found[0][1:]):
            found = (result, modes, extra)
    result, modes, search.extra = found
    return search, result, modes


def _extra_warmups(layout: ParallelLayout, m: int) -> range:
    """The eager 1F1B warm-ups worth simulating beside plain 1F1B: 1 .. min(p - 1, m - 1)
    (stage 0 can hold at most m in flight); none for one stage or the interleaved schedule."""
    if layout.schedule != Schedule["1f1b"]:
        return range(0)
    return range(1, min(layout.pp - 1, m - 1) + 1)


def _rows_of(samples: Tuple[int, ...], lengths: np.ndarray,
             row_len: int) -> Tuple[Tuple[int, ...], ...]:
    """The samples (indices into lengths) packed into rows of row_len tokens by pack_rows."""
    return tuple(tuple(samples[k] for k in row)
                 for row in pack_rows(lengths[list(samples)].tolist(), row_len))


def plan_iteration(lengths_per_rank: Sequence[Sequence[int]], layout: ParallelLayout,
                   model: ModelCost, hardware: HardwareModel, memory_budget_bytes: float, *,
                   max_seq_len: int, fast_mode: Optional[bool] = None,
                   options: PlanOptions = PlanOptions(), costs: Optional[MicroBatchCosts] = None,
                   on_bad: str = "raise") -> ExecutionPlan:
    """The dynamic plan of one iteration: per dp rank (lengths_per_rank[r]: its sequence
    lengths in tokens), micro-batches, their order and recompute, with the predicted iteration
    time (us) and peak memory per stage (bytes); see the module docstring.

    Bad input (an empty batch, a length outside [1, max_seq_len], a sample over the budget alone
    with full recompute): on_bad="raise" raises ConfigError naming the sample and the limit;
    "skip" leaves it out and records it in plan.skipped. A rank left with nothing has no
    micro-batch (its time is its gradient sync and optimizer step)."""
    t0 = time.perf_counter()
    if len(lengths_per_rank) != layout.dp:
        raise ConfigError(f"lengths for {len(lengths_per_rank)} data-parallel ranks, layout has "
                          f"dp={layout.dp}")
    costs = costs or MicroBatchCosts(layout, model, hardware)
    fast = _fast_mode(fast_mode)
    multiple = _pad_multiple(layout, options)
    if on_bad not in ("raise", "skip"):
        raise ValueError(f"on_bad must be 'raise' or 'skip', got {on_bad!r}")
    if on_bad == "raise" and not any(len(x) for x in lengths_per_rank):
        raise ConfigError("empty batch: no sequence on any data-parallel rank")
    bad = _bad_samples(lengths_per_rank, costs, memory_budget_bytes, max_seq_len, multiple)
    if bad and on_bad == "raise":
        rank, index, length, reason = bad[0]
        raise ConfigError(f"sample {index} of dp rank {rank} (length {length}): {reason}; "
                          f"drop it from the data or raise the limit ({len(bad)} such samples)")
    dropped = {(rank, index) for rank, index, _, _ in bad}
    results = []
    for rank, lengths in enumerate(lengths_per_rank):
        lengths = np.asarray(lengths, dtype=np.int64)
        keep = np.array([i for i in range(len(lengths)) if (rank, i) not in dropped],
                        dtype=np.int64)
        results.append(_plan_rank(costs, lengths, keep, memory_budget_bytes, max_seq_len,
                                  multiple, fast, options))
    if not bad:
        results = _keep_faster_baselines(costs, results, lengths_per_rank, memory_budget_bytes,
                                         max_seq_len)
    results = _in_lockstep(costs, results)
    return _make_plan(costs, results, memory_budget_bytes, Microbatching.dynamic,
                      "fast" if fast else "normal", t0, skipped=bad)


def _in_lockstep(costs: MicroBatchCosts, results: List[_RankResult]) -> List[_RankResult]:
    """The ranks' results with a MoE model's expert groups in lockstep (planner/lockstep.py),
    the ranks that changed priced again."""
    groups = lockstep_groups(costs.layout, costs.model.moe is not None)
    if not groups:
        return results
    mbs, rows, extra, changed = align(costs.layout, groups, [r.micro_batches for r in results],
                                      [r.packed_rows for r in results],
                                      [r.extra_warmup for r in results])
    priced = _price_ranks(costs, [mbs[r] for r in changed], [rows[r] for r in changed],
                          [extra[r] for r in changed])
    results = list(results)
    for r, result in zip(changed, priced):
        results[r] = result
    return results


# ====================================================================== baselines
def _baseline_mode(layout: ParallelLayout) -> Recompute:
    """One recompute mode for every micro-batch: the layout's strongest over its stages."""
    return max((mode for mode, _ in layout.recompute), key=MODE_CODES.__getitem__)


def _keep_faster_baselines(costs: MicroBatchCosts, results: List[_RankResult],
                           lengths_per_rank, budget: float, max_seq_len: int) -> List[_RankResult]:
    """Per rank, the padded or packed baseline's micro-batches where they are faster and fit
    the budget: the partition's objective only approximates the simulation, and it packs in
    sorted order, which can need more rows than data order."""
    layout = costs.layout
    for build in (_padded_micro_batches, _packed_micro_batches):
        mbs, packed = build(lengths_per_rank, layout, max_seq_len)
        if layout.schedule == Schedule.interleaved and any(len(x) % layout.pp for x in mbs):
            continue  # interleaving needs a multiple of pp micro-batches
        for rank, other in enumerate(_price_ranks(costs, mbs, packed)):
            if other.time_us < results[rank].time_us and (other.stage_bytes <= budget).all():
                results[rank] = other
    return results


def _padded_micro_batches(lengths_per_rank, layout: ParallelLayout, max_seq_len: int):
    """(micro-batches, rows) per rank of the padded baseline (padded_plan)."""
    longest = max((max(x) for x in lengths_per_rank if len(x)), default=1)
    padded = int(padded_length(longest, _pad_multiple(layout, PlanOptions()), max_seq_len))
    mode, size = _baseline_mode(layout), layout.micro_batch_size
    mbs = [[MicroBatch(tuple(range(i, min(i + size, len(x)))), padded, mode)
            for i in range(0, len(x), size)] for x in lengths_per_rank]
    return mbs, [[()] * len(x) for x in mbs]


def _packed_micro_batches(lengths_per_rank, layout: ParallelLayout, max_seq_len: int):
    """(micro-batches, rows) per rank of the packed baseline (packed_plan)."""
    mode, size = _baseline_mode(layout), layout.micro_batch_size
    mbs, packed = [], []
    for lengths in lengths_per_rank:
        rows = pack_rows(lengths, max_seq_len)
        groups = [tuple(rows[i:i + size]) for i in range(0, len(rows), size)]
        mbs.append([MicroBatch(tuple(x for row in g for x in row), max_seq_len, mode)
                    for g in groups])
        packed.append(groups)
    return mbs, packed


def padded_plan(lengths_per_rank: Sequence[Sequence[int]], layout: ParallelLayout,
                model: ModelCost, hardware: HardwareModel, memory_budget_bytes: float, *,
                max_seq_len: int, costs: Optional[MicroBatchCosts] = None) -> ExecutionPlan:
    """Baseline: micro-batches of layout.micro_batch_size consecutive samples (data order), all
    padded to the longest sequence of the whole batch (a multiple of tp under sequence
    parallelism), the layout's recompute; priced like plan_iteration."""
    costs = costs or MicroBatchCosts(layout, model, hardware)
    mbs, packed = _padded_micro_batches(lengths_per_rank, layout, max_seq_len)
    return _baseline_plan(costs, mbs, packed, memory_budget_bytes, Microbatching.padded)


def packed_plan(lengths_per_rank: Sequence[Sequence[int]], layout: ParallelLayout,
                model: ModelCost, hardware: HardwareModel, memory_budget_bytes: float, *,
                max_seq_len: int, costs: Optional[MicroBatchCosts] = None) -> ExecutionPlan:
    """Baseline: samples packed into rows of max_seq_len tokens (pack_rows), micro-batches of
    layout.micro_batch_size rows, each row priced as one max_seq_len sequence (attention over
    the whole row), the layout's recompute."""
    costs = costs or MicroBatchCosts(layout, model, hardware)
    mbs, packed = _packed_micro_batches(lengths_per_rank, layout, max_seq_len)
    return _baseline_plan(costs, mbs, packed, memory_budget_bytes, Microbatching.packed)


def _baseline_plan(costs: MicroBatchCosts, mbs, packed, budget: float,
                   kind: Microbatching) -> ExecutionPlan:
    """A baseline's micro-batches priced as price_plan does, a MoE model's expert groups in
    lockstep."""
    t0 = time.perf_counter()
    results = _in_lockstep(costs, _price_ranks(costs, mbs, packed))
    return _make_plan(costs, results, budget, kind, "normal", t0)
