"""Each cost term on its own against Megatron's (or the textbook) formula, with numbers worked by
hand on hand-made HardwareModel / ModelCost objects (tests/planner_fixtures.py)."""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.planner.cost_model import ConfigKey, StageCosts
from orchestrator.planner.schedule import in_flight_micro_batches, schedule_coefficients
from orchestrator.planner.terms import FwdBwd, overlap_extra_us
from orchestrator.planner.terms.compute import LayerCompute
from orchestrator.planner.terms.memory import (ActivationBytes, comm_buffer_bytes,
                                               stage_activation_bytes)
from orchestrator.choices import Dtype, Recompute
from orchestrator.planner.terms.pipeline import (boundary_intra_node, boundary_us,
                                                 on_end_stages, stage_sends)
from orchestrator.planner.terms.tp_comm import TpComm
from orchestrator.planner.terms.zero import ZeroSharding, ZeroTraffic, dp_sync_us
from orchestrator.workload.comm import layer_activation_bytes, pp_message_bytes, tp_messages
from orchestrator.workload.states import no_sp_extra_bytes_per_token
from planner_fixtures import hand_hardware, hand_model

# s = 1024 tokens, b = 2, h = 4096, bf16: 2sbh = 16 MiB per TP collective.
S, B, H = 1024, 2, 4096
MSG = 16 * 2**20
LOSS_BYTES = S * B * 4  # the vocab-parallel loss all-reduces one fp32 value per token


@pytest.fixture(scope="module")
def tp_hw():
    """TP group of 4 inside a node: all-gather 10 us + B / 100 GB/s, reduce-scatter 12 us +
    B / 100 GB/s, all-reduce 30 us + B / 50 GB/s."""
    return hand_hardware({("all_gather", "consec"): (4, 10.0, 100.0),
                          ("reduce_scatter", "consec"): (4, 12.0, 100.0),
                          ("allreduce", "consec"): (4, 30.0, 50.0)})


# ------------------------------------------------------------------ compute
def test_layer_compute_reads_the_fits_times_the_micro_batch():
    # block fwd 10 + 0.5 s + 0.001 s^2 at s = 100: 70 us per sequence; a micro-batch of b = 2
    # is one call: the constant once, the rest twice, 10 + 2 x 60 = 130
    model = hand_model()
    c = LayerCompute.from_model(model, seq_len=100, tp=1, micro_batch_size=2)
    assert c.block == FwdBwd(pytest.approx(130.0), pytest.approx(270.0))  # bwd 20 + 2 x 125
    assert c.selective_recompute_us == pytest.approx(20.0)  # the s^2 term: 0.001 * 100^2 * 2
    assert c.other == FwdBwd(pytest.approx(25.0), pytest.approx(50.0))  # 5 + 2 x 10, 10 + 2 x 20
    one = LayerCompute.from_model(model, seq_len=100, tp=1, micro_batch_size=1)
    assert one.block == FwdBwd(pytest.approx(70.0), pytest.approx(145.0))


# ------------------------------------------------------------------ tensor parallel
def test_tp_message_is_2sbh_bytes_in_bf16():
    assert layer_activation_bytes(S * B, H, Dtype.bf16) == 2 * S * B * H == MSG


def _tp(engine: str, sequence_parallel: bool, dtype: str = "bf16"):
    """The TP messages of a micro-batch of b = 2 sequences of s tokens (workload/comm.py)."""
    return tp_messages(engine, sequence_parallel, S * B, H, dtype)


def test_megatron_with_sequence_parallel_is_2ag_2rs_forward_4ag_2rs_backward(tp_hw):
    ag = 10 + MSG / 100e3  # 177.77216 us
    rs = 12 + MSG / 100e3  # 179.77216 us
    loss_ar = 30 + LOSS_BYTES / 50e3
    comm = TpComm.from_hardware(tp_hw, 4, _tp("megatron", True))
    assert comm.layer.fwd_us == pytest.approx(715.08864) == pytest.approx(2 * ag + 2 * rs)
    assert comm.layer.bwd_us == pytest.approx(1070.63296) == pytest.approx(4 * ag + 2 * rs)
    assert comm.embedding == FwdBwd(pytest.approx(rs), pytest.approx(ag))
    # vocab-parallel loss: three small all-reduces, no logits all-gather; the head's backward
    # gathers its sharded input again, as every SP linear of Megatron-LM
    assert comm.head == FwdBwd(pytest.approx(ag + 3 * loss_ar), pytest.approx(ag + rs))
    assert comm.recompute_us == pytest.approx(2 * ag + 2 * rs)  # the whole forward again


