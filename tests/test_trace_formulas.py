"""The traced messages against Megatron's formulas, hand-computed from the model config
(issue 13, "Cross-checks"): TP all-gather / reduce-scatter s*b*h*bytes per sub-layer with SP,
p2p activations s*b*h*bytes / (TP if SP), data-parallel gradients = the stage's parameter
bytes / TP in fp32, and the number of messages of the pipeline schedule; and every message of
every case against the workload model's list (workload/comm.py, engine "megatron"): the one
definition the trace is checked against.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from functools import lru_cache
from typing import List

import pytest

from orchestrator.models.config import ModelConfig
from orchestrator.trace.configs import TraceSettings, TraceSpec, plan_configs
from orchestrator.trace.tracer import trace_rank

TINY = ModelConfig(name="tiny", hidden=128, ffn=384, layers=8, heads=4, kv_heads=2, vocab=512,
                   seq_len=256, dtype="bf16")
BF16_BYTES, FP32_BYTES = 2, 4
SEQ, MBS, GBS = 256, 1, 16

# name -> ([ws, pp, tp], sequence_parallel, zero, schedule[, other TraceSettings fields])
CASES = {
    "sp_zero0": ([16, 2, 2], True, 0, "1f1b"),
    "sp_zero1": ([16, 2, 2], True, 1, "1f1b"),
    "sp_zero2": ([16, 2, 2], True, 2, "1f1b"),
    "no_sp_zero1": ([16, 2, 2], False, 1, "1f1b"),
    # DP 3: 4 buckets whose sizes are not all multiples of 3, so padding shows.
    "sp_zero1_dp3": ([12, 2, 2], True, 1, "1f1b"),
    "sp_interleaved": ([32, 4, 2], True, 1, "interleaved"),
    "sp_full_recompute": ([16, 2, 2], True, 1, "1f1b", {"recompute": "full"}),
    "no_sp_selective": ([16, 2, 2], False, 0, "1f1b", {"recompute": "selective"}),
    "sp_zero2_uneven": ([16, 2, 2], True, 2, "1f1b", {"layers_per_stage": (6, 2)}),
    "pp2_no_tp": ([8, 2, 1], False, 1, "1f1b"),
    # no pipeline, no TP, ZeRO-0: every rank holds the whole reduced gradient, so the norm needs
    # no all-reduce (train's replicas_only)
    "dp_only_zero0": ([4, 1, 1], False, 0, "1f1b"),
    # context parallelism ([ws, pp, tp, cp]): the ring, all-gather and Ulysses flavours
    "cp2_ring": ([16, 2, 2, 2], True, 1, "1f1b"),
    "cp4_ring_full_recompute": ([16, 2, 1, 4], False, 2, "1f1b", {"recompute": "full"}),
    "cp2_allgather_selective": ([16, 2, 2, 2], True, 1, "1f1b",
                                {"cp_comm": "allgather", "recompute": "selective"}),
    "cp2_a2a_interleaved": ([8, 2, 1, 2], False, 0, "interleaved", {"cp_comm": "a2a"}),
    # hierarchical: Ulysses over pairs of CP ranks, the ring over the two pairs
    "cp4_a2a2_ring_selective": ([16, 2, 1, 4], False, 1, "1f1b",
                                {"cp_comm": "a2a+p2p", "cp_a2a": 2, "recompute": "selective"}),
}


@lru_cache(maxsize=None)
def traced(case: str):
    """(spec, {representative rank: records}) of one case, traced once per session."""
    config, sp, zero, schedule, *other = CASES[case]
    settings = TraceSettings(global_batch_size=GBS if config[0] != 12 else 12,
                             micro_batch_size=MBS, seq_len=SEQ, sequence_parallel=sp,
                             schedule=schedule, zero=zero, **(other[0] if other else {}))
    specs, skipped = plan_configs([config], settings, TINY)
    assert not skipped, skipped
    spec = specs[0]
    return spec, {r: trace_rank(spec, TINY, r).records for r in spec.representative_ranks()}


def activation_bytes() -> int:
    """s * b * h * 2: one micro-batch's full residual stream in bf16."""
    return SEQ * MBS * TINY.hidden * BF16_BYTES


