"""The memory reserve: search.reserve_fraction x budget + search.reserve_GiB kept free per device,
the same rule for search and train's pre-launch check, and the headroom the strategy records."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.config import CONF_DIR, register_configs
from orchestrator.errors import ConfigError, InfeasibleError
from orchestrator.layout import ParallelLayout
from orchestrator.planner import HardwareModel, InfeasibleError as PlannerInfeasible, evaluate
from orchestrator.planner import search
from orchestrator.planner.cost_model import CostOptions, budget_for_GiB, memory_reserve_GiB
from orchestrator.stages.search import _report, _strategy
from orchestrator.stages.search_config import infeasible_advice, validate
from orchestrator.store.schema import Provenance
from orchestrator.train.plan import check_memory

from planner_fixtures import hand_model, synthetic_hardware

GiB = 2**30


def _cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["stage=search", *overrides])


# 4 layers of 0.5 GiB of Adam states (bf16 params, fp32 grads, optimizer), tp 1 only: the one
# layout searched below (pp1 tp1 dp4, ZeRO 0, no recompute) holds 4 x 0.5 = 2 GiB of it, plus
# ZeRO 0's gradient buckets, "other" and activations (~0.17 GiB), priced as Megatron's (the
# profile's states, Megatron-Core's activations in the compute dtype: fp32, as the search runs on
# the default CPU cluster; the reserve rule is the same for both engines).
MEGATRON = CostOptions(reserve_bytes=0.0, engine="megatron", dtype="fp32", device="cpu")
BLOCK_GiB = 0.5
SEARCHED = ("search.tp=1", "search.pp=1", "search.zero_stages=[0]", "search.recompute=[none]",
            "search.micro_batch_sizes=[1]", "search.schedules=[1f1b]", "search.global_batch_size=4",
            "search.seq_len=512", "search.plot=false", "search.engine=megatron")


def _model():
    block, other = hand_model().memory(1)
    b = BLOCK_GiB * GiB
    return hand_model(block=replace(block, param_bytes=b / 9, grad_bytes=2 * b / 9,
                                    optim_bytes=6 * b / 9), other=other)


def _own_peak_GiB() -> float:
    """The layout's peak without any reserve (what the model itself holds)."""
    layout = ParallelLayout.uniform(4, 1, 1, 4, micro_batch_size=1, num_micro_batches=1)
    pred = evaluate(layout, _model(), HardwareModel.from_dict(synthetic_hardware(1, 4)), 512,
                    options=MEGATRON)
    return pred.peak_memory_bytes / GiB


def test_reserve_arithmetic():
    assert memory_reserve_GiB(36, 0.2, 1.0) == pytest.approx(8.2)  # Galvatron's 20% + 1 GiB
    assert memory_reserve_GiB(36, 0.0, 2.0) == 2.0  # the old rule
    assert budget_for_GiB(27.8, 0.2, 1.0) == pytest.approx(36.0)  # 27.8 + 8.2 = 36
    # The defaults and the GPU figures (docs/gpu.md): on 79.18 GiB the reserve is
    # 0.10 x 79.18 + 1 = 8.92 GiB; a pick the search's closed form predicts at the 70.26 GiB
    # left is at most 70.26 / 0.95 under the workload model's walk (its worst on the test
    # matrices), which the allocator reserves 23,824 / 22,850 of (the one-GPU bf16 peak), + ~1
    # GiB of CUDA context, cuBLAS workspace and NCCL buffers = 78.11 <= 79.18.
    s = _cfg().search
    assert (s.reserve_fraction, s.reserve_GiB) == (0.10, 1.0)
    reserve = memory_reserve_GiB(79.18, s.reserve_fraction, s.reserve_GiB)
    assert reserve == pytest.approx(8.918)
    assert (79.18 - reserve) / 0.95 * 23824 / 22850 + 1 <= 79.18


def test_search_space_charges_the_reserve_of_its_budget():
    space = validate(_cfg("search.memory_GiB=10", "search.reserve_fraction=0.25",
                          "search.reserve_GiB=0.5", *SEARCHED))
    assert space.options.reserve_bytes == 3.0 * GiB  # 0.25 x 10 + 0.5


