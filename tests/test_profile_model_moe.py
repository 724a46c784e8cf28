"""profile_model on mixture-of-experts models: the MoE FFN's parts timed and counted beside the
dense block, in the profile's "moe" section, and the accessor the planner prices them with."""
from __future__ import annotations

import pytest
import yaml

from conftest import ledger, run_cli
from orchestrator.choices import MoePart
from orchestrator.config import CONF_DIR
from orchestrator.models.config import ModelConfig, count_attention_params, expert_width
from orchestrator.profiling.model import moe
from orchestrator.profiling.model.moe_costs import moe_costs
from orchestrator.profiling.model.plan import MOE_PART, plan_profile
from orchestrator.store import read_profile
from orchestrator.store.schema import ModelProfile

# tiny_moe on 4 local ranks, small: two lengths, tp 1 and 2, two timed iterations.
SMALL_MOE = ["stage=profile_model", "model=tiny_moe", "profile_model.seq_lens=[64,128]",
             "profile_model.max_tp=2", "profile_model.iters=2", "profile_model.warmup_iters=1",
             "profile_model.plot=false"]


def _model(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load(open(CONF_DIR / "model" / f"{name}.yaml")))


def _profile(profiles, name: str) -> ModelProfile:
    return read_profile(profiles / "local" / "model" / f"{name}.json", ModelProfile,
                        f"python -m orchestrator stage=profile_model model={name}")


def _compose(overrides=()):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orchestrator.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(
            compose(config_name="config", overrides=["stage=profile_model", *overrides]))


def test_tiny_moe_measured_profile_has_the_moe_parts_beside_a_dense_block(profiles):
    run_cli(*SMALL_MOE, profiles_dir=profiles, check=0)
    prof = _profile(profiles, "tiny_moe")
    cfg = _model("tiny_moe")
    assert prof.source == "measured"
    assert prof.model.experts == 8 and prof.model.top_k == 2 and prof.model.dense_layers == 1
    # the points time the dense block: attention + the SwiGLU of model.ffn, all on one rank
    block = prof.memory[1].block
    assert block.param_bytes == 4 * (count_attention_params(cfg) + 3 * cfg.hidden * cfg.ffn)
    m = prof.moe
    assert m is not None and m.source == "measured" and m.kernel == "loop"
    assert m.block == "dense" and m.experts_timed == 8
    assert sorted(m.experts) == [1, 2] and sorted(m.mlp) == [1, 2] and sorted(m.shared) == [1, 2]
    assert m.routing.tokens == [32, 64, 128]  # batch x seq / tp over the points
    assert m.experts[1].tokens == moe.expert_token_sweep(cfg, 128, 1) == [1, 4, 16, 64, 256]
    for p in m.points:
        assert p.source == "measured" and p.fwd_us > 0 and p.bwd_us > 0 and p.act_bytes > 0
        assert p.extras["groups"] == 4  # every rank timed, the ranks' median kept
    for fit in [m.routing, *m.experts.values(), *m.shared.values(), *m.mlp.values()]:
        assert all(c >= 0 for c in fit.fwd_us + fit.bwd_us)
    # activations per token copy of one expert: its input and four (tokens, width / etp)
    # intermediates (gate, silu, up, their product), fp32
    w = expert_width(cfg)
    for etp in (1, 2):
        assert m.experts[etp].act_bytes[1] == pytest.approx(4 * (cfg.hidden + 4 * w / etp))
    entries = ledger(profiles)
    assert entries[f"profile_model/tiny_moe/{MOE_PART}"]["state"] == "done"
    costs = moe_costs(prof)
    assert costs.expert_us(256) > costs.expert_us(1) > 0


def test_expert_time_grows_with_the_tokens_per_expert():
    import torch

    cfg = _model("tiny_moe")
    cases = [(MoePart.experts, n, 1) for n in (4, 4096)]
    # one thread, as a rank sharing this machine's cores runs (runtime.cpu_threads): the
    # backward's gradient add (train's accumulation) is multi-threaded, and two threads of
    # this process beside other tests' ranks stretched it to ~15 ms an iteration
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small, large = moe.measure_cases(cfg, cases, "cpu", warmup_iters=1, iters=3)
    finally:
        torch.set_num_threads(threads)
    # 1024x the GEMM work: even a busy CPU's noise cannot hide it
    assert large["fwd_us"] > 5 * small["fwd_us"]
    assert large["bwd_us"] > 5 * small["bwd_us"]
    assert large["act_bytes"] == pytest.approx(1024 * small["act_bytes"])


