"""stage=trace for a mixture-of-experts model (issue 26): the tiny MoE model (8 experts, top 2, a
shared expert, block 0 dense) traced at fake world sizes, its dispatcher's messages checked
against hand-computed sizes and against the workload model (workload/moe.py), the expert
gradients' group, the cost of a rank at any world size, the rank rule (every rank of a stage
issues the same shapes), the SimAI items and the command line's refusals."""
from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import List

import pytest
import yaml
from conftest import REPO, one_error_line, run_cli
from test_trace_scale import traced_with_counts

from orchestrator.models.config import ModelConfig, count_expert_params
from orchestrator.trace.configs import TraceSettings, TraceSpec, plan_configs
from orchestrator.trace.tracer import trace_rank
from orchestrator.workload.moe import (MoeShape, dispatch_bytes, expert_grad_sync_bytes,
                                       tokens_per_rank)

MOE = ModelConfig(**{**yaml.safe_load((REPO / "orchestrator/conf/model/tiny_moe.yaml")
                                       .read_text()), "dtype": "bf16"})
SEQ, HIDDEN, TOP_K, EXPERTS, BF16 = 256, 128, 2, 8, 2
MOE_LAYERS = {1, 2, 3}  # dense_layers 1


def _spec(config, global_batch_size: int = 8, zero: int = 1, model=MOE) -> TraceSpec:
    settings = TraceSettings(global_batch_size=global_batch_size, micro_batch_size=1,
                             seq_len=SEQ, sequence_parallel=True, zero=zero)
    specs, skipped = plan_configs([config], settings, model)
    assert not skipped, skipped
    return specs[0]


@lru_cache(maxsize=None)
def _traced(config: tuple, rank: int) -> List[dict]:
    return trace_rank(_spec(list(config)), MOE, rank).records


def _layer(record: dict) -> int:
    return int(record["module"].split(".")[1])


def _colls(records, group: str, phase=None) -> List[dict]:
    return [r for r in records if r["kind"] == "coll" and r["group"] == group
            and (phase is None or r["phase"] == phase)]


@pytest.mark.parametrize("rank", [0, 8])
def test_dispatcher_all_to_alls_per_moe_layer_and_micro_batch(rank):
    """WS 16 PP 2 TP 2 DP 4, EP 4: per MoE layer and micro-batch, forward the counts exchange
    (experts int64) and the tokens' two all-to-alls, backward two; each sends T x top_k / ep
    tokens of `hidden` bf16 to every EP peer (T = seq / tp, sequence parallelism)."""
    config = (16, 2, 2, 1, 4)
    spec = _spec(list(config))
    lay = spec.layout
    records = _traced(config, rank)
    a2a = [r for r in records if r["kind"] == "coll" and r["op"] == "all_to_all"]
    assert a2a and {r["group"] for r in a2a} == {"ep"}
    stage_layers = {0: {1}, 8: {2, 3}}[rank]  # blocks 0-1 and 2-3; block 0 is dense
    tokens = SEQ // lay.tp
    per_peer = tokens * TOP_K // lay.ep * HIDDEN * BF16
    for mb in range(lay.num_micro_batches):
        for layer in stage_layers:
            mine = [r for r in a2a if r["mb"] == mb and _layer(r) == layer]
            forward = [r for r in mine if r["phase"] == "F"]
            backward = [r for r in mine if r["phase"] == "B"]
            assert len(forward) == 3 and len(backward) == 2, (mb, layer, mine)
            counts, tokens_msgs = forward[0], forward[1:] + backward
            assert counts["dtype"] == "int64" and counts["bytes"] == EXPERTS * 8
            for r in tokens_msgs:
                assert r["send_bytes"] == [per_peer] * lay.ep
                assert r["recv_bytes"] == [per_peer] * lay.ep
                assert r["bytes"] == per_peer * lay.ep
                assert (r["group_size"], r["group_stride"]) == (lay.ep, lay.etp)
                assert r["group_first"] == rank - lay.coordinate(rank, "ep") * lay.etp
    # the workload model's all-to-all (workload/moe.py) is the same buffer
    model = dispatch_bytes(tokens_per_rank(SEQ, 1, lay.tp), MoeShape.of(MOE), lay.ep, lay.etp,
                           BF16)
    assert {r["bytes"] for r in a2a if r["dtype"] == "bf16"} == {model.a2a}
    assert len(a2a) == len(stage_layers) * lay.num_micro_batches * 5


