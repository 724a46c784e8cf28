"""Exact search of the fastest ParallelLayout under a memory budget.

The space: every (tp, pp, dp, ZeRO stage, sequence parallel, micro-batch size, schedule, virtual
stages) allowed by SearchSpace and by divisibility (a "config"), times every pipeline partition
(uneven layers per stage) and every per-stage recompute choice. The result is the minimum of
prediction.evaluate() over all feasible layouts of the space, found without enumerating them:

1. Per config, stage j's best recompute for n layers is the fastest option that fits the budget
   (time grows and memory falls with recompute, and e_0 does not depend on it), tabulated for
   all n at once with numpy: t*_j(n).
2. The objective alpha * sum_j t_j + beta * max_j t_j + e_0(n_0) + o_0(n_0) (stage 0's sync and
   optimizer step) is a sum plus a max, so for a threshold tau on max_j t_j a dynamic programme
   over (stage, layers used) gives the least sum with every stage <= tau; minimising
   beta * tau + that sum over the distinct values of t* is exact. Thresholds are batched through
   one vectorised DP and stop as soon as beta * tau + (a lower bound of the sum) cannot beat the
   incumbent.
3. Configs are visited in order of a lower bound (no recompute, perfectly balanced stages);
   once the bound reaches the k-th best found, the rest cannot enter the top-k and are skipped.

Fast mode keeps one schedule (the first of SearchSpace.schedules), recomputes whole stages only
(no choice of k layers) and takes only the min-max threshold and the next few (no full sweep).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orchestrator import errors
from orchestrator.choices import Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import ConfigKey, GiB, StageCosts
from orchestrator.planner.prediction import Prediction, evaluate
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.terms import MODE_NAMES
from orchestrator.planner.space import (SearchSpace, _divisors, auto_max_cp,  # noqa: F401
                                        enumerate_configs)

INF = float("inf")
FAST_MODE_THRESHOLDS = 2  # thresholds tried per config in fast mode (min-max and the next one)


@dataclass(frozen=True)
class SearchResult:
    """best/prediction: the fastest feasible layout and evaluate()'s prediction for it; top: up
    to top_k (layout, prediction), best first, one per config; considered: configs that passed
    the divisibility rules; rejected: configs dropped, by reason; pruned: configs skipped because
    their lower bound could not enter the top_k; solved: configs whose partitions were optimised;
    elapsed_s: wall time of the search."""

    best: ParallelLayout
    prediction: Prediction
    top: Tuple[Tuple[ParallelLayout, Prediction], ...]
    considered: int
    rejected: Dict[str, int]
    pruned: int
    solved: int
    elapsed_s: float
    fast_mode: bool

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready summary (the strategy file's body)."""
        return {
            "best": self.best.to_dict(),
            "prediction": self.prediction.to_dict(),
            "top": [{"layout": lay.to_dict(), "iteration_time_us": pred.iteration_time_us,
                     "peak_memory_bytes": pred.peak_memory_bytes} for lay, pred in self.top],
            "considered": self.considered, "rejected": dict(self.rejected),
            "pruned": self.pruned, "solved": self.solved, "elapsed_s": self.elapsed_s,
            "fast_mode": self.fast_mode,
        }


class InfeasibleError(errors.InfeasibleError):
    """No layout of the space fits. Carries the closest layout (least memory per device), the
    bytes it needs per device, and which bound to relax ("memory_budget_bytes",
    "global_batch_size", ...) with suggestions, and `relax`: SearchSpace field -> how."""

    def __init__(self, message: str, bound: str, closest: Optional[ParallelLayout] = None,
                 needed_bytes: Optional[float] = None, suggestions: Sequence[str] = (),
                 relax: Optional[Dict[str, str]] = None,
                 rejected: Optional[Dict[str, int]] = None):
        super().__init__(message)
        self.relax = dict(relax or {})  # SearchSpace field -> how to relax it
        self.rejected = dict(rejected or {})  # the layouts dropped, by reason
        self.bound = bound
        self.closest = closest
        self.needed_bytes = needed_bytes
        self.suggestions = tuple(suggestions)


