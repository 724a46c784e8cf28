"""Execution plans for variable-length batches (DynaPipe-style dynamic micro-batching).

plan_iteration() splits each data-parallel rank's batch into micro-batches, orders them and
picks each one's recompute, priced by the cost model's terms (planner/microbatch_costs.py) and
the event simulation (planner/schedule.py); padded_plan() and packed_plan() are the two fixed
baselines, priced the same way.

Partition (exact): a micro-batch is a contiguous run of the length-sorted batch padded to its
longest; the objective sum_i t_i + c max_i t_i (t_i: the bottleneck stage's forward + backward
of micro-batch i, c = (p - 1) / v: the fill and drain) is minimised by a dynamic programme over
split points for each candidate bound tau on the max (sum under t_i <= tau, plus c tau),
thresholds tried in increasing order until the unconstrained sum plus c tau cannot win. A
micro-batch is allowed when, with the stage's worst-case in-flight count of copies of it, every
stage fits the budget; it takes the fastest recompute that does. Then order candidates and
recompute adjustments go through the simulation, whose in-flight peak is the memory the plan
reports (and keeps under the budget).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import GiB
from orchestrator.planner.microbatch_costs import MicroBatchCosts, PricedMicroBatches
from orchestrator.planner.profiles import HardwareModel, ModelCost
from orchestrator.planner.schedule import simulate

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a plan: `samples` index this data-parallel rank's sequences of the
    iteration (in the order given to the planner), each padded to `padded_len` tokens;
    `recompute` ("none" | "selective" | "full": every layer of every stage) applies to this
    micro-batch on every pipeline stage."""

    samples: Tuple[int, ...]
    padded_len: int
    recompute: str = "none"

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def padded_tokens(self) -> int:
        return len(self.samples) * self.padded_len


# ====================================================================== the plan
@dataclass(frozen=True)
class PlanOptions:
    """pad_multiple: padded lengths are rounded up to it (and to tp under sequence parallelism);
    normal_adjustments / fast_adjustments: most recompute changes tried per rank."""

    pad_multiple: int = 1
    normal_adjustments: int = 64
    fast_adjustments: int = 4


@dataclass(frozen=True)
class ExecutionPlan:
    """One iteration's plan. micro_batches[r]: dp rank r's micro-batches in execution order;
    iteration_time_us: max over ranks of rank_time_us (simulated makespan + the stages'
    gradient sync and optimizer tail, us); stage_peak_memory_bytes[j]: stage j's peak over the
    ranks (static + in-flight activations + buffers + reserve, bytes); kind: "dynamic",
    "padded" or "packed"; mode: "normal" | "fast"; planning_ms: wall time to plan; skipped:
    (rank, index, length, reason) of each sample left out; packed_rows[r][i]: for "packed",
    micro-batch i's rows as tuples of sample indices (each row is one max_seq_len sequence)."""

    micro_batches: Tuple[Tuple[MicroBatch, ...], ...]
    schedule: str
    iteration_time_us: float
    rank_time_us: Tuple[float, ...]
    stage_peak_memory_bytes: Tuple[float, ...]
    memory_budget_bytes: float
    kind: str = "dynamic"
    mode: str = "normal"
    planning_ms: float = 0.0
    skipped: Tuple[Tuple[int, int, int, str], ...] = ()
    packed_rows: Tuple[Tuple[Tuple[Tuple[int, ...], ...], ...], ...] = ()

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
        }


@dataclass(frozen=True)
class _RankResult:
    """One rank's micro-batches priced and simulated: time (us), peak bytes per stage."""

    micro_batches: Tuple[MicroBatch, ...]
    time_us: float
    stage_bytes: np.ndarray


def simulate_rank(costs: MicroBatchCosts, priced: PricedMicroBatches) -> Tuple[float, np.ndarray]:
    """(time_us, stage_bytes[p]) of one rank running the priced micro-batches in column order:
    the simulated makespan plus each stage's tail after its own finish, and each stage's static
    bytes + simulated in-flight peak + the largest extra. With no micro-batch the simulation
    takes 0 us and the tail is the whole gradient sync plus the optimizer step."""
    layout = costs.layout
    m = priced.fwd_us.shape[1]
    sim = simulate(priced.fwd_us, priced.bwd_us, m, layout.schedule, layout.virtual_stages,
                   priced.boundary_us if layout.pp > 1 else 0.0, priced.stored_bytes)
    # The last backward on every stage is the last micro-batch's (chunk 0 under interleaving).
    window = priced.sync_window_us[:, -1] if m else np.zeros(layout.pp)
    time_us = float(np.max(np.array(sim.stage_finish_us) + costs.tail_us(window)))
    extra = priced.extra_bytes.max(axis=1) if m else np.zeros(layout.pp)
    return time_us, costs.static_bytes + np.array(sim.stage_peak_act_bytes) + extra


