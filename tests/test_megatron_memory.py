"""Megatron-Core's memory as search.engine=megatron prices it (planner/terms/megatron_memory.py):
a layer counted by hand, Korthikanti's (Megatron-LM's own) formula where its assumptions hold, and
the Llama 3 405B layouts of the published runs (bench/megatron_memory.py checks the same against
Megatron-LM's theoretical_memory_usage.py and a megatron-core layer's saved tensors)."""
from __future__ import annotations

import pytest

from orchestrator.choices import Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
from orchestrator.planner.cost_model import ConfigKey, StageCosts
from orchestrator.planner.terms.megatron_memory import (LSE_BYTES, LayerShape,
                                                        layer_activation_bytes_per_token)

from planner_fixtures import shaped_like, synthetic_hardware, synthetic_model

NONE, SELECTIVE, FULL = Recompute.none, Recompute.selective, Recompute.full


def test_layer_bytes_counted_by_hand():
    """h 64, 4 heads of 16, 2 KV heads, SwiGLU 96, bf16, tp 2, bytes per token."""
    shape = LayerShape(hidden=64, heads=4, kv_heads=2, ffn=96)
    rows = 4 * 64 * 2 / 2  # layer input, QKV input, norm 2's input, fc1 input: 256
    qkvo = (4 + 2 + 2 + 4) * 16 * 2 / 2  # Q, K, V, attention output: 192
    mlp = 3 * 96 * 2 / 2  # gate and up, SwiGLU's product: 288
    lse = 4 * 4 / 2  # flash attention's fp32 statistics: 8
    qkv_out = (4 + 2 + 2) * 16 * 2 / 2  # the fused QKV output V's view keeps: 128
    v_copy = 2 * 16 * 2 / 2  # the contiguous V the attention keeps instead: 32

    def at(mode, sp=True):
        return layer_activation_bytes_per_token(shape, 2, sp, mode)

    assert at(NONE) == rows + qkvo + mlp + lse == 744
    assert at(SELECTIVE) == rows + qkvo - v_copy + mlp + qkv_out == 832
    assert at(FULL) == 64 * 2 / 2 == 64
    # without SP the four residual rows and the kept input are whole on every TP rank
    assert at(NONE, sp=False) == 2 * rows + qkvo + mlp + lse == 1000
    assert at(FULL, sp=False) == 128
    # tp 1: nothing to shard either way
    assert (layer_activation_bytes_per_token(shape, 1, False, NONE)
            == layer_activation_bytes_per_token(shape, 1, True, NONE) == 2 * at(NONE, sp=False)
            - 2 * rows)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("hidden,heads", [(2304, 24), (12288, 96)])  # GPT 1.7B, 175B
def test_korthikanti_where_its_assumptions_hold(tp, hidden, heads):
    """An ungated 4h FFN, as many KV heads as heads, dropout masks: Korthikanti et al.'s
    34 s b h / t with SP and s b h (10 + 24 / t) without (2-byte elements, per token: 34 h / t),
    our no-recompute count less flash attention's statistics (their attention is unfused: its
    s^2 terms are what selective recompute drops and flash attention never keeps)."""
    shape = LayerShape(hidden, heads, heads, 4 * hidden)

    def ours(sp):
        return (layer_activation_bytes_per_token(shape, tp, sp, NONE, 2, gated_ffn=False,
                                                 dropout=True) - LSE_BYTES * heads / tp)

    assert ours(True) == pytest.approx(34 * hidden / tp, rel=1e-12)
    assert ours(False) == pytest.approx((10 + 24 / tp) * hidden, rel=1e-12)
    assert layer_activation_bytes_per_token(shape, tp, True, FULL) == 2 * hidden / tp


def test_megatron_lm_formula_for_other_ffn_widths():
    """Megatron-LM's theoretical_memory_usage.py: s b h (18 + 4 f / h) / t per layer (SP,
    selective), its FFN counted as two matrices at ffn_hidden_size: Llama 3 405B's f = 3.25 h
    at tp 8 is 31 h / 8."""
    h, f = 16384, 53248
    shape = LayerShape(h, 128, 128, f)
    ours = (layer_activation_bytes_per_token(shape, 8, True, NONE, gated_ffn=False, dropout=True)
            - LSE_BYTES * 128 / 8)
    assert ours == (18 + 4 * f / h) * h / 8 == 63488


# Llama 3 405B at tp 8 with SP, bytes per token of one layer: 4 residual rows 4 x 16384 x 2 / 8
# = 16384; Q, O (128 heads) and K, V (8 KV heads) of 128: (256 + 16) x 128 x 2 / 8 = 8704; SwiGLU
# 3 x 53248 x 2 / 8 = 39936; flash attention's statistics 4 x 128 / 8 = 64. (The profile's, our
# own engine's bytes, were 135,745: 2.09x.)
LLAMA_TP8_NONE = 16384 + 8704 + 39936 + 64


