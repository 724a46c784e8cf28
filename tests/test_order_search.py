"""The order of a few micro-batches: eager 1F1B's op order, the branch and bound against every
order, and the dynamic planner's use of both (planner/order_search.py, workload/order.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from orchestrator.planner.dynamic import MicroBatchCosts, plan_iteration, price_plan
from orchestrator.planner.order_search import best_order, problem_of
from orchestrator.planner.schedule import simulate
from orchestrator.workload.order import stage_order

from test_dynamic_planner import HW, MODEL, check_valid, layout


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_eager_1f1b_runs_every_op_once_with_more_in_flight(p):
    for m in range(1, 9):
        for extra in range(p):
            for s in range(p):
                order = stage_order(p, s, m, "1f1b", 1, extra)
                assert sorted(order) == sorted([("F", 0, i) for i in range(m)]
                                               + [("B", 0, i) for i in range(m)])
                live = peak = 0
                for kind, _, mb in order:
                    live += 1 if kind == "F" else -1
                    peak = max(peak, live)
                    if kind == "B":  # its forward came first
                        assert order.index(("F", 0, mb)) < order.index(("B", 0, mb))
                assert peak == min(p - s + min(extra, p - s - 1), m), (p, m, extra, s)
            # no deadlock, and equal micro-batches: more warm-up never slows the iteration
            plain = simulate([1.0] * p, [2.0] * p, m, "1f1b", 1, 0.1)
            eager = simulate([1.0] * p, [2.0] * p, m, "1f1b", 1, 0.1, extra_warmup=extra)
            assert eager.iteration_time_us <= plain.iteration_time_us + 1e-9
    with pytest.raises(ValueError, match="extra_warmup"):
        stage_order(p, 0, 2 * p, "interleaved", 2, 1)


def _brute_force(problem, fwd, bwd, boundary, stored):
    p, m = fwd.shape
    best = None
    for perm in map(list, itertools.permutations(range(m))):
        sim = simulate(fwd[:, perm], bwd[:, perm], m, "1f1b", 1, boundary[:, perm],
                       stored[:, perm], problem.extra_warmup)
        t = float(np.max(np.array(sim.stage_finish_us) + problem.tail_us[perm[-1]]))
        key = (problem.excess(sim.stage_peak_act_bytes), t)
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(24))
def test_branch_and_bound_finds_the_best_of_every_order(seed):
    """Random stages, micro-batches (two of them equal), sends, tails and a memory budget
    that rules some orders out: the key found is the best of all m! simulated orders."""
    rng = np.random.default_rng(seed)
    p, m, extra = int(rng.integers(2, 5)), int(rng.integers(2, 6)), int(rng.integers(0, 4))
    fwd = rng.uniform(1, 10, (p, m))
    bwd = 2 * fwd * rng.uniform(0.8, 1.2, (p, m))
    fwd[:, 1], bwd[:, 1] = fwd[:, 0], bwd[:, 0]
    boundary = rng.uniform(0, 0.5, (p, m))
    stored = fwd * 100
    tails = rng.uniform(0, 3, (m, p))
    budget = float(stored.sum(axis=1).max() * rng.uniform(0.4, 1.0))
    problems = [problem_of(fwd, bwd, boundary, stored_bytes=stored, tail_us=tails,
                           static_bytes=np.zeros(p), extra_bytes=np.zeros(p),
                           tail_bytes=np.zeros(p), budget_bytes=budget, extra_warmup=e)
                for e in (0, min(extra, p - 1))]
    start = _brute_force(problems[0], fwd, bwd, boundary, stored)  # a worse start is fine too
    found = best_order(problems, list(range(m))[::-1], (start[0] + 1, start[1]))
    want = min(_brute_force(pr, fwd, bwd, boundary, stored) for pr in problems)
    assert found.exact
    assert found.key[0] == pytest.approx(want[0]) and found.key[1] == pytest.approx(want[1])
    # the order and schedule returned give that key in the simulation
    order = list(found.order)
    extra_found = problems[found.problem].extra_warmup
    sim = simulate(fwd[:, order], bwd[:, order], m, "1f1b", 1, boundary[:, order],
                   stored[:, order], extra_found)
    t = float(np.max(np.array(sim.stage_finish_us) + tails[order[-1]]))
    assert t == pytest.approx(found.key[1])


def test_planner_plans_eager_1f1b_where_it_pays_and_prices_it_exactly():
    """Long-tailed batches under pp4: the planner picks extra warm-up on some, each such plan
    re-prices to its own time, and is faster than its micro-batches under plain 1F1B."""
    lay = layout(4, 1, 2)
    costs = MicroBatchCosts(lay, MODEL, HW)
    rng = np.random.default_rng(5)
    eager = 0
    for _ in range(12):
        lengths = [np.minimum(rng.lognormal(6.5, 1.0, 16).astype(int) + 1, 2048).tolist()
                   for _ in range(2)]
        budget = float(costs.alone_bytes(costs.price([4], [2048], [0])).max())
        plan = plan_iteration(lengths, lay, MODEL, HW, budget, max_seq_len=2048, costs=costs)
        check_valid(plan, lengths)
        assert max(plan.stage_peak_memory_bytes) <= budget
        again = price_plan(plan.micro_batches, costs, budget, packed_rows=plan.packed_rows,
                           extra_warmup=[plan.extra_warmup_of(r) for r in range(2)])
        assert again.iteration_time_us == pytest.approx(plan.iteration_time_us, rel=1e-9)
        if plan.extra_warmup:
            # per dp rank, eager only where it shortens that rank; the iteration is the slowest
            plain = price_plan(plan.micro_batches, costs, budget, packed_rows=plan.packed_rows)
            assert (plan.iteration_time_us <= plain.iteration_time_us * (1 + 1e-12)
                    or not plain.feasible)
            eager += plan.iteration_time_us < plain.iteration_time_us or not plain.feasible
    assert eager >= 3  # 5 of 12 faster by it


def test_small_batches_also_try_more_smaller_micro_batches():
    """Below fast_min_samples the planner also searches partitions with runs cut smaller
    (a short run of many samples at the pipeline's ends shortens its fill and drain): never
    slower than its own partition alone, faster on some batches, and every variant covers the
    samples once, in runs that fit."""
    from orchestrator.planner.dynamic import PlanOptions, _halved, partition
    from orchestrator.planner.microbatch_costs import price_candidates

    lay = layout(4, 1, 1)
    costs = MicroBatchCosts(lay, MODEL, HW)
    rng = np.random.default_rng(11)
    faster = 0
    for _ in range(24):
        lengths = [np.minimum(rng.lognormal(5.5, 1.2, 8).astype(int) + 1, 2048).tolist()]
        kw = dict(max_seq_len=2048, costs=costs)
        plan = plan_iteration(lengths, lay, MODEL, HW, 1e12, **kw)
        alone = plan_iteration(lengths, lay, MODEL, HW, 1e12,
                               options=PlanOptions(small_partition_splits=0), **kw)
        check_valid(plan, lengths)
        assert plan.iteration_time_us <= alone.iteration_time_us * (1 + 1e-12)
        faster += plan.iteration_time_us < alone.iteration_time_us * (1 - 1e-3)
        sorted_lengths = np.sort(lengths[0])
        cands = price_candidates(costs, sorted_lengths, sorted_lengths, 1e12, 2048)
        _, runs = partition(cands, 3.0)
        for variant in _halved(cands, runs, 3):
            assert variant[0][0] == 0 and variant[-1][1] == len(cands.bounds) - 1
            assert all(a < c and c == a2 for (a, c), (a2, _) in zip(variant, variant[1:]))
            assert all(np.isfinite(cands.t_us[a, c]) for a, c in variant)
            assert len(variant) > len(runs)
    assert faster >= 1  # 2 of 24 here; on the llama2_7b bench 2-6% at 8-16 sequences