def stage_params_per_tp_rank(spec: TraceSpec, stage: int) -> int:
    """Parameters one TP rank of `stage` holds: projections split over TP, norms replicated,
    the vocab-parallel embedding on the first stage, final norm + LM head on the last."""
    m, tp = TINY, spec.layout.tp
    head_dim = m.hidden // m.heads
    attn = (2 * m.hidden * m.hidden + 2 * m.hidden * m.kv_heads * head_dim) // tp
    mlp = 3 * m.hidden * m.ffn // tp
    block = attn + mlp + 2 * m.hidden  # attn_norm and mlp_norm are whole on every TP rank
    layers = spec.layout.layers_per_stage[stage]
    total = layers * block
    if stage == 0:
        total += m.vocab * m.hidden // tp
    if stage == spec.layout.pp - 1:
        total += m.hidden + m.vocab * m.hidden // tp
    return total


def in_blocks(records: List[dict], phase: str, group: str = "tp") -> List[dict]:
    return [r for r in records if r["kind"] == "coll" and r["group"] == group
            and r["phase"] == phase and r["module"].startswith("blocks.")]


# ------------------------------------------------------------------ tensor parallel
def tp_messages(records: List[dict], phase: str) -> Counter:
    """(op, bytes) -> count of the TP group's collectives in one phase (whole stage: the
    backward's module attribution is approximate, so blocks are not told apart)."""
    return Counter((r["op"], r["bytes"]) for r in records
                   if r["kind"] == "coll" and r["group"] == "tp" and r["phase"] == phase)


@pytest.mark.parametrize("case", ["sp_zero1", "sp_interleaved"])
def test_sp_two_all_gathers_and_two_reduce_scatters_per_layer_and_micro_batch(case):
    """Per layer and micro-batch: all-gather before attention and MLP, reduce-scatter after wo
    and w_down (backward: the reverse, and Megatron-LM's second all-gather of each sharded
    input for the weight gradient: 4 + 2), each s*b*h*2 bytes. Plus, per micro-batch, the
    embedding's reduce-scatter on the first stage and the LM head's input all-gather on the
    last (and their backward, the head's input gathered again)."""
    spec, traces = traced(case)
    lay = spec.layout
    act, m = activation_bytes(), lay.num_micro_batches
    for rank, records in traces.items():
        stage = spec.stage_of(rank)
        first, last = stage == 0, stage == lay.pp - 1
        layers = lay.layers_per_stage[stage]
        forward = tp_messages(records, "F")
        assert forward == {("all_gather", act): 2 * layers * m + m * last,
                           ("reduce_scatter", act): 2 * layers * m + m * first}, rank
        assert tp_messages(records, "B") == {
            ("all_gather", act): 4 * layers * m + m * first + m * last,
            ("reduce_scatter", act): 2 * layers * m + m * last}, rank
        in_layers = in_blocks(records, "F")
        assert Counter(r["op"] for r in in_layers) == {"all_gather": 2 * layers * m,
                                                       "reduce_scatter": 2 * layers * m}
        assert {(r["group_size"], r["dtype"]) for r in in_layers} == {(lay.tp, "bf16")}


def test_vocab_parallel_loss_three_small_all_reduces_and_no_logit_gather():
    """Megatron's vocab-parallel cross-entropy: the logits stay sharded over the vocabulary,
    and each micro-batch's loss all-reduces s*b fp32 values three times over TP (max, sum of
    exponentials, target logit)."""
    spec, traces = traced("sp_zero1")
    lay = spec.layout
    records = traces[spec.representative_ranks()[-1]]
    logits_bytes = SEQ * MBS * TINY.vocab * BF16_BYTES
    assert not [r for r in records if r["kind"] == "coll" and r["group"] == "tp"
                and r["bytes"] >= logits_bytes]
    loss = [r for r in records if r["kind"] == "coll" and r["phase"] == "loss"]
    assert Counter((r["op"], r["group"], r["bytes"], r["dtype"]) for r in loss) == {
        ("all_reduce", "tp", SEQ * MBS * FP32_BYTES, "fp32"): 3 * lay.num_micro_batches}
    assert Counter(r["mb"] for r in loss) == {mb: 3 for mb in range(lay.num_micro_batches)}


