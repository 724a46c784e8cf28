"""The planner prices the workload's messages (issue 40, "One list of messages, priced once").

orchestrator/workload/ says what a rank of the engine issues in one iteration (`rank_comms`,
checked against real gloo ranks by tests/test_train_engine.py and against the tracer by
tests/test_trace_formulas.py; the MoE dispatcher's `rank_moe_comms`, by
tests/test_moe_train.py). The planner keeps its closed form for speed; here, for every layout
of the engine matrices (tests/engine_matrix.py: every CP flavour, the EP families), both
engines, fp32 and bf16, what `StageCosts.messages` lists as priced for a stage equals that list
for the stage's ranks, term by term: TP, CP, pipeline and EP exactly (op, group, bytes, dtype,
phase, count), the data-parallel traffic by its bytes (the planner prices a stage's gradient
buckets as one message). And the times the planner uses are the prices of those messages.
Pure functions: the whole matrix in about a second.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
from engine_matrix import (BF16_LAYOUTS, LAYOUTS, MODEL, MOE_LAYOUTS, MOE_MODEL, WORLD_SIZE,
                           layout, moe_layout)
from planner_fixtures import synthetic_hardware, synthetic_model

from orchestrator.bandwidth import benchmark_of
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.planner import CostOptions, HardwareModel, ModelCost
from orchestrator.planner.cost_model import ConfigKey, StageCosts
from orchestrator.workload.comm import UNPRICED, rank_comms
from orchestrator.workload.moe import rank_moe_comms

HW = HardwareModel.from_dict(synthetic_hardware(1, WORLD_SIZE))
# every MoE block a MoE block: the planner prices the first dense_layers as MoE blocks too
# (planner/terms/moe.py), so a dense block 0 would show up as an extra dispatch there
MOE_ALL = {**MOE_MODEL, "dense_layers": 0}
TERMS = {"tp": {"tp"}, "cp": {"cp", "cp_a2a", "cp_ring"}, "pp": {"pp"}, "ep": {"ep", "etp"}}
DP_GROUPS = {"dp", "dp_cp"}
CASES = ([("dense", i) for i in range(len(LAYOUTS))]
         + [("dense bf16", i) for i in range(len(BF16_LAYOUTS))]
         + [("moe", i) for i in range(len(MOE_LAYOUTS))])


@lru_cache(maxsize=None)
def model_cost(moe: bool, dtype: str) -> ModelCost:
    """A synthetic profile of the matrix's model (its MoE twin for moe) in `dtype`."""
    shape = MOE_ALL if moe else MODEL
    profile = synthetic_model("engine", hidden=shape["hidden"], ffn=shape["ffn"],
                              layers=shape["layers"], heads=shape["heads"],
                              kv_heads=shape["kv_heads"], vocab=shape["vocab"],
                              seq_len=shape["seq_len"], tps=(1, 2, 4))
    profile["model"]["dtype"] = dtype
    cost = ModelCost.from_dict(profile)
    return cost.with_moe(ModelConfig(**shape, dtype=dtype)) if moe else cost


def _case(kind: str, index: int):
    """(ModelConfig dict, layout) of a matrix entry."""
    if kind == "moe":
        return MOE_ALL, moe_layout(WORLD_SIZE, *MOE_LAYOUTS[index])
    return MODEL, layout(*(BF16_LAYOUTS if kind == "dense bf16" else LAYOUTS)[index])


def _costs(lay: ParallelLayout, moe: bool, engine: str, dtype: str, **options) -> StageCosts:
    return StageCosts(ConfigKey.of(lay), model_cost(moe, dtype), HW, MODEL["seq_len"],
                      CostOptions(engine=engine, moe_imbalance=1.0, **options))


def _by_key(comms, groups) -> Counter:
    """{(op, group, bytes, dtype, phase, peer): count per iteration} of `groups`' messages."""
    out: Counter = Counter()
    for c in comms:
        if c.group in groups:
            assert float(c.bytes).is_integer(), c
            out[c.op, c.group, int(c.bytes), c.dtype, c.phase, c.peer] += c.count
    return +out


def _dp_totals(comms) -> Counter:
    """{(op, group, dtype, phase): bytes moved per iteration} of the data-parallel messages."""
    out: Counter = Counter()
    for c in comms:
        if c.group in DP_GROUPS:
            out[c.op, c.group, c.dtype, c.phase] += float(c.bytes) * c.count
    return out


def stage_lists(kind: str, index: int, engine: str, dtype: str):
    """[(stage, what the planner priced, the workload's list for the stage's first rank)]."""
    shape, lay = _case(kind, index)
    moe = kind == "moe"
    costs = _costs(lay, moe, engine, dtype)
    model = ModelConfig(**shape)
    out = []
    for j in range(lay.pp):
        rank = j * lay.tp * lay.cp * lay.dp  # every rank of a stage issues the same list
        mode, k = lay.recompute[j]
        priced = costs.messages(j, lay.layers_per_stage[j], mode, k)
        listed = [c for c in rank_comms(model, lay, rank, engine, dtype)
                  if c.what not in UNPRICED] + rank_moe_comms(model, lay, rank, engine, dtype)
        out.append((j, priced, listed))
    return lay, out


