"""Work is bounded before it starts: sizes known from the config alone (micro-batches, samples
the dynamic planner splits, ranks and bytes a trace writes, profile points, message sizes,
sweep points, local ranks) are refused past `limits.*` in one line naming the key, the size and
the bound, before any ledger entry or folder; raising the named limit goes on."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import one_error_line, run_cli
from orchestrator.config import CONF_DIR, register_configs
from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout
from orchestrator.limits import LimitsConfig, check_train, check_trace
from orchestrator.pipeline import check_launchable, plan_stage
from orchestrator.sweep import check_sweep_size

BILLION = 1_000_000_000
register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def _refused(stage: str, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        plan_stage(stage, _cfg(f"stage={stage}", *overrides))
    return str(info.value)


# ---------------------------------------------------------------- the three cases
def test_a_billion_sequences_are_refused_before_search_and_train_walk_them():
    """search and train (its prediction walked 125M micro-batches in busy_stages) refuse it
    at planning, naming the key, the size and the limit; raising the limit plans it."""
    search = _refused("search", f"search.global_batch_size={BILLION}")
    assert "search.global_batch_size=1000000000" in search
    assert "1,000,000,000" in search and "limits.max_micro_batches=65,536" in search
    assert f"limits.max_micro_batches={BILLION}" in search  # how to go on
    train = _refused("train", "train.pp=1", "train.tp=1", f"train.global_batch_size={BILLION}")
    assert "train.global_batch_size=1000000000" in train and "250,000,000" in train
    plan = plan_stage("search", _cfg("stage=search", f"search.global_batch_size={BILLION}",
                                     f"limits.max_micro_batches={BILLION}"))
    assert plan.detail.global_batch_size == BILLION


def test_tracing_every_rank_of_a_million_is_refused_and_representatives_are_not():
    config = ["trace.world_size=1000000", "trace.pp=4", "trace.tp=2",
              "trace.global_batch_size=1000000"]
    message = _refused("trace", *config, "trace.all_ranks=true")
    assert "trace.all_ranks=true" in message and "1,000,000" in message
    assert "limits.max_traced_ranks=1,024" in message
    plan = plan_stage("trace", _cfg("stage=trace", *config))  # one rank per stage: allowed
    assert plan.detail.specs[0].layout.world_size == 1_000_000


def test_search_at_65536_gpus_stays_allowed_by_default():
    plan = plan_stage("search", _cfg("stage=search", "search.world_size=65536"))
    assert plan.detail.world_size == 65536


@pytest.mark.parametrize("args", [
    ["stage=search", f"search.global_batch_size={BILLION}"],
    ["stage=trace", "trace.world_size=1000000", "trace.pp=4", "trace.tp=2",
     "trace.global_batch_size=1000000", "trace.all_ranks=true"],
], ids=["search", "trace"])
def test_bound_refused_in_one_line_exit_2_with_nothing_written(profiles, args):
    """Before: search hung in-process under a ledger entry left `running`; trace wrote every
    rank's files."""
    line = one_error_line(run_cli(*args, profiles_dir=profiles, timeout=120), 2)
    assert "limits.max_" in line
    assert not profiles.exists()  # no ledger entry, no run folder


# ---------------------------------------------------------------- the other sizes
def _layout(pp=1, tp=1, dp=4, mbs=1, m=8, layers=4):
    return ParallelLayout.uniform(pp * tp * dp, tp, pp, layers, micro_batch_size=mbs,
                                  num_micro_batches=m)


def test_trace_bytes_and_micro_batches_are_bounded():
    limits = LimitsConfig()
    check_trace(limits, [_layout(pp=4, dp=1, m=8)], all_ranks=False)  # ~ 6 MB
    with pytest.raises(ConfigError, match=r"GiB of trace files \(estimated\).*max_trace_GiB"):
        check_trace(limits, [_layout(pp=4, dp=1, m=40_000)], all_ranks=False)  # ~30 GB
    with pytest.raises(ConfigError, match=r"at \[4, 1, 1\]: micro-batches.*= 70,000"):
        check_trace(limits, [_layout(m=70_000)], all_ranks=False)


def test_dynamic_planner_samples_are_bounded_in_normal_mode_only():
    big = _layout(mbs=2, m=1000)  # 2,000 samples per data-parallel rank
    check_train(LimitsConfig(), big, "train.global_batch_size=8000", dynamic=False)
    with pytest.raises(ConfigError, match=r"train.global_batch_size=8000: samples per "
                                          r"data-parallel rank.*= 2,000.*max_dynamic_samples"):
        check_train(LimitsConfig(), big, "train.global_batch_size=8000", dynamic=True)


def test_profile_points_message_size_and_local_ranks_are_bounded():
    points = _refused("profile_model", "profile_model.seq_len_step=1", "model.seq_len=100000000",
                      "profile_model.source=analytic")  # before: 10^8 lengths listed
    assert "profile_model.seq_len_step=1" in points and "limits.max_profile_points" in points
    message = _refused("profile_hardware", "profile_hardware.max_size_bytes=100000000000")
    assert "limits.max_message_GiB=4.0" in message
    cfg = _cfg("stage=noop", "cluster.tasks_per_node=1000")
    with pytest.raises(ConfigError, match=r"cluster.tasks_per_node=1000: ranks launcher=local"):
        check_launchable(plan_stage("noop", cfg), cfg)


def test_sweep_points_are_counted_without_listing_them():
    check_sweep_size(["-m", "stage=search", "search.pp=1,2,4", "search.tp=1,2"])
    with pytest.raises(ConfigError, match=r"-m search.pp=range\(1,100000000\) search.tp=1,2: "
                                          r"points in the sweep.* = 199,999,998"):
        check_sweep_size(["-m", "stage=search", "search.pp=range(1,100000000)", "search.tp=1,2"])
    check_sweep_size(["-m", "search.pp=range(1,1000)", "limits.max_sweep_points=1000"])
    check_sweep_size(["stage=search", "search.pp=range(1,100000000)"])  # no -m: no sweep