def test_our_engine_with_sequence_parallel_gathers_again_and_reduces_the_loss(tp_hw):
    """stage=train's engine: 2 AG + 2 RS forward; the backward moves their gradients and
    gathers the sequence-sharded inputs again (2 more AG, issue 41; the counts
    test_train_engine checks against the real engine); its loss is vocab-parallel. Under bf16
    its weights and residual stream are bf16 (issue 41; under autocast over fp32 weights the
    gathers of norm outputs and their gradients moved twice the bytes, issue 40)."""
    ag, ag32 = 10 + MSG / 100e3, 10 + 2 * MSG / 100e3
    rs, rs32 = 12 + MSG / 100e3, 12 + 2 * MSG / 100e3
    loss_ar = 30 + LOSS_BYTES / 50e3
    comm = TpComm.from_hardware(tp_hw, 4, _tp("orchestrator", True))
    assert comm.layer == FwdBwd(pytest.approx(2 * ag + 2 * rs), pytest.approx(4 * ag + 2 * rs))
    assert comm.head == FwdBwd(pytest.approx(ag + 3 * loss_ar), pytest.approx(rs))
    assert comm.recompute_us == pytest.approx(2 * ag + rs)  # checkpointing stops early
    # in fp32 every message is the fp32 activation
    fp32 = TpComm.from_hardware(tp_hw, 4, _tp("orchestrator", True, "fp32"))
    assert fp32.layer == FwdBwd(pytest.approx(2 * ag32 + 2 * rs32),
                                pytest.approx(4 * ag32 + 2 * rs32))


def test_tp_without_sequence_parallel_is_2_allreduce_each_way(tp_hw):
    ar = 30 + MSG / 50e3  # 365.54432 us
    comm = TpComm.from_hardware(tp_hw, 4, _tp("megatron", False))  # all bf16
    assert comm.layer == FwdBwd(pytest.approx(731.08864), pytest.approx(731.08864))
    assert comm.embedding == FwdBwd(pytest.approx(ar), 0.0)
    # the head's forward: only the vocab-parallel loss's three all-reduces (always priced now:
    # the messages are the workload's, which has no loss-free variant)
    assert comm.head == FwdBwd(pytest.approx(3 * (30 + LOSS_BYTES / 50e3)), pytest.approx(ar))


def test_tp_of_one_rank_communicates_nothing(tp_hw):
    comm = TpComm.from_hardware(tp_hw, 1, _tp("orchestrator", False))
    assert comm.layer.total_us == comm.embedding.total_us == comm.head.total_us == 0.0


def test_stage_costs_use_the_tp_term_with_consecutive_ranks(tp_hw):
    model = hand_model(tp=4, hidden=H, heads=8, seq_len=S)
    costs = StageCosts(ConfigKey(4, 4, 1, 1, 0, True, B, 1, "1f1b", 1), model, tp_hw, S)
    assert costs.tp == TpComm.from_hardware(tp_hw, 4, _tp("orchestrator", True))
    # One stage holds everything: fwd = n (block + TP) + other + embedding + head (its input's
    # all-gather and the loss's three all-reduces); every message in the profile's bf16 (the
    # residual stream of bf16 weights).
    c = costs.compute
    ag, rs = 10 + MSG / 100e3, 12 + MSG / 100e3
    expected_fwd = (4 * (c.block.fwd_us + 2 * ag + 2 * rs) + c.other.fwd_us
                    + rs + ag + 3 * (30 + LOSS_BYTES / 50e3))
    assert costs.stage_fwd_us(0, 4) == pytest.approx(expected_fwd)


# ------------------------------------------------------------------ ZeRO
@pytest.mark.parametrize("zero,bytes_per_param", [(0, 18.0), (1, 6.0 + 12.0 / 8),
                                                  (2, 2.0 + 16.0 / 8), (3, 18.0 / 8)])