@pytest.mark.parametrize("kind,index", CASES)
def test_the_planner_prices_every_message_of_the_workload(kind, index):
    """Each term's messages as the planner prices them equal the workload's for the stage, for
    both engines in fp32 and bf16; data-parallel bytes too (our engine: Megatron's optimizer,
    which the planner prices for engine=megatron, is not the tracer's, which workload describes)
    within the buckets' padding to a multiple of the replicas."""
    for engine in ("orchestrator", "megatron"):
        for dtype in ("fp32", "bf16"):
            lay, stages = stage_lists(kind, index, engine, dtype)
            for j, priced, listed in stages:
                where = f"{lay.describe()} {engine} {dtype} stage {j}"
                for term, groups in TERMS.items():
                    want, got = _by_key(listed, groups), _by_key(priced, groups)
                    assert got == want, (f"{where} {term}:\n priced only "
                                         f"{sorted((got - want).items())}\n workload only "
                                         f"{sorted((want - got).items())}")
                if engine == "megatron" or kind == "moe":
                    continue  # (rank_comms keeps a MoE model's experts in the dense buckets)
                want, got = _dp_totals(listed), _dp_totals(priced)
                assert want.keys() == got.keys(), where
                buckets = sum(c.count for c in listed if c.group in DP_GROUPS)
                for key, size in want.items():
                    # each bucket / FSDP unit padded to a multiple of the replicas (fp32)
                    assert 0 <= size - got[key] <= buckets * 4 * lay.dp * lay.cp, (where, key)


def test_every_term_of_the_matrix_is_compared():
    """The matrix holds every CP flavour with and without recompute, EP with ETP, pipelines,
    ZeRO 0-3: none of the comparisons above is vacuous."""
    seen = set()
    for kind, index in CASES:
        lay, stages = stage_lists(kind, index, "orchestrator", "bf16")
        for _, priced, _ in stages:
            seen |= {(c.group, c.op, c.phase) for c in priced}
        seen.add(("layout", lay.cp_comm if lay.cp > 1 else "no cp", lay.recompute[0][0]))
    for flavour in ("p2p", "allgather", "a2a", "a2a+p2p"):
        assert ("layout", flavour, "none") in seen or ("layout", flavour, "full") in seen
    for group, op in (("tp", "all_gather"), ("tp", "all_reduce"), ("cp", "send"),
                      ("cp", "all_gather"), ("cp", "all_to_all"), ("cp_a2a", "all_to_all"),
                      ("cp_ring", "recv"), ("pp", "send"), ("pp", "recv"), ("ep", "all_to_all"),
                      ("etp", "all_gather"), ("etp", "all_reduce"), ("dp", "reduce_scatter"),
                      ("dp_cp", "all_gather")):
        assert any(g == group and o == op for g, o, _ in seen), (group, op)


# ---------------------------------------------------------------- what the price is
def _line_us(op: str, group_size: int, stride: int, size: float) -> float:
    alpha_us, us_per_byte = HW.collective_line(benchmark_of(op), group_size, stride)
    return alpha_us + size * us_per_byte


def test_bf16_tp_and_pipeline_messages_are_priced_at_the_engines_dtypes():
    """tp2 pp2 with SP under bf16: both engines gather the norm outputs and send pipeline
    activations in bf16 (the residual stream of bf16 weights: 32 tokens x 64 x 2 = 4 KiB per
    all-gather, half of it per send) and reduce matmul outputs in bf16 (ours moved the first
    two in fp32 before issue 41: autocast over fp32 weights)."""
    lay = layout(2, 2, {})
    for engine, gather_bytes, send_bytes in (("orchestrator", 4096, 2048),
                                             ("megatron", 4096, 2048)):
        # the collectives as moved (Megatron's --tp-comm-overlap hides part: test_planner_overlap)
        costs = _costs(lay, False, engine, "bf16",
                       tp_comm_overlap=False if engine == "megatron" else None)
        scatter = _line_us("reduce_scatter", 2, 1, 4096)  # attention / MLP outputs, bf16
        assert costs.tp.layer.fwd_us == pytest.approx(
            2 * _line_us("all_gather", 2, 1, gather_bytes) + 2 * scatter), engine
        assert costs.boundary_us[0] == pytest.approx(HW.p2p_time_us(send_bytes, True, 2))
        sends = [c for c in rank_comms(ModelConfig(**MODEL), lay, 0, engine, "bf16")
                 if c.op == "send"]
        assert {c.bytes for c in sends} == {send_bytes}