@dataclass
class _Table:
    """Stage options of one config: t[j, n] fastest time (us) of stage j with n layers under the
    budget (inf: none fits), code/k: its recompute; c[j, n]: its contribution to the objective;
    counts: the layer counts each stage may hold (stage_counts_valid)."""

    t: np.ndarray
    code: np.ndarray
    k: np.ndarray
    c: np.ndarray
    sum_lb: float  # lower bound of alpha * sum t + e_0 over all partitions
    counts: List[List[int]]  # per stage, the layer counts it may hold, ascending
    short_ends: bool  # the first and last stages may hold counts that are not multiples of v


def _stage_options(costs: StageCosts, L: int, budget: float, modes: Sequence[str],
                   fast: bool) -> _Table:
    """Tabulate, for every stage j and layer count n it may hold (stage_counts_valid), the
    fastest recompute that fits the budget, as (pp, N + 1) arrays."""
    key = costs.key
    p, v = key.pp, key.virtual_stages
    N = L - (p - 1) * v + (2 if costs.short_ends else 0)
    n = np.broadcast_to(np.arange(N + 1, dtype=float), (p, N + 1))
    j = np.arange(p)[:, None]
    valid = stage_counts_valid(n, v, costs.short_ends)
    zeros = np.zeros_like(n)
    best_t = np.full((p, N + 1), INF)
    best_code = np.zeros((p, N + 1), dtype=np.int8)
    best_k = np.zeros((p, N + 1), dtype=np.int64)

    def offer(opt_t, opt_ok, opt_code, opt_k):
        better = opt_ok & valid & (opt_t < best_t)
        best_t[better] = opt_t[better]
        best_code[better] = opt_code
        best_k[better] = opt_k[better]

    if Recompute.none in modes:
        ok = costs.memory_bytes(j, n, 0, zeros) <= budget
        offer(costs.stage_time_us(j, n, 0, zeros), ok, 0, zeros.astype(np.int64))
    if Recompute.selective in modes:
        ok = costs.memory_bytes(j, n, 1, n) <= budget
        offer(costs.stage_time_us(j, n, 1, n), ok, 1, n.astype(np.int64))
    if Recompute.full in modes:
        if fast:
            k = n.copy()
        else:
            # Memory never grows with k: the least k (r layers of each chunk) that fits, by
            # bisection on r for every (stage, n) at once (a linear guess from the activations
            # would miss the orchestrator engine's other terms).
            steps = np.maximum(np.ceil(n / v), 1.0)
            layers_of = chunk_recompute_layers(n, v)
            lo, hi = np.ones_like(n), steps.copy()
            fits_all = costs.memory_bytes(j, n, 2, np.minimum(layers_of(steps), n)) <= budget
            while np.any(lo < hi):
                mid = np.floor((lo + hi) / 2)
                ok_mid = costs.memory_bytes(j, n, 2, np.minimum(layers_of(mid), n)) <= budget
                hi = np.where((lo < hi) & ok_mid, mid, hi)
                lo = np.where((lo < hi) & ~ok_mid, mid + 1, lo)
            # n + v: does not fit even fully recomputed
            k = np.where(fits_all, layers_of(lo), n + v)
        k = np.minimum(k, np.maximum(n, v))
        ok = (costs.memory_bytes(j, n, 2, k) <= budget) & (k <= n)
        offer(costs.stage_time_us(j, n, 2, k), ok, 2, k.astype(np.int64))
    c = costs.alpha * best_t
    e0 = costs.tail_us(0, n[0])  # e_0 + o_0
    c[0] = c[0] + e0
    # Lower bound of the sum part: every layer without recompute, fixed per-stage terms, the
    # least e_0 any first stage can have.
    fixed = float(np.sum(_per_stage_us(costs)))
    finite_e0 = e0[valid[0] & np.isfinite(best_t[0])]
    sum_lb = (costs.alpha * (L * costs.layer.total_us + fixed)
              + (float(finite_e0.min()) if finite_e0.size else 0.0))
    if costs.short_ends:
        counts = [np.flatnonzero(row).tolist() for row in valid]
    else:
        counts = [list(range(v, N + 1, v))] * p  # multiples of v: one list for every stage
    return _Table(best_t, best_code, best_k, c, sum_lb, counts, costs.short_ends)


