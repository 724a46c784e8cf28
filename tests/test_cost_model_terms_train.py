"""The cost-model terms that issue 10's accuracy bench (bench/cost_model_accuracy.py) found
missing or mis-measured against `stage=train`: the optimizer step, and profile_model's timing
read as the median iteration (ranks sharing cores) with an optimizer step per part."""
from __future__ import annotations

import copy

import pytest
import torch

from orchestrator.layout import ParallelLayout
from orchestrator.planner import HardwareModel, ModelCost, SearchSpace, evaluate, search
from orchestrator.profiling.model.fit import fit_points
from orchestrator.profiling.model.optimizer_step import time_optimizer_step_us
from orchestrator.profiling.model.timing import combine_ranks, fastest_and_median
from planner_fixtures import GiB, synthetic_hardware, synthetic_model

SEQ = 512
BLOCK_OPTIM_US, OTHER_OPTIM_US = 900.0, 2_000.0


def _with_optimizer(model_json: dict) -> dict:
    """The same model profile with AdamW step times in every tp's fits (as profile_model
    writes them: the fits' extras)."""
    out = copy.deepcopy(model_json)
    for fit in out["fits"].values():
        fit["block_optim_us"] = BLOCK_OPTIM_US
        fit["other_optim_us"] = OTHER_OPTIM_US
    return out


@pytest.fixture(scope="module")
def models():
    plain = synthetic_model(layers=8, hidden=256, ffn=1024, heads=8, vocab=1000)
    return ModelCost.from_dict(plain), ModelCost.from_dict(_with_optimizer(plain))


@pytest.fixture(scope="module")
def hw():
    return HardwareModel.from_dict(synthetic_hardware(1, 4))


def test_profile_without_optimizer_figures_prices_no_optimizer_step(models):
    plain, _ = models
    assert plain.optimizer_us(1) == (0.0, 0.0)


def test_optimizer_step_of_all_layers_adds_to_the_iteration(models, hw):
    plain, priced = models
    layout = ParallelLayout.uniform(4, 1, 1, 8, num_micro_batches=2)  # dp4, zero 0
    without, with_opt = evaluate(layout, plain, hw, SEQ), evaluate(layout, priced, hw, SEQ)
    step_us = 8 * BLOCK_OPTIM_US + OTHER_OPTIM_US  # every rank steps every master (ZeRO-0)
    assert with_opt.iteration_time_us - without.iteration_time_us == pytest.approx(step_us)
    # the breakdown keeps its kinds: the step is compute
    assert (with_opt.breakdown_us["compute"] - without.breakdown_us["compute"]
            == pytest.approx(step_us))
    assert sum(with_opt.breakdown_us.values()) == pytest.approx(with_opt.iteration_time_us)


def test_zero1_steps_one_dp_shard_of_the_masters(models, hw):
    plain, priced = models
    layout = ParallelLayout.uniform(4, 1, 1, 8, num_micro_batches=2, zero=1)
    delta = (evaluate(layout, priced, hw, SEQ).iteration_time_us
             - evaluate(layout, plain, hw, SEQ).iteration_time_us)
    assert delta == pytest.approx((8 * BLOCK_OPTIM_US + OTHER_OPTIM_US) / 4)


def test_pipeline_iteration_adds_the_first_stages_step(models, hw):
    plain, priced = models
    layout = ParallelLayout.uniform(4, 1, 2, 8, num_micro_batches=4)  # pp2 dp2: 4 layers each
    delta = (evaluate(layout, priced, hw, SEQ).iteration_time_us
             - evaluate(layout, plain, hw, SEQ).iteration_time_us)
    # stage 0: its 4 blocks and half of "other" (the embedding's share of the memory)
    assert delta == pytest.approx(4 * BLOCK_OPTIM_US + 0.5 * OTHER_OPTIM_US)


def test_search_objective_includes_the_optimizer_step(models, hw):
    plain, priced = models
    space = SearchSpace(world_size=4, memory_budget_bytes=80 * GiB, global_batch_size=8,
                        seq_len=SEQ)
    result = search(priced, hw, space)
    again = evaluate(result.best, priced, hw, SEQ)
    assert result.prediction.iteration_time_us == pytest.approx(again.iteration_time_us)
    assert again.iteration_time_us > evaluate(result.best, plain, hw, SEQ).iteration_time_us


def test_point_times_are_the_median_iteration_and_keep_the_fastest():
    # one rank's samples: an iteration the OS left alone (100) among contended ones
    per_rank = [fastest_and_median({"block_fwd_us": [100.0, 300.0, 310.0, 290.0, 305.0],
                                    "block_bwd_us": [1.0], "other_fwd_us": [1.0],
                                    "other_bwd_us": [1.0], "block_optim_us": [50.0, 70.0, 60.0],
                                    "other_optim_us": [5.0]})] * 4
    point = combine_ranks(per_rank, tp=1)
    assert point["block_fwd_us"] == 300.0
    assert point["block_fwd_fastest_us"] == 100.0
    assert point["block_optim_us"] == 60.0
    assert point["other_optim_us"] == 5.0


def test_fits_carry_the_optimizer_step_median_over_lengths():
    base = {"tp": 1, "other_fwd_us": 10.0, "other_bwd_us": 20.0, "other_optim_us": 7.0}
    points = [{**base, "seq_len": s, "block_fwd_us": 100.0 + s, "block_bwd_us": 200.0 + 2 * s,
               "block_optim_us": b} for s, b in ((128, 40.0), (192, 50.0), (256, 90.0))]
    fit = fit_points(points)["1"]
    assert fit["block_optim_us"] == 50.0
    assert fit["other_optim_us"] == 7.0
    assert "block_optim_us" not in fit_points([{k: v for k, v in p.items()
                                                if "optim" not in k} for p in points])["1"]


def test_optimizer_step_time_grows_with_the_parameters():
    small = time_optimizer_step_us(10_000, torch.device("cpu"), warmup_iters=2, iters=7)
    large = time_optimizer_step_us(4_000_000, torch.device("cpu"), warmup_iters=2, iters=7)
    assert len(small) == 7 and min(small) > 0
    assert sorted(large)[3] > sorted(small)[3]