@pytest.mark.parametrize("part", list(MoePart))
def test_each_timed_moe_part_backward_runs_trains_gradient_accumulation(monkeypatch, part):
    """A part's timed backward adds the gradients it made into fp32 buffers, as train's
    buckets do each micro-batch (timing.MainGrads, as the points'): an expert's weights are
    added whatever its tokens, once per iteration."""
    from orchestrator.profiling.model import timing

    added = []
    original = timing.MainGrads.add

    def add(self):
        added.append(sum(p.grad is not None for p in self.buffers))
        original(self)
    monkeypatch.setattr(timing.MainGrads, "add", add)
    module = moe.build_part(_model("tiny_moe"), part, 1, "cpu")
    moe.time_case(_model("tiny_moe"), (part, 8, 1), "cpu", warmup_iters=1, iters=2,
                  module=module)
    params = sum(p.requires_grad for p in module.parameters())
    assert params > 0 and added == [params] * 3


def test_analytic_expert_flops_are_the_hand_count_and_time_is_each_gemm_on_the_sheet():
    """Each GEMM of a case at the sheet's curve for its own FLOPs (issue 41: a small expert's
    GEMMs run below a large one's rate), the other ops' bytes at hbm_GBps; a sheet with one
    efficiency prices FLOPs at it and routing's bytes at hbm_GBps, as before."""
    from orchestrator.device import OpCost, dense_peak_flops, load_device_sheet, op_us, peak_flops

    cfg = _model("qwen3_30b_a3b")
    h, w = cfg.hidden, expert_width(cfg)
    sheet = load_device_sheet("h100")
    hbm = sheet["hbm_GBps"] * 1e3  # bytes per us
    rates = {}
    for n, etp in ((128, 1), (2048, 4), (8192, 1)):
        counts = moe.count_case(cfg, MoePart.experts, n, etp)
        # per expert: three GEMMs of n x h x (w / etp), 2 FLOPs per multiply-add; backward twice
        assert counts["fwd"] == 2 * n * 3 * h * (w // etp)
        assert counts["bwd"] == 2 * counts["fwd"]
        assert counts["fwd"] + counts["bwd"] == 6 * n * 3 * h * (w // etp)
        record = moe.analytic_case(cfg, (MoePart.experts, n, etp), sheet)
        per_gemm = 2.0 * n * h * (w // etp)
        gemm_us = op_us(sheet, OpCost("gemm", per_gemm, 2.0 * (n * h + h * w // etp
                                                               + n * w // etp)))
        assert record["fwd_us"] == pytest.approx(3 * gemm_us + counts["fwd_bytes"] / hbm)
        rates[n] = counts["fwd"] / record["fwd_us"] / 1e6 / dense_peak_flops(sheet, "bf16")
    assert rates[128] < rates[8192] < sheet["efficiency"]["gemm"]["max"]
    # routing: the router GEMM (n x h x experts) and the bytes its other ops move
    route = moe.count_case(cfg, MoePart.routing, 1024, 1)
    assert route["fwd"] == 2 * 1024 * h * cfg.experts
    cpu = {**load_device_sheet("cpu"), "hbm_GBps": 100.0}  # one efficiency, with an HBM
    record = moe.analytic_case(cfg, (MoePart.routing, 1024, 1), cpu)
    assert record["fwd_us"] == pytest.approx(route["fwd"] / peak_flops(cpu, "bf16") * 1e6
                                             + route["fwd_bytes"] / (100.0 * 1e3))


def test_published_moe_shape_profiles_analytic_with_a_moe_section(profiles):
    run_cli("stage=profile_model", "model=qwen3_30b_a3b", "profile_model.max_tp=2",
            "profile_model.seq_lens=[1024,4096]", "profile_model.plot=false",
            profiles_dir=profiles, check=0)
    prof = _profile(profiles, "qwen3_30b_a3b")
    cfg = _model("qwen3_30b_a3b")
    assert prof.source == "analytic"
    m = prof.moe
    assert m.source == "analytic" and m.shared is None  # Qwen3 has no shared expert
    assert sorted(m.experts) == [1, 2]
    assert max(m.experts[1].tokens) == 4096 * cfg.top_k
    # the analytic fit is the FLOP rate exactly: no constant, 18 h w / etp FLOPs per token
    from orchestrator.device import load_device_sheet, peak_flops

    rate = peak_flops(load_device_sheet("cpu"), "bf16") / 1e6  # FLOPs per us
    for etp in (1, 2):
        fwd, bwd = m.experts[etp].fwd_us, m.experts[etp].bwd_us
        assert fwd[1] == pytest.approx(6 * cfg.hidden * expert_width(cfg) / etp / rate)
        assert bwd[1] == pytest.approx(2 * fwd[1])
        assert fwd[0] == pytest.approx(0, abs=1e-6)
    costs = moe_costs(prof)
    assert costs.expert_us(512, 1) == pytest.approx(2 * costs.expert_us(256, 1))


def test_a_dense_model_has_no_moe_section_or_sub_part():
    cfg = _compose()  # model=tiny
    plan = plan_profile(cfg)
    assert plan.moe_cases == ()
    assert MOE_PART not in plan.subparts()
    assert moe.moe_cases(ModelConfig(), [128], [1], 1) == []
    dense = {"moe": None}
    assert moe_costs(dense) is None
    moe_plan = plan_profile(_compose(["model=tiny_moe"]))
    assert moe_plan.subparts()[-1] == MOE_PART and moe_plan.moe_cases


def _section(fits_by_etp, routing=(10.0, 0.5)):
    def fit(c0, c1, act):
        return {"fwd_us": [c0, c1], "bwd_us": [2 * c0, 2 * c1], "act_bytes": [0.0, act],
                "tokens": [8, 64, 512], "source": "measured"}

    return {"moe": {
        "kernel": "loop", "block": "dense", "experts_timed": 8, "source": "measured",
        "routing": fit(*routing, 300.0),
        "experts": {str(e): fit(c0, c1, act) for e, (c0, c1, act) in fits_by_etp.items()},
        "mlp": {"1": fit(5.0, 3.0, 1000.0), "2": fit(5.0, 1.5, 600.0)}}}


def test_moe_costs_interpolate_extrapolate_and_scale_unprofiled_splits():
    # etp 1: 20 us + 1 us/token; etp 2: half the per-token work; bytes 100 + 400 / etp
    costs = moe_costs(_section({1: (20.0, 1.0, 500.0), 2: (20.0, 0.5, 300.0)}))
    assert costs.etps == (1, 2)
    assert costs.expert_fwd_us(64) == pytest.approx(84.0)  # a profiled count
    assert costs.expert_fwd_us(100) == pytest.approx(120.0)  # between
    assert costs.expert_fwd_us(10_000) == pytest.approx(10_020.0)  # beyond the sweep
    assert costs.expert_bwd_us(100) == pytest.approx(240.0)
    assert costs.expert_us(100, 2) == pytest.approx(3 * (20 + 50))
    # etp 4 was not profiled: from etp 2, its per-token term halved again
    assert costs.expert_fwd_us(100, 4) == pytest.approx(20 + 25)
    assert costs.expert_act_bytes(10, 4) == pytest.approx(10 * (100 + 400 / 4))
    assert costs.routing_us(1000) == pytest.approx(3 * (10 + 500))
    assert costs.shared_fwd_us(100) == 0.0  # no shared expert
    fwd, bwd = costs.moe_block_delta_us(rank_tokens=64, gathered_tokens=64,
                                        tokens_per_expert=16, local_experts=4)
    assert fwd == pytest.approx((10 + 0.5 * 64) + 4 * (20 + 16) - (5 + 3 * 64))
    assert bwd == pytest.approx(2 * fwd)
