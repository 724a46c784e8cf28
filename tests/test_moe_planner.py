"""The planner's mixture-of-experts side: the workload's counts by hand, expert sharding in the
memory model, the search's expert grids and the engine's limits (pure functions, no launch)."""
from __future__ import annotations

import math

import pytest

import planner_fixtures as pf
from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, SearchSpace, evaluate, search
from orchestrator.planner.search import InfeasibleError, enumerate_configs
from orchestrator.workload import moe as wm
from orchestrator.workload.states import rank_states
from orchestrator.workload.params import block_parameters, is_expert

GiB = 2**30


def _shape(**kw) -> wm.MoeShape:
    base = dict(hidden=64, experts=8, top_k=2, width=32, layers=4)
    return wm.MoeShape(**{**base, **kw})


def _moe_config(**kw) -> ModelConfig:
    base = dict(name="moe", hidden=1024, ffn=4096, layers=8, heads=16, kv_heads=4, vocab=32000,
                seq_len=2048, dtype="bf16", experts=16, top_k=2, expert_ffn=2048)
    return ModelConfig(**{**base, **kw})


def _models(**kw):
    """(dense twin's ModelCost, the MoE model's) from the synthetic dense profile."""
    cfg = _moe_config(**kw)
    dense = ModelCost.from_dict(pf.synthetic_model(
        "moe", hidden=cfg.hidden, ffn=cfg.ffn, layers=cfg.layers, heads=cfg.heads,
        kv_heads=cfg.kv_heads, vocab=cfg.vocab, seq_len=cfg.seq_len))
    return dense, dense.with_moe(cfg)


def test_all_to_all_bytes_by_hand():
    shape = _shape()
    tokens = wm.tokens_per_rank(seq_len=128, micro_batch_size=2, tp=2, cp=1)
    assert tokens == 128  # 2 x 128 / 2
    # 128 tokens x top-2 x hidden 64 x 2 bytes; 3 of 4 EP ranks are others
    assert wm.a2a_buffer_bytes(tokens, shape, 2) == 128 * 2 * 64 * 2
    assert wm.a2a_sent_bytes(tokens, shape, 4, 2) == 128 * 2 * 64 * 2 * 3 / 4
    # the busiest rank receives 1.5x the mean
    assert wm.a2a_buffer_bytes(tokens, shape, 2, imbalance=1.5) == 1.5 * 128 * 2 * 64 * 2
    sizes = wm.dispatch_bytes(tokens, shape, ep=4, etp=1, elem_bytes=2)
    assert sizes.sent_fwd == sizes.sent_bwd == 2 * 128 * 2 * 64 * 2 * 3 / 4  # dispatch + combine
    assert sizes.etp == 0


def test_etp_gathers_the_received_tokens():
    shape = _shape()
    sizes = wm.dispatch_bytes(100, shape, ep=2, etp=2, elem_bytes=2)
    received = 100 * 2 * 64 * 2
    assert sizes.etp == 2 * received  # the all-gather's output over 2 ETP ranks
    assert sizes.sent_fwd == 2 * received / 2 + 2 * sizes.etp / 2


def test_capacity_factor_pads_every_expert_whatever_the_load():
    shape = _shape(capacity_factor=1.25)
    cap = math.ceil(100 * 2 / 8 * 1.25)
    assert wm.capacity(100, shape) == cap == 32
    assert wm.assignments_sent(100, shape) == 8 * 32
    assert wm.assignments_received(100, shape, imbalance=2.0) == 8 * 32
    assert wm.default_imbalance(shape) == 1.0


def test_default_imbalance_follows_the_aux_loss():
    assert wm.default_imbalance(_shape(aux_loss_coef=0.02)) == 1.1
    assert wm.default_imbalance(_shape(aux_loss_coef=0.001)) == 1.2
    assert wm.default_imbalance(_shape(aux_loss_coef=1e-4)) == 1.3