def test_zero_sharding_gives_megatrons_bytes_per_param(zero, bytes_per_param):
    """Mixed-precision Adam, 2 + 4 + 12 bytes per parameter, sharded over dp = 8: 18, and
    6 + 12/dp with Megatron's distributed optimizer (ZeRO 1)."""
    params, grads, optim = ZeroSharding.of(zero, 8).shard(2.0, 4.0, 12.0)
    assert params + grads + optim == pytest.approx(bytes_per_param)


@pytest.fixture(scope="module")
def dp_hw():
    """dp 4 with stride tp 2 on 8-rank nodes: one node, "consec" fits."""
    return hand_hardware({("all_gather", "consec"): (4, 10.0, 100.0),
                          ("reduce_scatter", "consec"): (4, 12.0, 100.0),
                          ("allreduce", "consec"): (4, 20.0, 50.0)}, overlap_coe=1.2)


@pytest.mark.parametrize("zero,gather_us,reduce_scatter_us", [(0, 0.0, 0.0), (1, 0.0, 0.0),
                                                              (2, 0.0, 52.0), (3, 30.0, 52.0)])
def test_zero_traffic_per_layer(dp_hw, zero, gather_us, reduce_scatter_us):
    # 2 MB of bf16 params: 10 + 2e6 / 1e5 = 30 us; 4 MB of fp32 grads: 12 + 40 = 52 us
    traffic = ZeroTraffic.from_hardware(dp_hw, zero, 4, 2, 2e6, 4e6)
    assert traffic.gather_us == pytest.approx(gather_us)
    assert traffic.reduce_scatter_us == pytest.approx(reduce_scatter_us)


def test_zero3_traffic_sticks_out_by_the_overlap_rule(dp_hw):
    traffic = ZeroTraffic.from_hardware(dp_hw, 3, 4, 2, 2e6, 4e6)
    exposed = traffic.exposed(FwdBwd(100.0, 50.0), dp_hw.overlap_coe)
    # forward: 30 us beside 100 us of compute, 100 + 30 * 0.2 - 100 = 6 us
    # backward: 30 + 52 = 82 us beside 50 us, 82 + 50 * 0.2 - 50 = 42 us
    assert exposed == FwdBwd(pytest.approx(6.0), pytest.approx(42.0))
    assert overlap_extra_us(100.0, 30.0, 1.2) == pytest.approx(6.0)


@pytest.mark.parametrize("zero,dp,sync_us", [(0, 4, 100.0), (1, 4, 82.0), (2, 4, 30.0),
                                             (3, 4, 0.0), (0, 1, 0.0)])
def test_gradient_sync_by_zero_stage(dp_hw, zero, dp, sync_us):
    """fp32 grads (4 MB) all-reduced: 20 + 4e6 / 5e4 = 100 us; distributed optimizer:
    reduce-scatter 52 us + bf16 param (2 MB) all-gather 30 us."""
    assert dp_sync_us(dp_hw, zero, dp, 2, np.array([4e6]), np.array([2e6])) == \
        pytest.approx([sync_us])


# ------------------------------------------------------------------ pipeline p2p
def test_p2p_message_is_sbh_and_sharded_by_sequence_parallel():
    assert pp_message_bytes(float(S * B), H, 4, False, Dtype.bf16) == MSG
    assert pp_message_bytes(float(S * B), H, 4, True, Dtype.bf16) == MSG / 4


def test_boundaries_inside_a_node_are_intra():
    # pp 4, tp * dp = 4 ranks per stage, 8 ranks per node: stages 0, 1 on node 0, 2, 3 on 1.
    assert boundary_intra_node(4, 4, 8) == [True, False, True, False]
    assert boundary_intra_node(2, 4, 8) == [True, True]  # the wrap stays in node 0


def test_boundary_time_uses_intra_and_inter_fits():
    hw = hand_hardware({("p2p", "intra"): (2, 5.0, 200.0), ("p2p", "inter"): (2, 20.0, 25.0)})
    times = boundary_us(hw, MSG / 4, [True, False, True, False])
    intra, inter = 5 + MSG / 4 / 200e3, 20 + MSG / 4 / 25e3  # 25.97152, 187.77216 us
    assert times == pytest.approx([intra, inter, intra, inter])
    assert boundary_us(hw, MSG, [True]).tolist() == [0.0]  # pp = 1