def _per_stage_us(costs: StageCosts) -> np.ndarray:
    """Per-stage time (us per micro-batch) that does not depend on the layers: "other" and
    the pipeline sends, forward + backward."""
    return costs.other.fwd_us + costs.other.bwd_us + costs.sends.fwd_us + costs.sends.bwd_us


def stage_counts_valid(n: np.ndarray, v: int, short_ends: bool) -> np.ndarray:
    """Which layer counts n ([pp, N + 1]) each stage may hold: >= v and a multiple of v; with
    `short_ends` (Megatron-LM, v > 1) the first and last stages also any n >= 1 whose short
    end chunk is >= 0 layers (layout.stage_chunks: (v - 1) * ceil(n / v) <= n)."""
    valid = (n >= v) & (n % v == 0)
    if short_ends and v > 1:
        ends = (n >= 1) & ((v - 1) * np.ceil(n / v) <= n)
        valid = valid.copy()
        valid[[0, -1]] |= ends[[0, -1]]
    return valid


def chunk_recompute_layers(n, v: int):
    """A function of r: the layers stages of n recompute in full with the first r of each of
    their v chunks (all of a shorter chunk), layout.chunk_recompute's k vectorised (r * v for
    equal chunks, min(r, n) for v = 1)."""
    c = np.ceil(np.asarray(n, dtype=float) / v)
    short = np.maximum(n - (v - 1) * c, 0.0)
    return lambda r: (v - 1) * np.minimum(r, c) + np.minimum(r, short)


