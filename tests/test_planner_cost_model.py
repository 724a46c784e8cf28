"""The cost model: closed-form pipeline time, memory (Megatron's formulas for engine=megatron,
the workload model's for stage=train's engine) and communication, and the profile adapters it
reads."""
from __future__ import annotations

import pytest

from orchestrator.errors import ProfileError
from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
from orchestrator.planner.cost_model import BREAKDOWN_KINDS, ConfigKey, StageCosts
from orchestrator.planner.terms import overlap_extra_us
from planner_fixtures import GiB, synthetic_hardware, synthetic_model

SEQ = 512
MEGATRON = CostOptions(engine="megatron")


@pytest.fixture(scope="module")
def model_json():
    return synthetic_model(layers=8, hidden=256, ffn=1024, heads=8, vocab=1000)


@pytest.fixture(scope="module")
def model(model_json):
    return ModelCost.from_dict(model_json)


@pytest.fixture(scope="module")
def hw():
    return HardwareModel.from_dict(synthetic_hardware(2, 8))


def _block_params(model_json, tp):
    return model_json["memory"][str(tp)]["block"]["param_bytes"] / 2  # bf16: 2 bytes each


# ------------------------------------------------------------------ time
def test_iteration_is_sum_plus_m_minus_1_times_slowest_stage(model, hw):
    layout = ParallelLayout.uniform(8, 2, 4, 8, sequence_parallel=True, num_micro_batches=8)
    pred = evaluate(layout, model, hw, SEQ)  # dp = 1: no gradient sync
    t = pred.stage_time_us
    assert pred.iteration_time_us == pytest.approx(sum(t) + 7 * max(t), rel=1e-12)


def test_closed_form_equals_simulation_when_last_stage_is_slowest(model, hw):
    layout = ParallelLayout.uniform(8, 2, 4, 8, sequence_parallel=True, num_micro_batches=8)
    pred = evaluate(layout, model, hw, SEQ, simulate=True)
    assert max(pred.stage_time_us) == pred.stage_time_us[-1]
    assert pred.simulated_iteration_time_us == pytest.approx(pred.iteration_time_us, rel=1e-9)


def test_interleaving_shrinks_the_bubble(model, hw):
    kw = dict(sequence_parallel=True, num_micro_batches=8)
    plain = evaluate(ParallelLayout.uniform(8, 2, 4, 8, **kw), model, hw, SEQ)
    inter = evaluate(ParallelLayout.uniform(8, 2, 4, 8, schedule="interleaved",
                                            virtual_stages=2, **kw), model, hw, SEQ)
    assert inter.breakdown_us["bubble"] < plain.breakdown_us["bubble"]
    # dp = 1: T - m max t is the bubble, sum t - max t for 1F1B and (sum t - max t) / v
    # interleaved: the textbook (p - 1) t and (p - 1) t / v for equal stages.
    for pred, v in ((plain, 1), (inter, 2)):
        t = pred.stage_time_us
        assert pred.breakdown_us["bubble"] == pytest.approx((sum(t) - max(t)) / v, rel=1e-9)


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=2, sequence_parallel=True, zero=1, num_micro_batches=4),
    dict(tp=1, pp=4, zero=3, num_micro_batches=8, recompute="full"),
    dict(tp=4, pp=2, zero=2, num_micro_batches=4, schedule="interleaved", virtual_stages=2,
         recompute="selective"),
    dict(tp=1, pp=1, zero=0, num_micro_batches=2),
])
def test_breakdown_adds_up_to_the_iteration(model, hw, kw):
    layout = ParallelLayout.uniform(16, kw.pop("tp"), kw.pop("pp"), 8, **kw)
    pred = evaluate(layout, model, hw, SEQ)
    assert set(pred.breakdown_us) == set(BREAKDOWN_KINDS)
    assert sum(pred.breakdown_us.values()) == pytest.approx(pred.iteration_time_us, rel=1e-9)
    assert all(v >= -1e-6 for v in pred.breakdown_us.values())
    assert pred.tokens_per_s == pytest.approx(
        layout.global_batch_size * SEQ / (pred.iteration_time_us * 1e-6))


