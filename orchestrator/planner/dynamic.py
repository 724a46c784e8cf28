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

Files: the plan's types and pricing are execution_plan.py, the partition microbatch_partition.py,
the order and recompute search microbatch_order.py; this module puts them together per rank.
"""
from __future__ import annotations

import math
import os
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Microbatching, Recompute, Schedule
from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import GiB
from orchestrator.planner.lockstep import align, lockstep_groups
from orchestrator.planner.execution_plan import (ExecutionPlan, MicroBatch, PlanOptions,
                                                 _extra_warmups, _make_plan,
                                                 _price_ranks, _RankResult,
                                                 price_plan)
from orchestrator.planner.microbatch_costs import (MicroBatchCosts, pack_rows, padded_length,
                                                   price_candidates)
from orchestrator.planner.microbatch_order import _RankSearch, order_candidates
from orchestrator.planner.microbatch_partition import _token_splits, partition
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.terms import MODE_CODES, MODE_NAMES

# Re-exported: the plan's types and pricing live in execution_plan.py, the partition and the
# order search in microbatch_partition.py and microbatch_order.py; callers import them from here.
__all__ = ["ExecutionPlan", "MicroBatch", "MicroBatchCosts", "PlanOptions", "pack_rows",
           "packed_plan", "padded_plan", "partition", "plan_iteration", "price_candidates",
           "price_plan"]


# ====================================================================== plan_iteration
def _fast_mode(fast_mode: Optional[bool]) -> bool:
    """fast_mode, or when None ORCHESTRATOR_FAST_MODE=1 as for the layout search."""
    if fast_mode is not None:
        return bool(fast_mode)
    return os.environ.get("ORCHESTRATOR_FAST_MODE", "") not in ("", "0")


def packs(layout: ParallelLayout) -> bool:
    """Whether a layout's micro-batches may pack samples into rows: not under context
    parallelism, whose ring attention splits each row over the CP ranks with a causal mask of
    global positions and has no per-sample mask (models/context_parallel.py); there every
    sample gets a row of its own, padded."""
    return layout.cp == 1


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
                                 _token_splits(padded, options.fast_splits) if fast else None,
                                 pack=packs(layout))
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
    builds = (_padded_micro_batches, _packed_micro_batches) if packs(layout) else \
        (_padded_micro_batches,)
    for build in builds:
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
    the whole row), the layout's recompute. ConfigError under context parallelism (packs)."""
    if not packs(layout):
        raise ConfigError(f"train.microbatching=packed needs cp=1 (cp={layout.cp}): ring "
                          f"attention has no per-sample mask for packed rows; use "
                          f"train.microbatching=dynamic or padded")
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