@pytest.mark.parametrize("v,fwd,bwd", [(1, [1, 2, 3, 0], [0, 1, 2, 3]),
                                       (2, [2, 4, 6, 4], [4, 2, 4, 6])])
def test_sends_per_stage_with_interleaved_wrap(v, fwd, bwd):
    """Boundary times 1, 2, 3 and wrap 4: each chunk sends once; with v chunks the last stage's
    first v - 1 chunks wrap to stage 0 and stage 0 sends v - 1 gradients back over the wrap."""
    sends = stage_sends(np.array([1.0, 2.0, 3.0, 4.0]), v)
    assert sends.fwd_us.tolist() == fwd and sends.bwd_us.tolist() == bwd


def test_other_lives_on_the_end_stages():
    assert on_end_stages(1.0, 2.0, 3).tolist() == [1.0, 0.0, 2.0]
    assert on_end_stages(1.0, 2.0, 1).tolist() == [3.0]


# ------------------------------------------------------------------ schedule
@pytest.mark.parametrize("schedule,v,bubble", [("1f1b", 1, 3 / 8), ("interleaved", 2, 3 / 16)])
def test_schedule_coefficients_give_the_textbook_bubble(schedule, v, bubble):
    """p = 4 equal stages of time t, m = 8: T = (alpha p + beta) t, bubble T / (m t) - 1 =
    (p - 1) / m for 1F1B and (p - 1) / (v m) interleaved."""
    alpha, beta = schedule_coefficients(schedule, 8, v)
    assert (alpha, beta) == ((1.0, 7.0) if v == 1 else (0.5, 7.5))
    assert (alpha * 4 + beta) / 8 - 1 == pytest.approx(bubble)


@pytest.mark.parametrize("schedule,m,v,expected", [
    ("1f1b", 8, 1, [4, 3, 2, 1]), ("1f1b", 2, 1, [2, 2, 2, 1]),
    # Megatron: (p - j - 1) * 2 + (v - 1) * p + 1 chunks = 11, 9, 7, 5 of half a stage
    ("interleaved", 8, 2, [5.5, 4.5, 3.5, 2.5]),
    ("interleaved", 4, 2, [4.0, 4.0, 3.5, 2.5]),  # at most m v = 8 chunks
])
def test_in_flight_micro_batches(schedule, m, v, expected):
    assert in_flight_micro_batches(schedule, 4, m, v).tolist() == expected


# ------------------------------------------------------------------ memory
def test_activations_with_and_without_sequence_parallel():
    """h = 1024, a = 8, s = 512, t = 4. Megatron's SP figures per token: none h(34/t) + 5as/t =
    8704 + 5120, selective 34h/t = 8704, full 2h/t = 512. Without SP: h(10 + 24/t) + 5as/t =
    21504, selective h(10 + 24/t) = 16384, full 2h = 2048: what SP would shard is the
    difference (workload/states.no_sp_extra_bytes_per_token, which our engine's memory adds)."""
    sp = (13824.0, 8704.0, 512.0)
    no_sp = [a + no_sp_extra_bytes_per_token(mode, 4, 1024, 2) for a, mode in zip(sp, Recompute)]
    assert no_sp == [21504.0, 16384.0, 2048.0]
    assert all(no_sp_extra_bytes_per_token(mode, 1, 1024, 2) == 0 for mode in Recompute)


@pytest.mark.parametrize("code,k,expected", [
    (0, 0, 1000 * 3 * 4 * 13824),  # every layer keeps all
    (1, 4, 1000 * (3 * 4 * 8704 + (13824 - 8704))),  # + one layer's attention while rerun
    (2, 3, 1000 * (3 * (3 * 512 + 13824) + (13824 - 512))),  # 3 inputs + 1 whole + one rerun
])
def test_stage_activations_per_recompute_mode(code, k, expected):
    act = ActivationBytes(13824.0, 8704.0, 512.0)
    assert stage_activation_bytes(act, 1000.0, 3.0, 4, code, k) == pytest.approx(expected)


def test_comm_buffers():
    assert comm_buffer_bytes(3, 8, 4, 2e6, MSG) == 2 * 2e6 + MSG  # two gathered layers + one
    assert comm_buffer_bytes(3, 1, 1, 2e6, MSG) == 0.0
    assert comm_buffer_bytes(1, 8, 2, 2e6, MSG) == MSG