def test_expert_params_per_rank_and_the_block_parameter_list_agree():
    shape = _shape()
    # 8 experts / ep 4 = 2 experts of 3 x 64 x (32 / etp 2)
    assert wm.expert_params_per_rank(shape, ep=4, etp=2) == 2 * 3 * 64 * 16
    cfg = ModelConfig(name="m", hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=100,
                      experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=64)
    params = block_parameters(cfg, 0, tp=2, tp_rank=0, ep=4, etp=2)
    experts = sum(p.local_numel for p in params if is_expert(p))
    assert experts == wm.expert_params_per_rank(wm.MoeShape.of(cfg), 4, 2)
    assert sum(p.local_numel for p in params) == wm.moe_block_params_per_rank(cfg, 2, 4, 2)
    # grads reduced over edp: every MoE block's expert shard in fp32
    assert wm.expert_grad_sync_bytes(wm.MoeShape.of(cfg), 4, 2) == 2 * 4 * 2 * 3 * 64 * 16


def test_dense_blocks_keep_their_parameters():
    cfg = ModelConfig(name="m", hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=100,
                      experts=8, top_k=2, expert_ffn=32, dense_layers=1)
    dense = [p.name for p in block_parameters(cfg, 0, 1, 0)]
    assert "blocks.0.mlp.w_gate.weight" in dense and not any(".experts." in n for n in dense)
    assert any(".experts." in p.name for p in block_parameters(cfg, 1, 1, 0))


def test_expert_states_shard_over_edp():
    cfg = ModelConfig(name="m", hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=128,
                      seq_len=64, experts=8, top_k=2, expert_ffn=32)
    one = ParallelLayout.uniform(8, 1, 1, 2, zero=1, ep=1)
    four = ParallelLayout.uniform(8, 1, 1, 2, zero=1, ep=4)
    small, big = rank_states(cfg, four, 0), rank_states(cfg, one, 0)
    expert_numel = 2 * wm.expert_params_per_rank(wm.MoeShape.of(cfg), 1, 1)
    # fp32 parameters: 3/4 of the experts leave the rank
    assert big.params - small.params == 4 * expert_numel * 3 / 4


def test_zero3_search_prices_the_experts_states_as_the_engine_holds_them():
    """ZeRO-3 (FSDP2): the search's closed form holds rank_states' bytes (which
    tests/test_moe_train.py counts on real tensors): the routed experts shard over edp (ep 4
    of dp 16: 4 ranks), the rest over dp."""
    cfg = _moe_config()
    _, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    layout = ParallelLayout.uniform(16, 1, 1, 8, zero=3, ep=4, num_micro_batches=2)
    mem = evaluate(layout, moe, hw, 2048, options=CostOptions(engine="orchestrator")
                   ).memory_bytes[0]
    states = rank_states(cfg, layout, 0, dtype="bf16")
    assert mem["params"] + mem["grads"] + mem["optim"] + mem["comm_buffers"] == pytest.approx(
        states.total, rel=1e-3)


def test_memory_falls_with_expert_parallelism():
    _, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    peaks = []
    for engine in ("megatron", "orchestrator"):
        row = []
        for ep in (1, 2, 4, 16):
            layout = ParallelLayout.uniform(16, 1, 1, 8, zero=1, ep=ep, num_micro_batches=4)
            pred = evaluate(layout, moe, hw, 2048, options=CostOptions(engine=engine))
            row.append(pred.memory_bytes[0]["params"] + pred.memory_bytes[0]["optim"])
        peaks.append(row)
        assert row == sorted(row, reverse=True) and row[0] > row[-1], (engine, row)


def test_moe_block_costs_more_compute_with_more_experts_per_token():
    dense, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    layout = ParallelLayout.uniform(16, 1, 1, 8, ep=1, num_micro_batches=4)
    one = evaluate(layout, moe, hw, 2048).breakdown_us["compute"]
    _, four = _models(top_k=4)
    assert evaluate(layout, four, hw, 2048).breakdown_us["compute"] > one
    # a dense twin of the same shape prices no dispatcher
    assert "ep_comm" not in evaluate(layout.__class__.uniform(16, 1, 1, 8, num_micro_batches=4),
                                     dense, hw, 2048).breakdown_us