@pytest.mark.parametrize("cp,dp,seq", [(1, 128, 8192), (16, 8, 131072)])
def test_llama3_405b_first_stage_activations(cp, dp, seq):
    """TP8 PP16 (v2, interleaved, 16 micro-batches of 1) at 8K and at 128K over CP16: the first
    stage holds all 32 of its chunks' forwards (Megatron's warm-up covers them all), i.e. 16
    micro-batches of its 8 layers, each of s / cp = 8192 tokens, and their token ids."""
    model = ModelCost.from_dict(shaped_like("llama3_405b", tps=(8,)))
    hardware = HardwareModel.from_dict(synthetic_hardware(16384 // 8, 8))
    parts = (8,) * 15 + (6,)
    layout = ParallelLayout(world_size=16384, pp=16, tp=8, dp=dp, cp=cp, zero=1,
                            sequence_parallel=True, num_micro_batches=16,
                            schedule="interleaved", virtual_stages=2, layers_per_stage=parts,
                            recompute=tuple(("none", 0) for _ in parts))
    pred = evaluate(layout, model, hardware, seq, options=CostOptions(engine="megatron"))
    assert pred.memory_bytes[0]["activations"] == 16 * 8192 * (8 * LLAMA_TP8_NONE + 8)


def _walked_peak_layers(order, chunks):
    """Most layers' activations a stage running `order` holds at once, chunk c holding
    chunks[c] layers of each micro-batch in flight (planner/schedule._peak_in_flight's walk)."""
    live = peak = 0
    for op, chunk, _ in order:
        live += chunks[chunk] if op == "F" else -chunks[chunk]
        peak = max(peak, live)
    return peak


def test_llama3_405b_short_end_chunks_held_as_megatron_runs_them():
    """TP8 PP16 DP64, 32 micro-batches, v2, Llama 3's [7, 8 x 14, 7]: the first stage runs
    chunks of 3 and 4 layers, the last 4 and 3 (layout.stage_chunks), and holds what Megatron's
    schedule (stage_order, its warm-up and rounds) keeps of each chunk at its peak: 157 layers'
    worth on the first stage (31 chunks of 3, 16 of 4), not 23.5 x 8 = 188 as if its short
    chunk were full; 180 on the second (45 chunks of 4), the most of any stage."""
    from orchestrator.planner.schedule import in_flight_micro_batches, stage_order
    from orchestrator.planner.terms.megatron_memory import loss_activation_bytes_per_token

    model = ModelCost.from_dict(shaped_like("llama3_405b", tps=(8,)))
    hardware = HardwareModel.from_dict(synthetic_hardware(8192 // 8, 8))
    parts = (7,) + (8,) * 14 + (7,)
    layout = ParallelLayout(world_size=8192, pp=16, tp=8, dp=64, zero=1,
                            sequence_parallel=True, num_micro_batches=32,
                            schedule="interleaved", virtual_stages=2, layers_per_stage=parts,
                            recompute=tuple(("none", 0) for _ in parts))
    pred = evaluate(layout, model, hardware, 8192, options=CostOptions(engine="megatron"))
    in_flight = in_flight_micro_batches("interleaved", 16, 32, 2)
    loss = 8192 * loss_activation_bytes_per_token(model.hidden, model.vocab, 8, True)
    peaks = {}
    for stage, chunks in ((0, (3, 4)), (1, (4, 4)), (15, (4, 3))):
        peaks[stage] = _walked_peak_layers(stage_order(16, stage, 32, "interleaved", 2), chunks)
        ids = 8 * in_flight[stage] if stage == 0 else 0.0  # the embedding's token ids
        expected = 8192 * (peaks[stage] * LLAMA_TP8_NONE + ids) + (loss if stage == 15 else 0)
        assert pred.memory_bytes[stage]["activations"] == pytest.approx(expected, rel=1e-12)
    assert (peaks[0], peaks[1]) == (157, 180)
    acts = [mem["activations"] for mem in pred.memory_bytes]
    assert max(range(16), key=acts.__getitem__) == 1


@pytest.mark.parametrize("first_rc,last_rc", [(("none", 0), ("none", 0)),
                                              (("full", 2), ("full", 3)),
                                              (("selective", 3), ("full", 2))])
def test_short_end_chunks_with_recompute_held_as_the_schedule_walks_them(first_rc, last_rc):
    """p 4, v 2, 8 micro-batches, [3, 4, 4, 3]: chunks [1, 2] and [2, 1] on the end stages.
    Full recompute of k layers is r of each chunk, all of a shorter one (k 2: r 1 on [1, 2];
    k 3: r 2 on [2, 1]); each end stage's activations are the walked peak of its chunks' own
    bytes plus the layer being recomputed."""
    from orchestrator.planner.schedule import stage_order

    model = ModelCost.from_dict(synthetic_model("tiny", layers=14))
    hardware = HardwareModel.from_dict(synthetic_hardware(1, 4))
    parts = (3, 4, 4, 3)
    layout = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=8,
                            schedule="interleaved", virtual_stages=2, layers_per_stage=parts,
                            recompute=(first_rc, ("none", 0), ("none", 0), last_rc))
    options = CostOptions(engine="megatron")
    pred = evaluate(layout, model, hardware, 512, options=options)
    costs = StageCosts(ConfigKey.of(layout), model, hardware, 512, options)
    act, tokens = costs.act, costs.tokens
    for stage, chunks, (mode, k) in ((0, (1, 2), first_rc), (3, (2, 1), last_rc)):
        r = {2: 1, 3: 2}.get(k, 0)
        kept = [(act.selective * size if mode == "selective" else
                 act.full * min(r, size) + act.none * (size - min(r, size))) * tokens
                for size in chunks]
        live = peak = 0.0
        for op, chunk, _ in stage_order(4, stage, 8, "interleaved", 2):
            live += kept[chunk] if op == "F" else -kept[chunk]
            peak = max(peak, live)
        working = {"none": 0.0, "selective": act.none - act.selective,
                   "full": act.none - act.full}[mode] * tokens
        extra = (costs.in_flight[0] * costs.first_stage_act[0] if stage == 0
                 else costs.other_act[3])
        assert pred.memory_bytes[stage]["activations"] == pytest.approx(peak + working + extra,
                                                                        rel=1e-12)
