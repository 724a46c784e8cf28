"""Collectives priced by the nodes a group spans (HardwareModel's topology rules), on hand-made
profiles whose inter-node links are 10x slower than the intra-node ones. Every expected time is
worked by hand from the fits below: alpha_us + bytes / (algbw_GBps * 1e3)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, SearchSpace, evaluate, search
from orchestrator.planner.hardware_model import HardwareModel, LinkFit, group_span
from orchestrator.planner.terms.zero import ZeroTraffic, dp_sync_us

from planner_fixtures import hand_model

GiB = 2**30
MEGATRON = CostOptions(engine="megatron")

# 2 nodes x 4 ranks. All-reduce: inside a node 100 / 80 GB/s algbw (groups of 2 / 4); across
# nodes 10 GB/s (one per node), 8 (2 per node, strided 4 = ranks 0,2,4,6), 5 (4 per node, consec
# 8). Reduce-scatter / all-gather measured inside a node only (as profile_hardware does).
P2P = {("p2p", "intra"): (LinkFit(2, 5.0, 50.0),), ("p2p", "inter"): (LinkFit(2, 20.0, 5.0),)}
INTRA = {("allreduce", "consec"): (LinkFit(2, 10.0, 100.0), LinkFit(4, 20.0, 80.0)),
         ("reduce_scatter", "consec"): (LinkFit(2, 5.0, 200.0), LinkFit(4, 10.0, 160.0)),
         ("all_gather", "consec"): (LinkFit(2, 6.0, 200.0), LinkFit(4, 12.0, 160.0))}
ACROSS = {("allreduce", "consec"): INTRA[("allreduce", "consec")] + (LinkFit(8, 60.0, 5.0),),
          ("allreduce", "strided"): (LinkFit(2, 40.0, 10.0), LinkFit(4, 50.0, 8.0))}


def two_by_four(**extra) -> HardwareModel:
    return HardwareModel(tasks_per_node=4, world_size=8, overlap_coe=1.0,
                         fits={**INTRA, **ACROSS, **P2P, **extra}, name="2x4")


def one_node_fits_only() -> HardwareModel:
    """The same links without any collective measured across nodes: today's rule 4."""
    return HardwareModel(tasks_per_node=4, world_size=8, overlap_coe=1.0,
                         fits={**INTRA, **P2P}, name="2x4 intra only")


GRAD, PARAM = 8e6, 4e6  # bytes a stage syncs
# (dp, tp) -> (crosses nodes, all-reduce of GRAD, reduce-scatter of GRAD, all-gather of PARAM),
# us. Across nodes reduce-scatter / all-gather are the all-reduce line halved: alpha / 2, 2x algbw.
BY_HAND = {
    (2, 1): (False, 10 + 80, 5 + 40, 6 + 20),  # consec 2 / 100, 200 GB/s
    (2, 2): (False, 10 + 80, 5 + 40, 6 + 20),  # ranks 0, 2: one node, same fits
    (4, 1): (False, 20 + 100, 10 + 50, 12 + 25),  # consec 4 / 80, 160 GB/s
    (2, 4): (True, 40 + 800, 20 + 400, 20 + 200),  # ranks 0, 4: strided 2 / 10 GB/s
    (4, 2): (True, 50 + 1000, 25 + 500, 25 + 250),  # ranks 0,2,4,6: strided 4 / 8 GB/s
    (8, 1): (True, 60 + 1600, 30 + 800, 30 + 400),  # the whole world: consec 8 / 5 GB/s
}


def test_group_span_counts_nodes_and_members():
    assert group_span(8, 2, 8) == (2, 4)  # tp2 dp8 on 2 x 8: four per node on two nodes
    assert group_span(4, 2, 8) == (1, 4)
    assert group_span(2, 8, 8) == (2, 1)
    assert group_span(16, 1, 8) == (2, 8)
    assert group_span(4, 16, 8) == (4, 1)


def _layouts(world=8, tasks_per_node=4):
    for tp in (1, 2, 4):
        for pp in (1, 2, 4, 8):
            if world % (tp * pp) == 0 and tp <= tasks_per_node:
                yield tp, pp, world // (tp * pp)