def _price_micro_batches(costs: MicroBatchCosts, mbs: Sequence[MicroBatch],
                         rows: Optional[Sequence[int]] = None) -> PricedMicroBatches:
    """Price micro-batches as they are (rows[i]: sequences of micro-batch i, default its size)."""
    b = [mb.size for mb in mbs] if rows is None else list(rows)
    return costs.price(b, [mb.padded_len for mb in mbs],
                       [RECOMPUTE_MODES.index(mb.recompute) for mb in mbs])


def _make_plan(costs: MicroBatchCosts, results: Sequence[_RankResult], budget: float, kind: str,
               mode: str, t0: float, skipped=(), packed_rows=()) -> ExecutionPlan:
    times = tuple(r.time_us for r in results)
    peak = np.max(np.array([r.stage_bytes for r in results]), axis=0)
    return ExecutionPlan(micro_batches=tuple(r.micro_batches for r in results),
                         schedule=costs.layout.schedule, iteration_time_us=max(times),
                         rank_time_us=times, stage_peak_memory_bytes=tuple(peak.tolist()),
                         memory_budget_bytes=float(budget), kind=kind, mode=mode,
                         planning_ms=(time.perf_counter() - t0) * 1e3, skipped=tuple(skipped),
                         packed_rows=tuple(packed_rows))


def price_plan(micro_batches_per_rank: Sequence[Sequence[MicroBatch]], costs: MicroBatchCosts,
               memory_budget_bytes: float, kind: str = "dynamic") -> ExecutionPlan:
    """The ExecutionPlan of given micro-batches (in execution order, per dp rank), priced and
    simulated as plan_iteration prices its own."""
    t0 = time.perf_counter()
    results = []
    for mbs in micro_batches_per_rank:
        t, mem = simulate_rank(costs, _price_micro_batches(costs, mbs))
        results.append(_RankResult(tuple(mbs), t, mem))
    return _make_plan(costs, results, memory_budget_bytes, kind, "normal", t0)