def test_sp_norm_gradients_are_all_reduced_over_tp_once_per_iteration():
    """With SP the norm weights are replicated over TP and see only a sequence shard, so their
    gradients are partial sums: all-reduced over TP once per iteration, before the DP sync
    (Megatron's _allreduce_layernorm_grads)."""
    spec, traces = traced("sp_zero1")
    for rank, records in traces.items():
        stage = spec.stage_of(rank)
        norms = 2 * spec.layout.layers_per_stage[stage] + (stage == spec.layout.pp - 1)
        after_backward = [r for r in records if r["kind"] == "coll" and r["group"] == "tp"
                          and r["phase"] in ("dp", "optimizer")]
        elements = sum(r["bytes"] // (FP32_BYTES if r["dtype"] == "fp32" else BF16_BYTES)
                       for r in after_backward)
        assert elements == norms * TINY.hidden, rank


@pytest.mark.parametrize("phase", ["F", "B"])
def test_without_sp_two_all_reduces_per_layer_and_micro_batch(phase):
    """Forward: after attention and MLP. Backward: one input-gradient all-reduce per sub-layer
    (Megatron's fused QKV and gate/up), not one per projection (models/parallelize.py shares
    the sub-layer's input among them)."""
    spec, traces = traced("no_sp_zero1")
    lay = spec.layout
    for rank, records in traces.items():
        layers = lay.layers_per_stage[spec.stage_of(rank)]
        ops = in_blocks(records, phase)
        assert Counter(r["op"] for r in ops) == {"all_reduce": 2 * layers * lay.num_micro_batches}
        assert {r["bytes"] for r in ops} == {activation_bytes()}


# ------------------------------------------------------------------ pipeline
def expected_p2p(spec: TraceSpec, stage: int) -> Counter:
    """Messages per (op, phase) of one rank: each of its virtual stages receives the forward
    activation of every micro-batch unless it is the very first, sends it on unless it is the
    last, and the reverse for gradients in backward."""
    lay = spec.layout
    m, virtual = lay.num_micro_batches, lay.pp * lay.virtual_stages
    mine = [c * lay.pp + stage for c in range(lay.virtual_stages)]
    not_first = sum(v != 0 for v in mine)
    not_last = sum(v != virtual - 1 for v in mine)
    counts = Counter({("recv", "F"): m * not_first, ("send", "F"): m * not_last,
                      ("recv", "B"): m * not_last, ("send", "B"): m * not_first})
    return +counts  # drop zeros


