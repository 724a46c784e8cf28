"""The search returns the minimum of evaluate() over every feasible layout of its space: checked
against brute-force enumeration (every config, every partition, every per-stage recompute) on
small synthetic models, plus the infeasible case and fast mode."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from orchestrator.layout import ParallelLayout
from orchestrator.planner import (CostOptions, HardwareModel, InfeasibleError, ModelCost,
                                  SearchSpace, evaluate, search)
from orchestrator.planner.cost_model import ConfigKey, StageCosts
from orchestrator import errors
from planner_fixtures import GiB, synthetic_hardware, synthetic_model

REL = 1e-9


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _compositions(total, parts, step):
    """All tuples of `parts` positive multiples of `step` summing to `total`."""
    if parts == 1:
        if total >= step and total % step == 0:
            yield (total,)
        return
    for first in range(step, total - step * (parts - 1) + 1, step):
        for rest in _compositions(total - first, parts - 1, step):
            yield (first,) + rest


def _stage_recomputes(n, v, modes):
    out = []
    if "none" in modes:
        out.append(("none", 0))
    if "selective" in modes:
        out.append(("selective", n))
    if "full" in modes:
        out += [("full", k) for k in range(v, n + 1, v)]
    return out


def all_layouts(model, hw, space):
    """Every layout of the space (each with its StageCosts, to price it quickly)."""
    L = model.layers
    W = space.world_size
    for tp in _divisors(W):
        if (tp > space.max_tp or tp not in model.tps or model.heads % tp or model.kv_heads % tp
                or model.ffn % tp  # the shape TP must split (the vocabulary is padded)
                or (space.tp_within_node and (tp > hw.tasks_per_node or hw.tasks_per_node % tp))):
            continue
        for pp in _divisors(W // tp):
            if pp > space.max_pp or pp > L:
                continue
            dp = W // (tp * pp)
            for mbs in space.micro_batch_sizes:
                if space.global_batch_size % (dp * mbs):
                    continue
                m = space.global_batch_size // (dp * mbs)
                scheds = [("1f1b", 1)] if "1f1b" in space.schedules else []
                if "interleaved" in space.schedules:
                    scheds += [("interleaved", v) for v in space.virtual_stages
                               if pp > 1 and m % pp == 0 and L % v == 0 and pp * v <= L]
                for sp in space.sequence_parallel:
                    if sp and tp == 1:
                        continue
                    for zero in (space.zero_stages if dp > 1 else (0,)):
                        for sched, v in scheds:
                            key = ConfigKey(W, tp, pp, dp, zero, sp, mbs, m, sched, v)
                            costs = StageCosts(key, model, hw, space.seq_len, space.options)
                            for layers in _compositions(L, pp, v):
                                options = [_stage_recomputes(n, v, space.recompute)
                                           for n in layers]
                                for rc in itertools.product(*options):
                                    yield key.layout(layers, rc), costs


def brute_force(model, hw, space):
    """min over every feasible layout of evaluate(): (time_us, layout) or None."""
    best = None
    for layout, costs in all_layouts(model, hw, space):
        pred = evaluate(layout, model, hw, space.seq_len, space.memory_budget_bytes,
                        space.options, _costs=costs)
        if pred.feasible and (best is None or pred.iteration_time_us < best[0]):
            best = (pred.iteration_time_us, layout)
    return best


def _space(**kw):
    base = dict(world_size=8, memory_budget_bytes=1 * GiB, global_batch_size=16, seq_len=512,
                micro_batch_sizes=(1, 2), zero_stages=(0, 1, 3), virtual_stages=(2,),
                options=CostOptions(reserve_bytes=0))
    base.update(kw)
    return SearchSpace(**base)


def _budget_between(model, hw, space, frac):
    """A memory budget `frac` of the way from the least memory any layout needs (with full
    recompute) to what the even, no-recompute layout of the largest pp needs: memory binds."""
    lo = math.inf
    hi = 0.0
    L = model.layers
    for tp in (t for t in model.tps if space.world_size % t == 0 and t <= hw.tasks_per_node
               and model.heads % t == 0 and model.kv_heads % t == 0
               and model.ffn % t == 0):
        for pp in (p for p in _divisors(space.world_size // tp) if p <= L):
            lay_full = ParallelLayout.uniform(space.world_size, tp, pp, L, recompute="full",
                                              zero=max(space.zero_stages)
                                              if space.world_size // (tp * pp) > 1 else 0,
                                              sequence_parallel=tp > 1,
                                              num_micro_batches=space.global_batch_size
                                              // (space.world_size // (tp * pp)))
            lay_none = ParallelLayout.uniform(space.world_size, tp, pp, L, recompute="none",
                                              num_micro_batches=space.global_batch_size
                                              // (space.world_size // (tp * pp)))
            lo = min(lo, evaluate(lay_full, model, hw, space.seq_len).peak_memory_bytes)
            hi = max(hi, evaluate(lay_none, model, hw, space.seq_len).peak_memory_bytes)
    return lo + frac * (hi - lo)


CASES = [
    # (model kwargs, world, nodes, tasks_per_node, space kwargs, budget fraction)
    (dict(layers=6, hidden=256, ffn=1024, heads=8), 8, 1, 8,
     dict(micro_batch_sizes=(1,)), 0.15),
    (dict(layers=6, hidden=512, ffn=1536, heads=8, kv_heads=4, vocab=4000), 8, 2, 4,
     dict(zero_stages=(1, 2), global_batch_size=32, micro_batch_sizes=(2,)), 0.05),
    (dict(layers=4, hidden=384, ffn=1536, heads=4, seq_len=1024), 8, 2, 4,
     dict(global_batch_size=32, micro_batch_sizes=(1, 4)), 0.3),
    (dict(layers=6, hidden=256, ffn=768, heads=8), 16, 2, 8,
     dict(zero_stages=(0, 1), micro_batch_sizes=(1,), sequence_parallel=(True,),
          global_batch_size=32, max_pp=4), 0.1),
    (dict(layers=4, hidden=256, ffn=1024, heads=8), 64, 8, 8,
     dict(zero_stages=(0, 3), micro_batch_sizes=(1,), global_batch_size=64,
          sequence_parallel=(True,)), 0.2),
]


@pytest.mark.parametrize("model_kw,world,nodes,tpn,space_kw,frac", CASES)
def test_search_equals_brute_force_minimum(model_kw, world, nodes, tpn, space_kw, frac):
    model = ModelCost.from_dict(synthetic_model(**model_kw))
    hw = HardwareModel.from_dict(synthetic_hardware(nodes, tpn))
    space = _space(world_size=world, seq_len=model_kw.get("seq_len", 512), **space_kw)
    budget = _budget_between(model, hw, space, frac)
    space = _space(world_size=world, seq_len=model_kw.get("seq_len", 512),
                   **{**space_kw, "memory_budget_bytes": budget})
    expected = brute_force(model, hw, space)
    assert expected is not None, "test space should have a feasible layout"
    result = search(model, hw, space)
    assert result.prediction.feasible
    assert result.prediction.iteration_time_us == pytest.approx(expected[0], rel=REL), (
        f"search {result.best.describe()} vs brute force {expected[1].describe()}")
    # Same layout, or a different one of equal cost.
    again = evaluate(result.best, model, hw, space.seq_len, budget, space.options)
    assert again.iteration_time_us == pytest.approx(expected[0], rel=REL)
    # The ranking is sorted and every alternative is feasible.
    times = [pred.iteration_time_us for _, pred in result.top]
    assert times == sorted(times) and all(pred.feasible for _, pred in result.top)


def test_memory_forces_uneven_partition_or_recompute():
    """With a budget between full and no recompute, the winner uses recompute somewhere."""
    model = ModelCost.from_dict(synthetic_model(layers=6))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    probe = _space(recompute=("none", "selective", "full"), zero_stages=(0,))
    budget = _budget_between(model, hw, probe, 0.02)
    result = search(model, hw, _space(memory_budget_bytes=budget, zero_stages=(0,)))
    assert any(mode != "none" for mode, _ in result.best.recompute) or \
        len(set(result.best.layers_per_stage)) > 1


def test_infeasible_raises_with_closest_layout_and_bound():
    model = ModelCost.from_dict(synthetic_model(layers=4))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    space = _space(memory_budget_bytes=1024.0, micro_batch_sizes=(1,))
    with pytest.raises(InfeasibleError) as info:
        search(model, hw, space)
    err = info.value
    assert isinstance(err, errors.InfeasibleError)
    assert err.bound == "memory_budget_bytes"
    assert isinstance(err.closest, ParallelLayout)
    assert err.needed_bytes > 1024.0
    # The closest layout really needs that much, and nothing in the space needs less.
    pred = evaluate(err.closest, model, hw, space.seq_len)
    assert pred.peak_memory_bytes == pytest.approx(err.needed_bytes, rel=1e-9)
    least = min(evaluate(layout, model, hw, space.seq_len, options=space.options,
                         _costs=costs).peak_memory_bytes
                for layout, costs in all_layouts(model, hw, space))
    assert err.needed_bytes == pytest.approx(least, rel=1e-9)
    assert "GiB" in str(err) and "closest" in str(err)


def test_infeasible_batch_names_global_batch_size():
    model = ModelCost.from_dict(synthetic_model(layers=6))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    with pytest.raises(InfeasibleError) as info:
        search(model, hw, _space(global_batch_size=3, memory_budget_bytes=80 * GiB, max_pp=1,
                                  max_tp=2))
    assert info.value.bound == "global_batch_size"


def test_fast_mode_is_close_and_not_slower_to_answer():
    model = ModelCost.from_dict(synthetic_model(layers=8, hidden=512, ffn=2048))
    hw = HardwareModel.from_dict(synthetic_hardware(2, 8))
    probe = _space(world_size=16, global_batch_size=32)
    budget = _budget_between(model, hw, probe, 0.1)
    exact = search(model, hw, _space(world_size=16, global_batch_size=32,
                                     memory_budget_bytes=budget))
    fast = search(model, hw, _space(world_size=16, global_batch_size=32,
                                    memory_budget_bytes=budget, fast_mode=True))
    assert fast.fast_mode and fast.prediction.feasible
    assert fast.prediction.iteration_time_us >= exact.prediction.iteration_time_us * (1 - REL)
    assert fast.prediction.iteration_time_us <= exact.prediction.iteration_time_us * 1.25


def test_result_serialises():
    model = ModelCost.from_dict(synthetic_model(layers=6))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    result = search(model, hw, _space(memory_budget_bytes=80 * GiB))
    d = result.to_dict()
    assert ParallelLayout.from_dict(d["best"]) == result.best
    assert d["considered"] == result.considered
    assert [entry["iteration_time_us"] for entry in d["top"]] == \
        [pred.iteration_time_us for _, pred in result.top]
    assert d["prediction"]["iteration_time_us"] == d["top"][0]["iteration_time_us"]


@pytest.mark.parametrize("seed", range(8))
def test_search_equals_brute_force_on_random_small_spaces(seed):
    """Random small models, clusters, budgets and option subsets (seeded, so reproducible)."""
    rng = random.Random(seed)
    heads = rng.choice([4, 8])
    hidden = heads * rng.choice([32, 64])
    model_kw = dict(layers=rng.choice([2, 3, 4, 6]), hidden=hidden,
                    ffn=hidden * rng.choice([2, 4]), heads=heads,
                    kv_heads=rng.choice([heads, heads // 2]), vocab=rng.choice([500, 20000]),
                    seq_len=rng.choice([256, 2048]))
    nodes, tpn = rng.choice([(1, 8), (2, 4), (4, 2)])
    model = ModelCost.from_dict(synthetic_model(**model_kw))
    hw = HardwareModel.from_dict(synthetic_hardware(nodes, tpn,
                                                    overlap_coe=rng.choice([1.0, 1.3, 1.9])))
    world = nodes * tpn
    space_kw = dict(world_size=world, seq_len=model_kw["seq_len"],
                    global_batch_size=rng.choice([world, 2 * world]),
                    micro_batch_sizes=rng.choice([(1,), (1, 2)]),
                    zero_stages=rng.choice([(0,), (0, 2), (1, 3)]),
                    recompute=rng.choice([("none", "selective", "full"), ("full",),
                                          ("selective", "full")]),
                    schedules=rng.choice([("1f1b",), ("1f1b", "interleaved")]),
                    virtual_stages=rng.choice([(2,), (2, 3)]))
    budget = _budget_between(model, hw, _space(**space_kw), rng.choice([0.0, 0.05, 0.3, 1.0]))
    space = _space(**{**space_kw, "memory_budget_bytes": budget})
    expected = brute_force(model, hw, space)
    if expected is None:
        with pytest.raises(InfeasibleError):
            search(model, hw, space)
        return
    result = search(model, hw, space)
    assert result.prediction.iteration_time_us == pytest.approx(expected[0], rel=REL), (
        f"search {result.best.describe()} vs brute force {expected[1].describe()}")


def test_divisors_of_a_billion_devices_without_a_billion_steps():
    """A world of 10**9 devices costs the search its sqrt, not a loop over every integer."""
    from orchestrator.planner.search import _divisors

    for n in range(1, 300):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    billion = _divisors(10**9)
    assert len(billion) == 100 and billion[:4] == [1, 2, 4, 5] and billion[-1] == 10**9


def _megatron_layouts(model, world, gbs, v_options, recompute_modes):
    """Every layout Megatron-LM runs of this small space, tp 1 and interleaved only: any
    composition of the layers that ParallelLayout accepts (short end chunks included), every
    per-stage recompute it accepts."""
    from orchestrator.layout import LayoutError

    L = model.layers
    for pp in (p for p in _divisors(world) if 1 < p <= L):
        dp = world // pp
        m = gbs // dp
        for v in v_options:
            if m % pp:
                continue
            for layers in _compositions(L, pp, 1):
                base = dict(world_size=world, pp=pp, tp=1, dp=dp, num_micro_batches=m,
                            schedule="interleaved", virtual_stages=v, layers_per_stage=layers)
                try:
                    ParallelLayout(**base)
                except LayoutError:
                    continue
                options = [[("none", 0)] * ("none" in recompute_modes)
                           + [("full", k) for k in range(1, n + 1)
                              if "full" in recompute_modes] for n in layers]
                for rc in itertools.product(*options):
                    try:
                        yield ParallelLayout(**base, recompute=rc)
                    except LayoutError:
                        continue


@pytest.mark.parametrize("budget_frac", [1.0, 0.3])
def test_megatron_search_finds_the_best_partition_megatron_runs(budget_frac):
    """engine=megatron: 7 layers interleaved (v = 2, 3) split only with short end chunks; the
    search's best equals the brute-force minimum over every layout Megatron runs, and every
    layout it returns has a partition Megatron runs, written exactly (megatron_partition; the
    per-stage recompute the search also picks is another matter: one setting in Megatron)."""
    from orchestrator.planner.exports import megatron_partition, pipeline_layout_string

    model = ModelCost.from_dict(synthetic_model("tiny", layers=7, hidden=256, ffn=1024))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 4))
    options = CostOptions(reserve_bytes=0, engine="megatron")
    layouts = list(_megatron_layouts(model, 4, 8, (2, 3), ("none", "full")))
    assert any(lay.short_chunks for lay in layouts)
    peaks = sorted(evaluate(lay, model, hw, 512, options=options).peak_memory_bytes
                   for lay in layouts)
    budget = peaks[int(budget_frac * (len(peaks) - 1))]
    brute = min(pred.iteration_time_us for pred in (
        evaluate(lay, model, hw, 512, budget, options) for lay in layouts) if pred.feasible)
    space = SearchSpace(world_size=4, memory_budget_bytes=budget, global_batch_size=8,
                        seq_len=512, max_tp=1, zero_stages=(0,), micro_batch_sizes=(1,),
                        schedules=("interleaved",), virtual_stages=(2, 3),
                        recompute=("none", "full"), sequence_parallel=(False,),
                        options=options)
    result = search(model, hw, space)
    assert result.prediction.iteration_time_us == pytest.approx(brute, rel=REL)
    assert result.best.short_chunks  # 7 layers split no other way
    for layout, _ in result.top:
        assert layout.short_chunks
        assert megatron_partition(layout) == ["--pipeline-model-parallel-layout",
                                              pipeline_layout_string(layout)]


def test_orchestrator_engine_never_prices_short_chunks():
    """stage=train builds equal chunks: its engine's search offers no interleaving of 7 layers
    and evaluate refuses a short-chunk layout, naming the engine that runs it."""
    from orchestrator.layout import LayoutError

    model = ModelCost.from_dict(synthetic_model("tiny", layers=7, hidden=256, ffn=1024))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 4))
    space = SearchSpace(world_size=4, memory_budget_bytes=80 * GiB, global_batch_size=8,
                        seq_len=512, max_tp=1, zero_stages=(0,), micro_batch_sizes=(1,),
                        schedules=("interleaved",), virtual_stages=(2,),
                        sequence_parallel=(False,), options=CostOptions(reserve_bytes=0))
    with pytest.raises(InfeasibleError):
        search(model, hw, space)
    layout = ParallelLayout(world_size=4, pp=2, tp=1, dp=2, num_micro_batches=4,
                            schedule="interleaved", virtual_stages=2, layers_per_stage=(3, 4))
    with pytest.raises(LayoutError, match="search.engine=megatron"):
        evaluate(layout, model, hw, 512)
    assert evaluate(layout, model, hw, 512, options=CostOptions(engine="megatron")).feasible


def test_megatron_search_with_short_chunks_names_the_closest_when_nothing_fits():
    """Nothing fits: the closest layout of an interleaved-only space of 7 layers (short end
    chunks, layers taken off the end chunks) is a valid layout."""
    model = ModelCost.from_dict(synthetic_model("tiny", layers=7, hidden=256, ffn=1024))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 4))
    space = SearchSpace(world_size=4, memory_budget_bytes=1, global_batch_size=8,
                        seq_len=512, max_tp=1, zero_stages=(0,), micro_batch_sizes=(1,),
                        schedules=("interleaved",), virtual_stages=(2,),
                        sequence_parallel=(False,),
                        options=CostOptions(reserve_bytes=0, engine="megatron"))
    with pytest.raises(InfeasibleError) as caught:
        search(model, hw, space)
    closest = caught.value.closest
    assert closest.num_layers == 7 and closest.virtual_stages == 2 and closest.short_chunks


def test_megatron_engine_offers_zero3_only_without_pipeline_or_experts():
    """Megatron-LM's ZeRO 3 (--use-torch-fsdp2) refuses pp > 1 (its validate_args), so the
    Megatron engine's space has ZeRO 3 at pp 1 only, where ours has it at every pp."""
    from orchestrator.planner.space import enumerate_configs

    model = ModelCost.from_dict(synthetic_model("tiny", layers=4, hidden=256, ffn=1024))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    zero3_pps = {}
    for engine in ("orchestrator", "megatron"):
        space = _space(zero_stages=(0, 3), options=CostOptions(reserve_bytes=0, engine=engine))
        rejected = {}
        configs = enumerate_configs(model, hw, space, rejected)
        zero3_pps[engine] = {c.pp for c in configs if c.zero == 3}
        assert ("engine_megatron_zero3_pp_ep" in rejected) == (engine == "megatron")
    assert zero3_pps["megatron"] == {1} and max(zero3_pps["orchestrator"]) > 1
