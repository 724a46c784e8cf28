"""The best order of a few micro-batches under 1F1B (plain or eager), by branch and bound.

The dynamic planner (planner/dynamic.py) orders each rank's micro-batches through the event
simulation (planner/schedule.py). For up to ~8 micro-batches the best of all m! orders is found
here without trying them all: a depth-first search fixes the order one position at a time and
simulates, incrementally, every operation the fixed prefix already determines (a stage's next
operation is known once its micro-batch is placed; its start is max(the stage is free, its input
has arrived), as in the simulation, so the prefix's times are final). A prefix is dropped when
even its lower bound cannot beat the best order found:
- time: for every stage, when it is free now + every operation it still has to run (those of
  placed micro-batches, and the forward and backward of every unplaced one, whatever their
  order) + the least tail any last micro-batch could leave it (its gradient sync and optimizer
  step), the largest over the stages;
- memory: the in-flight peaks so far only grow, so their excess over the budget only grows.
Orders are judged as the planner judges them: excess over the budget first, then time. Equal
micro-batches are placed in one way only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Schedule
from orchestrator.workload.order import stage_order


@dataclass(frozen=True)
class OrderProblem:
    """m micro-batches (columns) on p stages, 1F1B with extra_warmup. fwd_us / bwd_us [p, m]:
    each operation's time including its send (forward to the next stage, backward to the
    previous); stored_bytes [p, m]: what an in-flight micro-batch holds; tail_us [m, p]: stage
    s's time after its last operation when micro-batch c is the last (exposed gradient sync +
    optimizer step); memory of an order is static_bytes + max(peak in-flight + extra_bytes,
    tail_bytes) per stage (each [p]), judged against budget_bytes."""

    fwd_us: np.ndarray
    bwd_us: np.ndarray
    stored_bytes: np.ndarray
    tail_us: np.ndarray
    static_bytes: np.ndarray
    extra_bytes: np.ndarray
    tail_bytes: np.ndarray
    budget_bytes: float
    extra_warmup: int = 0

    def excess(self, peaks: Sequence[float]) -> float:
        """Bytes over the budget of the worst stage with these in-flight peaks (0 if none)."""
        mem = self.static_bytes + np.maximum(np.asarray(peaks) + self.extra_bytes,
                                             self.tail_bytes)
        return max(0.0, float((mem - self.budget_bytes).max()))


@dataclass(frozen=True)
class OrderResult:
    """The best order found (key: (excess bytes, time us)) and the index of its problem (of
    those given to best_order); exact: every order was covered (False when node_limit
    stopped the search first); nodes: prefixes simulated."""

    order: Tuple[int, ...]
    key: Tuple[float, float]
    exact: bool
    nodes: int
    problem: int = 0


class _Search:
    """The depth-first search's state: per stage the next operation, when it is free, the
    live and peak in-flight bytes and the time of the operations run so far; per (stage,
    position) the forward's and backward's end."""

    def __init__(self, problem: OrderProblem, node_limit: int):
        self.pr = problem
        p, m = problem.fwd_us.shape
        self.p, self.m = p, m
        self.ops = [stage_order(p, s, m, Schedule["1f1b"], 1, problem.extra_warmup)
                    for s in range(p)]
        # where each op sits in its stage's list: a dependency is done when its stage is past it
        self.index_f = np.zeros((p, m), dtype=int)
        self.index_b = np.zeros((p, m), dtype=int)
        for s, ops in enumerate(self.ops):
            for i, (kind, _, pos) in enumerate(ops):
                (self.index_f if kind == "F" else self.index_b)[s, pos] = i
        self.index_f, self.index_b = self.index_f.tolist(), self.index_b.tolist()
        self.end_f = [[0.0] * m for _ in range(p)]
        self.end_b = [[0.0] * m for _ in range(p)]
        self.fwd, self.bwd = problem.fwd_us.tolist(), problem.bwd_us.tolist()
        self.stored = problem.stored_bytes.tolist()
        self.total = (problem.fwd_us + problem.bwd_us).sum(axis=1).tolist()  # [p]
        self.tails = problem.tail_us.tolist()  # [m][p]
        self.cols: List[int] = [0] * m
        self.node_limit, self.nodes = node_limit, 0
        # interchangeable columns: the same times, bytes and tail
        keys = [tuple(np.concatenate([problem.fwd_us[:, c], problem.bwd_us[:, c],
                                      problem.stored_bytes[:, c], problem.tail_us[c]]).tolist())
                for c in range(m)]
        self.twin = [keys.index(k) for k in keys]  # the first column equal to each

    def advance(self, k: int, state):
        """Run every operation the first k placed positions determine; state is (nxt, free,
        live, peak, done) per stage, changed in place."""
        nxt, free, live, peak, done = state
        p, ops, cols = self.p, self.ops, self.cols
        progress = True
        while progress:
            progress = False
            for s in range(p):
                stage_ops = ops[s]
                while nxt[s] < len(stage_ops):
                    kind, _, pos = stage_ops[nxt[s]]
                    if pos >= k:
                        break
                    c = cols[pos]
                    if kind == "F":
                        if s and self.index_f[s - 1][pos] >= nxt[s - 1]:
                            break
                        ready = self.end_f[s - 1][pos] if s else 0.0
                        end = max(free[s], ready) + self.fwd[s][c]
                        done[s] += self.fwd[s][c]
                        self.end_f[s][pos] = end
                        live[s] += self.stored[s][c]
                        peak[s] = max(peak[s], live[s])
                    else:
                        if s < p - 1:
                            if self.index_b[s + 1][pos] >= nxt[s + 1]:
                                break
                            ready = self.end_b[s + 1][pos]
                        else:
                            ready = self.end_f[s][pos]
                        end = max(free[s], ready) + self.bwd[s][c]
                        done[s] += self.bwd[s][c]
                        self.end_b[s][pos] = end
                        live[s] -= self.stored[s][c]
                    free[s] = end
                    nxt[s] += 1
                    progress = True

    def bound(self, k: int, state, unplaced: List[int]) -> Tuple[float, float]:
        """(excess, time) no completion of the k placed positions can beat. Each stage ends
        no earlier than it is free now + all its remaining work, nor before the next stage
        ends + its own backward of the last micro-batch (which needs the next stage's): for
        the last micro-batch c (one of the unplaced), the larger of the two down the stages,
        plus c's tail; the least over c."""
        _, free, _, peak, done = state
        p = self.p
        # every operation not run yet, placed or not: all of them less those run
        own = [free[s] + self.total[s] - done[s] for s in range(p)]
        lower = float("inf")
        for c in unplaced or [self.cols[self.m - 1]]:
            tails = self.tails[c]
            end = own[p - 1]
            time_us = end + tails[p - 1]
            for s in range(p - 2, -1, -1):
                end = max(own[s], end + self.bwd[s][c])
                time_us = max(time_us, end + tails[s])
            lower = min(lower, time_us)
        return self.pr.excess(peak), lower

    def run(self, incumbent: Sequence[int], incumbent_key: Tuple[float, float]):
        """(key, order) of the best order, exact: no node limit cut the search."""
        self.best = (tuple(incumbent_key), tuple(incumbent))
        start = ([0] * self.p, [0.0] * self.p, [0.0] * self.p, [0.0] * self.p,
                 [0.0] * self.p)
        self.exact = True
        self._dfs(0, start, list(incumbent), set())
        return self.best, self.exact

    def _dfs(self, k: int, state, preferred: List[int], placed: set) -> None:
        if k == self.m:
            _, free, _, peak, _ = state
            t = max(free[s] + self.tails[self.cols[-1]][s] for s in range(self.p))
            key = (self.pr.excess(peak), t)
            if key < self.best[0]:
                self.best = (key, tuple(self.cols))
            return
        tried = set()
        for c in [preferred[k]] + [c for c in range(self.m) if c != preferred[k]]:
            if c in placed or self.twin[c] in tried:
                continue
            if self.nodes >= self.node_limit:
                self.exact = False
                return
            tried.add(self.twin[c])
            self.nodes += 1
            self.cols[k] = c
            child = tuple(list(x) for x in state)
            self.advance(k + 1, child)
            placed.add(c)
            unplaced = [x for x in range(self.m) if x not in placed]
            if self.bound(k + 1, child, unplaced) < self.best[0]:
                self._dfs(k + 1, child, preferred, placed)
            placed.discard(c)


def best_order(problems: Sequence[OrderProblem], incumbent: Sequence[int],
               incumbent_key: Tuple[float, float], node_limit: int = 20000) -> OrderResult:
    """The best order of m columns (a permutation of range(m)) over one or more problems (the
    same micro-batches under different schedules: plain and eager 1F1B), starting from a known
    order of problems[0] and its key (excess, time_us), which is returned when nothing beats
    it. The node limit is shared; problems are searched in the order given."""
    m = problems[0].fwd_us.shape[1]
    if sorted(incumbent) != list(range(m)):
        raise ValueError(f"incumbent must order all {m} micro-batches, got {list(incumbent)}")
    best, index, exact, nodes = (tuple(incumbent_key), tuple(incumbent)), 0, True, 0
    for i, problem in enumerate(problems):
        search = _Search(problem, node_limit - nodes)
        found, covered = search.run(best[1], best[0])
        nodes += search.nodes
        exact = exact and covered
        if found[0] < best[0]:
            best, index = found, i
    return OrderResult(best[1], best[0], exact, nodes, index)


def problem_of(fwd_us: np.ndarray, bwd_us: np.ndarray, boundary_us: Optional[np.ndarray],
               **kw) -> OrderProblem:
    """An OrderProblem from the simulation's inputs: operation times without sends, and the
    sends across each boundary ([p, m], row j: j -> j + 1), as simulate() adds them."""
    fwd, bwd = np.array(fwd_us, dtype=float), np.array(bwd_us, dtype=float)
    if boundary_us is not None and fwd.shape[0] > 1:
        fwd[:-1] += boundary_us[:-1]
        bwd[1:] += boundary_us[:-1]
    return OrderProblem(fwd, bwd, **kw)