@pytest.mark.parametrize("tp,pp,dp", list(_layouts()))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_layout_prices_its_dp_group_by_the_nodes_it_spans(tp, pp, dp, zero):
    hw = two_by_four()
    sync = float(dp_sync_us(hw, zero, dp, tp, GRAD, PARAM))
    traffic = ZeroTraffic.from_hardware(hw, zero, dp, tp, PARAM, GRAD)
    if dp == 1:
        assert sync == 0 and not traffic.active
        return
    crosses, allreduce, reduce_scatter, all_gather = BY_HAND[(dp, tp)]
    assert (group_span(dp, tp, 4)[0] > 1) == crosses
    expected_sync = {0: allreduce, 1: reduce_scatter + all_gather, 2: all_gather, 3: 0.0}[zero]
    assert sync == pytest.approx(expected_sync, rel=1e-12)
    if zero >= 2:  # per micro-batch: gradients reduce-scattered, ZeRO 3 parameters gathered
        assert float(traffic.reduce_scatter_us) == pytest.approx(reduce_scatter, rel=1e-12)
        assert float(traffic.gather_us) == pytest.approx(all_gather if zero == 3 else 0.0)


def test_the_old_rule_priced_a_group_over_two_nodes_as_inside_one():
    """dp 4 ranks 2 apart on nodes of 4: two per node. Without fits across nodes (rule 4, what
    every profile got before) it is the intra-node group of 4; with them, the strided 4 fit."""
    assert one_node_fits_only().collective_time_us("allreduce", 4, 2, GRAD) == pytest.approx(120)
    assert two_by_four().collective_time_us("allreduce", 4, 2, GRAD) == pytest.approx(1050)


def test_search_keeps_data_parallel_traffic_inside_a_node():
    """tp 2 fixed, ZeRO 0, 8 sequences of 512 tokens; 4 layers of 16 MB fp32 gradients and 64 MB
    for "other": 128 MB per rank at pp 1. One micro-batch through the 4 layers takes ~7.4 ms.
    pp1 dp4: the dp group (4 ranks 2 apart) crosses nodes: 50 us + 128e6 B / 8 GB/s = 16,050 us
    of all-reduce, exposed (one Megatron DDP bucket, launched when the last backward ends):
    ~14.8 + 16 = 30.9 ms.
    pp2 dp2: each stage's dp group (2 ranks 2 apart) stays in its node (64 MB at 100 GB/s:
    0.65 ms, exposed); 4 micro-batches through 2 stages of ~3.9 ms: (4 + 1) x 3.9 + 0.65 =
    ~20.6 ms. The old rule priced pp1 dp4's group as the intra-node group of 4: 20 us + 128e6 B
    / 80 GB/s = 1,620 us: ~16.4 ms, no bubble: it won."""
    block, other = hand_model(tp=2).memory(2)
    model = hand_model(tp=2, block=replace(block, param_bytes=8e6, grad_bytes=16e6,
                                           optim_bytes=48e6), other=replace(other, grad_bytes=64e6))
    space = SearchSpace(world_size=8, memory_budget_bytes=80 * GiB, global_batch_size=8,
                        seq_len=512, tp=2, zero_stages=(0,), recompute=("none",),
                        micro_batch_sizes=(1,), schedules=("1f1b",), sequence_parallel=(False,),
                        options=MEGATRON)  # the profile's gradient bytes, as set above
    new, old = search(model, two_by_four(), space), search(model, one_node_fits_only(), space)
    assert (new.best.pp, new.best.dp) == (2, 2)
    assert (old.best.pp, old.best.dp) == (1, 4)
    assert new.prediction.breakdown_us["dp_sync_exposed"] == pytest.approx(10 + 64e6 / 1e5)
    pp1 = ParallelLayout.uniform(8, 2, 1, 4, micro_batch_size=1, num_micro_batches=2)
    for hw, sync_us, slower in ((two_by_four(), 50 + 128e6 / 8e3, True),
                                (one_node_fits_only(), 20 + 1600, False)):
        pred = evaluate(pp1, model, hw, 512, options=MEGATRON)
        # one bucket: the whole all-reduce after the last backward
        assert pred.breakdown_us["dp_sync_exposed"] == pytest.approx(sync_us, rel=1e-9)
        assert (pred.iteration_time_us > new.prediction.iteration_time_us) == slower