def test_recompute_costs_time(model, hw):
    base = dict(sequence_parallel=True, num_micro_batches=4)
    times = [evaluate(ParallelLayout.uniform(8, 2, 2, 8, recompute=rc, **base), model, hw,
                      SEQ).iteration_time_us for rc in ("none", "selective", "full")]
    assert times[0] < times[1] < times[2]
    # Same recompute on both stages of 4 layers: every t_j grows by the same amount r, so
    # T = sum t + (m - 1) max t grows by (p + m - 1) r = 5 r.
    costs = StageCosts(ConfigKey(8, 2, 2, 2, 0, True, 1, 4, "1f1b", 1), model, hw, SEQ)
    assert times[1] - times[0] == pytest.approx(5 * 4 * costs.compute.selective_recompute_us)
    assert times[2] - times[0] == pytest.approx(5 * 4 * costs.full_recompute_us)


def test_recompute_a_cpu_profile_timed_is_priced_as_timed(model_json, hw):
    # profile_model on a CPU (tp 1) times what each recompute mode adds to a block's forward +
    # backward, as train runs it; the cost model prices that, the FLOPs where it is absent.
    key = ConfigKey(1, 1, 1, 1, 0, False, 2, 4, "1f1b", 1)
    flops = StageCosts(key, ModelCost.from_dict(model_json), hw, SEQ)
    timed_json = {**model_json, "fits": {**model_json["fits"], "1": {
        **model_json["fits"]["1"], "recompute_us": {"selective": [3.0, 0.01, 0.0],
                                                    "full": [40.0, 0.2, 0.0]}}}}
    timed = StageCosts(key, ModelCost.from_dict(timed_json), hw, SEQ)
    assert timed.compute.selective_recompute_us == pytest.approx(3.0 + 2 * 0.01 * SEQ)
    assert timed.full_recompute_us == pytest.approx(40.0 + 2 * 0.2 * SEQ)
    assert flops.full_recompute_us == pytest.approx(flops.compute.block.fwd_us)
    assert timed.compute.block == flops.compute.block  # the rest as before
    layers = model_json["model"]["layers"]
    times = [evaluate(ParallelLayout.uniform(1, 1, 1, layers, recompute=rc, micro_batch_size=2,
                                             num_micro_batches=4), ModelCost.from_dict(timed_json),
                      hw, SEQ).iteration_time_us for rc in ("none", "full")]
    assert times[1] - times[0] == pytest.approx(4 * layers * (40.0 + 2 * 0.2 * SEQ))


def test_megatrons_sequence_parallel_backward_moves_more_than_forward(model, hw):
    key = ConfigKey(8, 4, 1, 2, 0, True, 1, 4, "1f1b", 1)
    # the collectives as moved (--tp-comm-overlap, which hides part of them: test_planner_overlap)
    megatron = CostOptions(engine="megatron", tp_comm_overlap=False)
    costs = StageCosts(key, model, hw, SEQ, megatron)
    assert costs.tp.layer.bwd_us > costs.tp.layer.fwd_us > 0  # 4 AG + 2 RS vs 2 AG + 2 RS
    ours = StageCosts(key, model, hw, SEQ)
    # ours too since issue 41: its SP backward re-gathers the norm outputs (bf16 weights: a
    # bf16 residual stream)
    assert ours.tp.layer.bwd_us - ours.tp.layer.fwd_us == pytest.approx(
        2 * hw.collective_time_us("all_gather", 4, 1, SEQ * 256 * 2))
    no_sp = StageCosts(ConfigKey(8, 4, 1, 2, 0, False, 1, 4, "1f1b", 1), model, hw, SEQ,
                       megatron)
    assert no_sp.tp.layer.bwd_us == no_sp.tp.layer.fwd_us  # 2 all-reduce each way
    message_bytes = SEQ * 256 * 2  # s * b * h * bf16
    assert costs.tp.layer.bwd_us - costs.tp.layer.fwd_us == pytest.approx(
        2 * hw.collective_time_us("all_gather", 4, 1, message_bytes))
    assert no_sp.tp.layer.fwd_us == pytest.approx(
        2 * hw.collective_time_us("allreduce", 4, 1, message_bytes))


