"""Megatron-Core's memory as search.engine=megatron prices it (planner/terms/megatron_memory.py):
a layer counted by hand, Korthikanti's (Megatron-LM's own) formula where its assumptions hold, and
the Llama 3 405B layouts of the published runs (bench/megatron_memory.py checks the same against
Megatron-LM's theoretical_memory_usage.py and a megatron-core layer's saved tensors)."""
from __future__ import annotations

import pytest

from orchestrator.choices import Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
from orchestrator.planner.terms.megatron_memory import (LSE_BYTES, LayerShape,
                                                        layer_activation_bytes_per_token)

from planner_fixtures import shaped_like, synthetic_hardware

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
