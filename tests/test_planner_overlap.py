"""Overlap priced as each engine runs it (issue 41): Megatron-LM's --tp-comm-overlap (Transformer
Engine's userbuffers), --overlap-grad-reduce and --overlap-param-gather, each a knob the Megatron
export writes; stage=train's engine has none of them. The terms are pure functions checked on
hand-computed cases, then the cost model composing them. (Names are imported inside each test so
that each fails on its own against code without them.)"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost
from orchestrator.planner.cost_model import ConfigKey, StageCosts
from planner_fixtures import synthetic_hardware, synthetic_model

SEQ = 1024


@pytest.fixture(scope="module")
def big():
    """Layers of ~0.2 B parameters (several Megatron gradient buckets per stage at tp 2)."""
    return ModelCost.from_dict(synthetic_model(layers=8, hidden=4096, ffn=11008, heads=32,
                                               vocab=32000, seq_len=SEQ))


@pytest.fixture(scope="module")
def hw():
    return HardwareModel.from_dict(synthetic_hardware(4, 8))  # 32 ranks, 8 per node


def test_pipelined_pieces_hide_all_but_a_piece():
    from orchestrator.planner.terms import pipelined_extra_us

    assert pipelined_extra_us(10.0, 4.0, 1.0) == 0.0  # bulk, side by side: hidden
    assert pipelined_extra_us(10.0, 14.0, 1.0) == pytest.approx(4.0)  # sticks out
    assert pipelined_extra_us(8.0, 4.0, 1.0, 0.25) == 0.0  # ring of 4: 6 us of GEMM hide 4
    assert pipelined_extra_us(8.0, 10.0, 1.0, 0.25) == pytest.approx(4.0)  # 10 - 6
    assert pipelined_extra_us(8.0, 4.0, 1.0, 0.25, 0.25) == pytest.approx(1.0)  # last piece
    assert pipelined_extra_us(8.0, 16.0, 1.0, 0.25, 0.25) == pytest.approx(10.0)  # 4 + 12 - 6
    assert pipelined_extra_us(8.0, 4.0, 1.5, 0.25, 0.25) == pytest.approx(2.5)  # 1 + 3 x 0.5
    np.testing.assert_allclose(pipelined_extra_us(np.array([8.0, 8.0]), np.array([4.0, 16.0]),
                                                  1.0, 0.25, 0.25), [1.0, 10.0])


def test_userbuffers_hide_what_each_gemm_can():
    from orchestrator.planner.terms.tp_comm import gemm_shares, userbuffer_layer_us

    # hidden 4, ffn 8, 2 heads of 2: qkv 4 x 12, proj 16, fc1 2 x 4 x 8, fc2 32 of 160
    assert gemm_shares(4, 8, 2, 2) == pytest.approx((0.3, 0.1, 0.4, 0.2))
    one = {"all_gather": 8.0, "reduce_scatter": 8.0}  # us of one collective of each
    shares = (0.1, 0.1, 0.4, 0.4)  # qkv and proj 10 us, fc1 and fc2 40 us of a 100 us forward
    layer = userbuffer_layer_us(one, one, 100.0, shares, 4, 1.0)
    # forward: qkv's ring gather 8 beside 3/4 x 10 (0.5 out), proj's reduce-scatter in 4
    # pieces (the last, 2, out), fc1's gather hidden, fc2's last piece out (2)
    assert layer.fwd_us == pytest.approx(0.5 + 2.0 + 0.0 + 2.0)
    # backward: fc2's ring gather hidden, proj's 0.5 out; fc1's and qkv's bulk gather and
    # reduce-scatter beside their dgrad and wgrad GEMMs (10 and 40 us): hidden
    assert layer.bwd_us == pytest.approx(0.5)
    # a MoE block's experts have no userbuffers: fc1's and fc2's collectives exposed
    experts = userbuffer_layer_us(one, one, 100.0, shares, 4, 1.0, mlp=False)
    assert experts.fwd_us == pytest.approx(0.5 + 2.0 + 8.0 + 8.0)
    assert experts.bwd_us == pytest.approx(8.0 + 0.5 + 8.0 + 8.0)
    # the overlap slows the GEMMs beside it: 8 us of gathers beside 30 us at 1.5
    assert userbuffer_layer_us(one, {}, 100.0, (0.1, 0.1, 0.4, 0.4), 4, 1.5).fwd_us > 4.5


def test_megatron_buckets_leave_the_last_one_exposed():
    from orchestrator.planner.terms.zero import megatron_bucket_count, overlapped_sync_us

    assert megatron_bucket_count(3.2e9, 64) == 50  # 64M-parameter buckets (1M x dp)
    assert megatron_bucket_count(1e6, 8) == 1
    assert megatron_bucket_count(80_000_001, 8) == 3  # 40M-parameter buckets
    # 5 buckets of 2 us beside a 20 us backward: the first bucket is ready after 4 us, the last
    # one's 2 us run after the backward
    assert overlapped_sync_us(10.0, 0.0, 20.0, 0.0, 5, 1.0) == pytest.approx(2.0)
    assert overlapped_sync_us(30.0, 0.0, 20.0, 0.0, 5, 1.0) == pytest.approx(6.0 + 24.0 - 16.0)
    assert overlapped_sync_us(10.0, 0.0, 20.0, 0.0, 1, 1.0) == pytest.approx(10.0)  # one bucket
    # the other model chunks' sync beside the backwards after them: 5 beside 3 sticks out 2
    assert overlapped_sync_us(10.0, 5.0, 20.0, 3.0, 5, 1.0) == pytest.approx(2.0 + 2.0)


@pytest.mark.parametrize("v", [1, 2])
def test_megatron_sync_overlaps_the_last_backward_and_the_next_forward(big, hw, v):
    from orchestrator.planner.terms.zero import (megatron_bucket_count, megatron_sync_parts_us,
                                                 overlapped_sync_us)

    layout = ParallelLayout.uniform(32, 2, 2, 8, sequence_parallel=True, zero=1,
                                    num_micro_batches=4, virtual_stages=v,
                                    schedule="interleaved" if v > 1 else "1f1b")
    key = ConfigKey.of(layout)
    coe = hw.overlap_coe
    costs = StageCosts(key, big, hw, SEQ, CostOptions(engine="megatron"))
    chunk = 4 // v  # stage 0's chunk 0: its first layers and the embedding
    grad0, param0 = (chunk * costs.block_grad_bytes + float(costs.other_grad_bytes[0]),
                     chunk * costs.block_param_bytes + float(costs.other_param_bytes[0]))
    grads0, gather0 = megatron_sync_parts_us(hw, 1, 8, 2, grad0, param0)
    grads, gather = megatron_sync_parts_us(
        hw, 1, 8, 2, 4 * costs.block_grad_bytes + float(costs.other_grad_bytes[0]),
        4 * costs.block_param_bytes + float(costs.other_param_bytes[0]))
    buckets = megatron_bucket_count(param0 / 2, 8)  # bf16 parameters
    assert buckets > 1
    behind = (v - 1) * chunk  # chunk 0's pp - 1 = 1 backward (forward) after the others'
    expected = (overlapped_sync_us(grads0, grads - grads0,
                                   chunk * costs.layer.bwd_us + float(costs.other.bwd_us[0]),
                                   behind * costs.layer.bwd_us, buckets, coe)
                + overlapped_sync_us(gather0, gather - gather0,
                                     chunk * costs.layer.fwd_us + float(costs.other.fwd_us[0]),
                                     behind * costs.layer.fwd_us, buckets, coe))
    assert float(costs.dp_exposed_us(0, 4)) == pytest.approx(float(expected))
    assert 0 < float(costs.dp_exposed_us(0, 4)) < grads + gather
    # --overlap-param-gather off: the all-gather runs in the optimizer step, whole
    no_gather = StageCosts(key, big, hw, SEQ, CostOptions(engine="megatron",
                                                          overlap_param_gather=False))
    assert float(no_gather.dp_exposed_us(0, 4)) == pytest.approx(float(
        expected - overlapped_sync_us(gather0, gather - gather0,
                                      chunk * costs.layer.fwd_us + float(costs.other.fwd_us[0]),
                                      behind * costs.layer.fwd_us, buckets, coe) + gather))
    # --overlap-grad-reduce off: one synchronous sync after the backward
    off = StageCosts(key, big, hw, SEQ, CostOptions(engine="megatron", overlap_grad_reduce=False,
                                                    overlap_param_gather=False))
    assert float(off.dp_exposed_us(0, 4)) == pytest.approx(float(grads + gather))


def test_tp_overlap_is_megatrons_with_sequence_parallelism_only(big, hw):
    from orchestrator.planner.terms.tp_comm import gemm_shares, userbuffer_layer_us

    key = ConfigKey.of(ParallelLayout.uniform(32, 4, 1, 8, sequence_parallel=True,
                                              num_micro_batches=4))
    on = StageCosts(key, big, hw, SEQ, CostOptions(engine="megatron"))
    off = StageCosts(key, big, hw, SEQ, CostOptions(engine="megatron", tp_comm_overlap=False))
    one = {op: hw.collective_time_us(op, 4, 1, SEQ * 4096 * 2)  # s x h, bf16
           for op in ("all_gather", "reduce_scatter")}
    gemm_fwd_us = big.block_linear_us(SEQ, 4)[0] * on.contention
    expected = userbuffer_layer_us(one, one, gemm_fwd_us, gemm_shares(4096, 11008, 32, 32), 4,
                                   hw.overlap_coe)
    assert on.tp.layer.fwd_us == pytest.approx(expected.fwd_us)
    assert on.tp.layer.bwd_us == pytest.approx(expected.bwd_us)
    assert on.tp.layer.total_us < off.tp.layer.total_us
    assert off.tp.layer.fwd_us == pytest.approx(2 * (one["all_gather"] + one["reduce_scatter"]))
    # the embedding's and LM head's collectives are no userbuffers
    assert on.tp.embedding == off.tp.embedding and on.tp.head == off.tp.head
    # stage=train's engine (DTensor) overlaps nothing; Megatron refuses it without SP
    ours = StageCosts(key, big, hw, SEQ, CostOptions(tp_comm_overlap=True))
    assert ours.tp.layer == StageCosts(key, big, hw, SEQ).tp.layer
    no_sp = ConfigKey.of(ParallelLayout.uniform(32, 4, 1, 8, num_micro_batches=4))
    assert (StageCosts(no_sp, big, hw, SEQ, CostOptions(engine="megatron")).tp.layer
            == StageCosts(no_sp, big, hw, SEQ, CostOptions(engine="megatron",
                                                           tp_comm_overlap=False)).tp.layer)


def test_megatron_args_say_what_was_priced():
    from orchestrator.planner.exports import megatron_args
    from orchestrator.planner.options import Overlap

    flags = {"--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"}
    sp_zero1 = ParallelLayout.uniform(16, 2, 2, 8, sequence_parallel=True, zero=1,
                                      num_micro_batches=4)
    assert flags <= set(megatron_args(sp_zero1))  # the defaults: all on
    assert not flags & set(megatron_args(sp_zero1, overlap=Overlap(False, False, False)))
    assert set(megatron_args(sp_zero1, overlap=Overlap(True, True, False))) & flags == {
        "--overlap-grad-reduce", "--tp-comm-overlap"}
    # ZeRO 0 has no distributed optimizer to gather; no SP, no userbuffers
    plain = set(megatron_args(ParallelLayout.uniform(16, 2, 2, 8, num_micro_batches=4)))
    assert plain & flags == {"--overlap-grad-reduce"}
    # ZeRO 3 is torch FSDP2: none of the DDP's
    fsdp = set(megatron_args(ParallelLayout.uniform(16, 2, 1, 8, zero=3, num_micro_batches=4)))
    assert not fsdp & {"--overlap-grad-reduce", "--overlap-param-gather"}


def _cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from orchestrator.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["stage=search", *overrides])


def test_search_knobs_reach_the_price_and_are_megatrons_only():
    from orchestrator.errors import ConfigError
    from orchestrator.stages.search_config import validate

    space = validate(_cfg("search.engine=megatron", "search.tp_comm_overlap=false"))
    assert space.options.overlap() == (False, True, True)  # tp_comm, grad_reduce, param_gather
    assert validate(_cfg("search.engine=megatron")).options.overlap() == (True, True, True)
    with pytest.raises(ConfigError, match="search.tp_comm_overlap is Megatron-LM's option"):
        validate(_cfg("search.tp_comm_overlap=true"))  # stage=train's engine has none
    with pytest.raises(ConfigError, match="needs search.overlap_grad_reduce"):
        validate(_cfg("search.engine=megatron", "search.overlap_grad_reduce=false",
                      "search.overlap_param_gather=true"))