def test_etp_collectives_when_etp_is_above_one():
    """EP 2 x ETP 2: per MoE layer and micro-batch over the ETP group (consecutive ranks),
    forward the counts' and the tokens' all-gathers and a reduce-scatter of the experts'
    partial outputs, backward an all-gather and a reduce-scatter; the gathered tokens are
    etp x T x top_k of `hidden` (workload/moe.py's ETP message)."""
    config = (16, 2, 2, 1, 2, 2)
    spec = _spec(list(config))
    lay = spec.layout
    records = _traced(config, 8)
    etp = _colls(records, "etp")
    assert {(r["group_size"], r["group_stride"], r["group_first"]) for r in etp} == {(2, 1, 8)}
    gathered = lay.etp * (SEQ // lay.tp) * TOP_K * HIDDEN * BF16
    model = dispatch_bytes(tokens_per_rank(SEQ, 1, lay.tp), MoeShape.of(MOE), lay.ep, lay.etp,
                           BF16)
    assert model.etp == gathered
    for mb in range(lay.num_micro_batches):
        for layer in (2, 3):
            mine = [(r["phase"], r["op"], r["bytes"]) for r in etp
                    if r["mb"] == mb and _layer(r) == layer]
            local_experts = EXPERTS // lay.ep
            assert mine == [("F", "all_gather", lay.etp * local_experts * 8),
                            ("F", "all_gather", gathered), ("F", "reduce_scatter", gathered),
                            ("B", "all_gather", gathered), ("B", "reduce_scatter", gathered)]
    assert not [r for r in etp if r["op"] == "all_reduce"]  # recorded as Megatron's


def test_expert_gradients_reduce_over_the_edp_group():
    """The routed experts' fp32 gradient buckets go over the EDP group (stride ep x etp), their
    bytes the stage's expert shards (workload/moe.expert_grad_sync_bytes); the dense buckets over
    DP hold everything else."""
    for config, rank in (((16, 2, 2, 1, 4), 8), ((16, 2, 2, 1, 2, 2), 8)):
        spec = _spec(list(config))
        lay = spec.layout
        records = _traced(config, rank)
        edp = _colls(records, "edp", phase="dp")
        # ZeRO 1: reduce-scattered (Megatron's distributed optimizer)
        assert edp and {(r["op"], r["dtype"]) for r in edp} == {("reduce_scatter", "fp32")}
        assert {(r["group_size"], r["group_stride"]) for r in edp} \
            == {(lay.edp, lay.ep * lay.etp)}
        assert sum(r["bytes"] for r in edp) == expert_grad_sync_bytes(
            MoeShape.of(MOE), lay.ep, lay.etp, layers=2)
        assert sum(r["bytes"] for r in edp) == \
            2 * EXPERTS // lay.ep * count_expert_params(MOE) // lay.etp * 4
        dense = _colls(records, "dp", phase="dp")
        assert dense and {(r["group_size"], r["group_stride"]) for r in dense} \
            == {(lay.dp, lay.tp)}
        # ZeRO 1: the updated parameters all-gathered over the same groups, in bf16 (the
        # traced rank's weights, as Megatron's distributed optimizer gathers them)
        assert 2 * sum(r["bytes"] for r in _colls(records, "edp", phase="optimizer")) \
            == sum(r["bytes"] for r in edp)


def test_a_moe_rank_costs_the_same_at_world_64_and_8192(monkeypatch):
    """The rank makes its own PP, DP, TP, EP, ETP and EDP groups and a mesh of its ep x etp
    ranks, nothing that grows with the world but its DP and EDP groups' members."""
    counts = {}
    for world in (64, 8192):
        dp = world // 4
        spec = _spec([world, 2, 2, 1, 2, 2], global_batch_size=2 * dp)
        lay = spec.layout
        rank = spec.representative_ranks()[1]
        counts[world] = traced = traced_with_counts(spec, rank, monkeypatch, MOE)
        assert traced["groups"] == sorted([lay.pp, lay.dp, lay.tp, lay.ep, lay.etp, lay.edp])
        assert max(traced["mesh_ranks"]) == max(lay.tp, lay.ep * lay.etp)
    small, huge = counts[64]["records"], counts[8192]["records"]
    assert len(small) == len(huge)
    # the micro-batches' ops and messages are the same up to the ranks (the optimizer's
    # buckets are padded to a multiple of dp and edp)
    strip = ("group_first", "peer", "i")
    assert [{k: v for k, v in r.items() if k not in strip} for r in small
            if r["phase"] in ("F", "B", "loss")] == \
        [{k: v for k, v in r.items() if k not in strip} for r in huge
         if r["phase"] in ("F", "B", "loss")]


def _shape_only(record: dict) -> tuple:
    out = dict(record)
    for key in ("group_first", "peer", "i"):
        out.pop(key, None)
    return tuple(sorted((k, json.dumps(v)) for k, v in out.items()))


def test_every_rank_of_a_stage_issues_the_same_shapes_under_uniform_routing():
    """The MoE rank rule: every rank of a stage (each (EP, ETP, TP, DP) position) traced; with
    group first ranks and peers dropped its stream is its stage representative's, and its
    expert groups' first ranks are the layout's."""
    config = [16, 2, 2, 1, 2, 2]
    spec = _spec(config)
    lay = spec.layout
    reps = {spec.stage_of(r): r for r in spec.representative_ranks()}
    streams = {}
    for rank in spec.all_ranks():
        records = trace_rank(spec, MOE, rank).records
        for r in records:
            if r["kind"] == "coll" and r["group"] in ("ep", "etp", "edp"):
                assert r["group_first"] == lay.group_ranks(r["group"], rank)[0], (rank, r)
        streams[rank] = [_shape_only(r) for r in records]
    for rank, stream in streams.items():
        assert stream == streams[reps[spec.stage_of(rank)]], rank
    assert "every (stage, EP rank)" in spec.rank_rule()


def test_simai_workload_has_the_expert_parallel_items():
    """trace.export=simai for EP 2 x ETP 2 = TP 2 (SimAI's expert grid): header `ep: 2`, per MoE
    layer and micro-batch a moelayer item with the all-to-alls as ALLTOALL_EP lines (counts,
    dispatch, combine forward; two backward) and the ETP messages un-suffixed (the TP group),
    the expert gradients as REDUCESCATTER_DP_EP / ALLGATHER_DP_EP (ZeRO 1)."""
    from test_trace_simai import check_one_group_per_line, parse

    from orchestrator.trace.simai import (COMM_TYPES, MOE_COMM_TYPES, simai_file_name,
                                          simai_workload, unexportable)

    config = (16, 2, 2, 1, 2, 2)
    spec = _spec(list(config))
    lay = spec.layout
    records = [dict(r) for r in _traced(config, 8)]
    for r in records:
        if r["kind"] == "compute":
            r["time_us"] = 1.0
    kind, header, count, items = parse(simai_workload(records, spec, MOE.name))
    assert header["ep"] == "2" and header["model_parallel_NPU_group"] == "2"
    assert count == len(items)
    assert {row[c] for row in items for c in (3, 6, 9)} <= set(COMM_TYPES) | set(MOE_COMM_TYPES)
    per_peer_total = (SEQ // lay.tp) * TOP_K * HIDDEN * BF16
    for layer in (2, 3):
        rows = [row for row in items if row[0] == f"layer{layer}_moelayer"]
        fwd = [(row[3], int(row[4])) for row in rows if row[3] != "NONE"]
        ig = [(row[6], int(row[7])) for row in rows if row[6] != "NONE"]
        m = lay.num_micro_batches
        assert fwd.count(("ALLTOALL_EP", per_peer_total)) == 2 * m
        assert fwd.count(("ALLTOALL_EP", EXPERTS * 8)) == m  # the counts exchange
        assert ig.count(("ALLTOALL_EP", per_peer_total)) == 2 * m
        assert fwd.count(("REDUCESCATTER", lay.etp * per_peer_total)) == m
        assert ig.count(("ALLGATHER", lay.etp * per_peer_total)) == m
    wg = {row[9]: int(row[10]) for row in items if row[0] in ("grad_param_comm", "grad_gather")
          and row[9] != "NONE"}
    # gradients fp32, the updated weights gathered in bf16
    assert wg["REDUCESCATTER_DP_EP"] == 2 * wg["ALLGATHER_DP_EP"] == expert_grad_sync_bytes(
        MoeShape.of(MOE), lay.ep, lay.etp, layers=2)
    check_one_group_per_line(items, records, lay.cp)
    assert "-ep2-" in simai_file_name(spec, MOE.name, 1, moe=True)
    assert "-MOE-True-" in simai_file_name(spec, MOE.name, 1, moe=True)
    # SimAI's expert tensor parallelism is TP's; CP and experts cannot share its EP group
    assert "etp(1) != tp(2)" in unexportable(_spec([16, 2, 2, 1, 4]).layout, moe=True)
    assert unexportable(lay, moe=True) is None


def test_megatron_arguments_for_the_experts():
    """summary.json's Megatron command line: the layout's and the experts' (names as Megatron-LM's
    arguments.py spells them), --moe-layer-freq in its list form."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.trace.megatron_args import megatron_command_args

    deepseek = ModelConfig(**yaml.safe_load(
        (REPO / "orchestrator/conf/model/deepseek_v3.yaml").read_text()))
    layout = ParallelLayout(world_size=64, pp=4, tp=2, dp=8, layers_per_stage=(16, 16, 16, 13),
                            ep=8, etp=1, sequence_parallel=True, zero=1, micro_batch_size=1,
                            num_micro_batches=4)
    args, notes = megatron_command_args(deepseek, layout)
    # each flag with the value after it (None for a flag alone, e.g. --overlap-grad-reduce)
    pairs = {a: (b if not b.startswith("--") else None)
             for a, b in zip(args, args[1:] + ["--"]) if a.startswith("--")}
    assert pairs["--num-experts"] == str(deepseek.experts)
    assert pairs["--moe-router-topk"] == str(deepseek.top_k)
    assert pairs["--expert-model-parallel-size"] == "8"
    assert pairs["--expert-tensor-parallel-size"] == "1"
    assert pairs["--moe-layer-freq"] == f"([0]*3+[1]*{deepseek.layers - 3})"
    assert pairs["--moe-token-dispatcher-type"] == "alltoall"
    assert pairs["--moe-router-load-balancing-type"] == "seq_aux_loss"
    assert "--moe-grouped-gemm" not in args and "--tensor-model-parallel-size" in args
    # the traced ZeRO-1 is --use-distributed-optimizer's reduce-scatter: nothing to add
    assert "--use-distributed-optimizer" in args
    assert not any("ZeRO-1" in note for note in notes), notes
    capped = dataclasses.replace(MOE, capacity_factor=1.25)
    args, _ = megatron_command_args(capped, _spec([16, 2, 2, 1, 4]).layout)
    assert args[args.index("--moe-expert-capacity-factor") + 1] == "1.25"
    assert "--moe-shared-expert-intermediate-size" in args


def test_bad_expert_configurations_are_refused_before_tracing(profiles):
    """One error line and exit 2: experts % ep, ep x etp not dividing a stage's ranks, top_k >
    experts, capacity_factor <= 0, ep on a dense model; a good MoE configuration traces, its
    SimAI file with the EP items, its summary with the Megatron MoE arguments."""
    base = ["stage=trace", "model=tiny_moe", "trace.global_batch_size=8", "trace.seq_len=256"]
    cases = {
        "experts(8) of tiny_moe is not divisible by ep(16)":
            ["trace.configs=[[16,1,2,1,16]]"],
        "ep(4) * etp(4) must divide the tp(2) * cp(1) * dp(4)":
            ["trace.configs=[[16,2,2,1,4,4]]"],
        "model.top_k(9) must be in 1..model.experts(8)": ["trace.configs=[[16,2,2]]",
                                                          "model.top_k=9"],
        "model.capacity_factor(0.0) must be > 0": ["trace.configs=[[16,2,2]]",
                                                   "model.capacity_factor=0"],
    }
    for message, extra in cases.items():
        line = one_error_line(run_cli(*base, *extra, profiles_dir=profiles), 2)
        assert message in line, line
    dense = one_error_line(run_cli("stage=trace", "model=tiny", "trace.configs=[[16,2,2]]",
                                   "trace.ep=2", profiles_dir=profiles), 2)
    assert "need a mixture-of-experts model" in dense
    good = run_cli(*base, "trace.configs=[[16,2,2,1,2,2]]", "trace.export=simai",
                   profiles_dir=profiles, check=0)
    assert "traced SIM_tiny_moe_Config0_WS16_PP2_TP2_DP4_EP2_ETP2_nMICROB2" in good.stdout
    folder = next(profiles.glob("*/trace/SIM_tiny_moe_Config0_*_EP2_ETP2_*"))
    text = next(folder.glob("tiny_moe-*-ep2-*-MOE-True-*-stage1.txt")).read_text()
    assert "ALLTOALL_EP" in text and "ALLREDUCE_DP_EP" in text  # trace.zero=0
    summary = json.loads((folder / "summary.json").read_text())
    assert "--expert-model-parallel-size" in summary["megatron_args"]
    assert "every (stage, EP rank)" in summary["rank_rule"]