def test_overlap_slows_both_sides_by_the_coefficient():
    assert overlap_extra_us(10.0, 4.0, 1.5) == pytest.approx(2.0)  # comm hidden, compute slowed
    assert overlap_extra_us(4.0, 10.0, 1.5) == pytest.approx(8.0)  # comm sticks out
    assert overlap_extra_us(4.0, 10.0, 1.0) == pytest.approx(6.0)


def test_gradient_sync_is_exposed_only_with_data_parallelism(model, hw):
    single = evaluate(ParallelLayout.uniform(2, 2, 1, 8, sequence_parallel=True), model, hw, SEQ,
                      options=MEGATRON)
    many = evaluate(ParallelLayout.uniform(16, 2, 1, 8, sequence_parallel=True), model, hw, SEQ,
                    options=MEGATRON)
    assert single.breakdown_us["dp_sync_exposed"] == 0
    assert many.breakdown_us["dp_sync_exposed"] > 0
    # dp 8 with stride tp 2 all-reduces the fp32 gradients of all 8 blocks and "other" of one
    # stage holding everything: one Megatron DDP bucket (< 40M parameters), launched when the
    # last backward has made all of them, so all of it is exposed (test_planner_overlap: more
    # buckets overlap).
    block, other = model.memory(2)
    sync = hw.collective_time_us("allreduce", 8, 2, 8 * block.grad_bytes + other.grad_bytes)
    assert many.breakdown_us["dp_sync_exposed"] == pytest.approx(sync)
    # A degree the profile lacks: the error names the ones it has and the command that adds it.
    with pytest.raises(ProfileError, match=r"no memory for tp=16 \(profiled: \[1, 2, 4, 8\]\)"
                                           r".*profile_model\.max_tp=16"):
        model.memory(16)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_engine_data_parallel_sync_is_what_train_runs(model, hw, zero):
    """stage=train's engine (workload/comm.py): fp32 gradients all-reduced (ZeRO 0) or
    reduce-scattered (ZeRO 1/2 as Megatron's distributed optimizer, ZeRO 3: FSDP once per
    iteration) beside the last backward; ZeRO 1/2
    all-gather the parameters after the optimizer step, where nothing hides it; ZeRO 3
    all-gathers each block in forward and backward per micro-batch (no pipeline). The profile
    is bf16: the engine's weights, so every gather, are bf16 (issue 41)."""
    from orchestrator.workload.params import block_parameters

    layout = ParallelLayout.uniform(16, 2, 1, 8, sequence_parallel=True, zero=zero,
                                    num_micro_batches=2)
    pred = evaluate(layout, model, hw, SEQ)
    costs = StageCosts(ConfigKey.of(layout), model, hw, SEQ)
    numel = sum(p.local_numel for p in block_parameters(_config(model), 0, 2, 0))
    layer = 4.0 * numel
    assert costs.block_grad_bytes == layer
    assert costs.block_param_bytes == 2.0 * numel
    stage = 8 * layer + float(costs.other_grad_bytes[0])
    op = "allreduce" if zero == 0 else "reduce_scatter"
    during = hw.collective_time_us(op, 8, 2, stage)
    params = 8 * 2.0 * numel + float(costs.other_param_bytes[0])
    after = hw.collective_time_us("all_gather", 8, 2, params) if zero in (1, 2) else 0.0
    window = 8 * costs.layer.bwd_us + float(costs.other.bwd_us[0])
    exposed = float(overlap_extra_us(window, during, hw.overlap_coe)) + after
    assert float(costs.dp_exposed_us(0, 8)) == pytest.approx(exposed, rel=1e-9)
    if zero < 3:  # (ZeRO 3's per-layer gathers add to the breakdown's exposed sync too)
        assert pred.breakdown_us["dp_sync_exposed"] == pytest.approx(exposed, rel=1e-9)
    gather = hw.collective_time_us("all_gather", 8, 2, 2.0 * numel) if zero == 3 else 0.0
    assert costs.zero_layer.fwd_us == pytest.approx(
        float(overlap_extra_us(costs.compute.block.fwd_us + costs.tp.layer.fwd_us, gather,
                               hw.overlap_coe)))


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("zero,bytes_per_param", [
    (0, lambda dp: 18.0), (1, lambda dp: 6.0 + 12.0 / dp), (2, lambda dp: 2.0 + 16.0 / dp),
    (3, lambda dp: 18.0 / dp)])