@pytest.mark.parametrize("case", ["sp_zero1", "no_sp_zero1", "sp_interleaved"])
def test_p2p_messages_and_sizes(case):
    spec, traces = traced(case)
    lay = spec.layout
    size = activation_bytes() // (lay.tp if lay.sequence_parallel else 1)
    for rank, records in traces.items():
        p2p = [r for r in records if r["kind"] == "p2p"]
        assert Counter((r["op"], r["phase"]) for r in p2p) == expected_p2p(
            spec, spec.stage_of(rank)), rank
        assert {r["bytes"] for r in p2p} == {size}
        assert {r["dtype"] for r in p2p} == {"bf16"}
        # Every micro-batch crosses every boundary once per direction and chunk.
        assert sorted(Counter(r["mb"] for r in p2p).values()) == [
            len(p2p) // lay.num_micro_batches] * lay.num_micro_batches


def test_first_stage_1f1b_sends_m_forwards_and_receives_m_gradients():
    spec, traces = traced("sp_zero1")
    m = spec.layout.num_micro_batches
    assert m == GBS // (spec.layout.dp * MBS) == 4
    first = [(r["op"], r["phase"]) for r in traces[0] if r["kind"] == "p2p"]
    assert Counter(first) == {("send", "F"): m, ("recv", "B"): m}
    last = [(r["op"], r["phase"]) for r in traces[spec.representative_ranks()[-1]]
            if r["kind"] == "p2p"]
    assert Counter(last) == {("recv", "F"): m, ("send", "B"): m}


# ------------------------------------------------------------------ data parallel
GRAD_OP = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter"}


@pytest.mark.parametrize("case", ["sp_zero0", "sp_zero1", "sp_zero2", "no_sp_zero1",
                                  "sp_zero1_dp3"])
def test_dp_gradient_bytes_are_the_stage_parameters_per_tp_rank_in_fp32(case):
    spec, traces = traced(case)
    lay = spec.layout
    for rank, records in traces.items():
        grads = [r for r in records if r["phase"] == "dp" and r["kind"] != "compute"
                 and r["group"] != "tp"]  # tp: SP norm gradients, checked below
        assert {(r["op"], r["group"], r["group_size"], r["dtype"]) for r in grads} == {
            (GRAD_OP[lay.zero], "dp", lay.dp, "fp32")}
        exact_bytes = FP32_BYTES * stage_params_per_tp_rank(spec, spec.stage_of(rank))
        padding_bytes = sum(r["bytes"] for r in grads) - exact_bytes
        # Each bucket is padded to a multiple of dp elements.
        assert 0 <= padding_bytes < lay.dp * FP32_BYTES * len(grads), (rank, padding_bytes)
        gathers = [r for r in records if r["phase"] == "optimizer" and r["op"] == "all_gather"]
        if lay.zero == 0:
            assert gathers == []
        else:  # the updated slices come back from every dp rank, bucket by bucket, in bf16
            # (Megatron's distributed optimizer gathers its bf16 parameters; fp32 before
            # issue 41: the optimizer gathered fp32 masters into bf16 weights)
            assert [2 * r["bytes"] for r in gathers] == [r["bytes"] for r in grads]
            assert {(r["group"], r["dtype"]) for r in gathers} == {("dp", "bf16")}


def test_dp3_buckets_are_padded():
    """The padding bound above is not vacuous: with DP 3 the last stage's 427,136 parameters
    per TP rank are no multiple of 3, so its buckets carry padding."""
    spec, traces = traced("sp_zero1_dp3")
    last = spec.layout.pp - 1
    assert stage_params_per_tp_rank(spec, last) == 427_136
    records = traces[spec.representative_ranks()[last]]
    buckets = [r for r in records if r["phase"] == "dp" and r.get("group") == "dp"]
    assert sum(r["bytes"] for r in buckets) > FP32_BYTES * 427_136
    assert all(r["bytes"] // FP32_BYTES % 3 == 0 for r in buckets)


# ------------------------------------------------------------------ context parallelism
def kv_bytes(spec: TraceSpec) -> int:
    """One ring message: this rank's K and V, 2 x b x s / cp x kv_heads / tp x head_dim, bf16."""
    lay = spec.layout
    return (2 * MBS * SEQ // lay.cp * TINY.kv_heads // lay.tp * (TINY.hidden // TINY.heads)
            * BF16_BYTES)


@pytest.mark.parametrize("case", ["cp2_ring", "cp4_ring_full_recompute"])
def test_ring_sends_kv_cp_minus_1_times_forward_and_its_gradient_cp_times_backward(case):
    """Per layer and micro-batch, to the next CP rank: cp - 1 K/V blocks forward; backward
    cp - 1 again (2 (cp - 1) when the layer's forward reruns) and cp of their gradients."""
    spec, traces = traced(case)
    lay = spec.layout
    m, cp = lay.num_micro_batches, lay.cp
    reruns = lay.recompute[0][0] == "full"
    for rank, records in traces.items():
        layers = lay.layers_per_stage[spec.stage_of(rank)]
        ring = [r for r in records if r["kind"] == "p2p" and r["group"] == "cp"]
        cp_ranks = lay.group_ranks("cp", rank)
        after = cp_ranks[(cp_ranks.index(rank) + 1) % cp]
        assert {(r["op"], r["peer"]) for r in ring if r["op"] == "send"} == {("send", after)}
        assert {r["bytes"] for r in ring} == {kv_bytes(spec)}
        sends = Counter((r["phase"], r["mb"]) for r in ring if r["op"] == "send")
        assert sends == {**{("F", mb): (cp - 1) * layers for mb in range(m)},
                         **{("B", mb): ((cp - 1) * (1 + reruns) + cp) * layers
                            for mb in range(m)}}, rank


def test_allgather_and_a2a_flavours_per_layer():
    """allgather: 2 all-gathers of the whole sequence's K or V forward (+2 when selective
    recompute reruns the core), 2 reduce-scatters backward. a2a: Q, K, V and the output, 4
    all-to-alls each way; Q and the output b x s / cp x h / tp, K and V kv_heads / h of it."""
    spec, traces = traced("cp2_allgather_selective")
    lay = spec.layout
    m = lay.num_micro_batches
    for rank, records in traces.items():
        layers = lay.layers_per_stage[spec.stage_of(rank)]
        cp_colls = Counter((r["op"], r["phase"], r["bytes"]) for r in records
                           if r["kind"] == "coll" and r["group"] == "cp")
        whole = kv_bytes(spec) // 2 * lay.cp
        assert cp_colls == {("all_gather", "F", whole): 2 * layers * m,
                            ("all_gather", "B", whole): 2 * layers * m,
                            ("reduce_scatter", "B", whole): 2 * layers * m}, rank
    spec, traces = traced("cp2_a2a_interleaved")
    lay = spec.layout
    m = lay.num_micro_batches
    q_bytes = MBS * SEQ // lay.cp * TINY.hidden // lay.tp * BF16_BYTES
    for rank, records in traces.items():
        layers = lay.layers_per_stage[spec.stage_of(rank)]
        cp_colls = Counter((r["op"], r["phase"], r["bytes"]) for r in records
                           if r["kind"] == "coll" and r["group"] == "cp")
        assert cp_colls == {
            ("all_to_all", phase, size): 2 * layers * m
            for phase in "FB" for size in (q_bytes, kv_bytes(spec) // 2)}, rank


# ------------------------------------------------------------------ the workload model
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_message_is_the_workload_models(case):
    """Op, group, bytes, dtype and count of every collective and p2p message of each traced
    rank equal orchestrator/workload's list for engine "megatron" (bf16)."""
    from orchestrator.workload.comm import rank_comms

    spec, by_rank = traced(case)
    layout = spec.layout
    model = dataclasses.replace(TINY, seq_len=SEQ)
    for rank, records in by_rank.items():
        seen, predicted = Counter(), Counter()
        for r in records:
            if r["kind"] == "coll":
                seen[r["op"], r["group"], r["bytes"], r["dtype"]] += 1
            elif r["kind"] == "p2p":
                seen[r["op"], r["peer"], r["bytes"], r["dtype"]] += 1
        for c in rank_comms(model, layout, rank, engine="megatron", dtype="bf16"):
            if c.op in ("send", "recv"):
                ranks = layout.group_ranks(c.group, rank)  # pp, cp, cp_ring
                me = ranks.index(rank)
                peer = ranks[(me + (1 if c.peer == "next" else -1)) % len(ranks)]
                predicted[c.op, peer, c.bytes, c.dtype] += c.count
            else:
                predicted[c.op, c.group, c.bytes, c.dtype] += c.count
        assert seen == predicted, (
            f"{case} rank {rank}:\n traced only {sorted((seen - predicted).items())}\n"
            f" predicted only {sorted((predicted - seen).items())}")