def test_dispatcher_is_priced_with_ep_and_only_then():
    _, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    at = {ep: evaluate(ParallelLayout.uniform(16, 1, 1, 8, ep=ep, num_micro_batches=4), moe, hw,
                       2048).breakdown_us["ep_comm"] for ep in (1, 8, 16)}
    assert at[1] == 0.0 < at[8] < at[16]  # ep 16 crosses the node


def test_all_to_all_across_nodes_is_slower_per_byte():
    hw = HardwareModel.from_dict(pf.synthetic_hardware(4, 8))
    _, inside = hw.all2all_line(8, 1)
    _, across = hw.all2all_line(16, 1)
    assert across > inside


def test_search_picks_expert_parallelism_when_the_experts_do_not_fit():
    _, moe = _models(experts=64, expert_ffn=4096)
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    layout = ParallelLayout.uniform(16, 1, 1, 8, zero=1, ep=1, num_micro_batches=4)
    budget = 0.6 * evaluate(layout, moe, hw, 2048, options=CostOptions(engine="megatron")
                            ).peak_memory_bytes
    space = SearchSpace(world_size=16, memory_budget_bytes=budget, global_batch_size=64,
                        seq_len=2048, max_pp=1, zero_stages=(0, 1),
                        options=CostOptions(engine="megatron"))
    result = search(moe, hw, space)
    assert result.best.ep > 1
    assert result.prediction.feasible


def test_search_refuses_ep_that_does_not_divide_the_experts():
    _, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    space = SearchSpace(world_size=16, memory_budget_bytes=80 * GiB, global_batch_size=64,
                        seq_len=2048, ep=3)
    with pytest.raises(InfeasibleError):
        search(moe, hw, space)
    with pytest.raises(LayoutError, match=r"experts\(16\).*ep\(32\)|ep\(32\)"):
        evaluate(ParallelLayout.uniform(32, 1, 1, 8, ep=32), moe,
                 HardwareModel.from_dict(pf.synthetic_hardware(4, 8)), 2048)


def test_orchestrator_engine_runs_cp_and_zero3_with_experts_but_not_zero3_with_etp():
    _, moe = _models()
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    for engine in ("orchestrator", "megatron"):
        space = SearchSpace(world_size=16, memory_budget_bytes=80 * GiB, global_batch_size=64,
                            seq_len=16384, max_cp=4, max_etp=2,
                            options=CostOptions(engine=engine))
        configs = enumerate_configs(moe, hw, space, {})
        assert any(c.ep > 1 for c in configs)
        assert any(c.cp > 1 and c.ep > 1 for c in configs)
        zero3 = [c for c in configs if c.zero == 3]
        if engine == "orchestrator":
            # stage=train's FSDP shards an expert split over one mesh dimension only
            assert any(c.ep > 1 for c in zero3) and not any(c.etp > 1 for c in zero3)
        else:  # Megatron's ZeRO 3 (--use-torch-fsdp2) runs with pp 1 and ep 1 only
            assert zero3 and all(c.pp == 1 and c.ep == 1 for c in zero3)
        # a MoE block under tensor parallelism needs sequence parallelism
        assert all(c.sequence_parallel for c in configs if c.tp > 1)
        if engine == "orchestrator":  # torch's pipeline schedules: a micro-batch per stage
            assert all(c.num_micro_batches >= c.pp for c in configs if c.pp > 1)


def test_dense_models_search_no_expert_grids():
    dense, _ = _models()
    assert dense.with_moe(ModelConfig(name="moe", hidden=1024, layers=8)) is dense
    hw = HardwareModel.from_dict(pf.synthetic_hardware(2, 8))
    space = SearchSpace(world_size=16, memory_budget_bytes=80 * GiB, global_batch_size=64,
                        seq_len=2048)
    assert {(c.ep, c.etp) for c in enumerate_configs(dense, hw, space, {})} == {(1, 1)}