def test_megatron_bytes_per_param_by_zero_stage(model_json, model, hw, zero, bytes_per_param):
    layout = ParallelLayout.uniform(16, 2, 2, 8, zero=zero, num_micro_batches=2)
    pred = evaluate(layout, model, hw, SEQ, options=MEGATRON)
    # Stage 1 holds 4 blocks and half of "other" (the LM head).
    other = model_json["memory"]["2"]["other"]["param_bytes"] / 2 * 0.5
    params = 4 * _block_params(model_json, 2) + other
    mem = pred.memory_bytes[1]
    assert mem["params"] + mem["grads"] + mem["optim"] == pytest.approx(
        params * bytes_per_param(layout.dp), rel=1e-12)


@pytest.mark.parametrize("zero,bytes_per_param", [
    (0, lambda dp: 18.0), (1, lambda dp: 6.0 + 12.0 / dp), (2, lambda dp: 2.0 + 12.0 / dp),
    (3, lambda dp: 12.0 / dp)])
def test_engine_bytes_per_param_by_zero_stage(model, hw, zero, bytes_per_param):
    """stage=train's engine in the profile's bf16, between steps: bf16 parameters and an fp32
    master (the whole bucket under ZeRO 0, a 1/dp slice under ZeRO 1/2), fp32 gradient buckets
    (ZeRO 0/1; ZeRO 2's 4/dp shard lives from the backward to the step only), AdamW's two fp32
    moments: Megatron's 18 and 6 + 12/dp; ZeRO 3 FSDP2's fp32 shard (the master) and moments;
    the LM head's exact size on the last stage (no share knob)."""
    from orchestrator.workload.params import block_parameters

    layout = ParallelLayout.uniform(16, 2, 2, 8, zero=zero, num_micro_batches=2)
    pred = evaluate(layout, model, hw, SEQ)
    config = _config(model)
    numel = (4 * sum(p.local_numel for p in block_parameters(config, 0, 2, 0))
             + model.hidden + model.vocab // 2 * model.hidden)
    mem = pred.memory_bytes[1]
    assert mem["params"] + mem["grads"] + mem["optim"] == pytest.approx(
        numel * bytes_per_param(layout.dp), rel=1e-12)


def _config(model):
    from orchestrator.models.config import ModelConfig

    return ModelConfig(name=model.name, hidden=model.hidden, ffn=model.ffn, layers=model.layers,
                       heads=model.heads, kv_heads=model.kv_heads, vocab=model.vocab,
                       seq_len=SEQ, dtype=model.dtype)


LAYOUTS = [  # (world, tp, pp, extra)
    (8, 1, 1, {}), (8, 2, 1, {"sequence_parallel": True}), (8, 2, 1, {}),
    (8, 2, 4, {"sequence_parallel": True, "num_micro_batches": 8}),
    (8, 1, 4, {"num_micro_batches": 16, "recompute": "full"}),
    (16, 2, 2, {"zero": 1, "num_micro_batches": 4, "recompute": "selective"}),
    (16, 1, 2, {"zero": 2, "num_micro_batches": 4}),
    (16, 2, 2, {"zero": 3, "num_micro_batches": 2, "sequence_parallel": True}),
    (16, 2, 1, {"zero": 3, "num_micro_batches": 2, "sequence_parallel": True}),
    (8, 1, 2, {"schedule": "interleaved", "virtual_stages": 2, "num_micro_batches": 4}),
]


@pytest.mark.parametrize("world,tp,pp,extra", LAYOUTS)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engine_memory_is_the_workload_models(model, hw, world, tp, pp, extra, device):
    """The search's closed form against orchestrator/workload/memory.rank_memory (the walk of
    the rank's op order that tests/test_train_engine.py checks against real steps): states
    equal, peaks within 6% (the closed form adds the largest transient to the largest in-flight
    activations)."""
    from orchestrator.workload.memory import BlockActivations, rank_memory

    layout = ParallelLayout.uniform(world, tp, pp, 8, **extra)
    pred = evaluate(layout, model, hw, SEQ, options=CostOptions(device=device))
    block, _ = model.memory(tp)
    tokens = SEQ * layout.micro_batch_size
    act = BlockActivations(*(block.act_bytes_per_token_at(mode, SEQ) * tokens
                             for mode in ("none", "selective", "full")),
                           elem_bytes=model.dtype_bytes)
    for j in range(pp):
        rank = layout.group_ranks("pp", 0)[j]
        walked = rank_memory(_config(model), layout, rank, act, dtype=model.dtype,
                             device=device, seq_len=SEQ)
        mem = pred.memory_bytes[j]
        states = mem["params"] + mem["grads"] + mem["optim"] + mem["comm_buffers"]
        assert states == pytest.approx(walked.states.total, rel=1e-3), layout.describe()
        assert mem["total"] == pytest.approx(walked.peak, rel=0.06), (
            f"{layout.describe()} stage {j}: walk {walked.phase} {dict(walked.at_peak)}")


# Megatron-Core's layer on the fixture (h 256, 8 heads = 8 KV heads of 32, SwiGLU 1024, bf16) at
# tp 2 with SP, bytes per token (planner/terms/megatron_memory.py): 4 residual rows 4 x 256 x 2 / 2
# = 1024, Q K V O (8 + 8 + 8 + 8) x 32 x 2 / 2 = 1024, SwiGLU 3 x 1024 x 2 / 2 = 3072, flash
# attention's fp32 statistics 4 x 8 / 2 = 16; full recompute keeps the input, 256 x 2 / 2.
MEGATRON_TP2_NONE, MEGATRON_TP2_FULL = 1024 + 1024 + 3072 + 16, 256
# The last stage's loss: the final norm's input and output 2 x 256 x 2 / 2 and the vocab-parallel
# cross entropy's fp32 softmax beside the bf16 logits (4 + 2) x 1000 / 2; the first stage keeps
# each in-flight micro-batch's int64 token ids.
MEGATRON_TP2_LOSS, TOKEN_IDS = 512 + 3000, 8


def test_megatron_1f1b_stage_holds_p_minus_j_micro_batches(model, hw):
    layout = ParallelLayout.uniform(8, 2, 4, 8, sequence_parallel=True, num_micro_batches=16)
    pred = evaluate(layout, model, hw, SEQ, options=MEGATRON)
    for j in range(3):  # the last stage also holds the LM head's activations
        ids = TOKEN_IDS if j == 0 else 0
        assert pred.memory_bytes[j]["activations"] == pytest.approx(
            (4 - j) * SEQ * (2 * MEGATRON_TP2_NONE + ids))


def test_megatron_full_recompute_keeps_layer_inputs_plus_one_layer(model, hw):
    layout = ParallelLayout(world_size=2, pp=1, tp=2, dp=1, sequence_parallel=True,
                            layers_per_stage=(8,), recompute=(("full", 6),))
    pred = evaluate(layout, model, hw, SEQ, options=MEGATRON)
    none, full = MEGATRON_TP2_NONE, MEGATRON_TP2_FULL
    expected = SEQ * (6 * full + 2 * none + (none - full) + MEGATRON_TP2_LOSS + TOKEN_IDS)
    assert pred.memory_bytes[0]["activations"] == pytest.approx(expected)


@pytest.mark.parametrize("options", [MEGATRON, CostOptions()])
def test_without_sequence_parallel_activations_grow(model, hw, options):
    sp = evaluate(ParallelLayout.uniform(4, 4, 1, 8, sequence_parallel=True), model, hw, SEQ,
                  options=options)
    no_sp = evaluate(ParallelLayout.uniform(4, 4, 1, 8), model, hw, SEQ, options=options)
    assert no_sp.memory_bytes[0]["activations"] > sp.memory_bytes[0]["activations"]
    if options.engine == "megatron":
        # One micro-batch in flight, 8 layers: each token keeps its 4 residual rows whole (4 x
        # 256 x 2 bytes) instead of 1/4 of them, and the loss its final norm's 2.
        assert no_sp.memory_bytes[0]["activations"] - sp.memory_bytes[0]["activations"] == \
            pytest.approx(SEQ * (8 * 4 + 2) * 256 * 2 * (1 - 1 / 4))


def test_over_budget_is_infeasible_with_a_reason(model, hw):
    layout = ParallelLayout.uniform(8, 2, 4, 8, num_micro_batches=8)
    pred = evaluate(layout, model, hw, SEQ, memory_budget_bytes=1e6)
    assert not pred.feasible
    assert "stage 0 needs" in pred.reason and "GiB > budget" in pred.reason
    assert evaluate(layout, model, hw, SEQ, memory_budget_bytes=80 * GiB).feasible


def test_reserve_is_charged_on_every_stage(model, hw):
    layout = ParallelLayout.uniform(8, 2, 4, 8, num_micro_batches=8)
    pred = evaluate(layout, model, hw, SEQ, options=CostOptions(reserve_bytes=GiB))
    assert all(mem["reserve"] == GiB for mem in pred.memory_bytes)
    for mem in pred.memory_bytes:
        parts = sum(v for k, v in mem.items() if k != "total")
        assert mem["total"] == pytest.approx(parts, rel=1e-12)


# ------------------------------------------------------------------ errors
def test_layout_for_another_model_is_rejected(model, hw):
    with pytest.raises(LayoutError, match=r"sum\(layers_per_stage\)=6 != layers\(8\)"):
        evaluate(ParallelLayout.uniform(8, 2, 2, 6), model, hw, SEQ)


def test_unprofiled_tp_names_the_stage_to_rerun(hw):
    model = ModelCost.from_dict(synthetic_model(layers=8, tps=(1, 2)))
    with pytest.raises(ProfileError, match="stage=profile_model"):
        evaluate(ParallelLayout.uniform(8, 4, 2, 8), model, hw, SEQ)


def test_evaluate_is_exposed_at_package_level():
    import orchestrator.planner as planner
    assert planner.evaluate is evaluate


# ------------------------------------------------------------------ profile adapters
def test_hardware_uses_exact_fit_then_nearest_larger_then_ring_extrapolation():
    hw_json = synthetic_hardware(2, 8, max_group=8)
    fits = hw_json["benchmarks"]["allreduce"]["fits"]
    fits[:] = [f for f in fits if f["group_size"] != 4]  # pretend 4 was not measured
    hw = HardwareModel.from_dict(hw_json)
    size = 64e6
    by = {(f["group_size"], f["layout"]): f for f in fits}
    exact = by[(2, "consec")]
    assert hw.time_us("allreduce", 2, "consec", size) == pytest.approx(
        exact["alpha_us"] + size / (exact["algbw_GBps"] * 1e3))
    larger = by[(8, "consec")]
    assert hw.time_us("allreduce", 4, "consec", size) == pytest.approx(
        larger["alpha_us"] + size / (larger["algbw_GBps"] * 1e3))
    # Beyond the largest measured group: bus bandwidth stays, latency grows with ring steps.
    t64 = hw.time_us("allreduce", 64, "consec", size)
    busbw8 = larger["algbw_GBps"] * 2 * 7 / 8
    algbw64 = busbw8 / (2 * 63 / 64)
    assert t64 == pytest.approx(larger["alpha_us"] * 63 / 7 + size / (algbw64 * 1e3))


def test_group_layout_follows_nodes():
    hw = HardwareModel.from_dict(synthetic_hardware(4, 8))
    assert hw.group_layout(8, 1) == "consec"  # one node
    assert hw.group_layout(4, 2) == "consec"  # dp 4 with tp 2: still one node
    assert hw.group_layout(4, 8) == "strided"  # one member per node
    assert hw.group_layout(8, 2) == "consec"  # two nodes, four members each
    assert hw.p2p_time_us(1e6, True, 4) < hw.p2p_time_us(1e6, False, 4)


def test_model_cost_reads_the_quadratic_fit(model_json, model):
    c = model_json["fits"]["2"]["block_fwd_us"]
    assert model.block_fwd_us(1000, 2) == pytest.approx(c[0] + c[1] * 1000 + c[2] * 1e6)
    assert model.attention_core_fwd_us(1000, 2) == pytest.approx(c[2] * 1e6)
    assert model.tps == (1, 2, 4, 8)


def test_profiles_missing_sections_say_what_to_rerun():
    with pytest.raises(ProfileError, match="stage=profile_hardware"):
        HardwareModel.from_dict({"cluster": {"tasks_per_node": 8}})
    with pytest.raises(ProfileError, match="stage=profile_model"):
        ModelCost.from_dict({"model": {}})
    hw = HardwareModel.from_dict({"cluster": {"tasks_per_node": 8, "world_size": 8},
                                  "benchmarks": {}})
    with pytest.raises(ProfileError, match=r"no fits for allreduce, p2p, reduce_scatter, "
                                           r"all_gather, all2all \(this one needs allreduce\).*"
                                           r"benchmarks=\[allreduce,p2p,reduce_scatter,all_gather,"
                                           r"all2all\]"):
        hw.time_us("allreduce", 4, "consec", 1e6)


def test_activation_fit_moves_memory_to_other_sequence_lengths(model_json, hw):
    """Without flash attention, bytes per token grow with s (the profile's act_bytes_fit; the
    orchestrator engine's activations start from the profile, Megatron's are flash attention's
    closed form)."""
    import copy
    prof = copy.deepcopy(model_json)
    block = prof["memory"]["2"]["block"]
    per_token = block["act_bytes_per_token"]["none"]
    # bytes per micro-batch = per_token * s + 0.5 * s^2 / 512 (an s^2 term), profiled at 512
    block["act_seq_len"] = 512
    block["act_bytes_fit"] = {mode: [0.0, block["act_bytes_per_token"][mode] - 0.5, 0.5 / 512]
                              for mode in ("none", "selective", "full")}
    model = ModelCost.from_dict(prof)
    part = model.memory(2)[0]
    assert part.act_bytes_per_token_at("none", 512) == pytest.approx(per_token)
    assert part.act_bytes_per_token_at("none", 2048) == pytest.approx(per_token - 0.5 + 2.0)
    key = ConfigKey.of(ParallelLayout.uniform(2, 2, 1, 8, sequence_parallel=True))
    short, long = (StageCosts(key, model, hw, seq).block_activations for seq in (512, 2048))
    assert long.none > 4 * short.none