def largest_stage_lb(L: int, p: int, v: int, short_ends: bool) -> int:
    """The least layer count the largest stage of any partition of L layers holds: ceil(L /
    (p v)) v with equal chunks; with short end chunks the least X such that p - 2 middle
    stages of a multiple of v and two end stages, all <= X, can hold L."""
    if not (short_ends and v > 1 and p > 1):
        return math.ceil(L / (p * v)) * v

    def end_cap(x: int) -> int:  # the most an end stage of <= x layers holds
        while x > 0 and (v - 1) * math.ceil(x / v) > x:
            x -= 1
        return x

    x = max(1, math.ceil(L / p))
    while (p - 2) * (x // v) * v + 2 * end_cap(x) < L:
        x += 1
    return x


def config_lower_bound(costs: StageCosts, L: int) -> float:
    """A lower bound (us) of the iteration time of any layout of this config: no recompute,
    perfectly balanced stages, no exposed data-parallel sync."""
    key = costs.key
    p, v = key.pp, key.virtual_stages
    layer = costs.layer.total_us
    per_stage = _per_stage_us(costs)
    total = L * layer + float(per_stage.sum())
    biggest = largest_stage_lb(L, p, v, costs.short_ends)  # some stage holds at least this
    max_lb = max(total / p, biggest * layer + float(per_stage.min()))
    return costs.alpha * total + costs.beta * max_lb


def may_fit(costs: StageCosts, L: int, budget: float, modes: Sequence[str]) -> bool:
    """False when no partition of this config can fit the budget: some stage holds at least
    ceil(L / (p v)) v layers, and memory grows with the layers and falls with recompute, so
    the least any stage needs at that count under the most recompute allowed bounds every
    partition's peak from below (one call where solving tabulates every stage size)."""
    key = costs.key
    p, v = key.pp, key.virtual_stages
    biggest = largest_stage_lb(L, p, v, costs.short_ends)
    j = np.arange(p)
    n = np.full(p, float(biggest))
    # the most recompute allowed holds the least (none > selective > full)
    code = max(c for c, mode in enumerate(MODE_NAMES) if mode in modes)
    k = n if code else np.zeros_like(n)
    return float(np.min(costs.memory_bytes(j, n, code, k))) <= budget


def _min_sum_dp(table: _Table, L: int, v: int, taus: np.ndarray):
    """For each threshold in `taus`: least sum of table.c over partitions of L layers with every
    stage time <= tau. Returns (values[T], choice[p, T, L+1]) for backtracking."""
    p, width = table.t.shape
    T = len(taus)
    dp = np.full((T, L + 1), INF)
    dp[:, 0] = 0.0
    choice = np.zeros((p, T, L + 1), dtype=np.int16)
    tau_max = float(taus.max())
    counts = table.counts
    # layers the stages before j hold at least (each its fewest)
    before = np.cumsum([0] + [c[0] if c else L + 1 for c in counts]).tolist()
    for j in range(p):
        new = np.full((T, L + 1), INF)
        ch = choice[j]
        lo, hi = before[j], L - (before[p] - before[j])  # layers before stage j
        hi_after = L - (before[p] - before[j + 1])
        if hi < lo:
            return np.full(T, INF), choice
        for n in counts[j]:
            tn = table.t[j, n]
            if not tn <= tau_max or lo + n > hi_after:
                break  # times grow with n: no larger stage fits any threshold
            top = min(hi, hi_after - n)
            cand = dp[:, lo:top + 1] + table.c[j, n]
            allowed = tn <= taus
            if not allowed.all():
                cand = np.where(allowed[:, None], cand, INF)
            dst = new[:, lo + n:top + n + 1]
            better = cand < dst
            if better.any():
                dst[better] = cand[better]
                ch[:, lo + n:top + n + 1][better] = n
        dp = new
    return dp[:, L], choice


def _backtrack(choice: np.ndarray, t_index: int, L: int) -> List[int]:
    p = choice.shape[0]
    layers = []
    l = L
    for j in range(p - 1, -1, -1):
        n = int(choice[j, t_index, l])
        layers.append(n)
        l -= n
    assert l == 0, "backtrack did not use every layer"
    return layers[::-1]


def solve_config(costs: StageCosts, L: int, budget: float, modes: Sequence[str],
                 bound: float = INF, fast: bool = False
                 ) -> Optional[Tuple[float, List[int], List[Tuple[str, int]]]]:
    """Fastest partition + per-stage recompute of one config under the memory budget:
    (objective_us, layers_per_stage, recompute); None when no partition fits the budget;
    (inf, [], []) when partitions fit but none beats `bound`."""
    key = costs.key
    v = key.virtual_stages
    table = _stage_options(costs, L, budget, modes, fast)
    if not all(c and np.isfinite(table.t[j, c[0]]) for j, c in enumerate(table.counts)):
        return None  # some stage cannot hold even its fewest layers
    values = np.unique(table.t[np.isfinite(table.t)])
    # Least threshold at which the stages can hold L layers (times grow with n, so stage j can
    # take any count it may hold up to nmax_j(tau)); a valid lower end for the sweep.
    if not table.short_ends:  # multiples of v: nmax_j = v x the counts that fit
        valid_t = table.t[:, v::v]
        counts = np.stack([np.searchsorted(np.sort(row[np.isfinite(row)]), values,
                                           side="right") for row in valid_t])
        most_sum = counts.sum(axis=0) * v
    else:
        counts, most = [], []
        for j, ns in enumerate(table.counts):
            ns = np.asarray(ns)
            row = table.t[j, ns]
            ns = ns[np.isfinite(row)]
            fit = np.searchsorted(np.sort(row[np.isfinite(row)]), values, side="right")
            counts.append(fit)
            most.append(np.where(fit > 0, ns[np.maximum(fit - 1, 0)], 0))
        counts, most_sum = np.stack(counts), np.stack(most).sum(axis=0)
    reachable = (most_sum >= L) & (counts.min(axis=0) >= 1)
    if not reachable.any():
        return None
    taus = values[np.argmax(reachable):]
    if costs.beta <= 0:
        taus = taus[-1:]  # one micro-batch: the max term has no weight
    best: Tuple[float, Optional[List[int]]] = (bound, None)  # (objective, layers_per_stage)
    batch = FAST_MODE_THRESHOLDS if fast else 16
    start = 0
    while start < len(taus):
        chunk = taus[start:start + batch]
        # Thresholds whose best case cannot beat the incumbent end the sweep.
        live = costs.beta * chunk + table.sum_lb < best[0]
        if not live.any():
            break
        chunk = chunk[:int(np.argmin(live)) if not live.all() else len(chunk)]
        sums, choice = _min_sum_dp(table, L, v, chunk)
        obj = sums + costs.beta * chunk
        i = int(np.argmin(obj))
        if obj[i] < best[0]:
            best = (float(obj[i]), _backtrack(choice, i, L))
        start += len(chunk)
        if fast:
            break
        batch = min(batch * 2, 256)
    if best[1] is None:
        return INF, [], []
    layers = best[1]
    recompute = []
    for j, n in enumerate(layers):
        code = int(table.code[j, n])
        recompute.append((MODE_NAMES[code], 0 if code == 0 else int(table.k[j, n])))
    return best[0], layers, recompute


# ====================================================================== search
def search(model_cost: ModelCost, hardware: HardwareModel, space: SearchSpace) -> SearchResult:
    """Fastest feasible layout of `space` by evaluate(); raises InfeasibleError when none fits."""
    t_start = time.perf_counter()
    L = model_cost.layers
    rejected: Dict[str, int] = {}
    configs = enumerate_configs(model_cost, hardware, space, rejected)
    if not configs:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.items())) or "none"
        listed = space.micro_batch_sizes is not None  # every divisor otherwise: none smaller
        relax = {"global_batch_size": "a multiple of world_size / (tp * pp)",
                 **({"micro_batch_sizes": "allow smaller"} if listed else {}),
                 "max_pp": "raise", "max_tp": "raise"}
        sizes = (f"micro_batch_sizes={list(space.micro_batch_sizes)}" if listed
                 else "any micro-batch size")
        raise InfeasibleError(
            f"no (tp, pp, dp, micro-batch) combination of world_size={space.world_size} divides "
            f"global_batch_size={space.global_batch_size} with {sizes} (rejected: {reasons}); "
            f"relax global_batch_size (a multiple of world_size / (tp * pp))"
            f"{' or micro_batch_sizes' if listed else ''}, or raise max_pp/max_tp",
            bound="global_batch_size", suggestions=tuple(relax), relax=relax, rejected=rejected)
    modes = space.recompute
    budget = float(space.memory_budget_bytes)
    fast = space.fast_mode

    costs_of = []
    bounds = np.empty(len(configs))
    for i, key in enumerate(configs):
        costs = StageCosts(key, model_cost, hardware, space.seq_len, space.options)
        costs_of.append(costs)
        bounds[i] = config_lower_bound(costs, L)
    order = np.argsort(bounds, kind="stable")

    top_k = max(1, space.top_k)
    heap: List[Tuple[float, int, List[int], List[Tuple[str, int]]]] = []  # max-heap by -obj
    pruned = solved = 0
    memory_rejected = 0
    for rank, i in enumerate(order):
        kth = -heap[0][0] if len(heap) >= top_k else INF
        if bounds[i] >= kth:
            pruned = len(order) - rank
            break
        if not may_fit(costs_of[i], L, budget, modes):
            memory_rejected += 1
            continue
        solved += 1
        found = solve_config(costs_of[i], L, budget, modes, bound=kth, fast=fast)
        if found is None:
            memory_rejected += 1
            continue
        obj, layers, recompute = found
        if not layers:
            continue  # fits, but cannot enter the top_k
        entry = (-obj, -int(i), layers, recompute)
        if len(heap) < top_k:
            heapq.heappush(heap, entry)
        elif obj < -heap[0][0]:
            heapq.heapreplace(heap, entry)
    if memory_rejected:
        rejected["memory"] = rejected.get("memory", 0) + memory_rejected
    if not heap:
        _raise_infeasible(model_cost, hardware, space, configs, costs_of, rejected)

    ranked = sorted(heap, key=lambda e: (-e[0], -e[1]))
    top = []
    for _neg_obj, neg_i, layers, recompute in ranked:
        costs = costs_of[-neg_i]
        layout = costs.key.layout(layers, recompute)
        pred = evaluate(layout, model_cost, hardware, space.seq_len, budget, space.options,
                        _costs=costs)
        top.append((layout, pred))
    top.sort(key=lambda lp: lp[1].iteration_time_us)
    best, prediction = top[0]
    return SearchResult(best=best, prediction=prediction, top=tuple(top),
                        considered=len(configs), rejected=rejected, pruned=pruned,
                        solved=solved, elapsed_s=time.perf_counter() - t_start, fast_mode=fast)