@pytest.mark.parametrize("mode,hops_again", [("none", 0), ("selective", 3), ("full", 3)])
def test_the_ring_backward_prices_every_hop_the_engine_runs(mode, hops_again):
    """cp4, 4 layers (with nothing to hide under): forward 3 hops per layer, backward 2cp - 1 = 7
    (the K/V blocks again and their gradients), and a recompute's rerun of the forward 3 more:
    per micro-batch 4 x (3 + 7) = 40 hops plus 12 rerun, as the workload counts them."""
    lay = layout(1, 1, {"cp": 4, "recompute": mode})
    costs = _costs(lay, False, "orchestrator", "fp32")
    hop = costs.cp.hop_us
    kv = 2 * 32 // 4 * 2 * 16 * 4  # 8 tokens, 2 KV heads of 16, K and V, fp32
    assert hop == pytest.approx(HW.p2p_time_us(kv, True, 2))
    sends = sum(c.count for c in rank_comms(ModelConfig(**MODEL), lay, 0) if c.op == "send")
    assert sends == (4 * (3 + 7) + 4 * hops_again) * lay.num_micro_batches
    window_us = costs.compute.selective_recompute_us * 3 / 4  # the attention it runs beside
    exposed = [float(max(w, c) + min(w, c) * (HW.overlap_coe - 1) - w)
               for w, c in ((window_us, 3 * hop), (2.5 * window_us, 7 * hop))]
    assert (costs.cp.layer.fwd_us, costs.cp.layer.bwd_us) == pytest.approx(exposed)
    code = {"none": 0, "selective": 1, "full": 2}[mode]
    rerun = costs.recompute_us(4, code, 4)
    compute = {"none": 0.0, "selective": 4 * costs.compute.selective_recompute_us,
               "full": 4 * (costs.compute.block.fwd_us + costs.tp.recompute_us)}[mode]
    assert float(rerun) == pytest.approx(compute + 4 * (exposed[0] if hops_again else 0.0))


def test_the_dispatcher_is_priced_at_the_engines_dtypes():
    """ep2 x etp2 under bf16: the tokens go out in bf16 (the block's input, the residual
    stream of bf16 weights; fp32 in ours before issue 41) and come back in bf16 (the experts'
    matmul outputs), and ETP sums the
    experts' partial outputs with an all-reduce (Megatron: all bf16, a reduce-scatter); the
    planner's time is the price of exactly the workload's messages."""
    lay = moe_layout(WORLD_SIZE, 1, 1, {"ep": 2, "etp": 2})
    for engine in ("orchestrator", "megatron"):
        costs = _costs(lay, True, engine, "bf16")
        messages = rank_moe_comms(ModelConfig(**MOE_ALL), lay, 0, engine, "bf16")
        per_layer = lay.layers_per_stage[0] * lay.num_micro_batches
        a2a_alpha, a2a_per_byte = HW.all2all_line(2, 2)
        for phase, priced in (("fwd", costs.moe_comm.layer.fwd_us),
                              ("bwd", costs.moe_comm.layer.bwd_us)):
            want = sum(c.count * (a2a_alpha + c.bytes * a2a_per_byte if c.op == "all_to_all"
                                  else _line_us(c.op, 2, 1, c.bytes))
                       for c in messages if c.phase == phase) / per_layer
            assert priced == pytest.approx(want), (engine, phase)
        dtypes = {(c.what, c.dtype) for c in messages}
        assert {("token dispatch", "bf16"), ("token combine", "bf16"),
                ("ETP tokens", "bf16")} <= dtypes, dtypes
        assert {c.op for c in messages if c.group == "etp"} == {
            "all_gather", "all_reduce" if engine == "orchestrator" else "reduce_scatter"}


@pytest.mark.parametrize("pp,v", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3)])
def test_stage_sends_are_priced_at_the_listed_counts(pp, v):
    """terms/pipeline.stage_sends (the search's closed form) sends what stage_send_counts (what
    messages() lists, held equal to the workload above) counts, over the boundary it takes."""
    from orchestrator.planner.terms.pipeline import stage_send_counts, stage_sends

    boundary = np.arange(1.0, pp + 1.0) ** 2  # a time per boundary j -> j + 1 (last: the wrap)
    fwd, bwd = stage_send_counts(pp, v)
    sends = stage_sends(boundary, v)
    assert sends.fwd_us.tolist() == (fwd * boundary).tolist()
    assert sends.bwd_us.tolist() == (bwd * np.roll(boundary, 1)).tolist()


def test_priced_times_do_not_depend_on_the_listing():
    """messages() only reads what the terms priced: building it leaves every time as it was."""
    lay = layout(2, 2, {"cp": 1})
    costs = _costs(lay, False, "orchestrator", "bf16")
    before = (costs.layer, costs.full_recompute_us, np.array(costs.boundary_us))
    costs.messages(0, 2)
    assert (costs.layer, costs.full_recompute_us) == before[:2]
    assert (costs.boundary_us == before[2]).all()