def test_a_pick_that_fitted_the_old_reserve_is_rejected_naming_the_reserve():
    own = _own_peak_GiB()
    assert 2.0 < own < 2.25  # 4 x 0.5 GiB of blocks + buckets, "other", activations
    budget = round(own + 1.2, 2)  # a constant 1 GiB reserve: fits
    model, hw = _model(), HardwareModel.from_dict(synthetic_hardware(1, 4))
    old = validate(_cfg(f"search.memory_GiB={budget}", "search.reserve_fraction=0",
                        "search.reserve_GiB=1", *SEARCHED))
    assert search(model, hw, old).best.dp == 4
    cfg = _cfg(f"search.memory_GiB={budget}", *SEARCHED)  # defaults: 0.10 x budget + 1 GiB
    space = validate(cfg)
    reserve = 0.10 * budget + 1
    assert own + reserve > budget  # ~2.23 + 0.10 x 3.43 + 1 = 3.57 > 3.43
    layout = ParallelLayout.uniform(4, 1, 1, 4, micro_batch_size=1, num_micro_batches=1)
    pred = evaluate(layout, model, hw, 512, memory_budget_bytes=space.memory_budget_bytes,
                    options=space.options)
    assert not pred.feasible and f"reserve kept free: {reserve:.2f} GiB" in pred.reason
    with pytest.raises(PlannerInfeasible) as err:
        search(model, hw, space)
    advice = infeasible_advice(err.value, cfg)
    assert f"with {reserve:.2f} GiB of it kept free" in advice
    assert "search.reserve_fraction=0.1" in advice and "search.reserve_GiB=1.0" in advice
    # The budget that holds the model and its own reserve: (own + 1) / 0.9, rounded up.
    needed = (own + 1) / 0.9
    assert f"search.memory_GiB={int(needed * 100 + 1) / 100}" in advice


@pytest.mark.parametrize("overrides,named", [
    (["search.reserve_fraction=1"], "search.reserve_fraction(1.0) must be in [0, 1)"),
    (["search.reserve_fraction=-0.1"], "search.reserve_fraction(-0.1) must be in [0, 1)"),
    (["search.reserve_GiB=-1"], "search.reserve_GiB(-1.0) must be >= 0"),
    (["search.memory_GiB=4", "search.reserve_fraction=0.5", "search.reserve_GiB=2"],
     "search.reserve_fraction(0.5) x 4.0 GiB + search.reserve_GiB(2.0) = 4 GiB kept free must "
     "be below"),
])
def test_reserve_config_errors(overrides, named):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(*overrides))
    assert named in str(err.value)


def test_train_checks_memory_with_the_same_rule():
    """train.memory_GiB=3: reserve 0.10 x 3 + 1 = 1.30 GiB; a ~2.23 GiB prediction needs 3.53;
    with 0.4 GiB instead of 1 (0.7 GiB) it fits."""
    layout = ParallelLayout.uniform(4, 1, 1, 4, micro_batch_size=1, num_micro_batches=1)
    pred = evaluate(layout, _model(), HardwareModel.from_dict(synthetic_hardware(1, 4)), 512,
                    options=MEGATRON)
    with pytest.raises(InfeasibleError, match="a reserve of 1.30 GiB"):
        check_memory(_cfg("stage=train", "train.memory_GiB=3"), pred)
    check_memory(_cfg("stage=train", "train.memory_GiB=3", "search.reserve_GiB=0.4"), pred)


def test_strategy_records_the_reserve_and_the_headroom(capsys):
    cfg = _cfg("search.memory_GiB=8", *SEARCHED)
    space = validate(cfg)
    result = search(_model(), HardwareModel.from_dict(synthetic_hardware(1, 4)), space)
    strategy = _strategy(cfg, result, space, [], [], Provenance())
    reserve = 0.10 * 8 + 1  # 1.8 GiB
    assert strategy.space.reserve_fraction == 0.10 and strategy.space.reserve_GiB == 1.0
    assert strategy.space.reserve_total_GiB == pytest.approx(reserve)
    peak_GiB = result.prediction.peak_memory_bytes / GiB  # the reserve included
    assert strategy.headroom.reserve_GiB == pytest.approx(reserve)
    assert strategy.headroom.free_GiB == pytest.approx(8 - peak_GiB)
    assert strategy.headroom.free_GiB == pytest.approx(8 - reserve - _own_peak_GiB())
    _report(result, strategy, cfg)
    line = [x for x in capsys.readouterr().out.splitlines() if "memory per device" in x]
    assert line and f"reserve {reserve:.2f}" in line[0]
    assert f"headroom {8 - peak_GiB:.2f} GiB" in line[0]


@pytest.mark.parametrize("engine", ["orchestrator", "megatron"])
def test_search_prices_the_engine_it_is_told_and_says_which(engine, capsys):
    """search.engine reaches the cost model (workload.tp's counts of that engine) and the
    strategy and the printed table name it."""
    cfg = _cfg("search.memory_GiB=8", *SEARCHED, f"search.engine={engine}")
    space = validate(cfg)
    assert space.options.engine == engine
    result = search(_model(), HardwareModel.from_dict(synthetic_hardware(1, 4)), space)
    strategy = _strategy(cfg, result, space, [], [], Provenance())
    assert strategy.space.engine == engine
    _report(result, strategy, cfg)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"communication and memory of the {engine} engine" in printed