# ====================================================================== infeasible
def _least_memory_layout(costs: StageCosts, L: int, modes: Sequence[str]
                         ) -> Optional[Tuple[float, ParallelLayout]]:
    """The partition of this config whose largest per-device memory is least, each stage using
    its most memory-saving recompute: (bytes, layout). Stages of a multiple of v, for the
    least multiple of v >= L; the layers over L are taken from the short end chunks (last
    stage first), None when they cannot hold them."""
    key = costs.key
    p, v = key.pp, key.virtual_stages
    target = L
    L = math.ceil(L / v) * v
    N = L - (p - 1) * v
    n = np.arange(v, N + 1, v, dtype=float)
    mem = np.full((p, len(n)), INF)
    pick = np.zeros((p, len(n)), dtype=np.int8)
    for j in range(p):
        for code, mode in enumerate(MODE_NAMES):
            if mode not in modes:
                continue
            k = np.zeros_like(n) if code == 0 else n
            m = costs.memory_bytes(j, n, code, k)
            better = m < mem[j]
            mem[j][better] = m[better]
            pick[j][better] = code
    values = np.unique(mem)
    counts = np.stack([np.searchsorted(row, values, side="right") for row in mem])  # rows grow
    ok = (counts.sum(axis=0) * v >= L) & (counts.min(axis=0) >= 1)
    if not ok.any():
        return None
    limit = values[np.argmax(ok)]
    caps = counts[:, np.argmax(ok)] * v
    layers = [v] * p
    spare = L - p * v
    for j in range(p):
        add = min(spare, int(caps[j]) - v)
        layers[j] += add
        spare -= add
    codes = [int(pick[j, nj // v - 1]) for j, nj in enumerate(layers)]
    excess = L - target  # > 0 only where short end chunks are allowed (space.py)
    for j in (p - 1, 0):
        take = min(excess, layers[j] // v)  # a short chunk keeps >= 0 layers
        layers[j] -= take
        excess -= take
    if excess:
        return None
    recompute = [(MODE_NAMES[code], 0 if code == 0 else nj) for code, nj in zip(codes, layers)]
    return float(limit), key.layout(layers, recompute)


def _raise_infeasible(model: ModelCost, hardware: HardwareModel, space: SearchSpace,
                      configs: List[ConfigKey], costs_of: List[StageCosts],
                      rejected: Dict[str, int]) -> None:
    best = None
    for costs in costs_of:
        found = _least_memory_layout(costs, model.layers, space.recompute)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    needed, layout = best
    relax = _relaxations(model, space, needed)
    suggestions = [f"{field} {advice}" for field, advice in relax.items()]
    raise InfeasibleError(
        f"no layout of {model.name} fits memory_budget_bytes={space.memory_budget_bytes / GiB:.2f}"
        f" GiB per device on {space.world_size} devices (seq_len {space.seq_len}, global batch "
        f"{space.global_batch_size}); the closest, {layout.describe()}, needs "
        f"{needed / GiB:.2f} GiB. Relax: " + "; ".join(suggestions),
        bound="memory_budget_bytes", closest=layout, needed_bytes=needed,
        suggestions=suggestions, relax=relax)


def _relaxations(model: ModelCost, space: SearchSpace, needed_bytes: float) -> Dict[str, str]:
    """SearchSpace field -> how to relax it so that more layouts fit, most direct first."""
    relax = {"memory_budget_bytes": f">= {needed_bytes / GiB:.2f} GiB"}
    if Recompute.full not in space.recompute:
        relax["recompute"] = "add 'full'"
    if 3 not in space.zero_stages:
        relax["zero_stages"] = "add 3"
    for fixed, bound, top in (("pp", "max_pp", min(model.layers, space.world_size)),
                              ("tp", "max_tp", max(model.tps))):
        if getattr(space, fixed) is not None:
            relax[fixed] = "unset (search every degree)"
        elif getattr(space, bound) < top:
            relax[bound] = f"raise above {getattr(space, bound)}"
    if space.micro_batch_sizes is not None and min(space.micro_batch_sizes) > 1:
        relax["micro_batch_sizes"] = "allow 1"
    relax["seq_len"] = "shorter (or more devices)"
    return relax