def test_issue_example_tp2_dp8_on_two_nodes_of_eight():
    """Galvatron-like 2 x 8 profile: the dp group of tp2*dp8 is 8 ranks 2 apart (4 per node on
    2 nodes), measured as the strided group of 8 on 16 ranks at 20.8 GB/s busbw; its 405 MB
    all-reduce takes 405e6 / (20.8 / 1.75 * 1e3) = 34,075 us, not the intra-node group of 8's
    (197 GB/s busbw: 3,598 us)."""
    factor8 = 2 * 7 / 8
    hw = HardwareModel(
        tasks_per_node=8, world_size=16, overlap_coe=1.0, name="2x8",
        fits={("allreduce", "consec"): (LinkFit(8, 0.0, 197.0 / factor8),),
              ("allreduce", "strided"): (LinkFit(2, 0.0, 12.0), LinkFit(8, 0.0, 20.8 / factor8))})
    assert hw.collective_time_us("allreduce", 8, 2, 405e6) == pytest.approx(34074.5, abs=0.1)
    assert hw.collective_time_us("allreduce", 8, 1, 405e6) == pytest.approx(3597.7, abs=0.1)


def test_unmeasured_signature_is_intra_plus_inter_by_hand():
    """4 nodes x 4 ranks; measured: inside a node (consec 2, 4) and one per node (strided 2 =
    stride 8, strided 4 = stride 4). dp 8 ranks 2 apart: 2 per node on 4 nodes, never measured:
    all-reduce = intra all-reduce over 2 of S + inter all-reduce over 4 of S / 2."""
    hw = HardwareModel(
        tasks_per_node=4, world_size=16, overlap_coe=1.0, name="4x4",
        fits={**INTRA, ("allreduce", "strided"): (LinkFit(2, 40.0, 10.0),
                                                  LinkFit(4, 70.0, 6.0))})
    S = 12e6
    # intra 2: 10 + 12e6 / 1e5 = 130; inter 4 of 6e6: 70 + 6e6 / 6e3 = 1070
    assert hw.collective_time_us("allreduce", 8, 2, S) == pytest.approx(130 + 1070)
    # 4 per node on 4 nodes: intra 4: 20 + 12e6 / 8e4 = 170; inter of 3e6: 70 + 500
    assert hw.collective_time_us("allreduce", 16, 1, S) == pytest.approx(170 + 570)
    # reduce-scatter: its own intra fit (5 + 12e6 / 2e5 = 65) + the inter all-reduce halved
    # (35 us, 12 GB/s: 35 + 6e6 / 1.2e4 = 535)
    assert hw.collective_time_us("reduce_scatter", 8, 2, S) == pytest.approx(65 + 535)
    # one per node on 2 nodes: the measured strided 2 as is: 40 + 12e6 / 1e4
    assert hw.collective_time_us("allreduce", 2, 8, S) == pytest.approx(1240)


def test_beyond_the_largest_inter_group_the_ring_extrapolates():
    """8 ranks one per node on a profile measured up to 4 nodes: bus bandwidth of the strided 4
    (6 GB/s algbw x 2 * 3/4 = 9 GB/s busbw) kept, algbw 9 / (2 * 7/8) GB/s; alpha 70 * 7/3."""
    hw = HardwareModel(tasks_per_node=4, world_size=16, overlap_coe=1.0, name="4x4",
                       fits={**INTRA, ("allreduce", "strided"): (LinkFit(4, 70.0, 6.0),)})
    S = 7e6
    expected = 70 * 7 / 3 + S / (9 / 1.75 * 1e3)
    assert hw.collective_time_us("allreduce", 8, 4, S) == pytest.approx(expected)
