"""search keeps stage=tune's measured fastest as the layout to train only when this search could
have chosen it: a search narrowed by search.* (search.pp=4, a smaller search.memory_GiB, ...)
trains its own best, not a pick outside what the user asked for."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from planner_fixtures import synthetic_hardware, synthetic_model

from orchestrator.planner import HardwareModel, ModelCost, SearchSpace, search
from orchestrator.stages.search import _in_space, _trained_layout

GiB = 1 << 30


def _setup():
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    mc = ModelCost.from_dict(synthetic_model(layers=8, hidden=256, ffn=1024, heads=8,
                                             vocab=1000))
    space = SearchSpace(world_size=8, memory_budget_bytes=80 * GiB, global_batch_size=16,
                        seq_len=512)
    return hw, mc, space


def test_a_pick_outside_a_narrowed_search_is_not_trained():
    hw, mc, space = _setup()
    pick = search(mc, hw, dataclasses.replace(space, pp=1, tp=1)).best  # tune's measured fastest
    calibration = SimpleNamespace(pick=pick, pick_describe=pick.describe(), seq_len=512)
    narrowed = dataclasses.replace(space, pp=2)
    result = search(mc, hw, narrowed)
    notes = []
    trained = _trained_layout([(None, calibration)], narrowed, result, notes,
                              lambda lay: _in_space(lay, narrowed, mc, hw))
    assert trained == result.best and trained.pp == 2
    assert "outside this search's space" in notes[0]
    # the same search as tune's: the pick is kept
    result = search(mc, hw, space)
    notes = []
    assert _trained_layout([(None, calibration)], space, result, notes,
                           lambda lay: _in_space(lay, space, mc, hw)) == pick


def test_in_space_checks_degrees_zero_and_memory():
    hw, mc, space = _setup()
    best = search(mc, hw, space).best
    assert _in_space(best, space, mc, hw)
    assert not _in_space(best, dataclasses.replace(space, pp=best.pp * 2), mc, hw)
    others = tuple(z for z in space.zero_stages if z != best.zero)
    assert not _in_space(best, dataclasses.replace(space, zero_stages=others), mc, hw)
    assert not _in_space(best, dataclasses.replace(space, memory_budget_bytes=1), mc, hw)