# ====================================================================== partition
def padded_length(length, multiple: int, max_seq_len: int):
    """Length rounded up to `multiple`, never above max_seq_len (ints or numpy arrays)."""
    return np.minimum(-(-np.asarray(length) // multiple) * multiple, max_seq_len)


@dataclass(frozen=True)
class Candidates:
    """Every contiguous run [i, j) of a sorted batch of n: t_us[i, j] the bottleneck stage's
    time with the fastest recompute that fits (inf: none fits or j <= i), mode[i, j] its code."""

    t_us: np.ndarray
    mode: np.ndarray
    padded_len: np.ndarray


def price_candidates(costs: MicroBatchCosts, sorted_padded: np.ndarray,
                     budget: float) -> Candidates:
    """Price every run [i, j) of the ascending padded lengths under every recompute mode; keep
    the fastest that fits (MicroBatchCosts.alone_bytes on every stage)."""
    n = len(sorted_padded)
    i, j = np.triu_indices(n + 1, k=1)
    b, s = j - i, sorted_padded[j - 1]
    k = len(i)
    priced = costs.price(np.tile(b, 3), np.tile(s, 3), np.repeat(np.arange(3), k))
    t = priced.stage_time_us.max(axis=0).reshape(3, k)
    fits = (costs.alone_bytes(priced) <= budget).all(axis=0).reshape(3, k)
    t = np.where(fits, t, np.inf)
    best = np.argmin(t, axis=0)
    t_us = np.full((n + 1, n + 1), np.inf)
    mode = np.zeros((n + 1, n + 1), dtype=int)
    t_us[i, j] = t[best, np.arange(k)]
    mode[i, j] = best
    padded = np.zeros((n + 1, n + 1), dtype=int)
    padded[i, j] = s
    return Candidates(t_us, mode, padded)


def _min_sum(t_us: np.ndarray, taus: np.ndarray, groups: int):
    """For each bound tau: the least sum of t over partitions of [0, n) into runs with t <= tau
    whose count is a multiple of `groups` (dp[T, n + 1, groups], state = count mod groups).
    Returns (sums[T], dp)."""
    n = t_us.shape[0] - 1
    dp = np.full((len(taus), n + 1, groups), np.inf)
    dp[:, 0, 0] = 0.0
    masked = np.where(t_us[None] <= taus[:, None, None], t_us[None], np.inf)
    for j in range(1, n + 1):
        best = (dp[:, :j, :] + masked[:, :j, j][:, :, None]).min(axis=1)
        dp[:, j, :] = np.roll(best, 1, axis=-1)  # one more run: count mod groups + 1
    return dp[:, n, 0], dp


def partition(cands: Candidates, fill_drain: float, groups: int = 1,
              batch: int = 16) -> Tuple[float, List[Tuple[int, int]]]:
    """Exact minimum of sum_i t_i + fill_drain * max_i t_i over partitions of the sorted batch
    into runs [i, j) (count a multiple of `groups`); returns (objective_us, runs). (inf, [])
    when no partition fits."""
    t = cands.t_us
    n = t.shape[0] - 1
    if n == 0:
        return 0.0, []
    finite = np.unique(t[np.isfinite(t)])
    singles = t[np.arange(n), np.arange(1, n + 1)]
    # Every sample sits in some run, and a run is never faster than its longest sample alone.
    taus = finite[finite >= singles.max()] if fill_drain > 0 else finite[-1:]
    lower, _ = _min_sum(t, finite[-1:], groups)
    best, best_tau = np.inf, None
    for start in range(0, len(taus), batch):
        chunk = taus[start:start + batch]
        if lower[0] + fill_drain * chunk[0] >= best:
            break  # sums only fall as tau grows, by no more than down to `lower`
        sums, _ = _min_sum(t, chunk, groups)
        objective = sums + fill_drain * chunk
        k = int(np.argmin(objective))
        if objective[k] < best:
            best, best_tau = float(objective[k]), chunk[k]
    if best_tau is None:
        return np.inf, []
    return best, _backtrack(t, best_tau, groups)


def _backtrack(t_us: np.ndarray, tau: float, groups: int) -> List[Tuple[int, int]]:
    """The runs of the least-sum partition under bound tau."""
    _, dp = _min_sum(t_us, np.array([tau]), groups)
    dp = dp[0]
    masked = np.where(t_us <= tau, t_us, np.inf)
    runs, j, c = [], t_us.shape[0] - 1, 0
    while j > 0:
        prev = (c - 1) % groups
        i = int(np.argmin(dp[:j, prev] + masked[:j, j]))
        runs.append((i, j))
        j, c = i, prev
    return runs[::-1]


# ====================================================================== order and recompute
def order_candidates(runs: Sequence[Tuple[int, int]], fast: bool) -> List[List[int]]:
    """Orders of the runs (indices into `runs`, which ascend in length) to simulate: as
    partitioned, longest first, shortest first then the longest, and long/short alternating
    (DynaPipe-style: a long micro-batch's backward hides under short forwards). Fast: the
    first only."""
    m = len(runs)
    ascending = list(range(m))
    if fast or m <= 1:
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
    """Order and recompute of one rank's runs through the simulation. The three recompute modes
    of every run are priced once; a candidate is (order, modes)."""

    def __init__(self, costs: MicroBatchCosts, runs, padded_len: np.ndarray, budget: float):
        self.costs, self.budget = costs, budget
        m = len(runs)
        b = [j - i for i, j in runs]
        self.all_modes = costs.price(np.tile(b, 3), np.tile(padded_len, 3),
                                     np.repeat(np.arange(3), m))
        self.m = m

    def run(self, order: Sequence[int], modes: Sequence[int]) -> Tuple[float, np.ndarray]:
        columns = [mode * self.m + r for r, mode in zip(order, (modes[r] for r in order))]
        return simulate_rank(self.costs, self.all_modes.take(columns))

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


# ====================================================================== plan_iteration
def _fast_mode(fast_mode: Optional[bool]) -> bool:
    """fast_mode, or when None ORCHESTRATOR_FAST_MODE=1 as for the layout search."""
    if fast_mode is not None:
        return bool(fast_mode)
    return os.environ.get("ORCHESTRATOR_FAST_MODE", "") not in ("", "0")


def _pad_multiple(layout: ParallelLayout, options: PlanOptions) -> int:
    """Padded lengths are multiples of pad_multiple, and of tp under sequence parallelism."""
    if layout.sequence_parallel:
        return math.lcm(options.pad_multiple, layout.tp)
    return options.pad_multiple


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
    sort = np.argsort(lengths[indices], kind="stable")
    ordered = indices[sort]
    padded = padded_length(lengths[ordered], multiple, max_seq_len)
    groups = layout.pp if layout.schedule == "interleaved" else 1
    fill_drain = (layout.pp - 1) / layout.virtual_stages
    steps = options.fast_adjustments if fast else options.normal_adjustments
    dp_budget = budget
    for attempt in range(8):
        if attempt:  # over the budget: fast mode's adjustment bound gives way to the budget
            steps = options.normal_adjustments
        cands = price_candidates(costs, padded, dp_budget)
        objective, runs = partition(cands, fill_drain, groups)
        if not np.isfinite(objective):
            raise ConfigError(f"no micro-batch split of {len(ordered)} samples fits "
                              f"{layout.schedule} with pp={layout.pp} (interleaved needs a "
                              f"multiple of pp micro-batches): use schedule=1f1b or more samples")
        search = _RankSearch(costs, runs, np.array([cands.padded_len[i, j] for i, j in runs]),
                             budget)
        best = None
        for order in order_candidates(runs, fast):
            modes = [int(cands.mode[i, j]) for i, j in runs]
            time_us, mem, modes = search.adjust(order, modes, steps)
            if best is None or (time_us, mem.max() > budget) < (best[0], best[1].max() > budget):
                best = (time_us, mem, modes, order)
        time_us, mem, modes, order = best
        if (mem <= budget).all():
            break
        dp_budget -= float((mem - budget).max())
    mbs = tuple(MicroBatch(tuple(int(x) for x in ordered[runs[r][0]:runs[r][1]]),
                           int(padded[runs[r][1] - 1]), RECOMPUTE_MODES[modes[r]]) for r in order)
    return _RankResult(mbs, time_us, mem)


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
    return _make_plan(costs, results, memory_budget_bytes, "dynamic",
                      "fast" if fast else "normal", t0, skipped=bad)


# ====================================================================== baselines
def _baseline_mode(layout: ParallelLayout) -> str:
    """One recompute mode for every micro-batch: the layout's strongest over its stages."""
    return max((mode for mode, _ in layout.recompute), key=RECOMPUTE_MODES.index)


def padded_plan(lengths_per_rank: Sequence[Sequence[int]], layout: ParallelLayout,
                model: ModelCost, hardware: HardwareModel, memory_budget_bytes: float, *,
                max_seq_len: int, costs: Optional[MicroBatchCosts] = None) -> ExecutionPlan:
    """Baseline: micro-batches of layout.micro_batch_size consecutive samples (data order), all
    padded to the longest sequence of the whole batch (a multiple of tp under sequence
    parallelism), the layout's recompute; priced like plan_iteration."""
    costs = costs or MicroBatchCosts(layout, model, hardware)
    longest = max((max(x) for x in lengths_per_rank if len(x)), default=1)
    padded = int(padded_length(longest, _pad_multiple(layout, PlanOptions()), max_seq_len))
    mode, size = _baseline_mode(layout), layout.micro_batch_size
    mbs = [[MicroBatch(tuple(range(i, min(i + size, len(x)))), padded, mode)
            for i in range(0, len(x), size)] for x in lengths_per_rank]
    return price_plan(mbs, costs, memory_budget_bytes, kind="padded")


def pack_rows(lengths: Sequence[int], max_seq_len: int) -> List[Tuple[int, ...]]:
    """Samples in data order concatenated into rows of at most max_seq_len tokens; a sample
    longer than what is left of a row starts a new row (no splitting)."""
    rows, row, used = [], [], 0
    for index, length in enumerate(lengths):
        if row and used + length > max_seq_len:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(tuple(row))
    return rows


def packed_plan(lengths_per_rank: Sequence[Sequence[int]], layout: ParallelLayout,
                model: ModelCost, hardware: HardwareModel, memory_budget_bytes: float, *,
                max_seq_len: int, costs: Optional[MicroBatchCosts] = None) -> ExecutionPlan:
    """Baseline: samples packed into rows of max_seq_len tokens (pack_rows), micro-batches of
    layout.micro_batch_size rows, each row priced as one max_seq_len sequence (attention over
    the whole row), the layout's recompute."""
    t0 = time.perf_counter()
    costs = costs or MicroBatchCosts(layout, model, hardware)
    mode, size = _baseline_mode(layout), layout.micro_batch_size
    results, packed = [], []
    for lengths in lengths_per_rank:
        rows = pack_rows(lengths, max_seq_len)
        groups = [tuple(rows[i:i + size]) for i in range(0, len(rows), size)]
        mbs = tuple(MicroBatch(tuple(x for row in g for x in row), max_seq_len, mode)
                    for g in groups)
        t, mem = simulate_rank(costs, _price_micro_batches(costs, mbs, [len(g) for g in groups]))
        results.append(_RankResult(mbs, t, mem))
        packed.append(tuple(groups))
    return _make_plan(costs, results, memory_budget_bytes, "packed", "normal", t0,
                      packed_rows=packed)
