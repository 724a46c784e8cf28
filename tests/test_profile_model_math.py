"""profile_model's pieces without a launch: fits, activation counting, state bytes, the plan."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orchestrator.choices import Dtype, Recompute
from orchestrator.config import CONF_DIR, register_configs
from orchestrator.errors import ConfigError
from orchestrator.models.config import ModelConfig, count_block_params
from orchestrator.profiling.model import analytic as an
from orchestrator.profiling.model import memory as mem
from orchestrator.profiling.model.fit import (fit_activation_bytes, fit_block, fit_points,
                                              fit_poly_nonneg, predict_poly)
from orchestrator.profiling.model.plan import plan_profile
from orchestrator.profiling.model.runner import point_runner
from orchestrator.profiling.model.timing import build_point_model, memory_point


def _compose(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(
            compose(config_name="config", overrides=["stage=profile_model", *overrides]))


# ---------------------------------------------------------------- fits
def test_block_fit_extrapolates_a_quadratic_from_four_noisy_points():
    rng = np.random.default_rng(0)
    truth = [300.0, 2.0, 0.004]  # us: launch overhead, projections, attention
    seqs = [256, 512, 768, 1024]
    measured = [predict_poly(truth, s) * (1 + rng.uniform(-0.02, 0.02)) for s in seqs]
    coeffs, resid = fit_poly_nonneg(seqs, measured, 2)
    assert max(abs(r) for r in resid) < 0.03
    for s in (2048, 4096):
        assert predict_poly(coeffs, s) == pytest.approx(predict_poly(truth, s), rel=0.10)


def test_block_fit_uses_flops_when_noise_hides_the_attention_term():
    # tiny-like: dense work linear in s, attention s^2, 4% noise on four short lengths
    def flops(s):
        return 4e5 * s + 256.0 * s * s

    seqs = [256, 512, 768, 1024]
    noise = [1.04, 0.96, 1.04, 0.97]
    times = [(20 + flops(s) / 1e5) * n for s, n in zip(seqs, noise)]
    coeffs, _, model = fit_block(seqs, times, [flops(s) for s in seqs])
    assert model == "flops"
    for s in (2048, 4096):
        assert predict_poly(coeffs, s) == pytest.approx(20 + flops(s) / 1e5, rel=0.10)


def test_block_fit_on_exact_analytic_times_keeps_the_flop_model_and_is_exact():
    # Analytic times are FLOPs / rate: both candidates predict the longest length to round-off,
    # and the simpler FLOP model is kept (not whichever round-off happens to favour).
    def flops(s):
        return 4e5 * s + 256.0 * s * s

    seqs = [512, 1024, 2048, 4096]
    coeffs, resid, model = fit_block(seqs, [flops(s) / 1e5 for s in seqs], [flops(s) for s in seqs])
    assert model == "flops"
    assert max(abs(r) for r in resid) < 1e-12
    assert coeffs == pytest.approx([0.0, 4.0, 256.0 / 1e5], abs=1e-9)


def test_block_fit_of_two_lengths_keeps_the_attention_term_selective_recompute_reruns():
    # Two profiled lengths (the README's and the GPU check's): the FLOPs, f1 s + f2 s^2, split
    # exactly into dense and attention work; a line through the two points had no s^2 term,
    # so selective recompute (the attention core, priced from it) cost nothing.
    def flops(s):
        return 4e5 * s + 256.0 * s * s

    seqs = [64, 128]
    coeffs, resid, model = fit_block(seqs, [30 + flops(s) / 1e5 for s in seqs],
                                     [flops(s) for s in seqs])
    assert model == "flops" and max(abs(r) for r in resid) < 1e-9
    assert coeffs == pytest.approx([30.0, 4.0, 256.0 / 1e5], rel=1e-6)
    assert predict_poly(coeffs, 1024) == pytest.approx(30 + flops(1024) / 1e5, rel=1e-6)


def test_recompute_fits_what_each_mode_adds_to_the_block():
    # A CPU's points time the block's forward + backward under each recompute mode; the fit
    # is of what the mode adds, shaped as the forward's work, never below 1% of the forward.
    from orchestrator.profiling.model.fit import fit_recompute

    def flops(s):
        return 4e5 * s + 256.0 * s * s

    points = [{"seq_len": s, "block_fwd_us": 10 + flops(s) / 1e5,
               "block_bwd_us": 20 + 2 * flops(s) / 1e5,
               "block_full_us": 30 + 3 * flops(s) / 1e5 + 15 + 1.5 * flops(s) / 1e5,
               "block_selective_us": 30 + 3 * flops(s) / 1e5 - 1.0,  # noise: "faster"
               "flops": {"block_fwd": flops(s)}} for s in (64, 128)]
    fits = fit_recompute(points)
    for p in points:
        s = p["seq_len"]
        assert predict_poly(fits["full"], s) == pytest.approx(15 + 1.5 * flops(s) / 1e5)
        assert predict_poly(fits["selective"], s) == pytest.approx(0.01 * p["block_fwd_us"],
                                                                   rel=0.05)
    assert fit_recompute([{k: v for k, v in p.items() if k != "block_full_us"}
                          for p in points]) is None  # a point without: none (FLOPs price it)


def test_fit_never_goes_negative_on_noise():
    # Flat, noisy times: an unconstrained quadratic would bend down; the fit keeps c >= 0.
    coeffs, _ = fit_poly_nonneg([128, 256, 384, 512], [100.0, 97.0, 103.0, 96.0], 2)
    assert all(c >= 0 for c in coeffs)
    assert predict_poly(coeffs, 1_000_000) > 0


def test_fit_points_gives_the_schema_fields_per_tp():
    points = [{"seq_len": s, "tp": tp, "source": "measured",
               "block_fwd_us": (10 + 0.5 * s + 1e-3 * s * s) / tp,
               "block_bwd_us": (20 + 1.0 * s + 2e-3 * s * s) / tp,
               "other_fwd_us": 5 + 0.1 * s, "other_bwd_us": 8 + 0.2 * s}
              for tp in (1, 2) for s in (128, 256, 384, 512)]
    fits = fit_points(points)
    assert set(fits) == {"1", "2"}
    f = fits["2"]
    assert len(f["block_fwd_us"]) == 3 and len(f["other_bwd_us"]) == 2
    assert f["max_rel_err"] < 1e-6
    assert predict_poly(f["block_bwd_us"], 4096) == pytest.approx((20 + 4096 + 2e-3 * 4096**2) / 2)


def test_activation_fit_reproduces_linear_and_quadratic_growth():
    seqs = [128, 256, 512]
    assert predict_poly(fit_activation_bytes(seqs, [1000 * s for s in seqs]), 131072) == \
        pytest.approx(1000 * 131072)
    quad = [64 * s + 2 * s * s for s in seqs]
    assert predict_poly(fit_activation_bytes(seqs, quad), 4096) == pytest.approx(64 * 4096 + 2 * 4096**2)


# ---------------------------------------------------------------- activation counting
def _expected_tiny_block_bytes(cfg: ModelConfig, s: int) -> dict:
    """What one tiny block (fp32, flash attention on CPU) must keep, tensor by tensor.

    Read off the model's code: each RMSNorm keeps its input, 1/rms (s floats), the normalised
    tensor and its output (the projections' input); attention keeps rotated q, k and v, the
    output (the flash kernel's layout makes the reshape before wo a view: one storage) and
    logsumexp (heads x s floats); the SwiGLU MLP keeps gate, up and their product (w_down's
    input; models/gpt.SwiGLU recomputes silu(gate) in its backward, as Megatron's fused one).
    """
    h, f = cfg.hidden, cfg.ffn
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    norms = 2 * (3 * s * h + s)
    attention = s * h + 2 * s * kv + s * h + cfg.heads * s
    mlp = 3 * s * f
    elems = norms + attention + mlp
    lse = cfg.heads * s
    return {"none": 4 * elems, "selective": 4 * (elems - lse), "full": 4 * s * h}


@pytest.mark.parametrize("kernel", ["flash_attention_for_cpu", "flash_attention",
                                    "efficient_attention", "cudnn_attention"])
def test_gqa_attention_flops_count_every_query_head_on_every_kernel(kernel):
    """4 query heads over 1 K/V head cost what 4 full heads cost: 2 matmuls of b*hq*sq*sk*d
    forward, 2.5x that backward (the GPU image's torch 2.11 asserted on these shapes)."""
    b, hq, hkv, s, d = 2, 4, 1, 64, 16
    q, kv = (b, hq, s, d), (b, hkv, s, d)
    mapping = an._flop_mapping()
    fwd = mapping[getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}")]
    bwd = mapping[getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_backward")]
    assert fwd(q, kv, kv) == 2 * (2 * b * hq * s * s * d)
    assert bwd(q, q, kv, kv) == 5 * (2 * b * hq * s * s * d)


def test_saved_tensor_count_of_a_tiny_block_matches_its_tensors():
    cfg = ModelConfig()
    s = 64
    pm = build_point_model(cfg, s, 1, None, "cpu")
    got = memory_point(pm, s)["block_act_bytes"]
    assert got == _expected_tiny_block_bytes(cfg, s)


def test_fake_tensors_count_exactly_what_real_tensors_save():
    cfg = ModelConfig()
    real = memory_point(build_point_model(cfg, 96, 1, None, "cpu"), 96)
    fake = an.fake_tensors_mode()
    with fake:
        counted = memory_point(build_point_model(cfg, 96, 1, None, "cpu"), 96)
    assert counted == real


def test_selective_recompute_keeps_the_attention_inputs_and_gives_the_same_output():
    cfg = ModelConfig()
    pm = build_point_model(cfg, 32, 1, None, "cpu")
    cos, sin = pm.rope()
    x = pm.block_input(32)
    ref = pm.block(x, cos, sin)
    ref.sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    with mem.CheckpointAttention():
        y = pm.block(x, cos, sin)
    y.sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, ref_grad)


def test_gpu_kernel_count_keeps_norm_inputs_not_fp32_copies():
    cfg = ModelConfig(dtype="bfloat16")
    pm = build_point_model(cfg, 64, 1, None, "cpu")
    cpu = memory_point(pm, 64)["block_act_bytes"]["none"]
    gpu = memory_point(pm, 64, gpu_kernels=True)["block_act_bytes"]["none"]
    s, h = 64, cfg.hidden
    # per norm, CPU keeps an fp32 copy of the input and the fp32 normalised tensor (8 B), CUDA's
    # fused kernel the bf16 input (2 B): 6 B per element, twice per block
    assert cpu - gpu == 2 * 6 * s * h


# ---------------------------------------------------------------- states and formulas
def test_state_bytes_follow_mixed_precision_adam():
    cfg = ModelConfig(dtype="bfloat16")
    pm = build_point_model(cfg, 32, 1, None, "cpu")
    st = mem.state_bytes(pm.block.parameters())
    n = count_block_params(cfg)
    assert st == {"param_bytes": 2 * n, "grad_bytes": 4 * n, "optim_bytes": 12 * n, "numel": n}


def test_megatron_formula_terms():
    s, b, h, a = 2048, 1, 4096, 32
    assert mem.megatron_act_bytes(s, b, h, a, 1, "none") == s * b * h * (34 + 5 * a * s / h)
    assert mem.megatron_act_bytes(s, b, h, a, 8, "selective") == 34 * s * b * h / 8
    assert mem.megatron_act_bytes(s, b, h, a, 8, "full") == 2 * s * b * h / 8
    assert mem.megatron_act_bytes(s, b, h, a, 1, "full", elem_bytes=4) == 4 * s * b * h


# ---------------------------------------------------------------- planning
def test_default_plan_for_tiny_measures_on_cpu_with_the_tp_degrees_it_allows():
    plan = plan_profile(_compose())
    assert plan.source == "measured"
    assert plan.tps == (1, 2)  # tiny has 2 KV heads: tp=4 cannot split them
    assert plan.seq_lens[-1] == 256 and len(plan.seq_lens) >= 4


def test_big_model_without_gpu_is_analytic_and_runs_in_this_process():
    from orchestrator.stages.profile_model import STAGE

    cfg = _compose(["model=qwen_100b"])
    plan = plan_profile(cfg)
    assert plan.source == "analytic" and plan.tps == (1, 2, 4, 8)
    assert STAGE.plan(cfg).ranks == "one"
    assert plan.seq_lens[-1] == 131072


@pytest.mark.parametrize("overrides, words", [
    (["profile_model.max_tp=4"], "model.kv_heads(2) is not divisible by tp(4)"),
    (["profile_model.max_tp=8", "model.kv_heads=4"], "cluster's 4 ranks"),
    (["profile_model.seq_lens=[101]", "profile_model.max_tp=2"], "not divisible by tp(2)"),
    (["profile_model.device=tpu"], "available: a100, cpu, h100, h200"),
])
def test_invalid_settings_are_config_errors_before_launch(overrides, words):
    from orchestrator.stages.profile_model import STAGE

    with pytest.raises(ConfigError) as e:
        STAGE.plan(_compose(overrides))
    assert words in str(e.value)


def test_an_unknown_source_is_refused_before_hydra_composes():
    from orchestrator.cli import check_closed_choices

    with pytest.raises(ConfigError) as e:
        check_closed_choices(["stage=profile_model", "profile_model.source=guess"])
    assert "allowed: auto, measured, analytic" in str(e.value)


def test_analytic_memory_equals_measured_memory_on_the_same_kernels():
    """Shapes-only counting on a fake 2-rank TP group equals counting a real 1-rank run's
    quantities where they can be compared (tp=1), and shards states by tp exactly."""
    cfg = _compose(["profile_model.source=analytic", "profile_model.seq_lens=[64,128]",
                    "profile_model.max_tp=2"])
    plan = plan_profile(cfg)
    runner = point_runner(None, cfg, plan, plan.tps)
    records = {}
    for tp in plan.tps:
        with runner.for_tp(tp, 128):
            records[tp] = runner.point(128, tp)
    real = memory_point(build_point_model(ModelConfig(), 128, 1, None, "cpu"), 128)
    assert records[1]["block_act_bytes"] == real["block_act_bytes"]
    assert records[1]["source"] == "analytic"
    assert records[1]["flops"] == {k: 2 * v for k, v in records[2]["flops"].items()}
    # each record's Megatron comparison is its own block bytes over the formula
    for rec in records.values():
        assert rec["megatron_ratio"] == {m: rec["block_act_bytes"][m] / rec["megatron_act_bytes"][m]
                                         for m in Recompute}
    cfg_m = ModelConfig()
    n = count_block_params(cfg_m)
    norms = 2 * cfg_m.hidden
    assert records[2]["states"]["block"]["numel"] == (n - norms) // 2 + norms
    # full recompute keeps the sequence-parallel input shard only
    assert records[2]["block_act_bytes"]["full"] == 4 * 128 * cfg_m.hidden // 2
    assert records[1]["megatron_act_bytes"]["full"] == 4 * 128 * cfg_m.hidden  # fp32 input


def test_point_estimate_counts_fp32_activations_at_4_bytes():
    """The model's dtype is a Dtype ("fp32"): the estimate once looked up torch's names
    ("float32") and counted every dtype at 2 bytes."""
    from dataclasses import replace

    bf16 = ModelConfig(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=128,
                       seq_len=64, dtype="bf16")
    fp32 = replace(bf16, dtype="fp32")
    # states (18 B/param) and the fp32 logits do not depend on the dtype; the activations do
    diff = an.estimate_point_bytes(fp32, 64) - an.estimate_point_bytes(bf16, 64)
    h, g, f = 64, 2 / 4, 128 / 64
    per_elem = 64 * h * (24 + 4 * g + 8 * f) / 2 + 64 * 4 * h
    assert diff == pytest.approx(per_elem * (4 - 2))


def test_kernel_bytes_count_reads_and_writes_of_plain_in_place_and_foreach_ops():
    from orchestrator.profiling.model.optimizer_step import KernelBytes

    a, b = torch.ones(1000), torch.ones(1000)
    with KernelBytes() as plain:
        torch.add(a, b)  # reads 2, writes 1
    with KernelBytes() as in_place:
        a.mul_(2.0)  # reads 1, writes it back
    with KernelBytes() as foreach:
        torch._foreach_mul_([a, b], 2.0)  # returns nothing: reads 2, writes 2
    assert (plain.bytes, in_place.bytes, foreach.bytes) == (12000, 8000, 16000)


def test_the_profiled_backward_adds_gradients_into_fp32_as_train_does_and_frees_them():
    """Train adds each micro-batch's gradients into its fp32 buckets (train/grads.py); the
    profile's backward pays the same add (MainGrads): 10 bytes per bf16 parameter, the sum
    exact, the gradient freed."""
    from orchestrator.profiling.model.optimizer_step import KernelBytes
    from orchestrator.profiling.model.timing import MainGrads

    pm = build_point_model(ModelConfig(dtype="bf16"), 32, 1, None, "cpu")
    grads = MainGrads(pm.model.parameters())
    cos, sin = pm.rope()
    x = pm.block_input(32, torch.Generator().manual_seed(0))
    block = list(pm.block.parameters())
    seen = []
    for step in range(2):
        pm.block(x * (step + 1), cos, sin).float().square().sum().backward()
        seen.append([p.grad.float() for p in block])
        with KernelBytes() as counted:
            grads.add()
        assert counted.bytes == (4 + 2 + 4) * sum(p.numel() for p in block)
        assert all(p.grad is None for p in block)
    for p, first, second in zip(block, *seen):
        assert torch.equal(grads.buffers[p], (first + second).reshape(-1))
    assert not grads.buffers[pm.model.lm_head.weight].any()  # no gradient: nothing added


def test_each_timed_backward_runs_trains_gradient_accumulation(monkeypatch):
    """time_point's block and other backwards, each recompute mode's, and the GPU's queued
    calls (run here untimed) each add the gradients their backward made: the profile times
    what a micro-batch costs in train, gradient hooks included."""
    from orchestrator.profiling.model import host_device, timing

    pm = build_point_model(ModelConfig(), 32, 1, None, "cpu")
    names = {p: name.split(".")[0] for name, p in pm.model.named_parameters()}
    calls = []
    original = timing.MainGrads.add

    def add(self):
        calls.append(sorted({names[p] for p in self.buffers if p.grad is not None}))
        original(self)
    monkeypatch.setattr(timing.MainGrads, "add", add)
    block, other = ["blocks"], ["lm_head", "norm", "tok_emb"]
    timing.time_point(pm, 32, warmup_iters=1, iters=1)
    assert calls == [block, other] * 2
    calls.clear()
    timing.time_recompute(pm, 32, warmup_iters=0, iters=1)
    assert calls == [block] * len(timing.RECOMPUTE_KEYS)
    calls.clear()
    x = pm.block_input(32)
    tokens, targets = pm.tokens(32)
    host_device._host_device_once(pm, x, torch.randn_like(x), *pm.rope(), tokens, targets,
                                  host_device._Untimed, lambda: None,
                                  timing.MainGrads(pm.model.parameters()))
    assert calls == [block, other]


def test_analytic_optimizer_step_is_its_bytes_at_the_sheets_hbm_bandwidth():
    """A GPU sheet with hbm_GBps prices each part's step from its own parameters; a sheet
    without (cpu) prices none, as before."""
    from orchestrator.profiling.model.optimizer_step import optimizer_step_bytes_per_element
    from orchestrator.profiling.model.timing import local_numel

    us = {}
    for device in ("h100", "cpu"):
        cfg = _compose(["profile_model.source=analytic", "profile_model.seq_lens=[64,128]",
                        "profile_model.max_tp=1", f"profile_model.device={device}"])
        plan = plan_profile(cfg)
        runner = point_runner(None, cfg, plan, plan.tps)
        with runner.for_tp(1, 128):
            us[device] = runner.point(128, 1)
            pm = runner._pm
            numel = (local_numel(pm.block.parameters()), local_numel(pm.other_params()))
    per_us = optimizer_step_bytes_per_element(True) / (3350 * 1e3)  # h100: 3350 GB/s
    assert us["h100"]["block_optim_us"] == pytest.approx(numel[0] * per_us, rel=1e-12)
    assert us["h100"]["other_optim_us"] == pytest.approx(numel[1] * per_us, rel=1e-12)
    assert "block_optim_us" not in us["cpu"]
    # train's gradient add per micro-batch, apart (a measured backward holds it): the
    # gradient and the fp32 bucket read, the bucket written
    add_us = (Dtype.parse(cfg.model.dtype).bytes + 8) / (3350 * 1e3)
    assert us["h100"]["block_grad_add_us"] == pytest.approx(numel[0] * add_us, rel=1e-12)
    assert us["h100"]["other_grad_add_us"] == pytest.approx(numel[1] * add_us, rel=1e-12)
    assert "block_grad_add_us" not in us["cpu"]


def test_an_analytic_gradient_add_is_priced_for_trains_engine_not_megatrons():
    """stage=train's engine adds each micro-batch's gradients into fp32 buckets (a measured
    profile's backward holds it); Megatron fuses it into the weight-gradient GEMM: an analytic
    profile's add goes on each backward call for the one engine and not the other."""
    from types import SimpleNamespace

    from orchestrator.planner import ModelCost
    from orchestrator.planner.terms.compute import layer_compute
    from planner_fixtures import synthetic_model

    prof = synthetic_model("gpu", tps=(1,))
    prof["fits"]["1"].update(block_grad_add_us=120.0, other_grad_add_us=80.0)
    cost, plain = ModelCost.from_dict(prof), ModelCost.from_dict(synthetic_model("gpu", tps=(1,)))
    key = SimpleNamespace(tp=1, cp=1)
    for b in (1, 4):
        ours = layer_compute(cost, key, 1024, b, 1.0, 1.0, "orchestrator")
        megatron = layer_compute(cost, key, 1024, b, 1.0, 1.0, "megatron")
        measured = layer_compute(plain, key, 1024, b, 1.0, 1.0, "orchestrator")
        assert megatron == measured  # no add: as before
        assert ours.block.bwd_us == pytest.approx(megatron.block.bwd_us + 120.0)  # once a call
        assert ours.other.bwd_us == pytest.approx(megatron.other.bwd_us + 80.0)
        assert ours.block.fwd_us == megatron.block.fwd_us


# ---------------------------------------------------------------- per-op compute (issue 41)
def _model(name: str) -> ModelConfig:
    import yaml

    return ModelConfig(**yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text()))


def test_count_ops_files_each_gemm_and_the_flash_call_with_the_flop_counters_flops():
    """Per-op accounting: a block's forward runs q, k, v, o, gate, up and down (7 GEMMs) and one
    flash call, its backward two GEMMs per weight; their FLOPs add up to FlopCounterMode's."""
    cfg = ModelConfig(dtype="bfloat16")
    s = 64
    with an.fake_tensors_mode():
        pm = build_point_model(cfg, s, 1, None, "cpu")
        flops, ops = an.count_ops(pm, s)
    assert flops == an.count_flops(pm, s)
    for part, n_gemms in (("block_fwd", 7), ("block_bwd", 14)):
        p = ops[part]
        assert len(p.gemms) == n_gemms and len(p.attention) == 1
        attention_flops, keys, head_dim, _ = p.attention[0]
        assert (keys, head_dim) == (s, cfg.hidden // cfg.heads)
        gemm_flops = sum(2.0 * b * m * k * n for b, m, k, n, _ in p.gemms)
        assert gemm_flops + attention_flops == pytest.approx(flops[part], rel=1e-12)
        assert attention_flops == flops[f"attn{part[5:]}"]
        assert {elem for *_, elem in p.gemms} == {2}  # bf16
        assert p.other_bytes > 0  # norms, rotary, SwiGLU, residual adds
    # the LM head: (tokens, hidden) x (hidden, vocab) forward, dgrad and wgrad backward
    assert [g[1:4] for g in ops["other_fwd"].gemms] == [(s, cfg.hidden, cfg.vocab)]
    assert len(ops["other_bwd"].gemms) == 2


def test_a_tp_rank_runs_the_gemm_split_along_heads_ffn_or_vocabulary():
    tokens, hidden, ffn, tp = 4096, 1024, 3072, 4
    split = {  # tp=1 (batch, m, k, n) -> this rank's (m, k, n)
        (1, tokens, hidden, ffn): (tokens, hidden, ffn / tp),   # column-parallel forward
        (1, tokens, ffn, hidden): (tokens, ffn / tp, hidden),   # row-parallel forward
        (1, ffn, tokens, hidden): (ffn / tp, tokens, hidden),   # its weight gradient
        (1, tokens, hidden, hidden): (tokens, hidden, hidden / tp),  # q or o: same bytes
    }
    for (b, m, k, n), (m1, k1, n1) in split.items():
        flops, nbytes = an.sharded_gemm((b, m, k, n, 2), tokens, hidden, tp)
        assert flops == 2.0 * m1 * k1 * n1
        assert nbytes == 2 * (m1 * k1 + k1 * n1 + m1 * n1)
    assert an.sharded_gemm((1, tokens, hidden, ffn, 2), tokens, hidden, 1) == \
        (2.0 * tokens * hidden * ffn, 2.0 * (tokens * hidden + hidden * ffn + tokens * ffn))


def test_a_small_models_block_runs_below_a_large_ones_efficiency_on_the_h100_sheet():
    """Issue 41: at one constant (0.55) a GPT 1.7B block (tp1, seq 2048) and a Llama 3 405B
    block (tp8, seq 8192) both ran at 0.55 of peak; per op, small GEMMs, flash attention at head
    dim 96 and the memory-bound ops pull the small one down and the large GEMMs lift the big
    one, within the sheet's largest-GEMM ceiling."""
    sheet = an.load_device_sheet("h100")
    gpt = ModelConfig(name="gpt_1.7b", hidden=2304, ffn=9216, layers=24, heads=24, kv_heads=24,
                      vocab=50304, seq_len=2048, dtype="bf16")
    small = an.block_efficiency(gpt, 2048, 1, sheet)
    large = an.block_efficiency(_model("llama3_405b"), 8192, 8, sheet)
    assert small < 0.5 < 0.6 < large < sheet["efficiency"]["gemm"]["max"]


def test_a_sheet_with_one_efficiency_still_prices_every_flop_at_it():
    """Old sheets read as before: per-op counts or not, time = FLOPs / tp / (peak x eff)."""
    cpu = an.load_device_sheet("cpu")
    cfg = ModelConfig()
    with an.fake_tensors_mode():
        flops, ops = an.count_ops(build_point_model(cfg, 64, 1, None, "cpu"), 64)
    times = an.analytic_times_us(flops, 2, cpu, "fp32", ops, tokens=64, hidden=cfg.hidden)
    rate = 0.1e12 * 0.45 / 1e6  # the cpu sheet: fp32 0.1 TFLOP/s x 0.45, per us
    assert times == pytest.approx({f"{k}_us": flops[k] / 2 / rate for k in
                                   ("block_fwd", "block_bwd", "other_fwd", "other_bwd")})


def test_an_embedding_lookup_moves_the_rows_it_gathers_not_the_table():
    table = torch.empty(1_000_000, 64, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(10, dtype=torch.long, device="meta")
    with an.ops_mode() as mode:
        torch.nn.functional.embedding(ids, table)
    assert mode.bytes == 2 * 10 * 64 * 2 + 10 * 8
