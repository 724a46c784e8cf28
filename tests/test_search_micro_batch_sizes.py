"""The search prices every micro-batch size that divides a replica's batch (issue 42: mbs 8, the
measured fastest on an H200, was never priced under the old default [1, 2, 4]), a user's list
when one is given, and drops the sizes that cannot fit before solving them."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orchestrator.config import CONF_DIR, register_configs
from orchestrator.planner import (CostOptions, HardwareModel, ModelCost, SearchSpace, evaluate,
                                  search)
from orchestrator.planner.space import enumerate_configs
from orchestrator.stages.search_config import search_space
from planner_fixtures import GiB, synthetic_hardware, synthetic_model

register_configs()


def _space(**kw) -> SearchSpace:
    base = dict(world_size=1, memory_budget_bytes=80 * GiB, global_batch_size=8, seq_len=512,
                zero_stages=(0,), schedules=("1f1b",), options=CostOptions(reserve_bytes=0))
    return SearchSpace(**{**base, **kw})


def _profiles(**model_kw):
    return (ModelCost.from_dict(synthetic_model(layers=4, **model_kw)),
            HardwareModel.from_dict(synthetic_hardware(1, 8)))


def _sizes(space: SearchSpace, model: ModelCost, hw: HardwareModel) -> set:
    return {key.micro_batch_size for key in enumerate_configs(model, hw, space, {})}


@pytest.mark.parametrize("batch,expected", [(8, {1, 2, 4, 8}), (12, {1, 2, 3, 4, 6, 12})])
def test_default_space_has_every_divisor_of_the_replica_batch(batch, expected):
    """At dp 1 the replica's batch is the global batch: every divisor, none other (5, 7 ...)."""
    model, hw = _profiles()
    assert _sizes(_space(global_batch_size=batch), model, hw) == expected


def test_default_divides_each_replica_batch_not_the_global_one():
    """At dp 4 a batch of 8 leaves 2 sequences per replica: mbs 1 and 2 only there."""
    model, hw = _profiles()
    keys = enumerate_configs(model, hw, _space(world_size=4, max_tp=1, max_pp=1), {})
    assert {k.dp for k in keys} == {4}
    assert {(k.micro_batch_size, k.num_micro_batches) for k in keys} == {(1, 2), (2, 1)}


def test_a_user_list_is_honoured():
    """search.micro_batch_sizes=[1,2]: only those (and a size not dividing the batch is counted
    among the rejected, as before)."""
    model, hw = _profiles()
    assert _sizes(_space(micro_batch_sizes=(1, 2)), model, hw) == {1, 2}
    rejected = {}
    keys = enumerate_configs(model, hw, _space(micro_batch_sizes=(1, 3)), rejected)
    assert {k.micro_batch_size for k in keys} == {1} and rejected["batch_not_divisible"] >= 1


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config",
                                           overrides=["stage=search", *overrides]))


def test_the_config_default_is_every_divisor_and_a_list_stays_a_list():
    assert search_space(_cfg()).micro_batch_sizes is None
    assert search_space(_cfg("search.micro_batch_sizes=[1,2]")).micro_batch_sizes == (1, 2)


def test_the_pick_is_the_larger_micro_batch_where_it_is_cheapest():
    """A per-call cost (the profile's constant, 2 ms per block pass) that larger micro-batches
    amortise: mbs 8 of a batch of 8 is the cheapest layout, and the search picks it."""
    model, hw = _profiles(overhead_us=2000.0)
    result = search(model, hw, _space())
    assert result.best.micro_batch_size == 8 and result.best.num_micro_batches == 1
    at_4 = search(model, hw, _space(micro_batch_sizes=(1, 2, 4)))
    assert result.prediction.iteration_time_us < at_4.prediction.iteration_time_us


def _peak(model, hw, space, mbs) -> float:
    """The least peak of the one-stage layout at `mbs` with full recompute."""
    from orchestrator.layout import ParallelLayout

    layout = ParallelLayout.uniform(1, 1, 1, model.layers, recompute="full", micro_batch_size=mbs,
                                    num_micro_batches=space.global_batch_size // mbs)
    return evaluate(layout, model, hw, space.seq_len, options=space.options).peak_memory_bytes


def test_a_size_that_cannot_fit_is_pruned_not_solved():
    """A budget between mbs 4's least peak and mbs 8's: mbs 8 is enumerated and its memory bound
    (may_fit, or the partition's tables) rejects it, and the pick is the largest size that fits.
    (No rule drops the larger sizes of a config with a smaller one: with one micro-batch there
    is no gradient accumulation, so mbs = the replica's batch can fit where a smaller size does
    not.)"""
    model, hw = _profiles(overhead_us=2000.0)
    probe = _space()
    budget = (_peak(model, hw, probe, 4) + _peak(model, hw, probe, 8)) / 2
    space = _space(memory_budget_bytes=budget)
    assert 8 in _sizes(space, model, hw)
    result = search(model, hw, space)
    assert result.best.micro_batch_size == 4
    assert result.rejected["memory"] >= 1
    assert all(lay.micro_batch_size < 8 for lay, _ in result.top)


def test_a_batch_no_replica_divides_does_not_advise_smaller_sizes_when_all_are_searched():
    """Every size is already searched: the advice names the batch and the degrees, not
    micro_batch_sizes (a user's list still gets "allow smaller")."""
    from orchestrator.planner import InfeasibleError

    model, hw = _profiles()
    for sizes, advised in ((None, False), ((2,), True)):
        with pytest.raises(InfeasibleError) as info:
            search(model, hw, _space(world_size=8, global_batch_size=3, max_pp=1, max_tp=2,
                                     micro_batch_sizes=sizes))
        assert info.value.bound == "global_batch_size"
        assert ("micro_batch_sizes" in info.value.relax) == advised, info.value.relax
