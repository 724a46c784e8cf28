"""The order of a rank's micro-batches and their recompute, searched through the event
simulation under plain and eager 1F1B (_RankSearch.improve); exact for a few micro-batches
(planner/order_search.py)."""
from __future__ import annotations

import itertools
import math
from typing import List, Sequence, Tuple

import numpy as np

from orchestrator.choices import Schedule
from orchestrator.planner.microbatch_costs import (MicroBatchCosts)
from orchestrator.planner.order_search import best_order, problem_of
from orchestrator.planner.execution_plan import _extra_warmups, simulate_rank


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
