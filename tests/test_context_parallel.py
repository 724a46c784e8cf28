"""Context parallelism's pieces: the load-balanced split, attention over the ring and over an
all-gathered sequence against one process's causal attention on real gloo ranks, the planner's
pricing (both engines), search, exports and stage=train. The engine's CP layouts train in
test_train_engine's matrix (losses, messages and memory against the workload model)."""
from __future__ import annotations

import pytest
import torch

from orchestrator.models.context_parallel import chunk_positions
from conftest import one_error_line, run_cli, spawn_ranks

SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 32, 2, 4, 2, 8


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_split_covers_every_token_once_and_balances_the_causal_work(cp):
    per_rank = [chunk_positions(SEQ, cp, r) for r in range(cp)]
    assert sorted(torch.cat(per_rank).tolist()) == list(range(SEQ))
    assert all(len(p) == SEQ // cp for p in per_rank)
    # A query at position i attends to i + 1 keys: every rank gets the same number of pairs.
    work = {int((p + 1).sum()) for p in per_rank}
    assert len(work) == 1


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"seq_len\(30\) % \(2 \* cp\(4\)\) != 0"):
        chunk_positions(30, 4, 0)


def _whole_sequence():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64)
            for _ in range(2))
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v, grad_out


# (flavour, bytes of one score tile): the ring in one tile per block and a row per tile; a2a
# (Ulysses) over CP groups of 2 (ranks 0, 1 and 2, 3): tp x cp must divide the 2 KV heads;
# a2a+p2p over all 4: Ulysses inside those pairs, the ring over them (ranks 0, 2 and 1, 3)
FLAVOURS = [("p2p", 1 << 26), ("p2p", 1), ("allgather", 1 << 26), ("a2a", 1 << 26),
            ("a2a+p2p", 1)]


def _cp_ranks(rank, out):
    """One launch of 4 gloo ranks: each flavour's attention on this rank's share."""
    import torch.distributed as dist

    from orchestrator.models.context_parallel import ContextParallel

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for comm, tile_bytes in FLAVOURS:
        group = pairs[rank // 2] if comm == "a2a" else dist.group.WORLD
        context = ContextParallel(group, comm, score_tile_bytes=tile_bytes,
                                  levels=(pairs[rank // 2], rings[rank % 2]))
        q, k, v, grad_out = _whole_sequence()
        mine = [context.split(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
        y = context.attention(*mine)
        y.backward(context.split(grad_out, dim=2))
        out[comm, tile_bytes, rank] = {"positions": context.positions(SEQ), "y": y.detach(),
                                       "grads": [t.grad for t in mine]}


@pytest.fixture(scope="module")
def cp_ranks():
    return spawn_ranks(_cp_ranks, 4)


@pytest.mark.parametrize("comm,tile_bytes", FLAVOURS)
def test_cp_attention_equals_one_process_causal_attention(cp_ranks, comm, tile_bytes):
    """4 CP ranks (2 for a2a), GQA heads: each rank's output and its q, k, v gradients are the
    one-process attention's at its positions (float64, to 1e-12), around the ring (its blocks
    merged by log-sum-exp, whole or a query row at a time), over the gathered sequence and over
    the whole sequence with a share of the heads (Ulysses), and both (Ulysses inside pairs of
    ranks, the ring over the pairs)."""
    q, k, v, grad_out = _whole_sequence()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    y = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True,
                                                         enable_gqa=True)
    y.backward(grad_out)
    for rank in range(4):
        got = cp_ranks[comm, tile_bytes, rank]
        index = got["positions"]
        assert torch.allclose(got["y"], y.detach().index_select(2, index), rtol=0, atol=1e-12)
        for name, mine, ref in zip("qkv", got["grads"], whole):
            assert torch.allclose(mine, ref.grad.index_select(2, index), rtol=0,
                                  atol=1e-12), f"d{name} on rank {rank}"


# ---------------------------------------------------------------- planner (Megatron-LM's CP)
def _planner_inputs():
    from planner_fixtures import synthetic_hardware, synthetic_model

    from orchestrator.planner.hardware_model import HardwareModel

    from orchestrator.planner.model_cost import ModelCost
    model = ModelCost.from_dict(synthetic_model(layers=8, seq_len=8192, tps=(1, 2)))
    return model, HardwareModel.from_dict(synthetic_hardware(2, 8))


def _options():
    from orchestrator.planner.cost_model import CostOptions

    return CostOptions(engine="megatron")


def test_cp_splits_each_rank_compute_and_activations_and_prices_its_ring():
    """cp2 x dp4 against dp8 on the same 8 ranks and batch: each rank does as much work (half
    of each of twice the micro-batches, each call's own cost paid twice as often), holds half
    the activations of one micro-batch, and pays a ring the dp layout does not."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner.prediction import evaluate

    model, hw = _planner_inputs()
    dp8 = ParallelLayout.uniform(8, 1, 1, 8, num_micro_batches=2)
    cp2 = ParallelLayout.uniform(8, 1, 1, 8, cp=2, num_micro_batches=4)
    assert dp8.global_batch_size == cp2.global_batch_size == 16
    a, b = (evaluate(lay, model, hw, 8192, options=_options()) for lay in (dp8, cp2))
    # the per-sequence work is the same; each of the 2 more calls pays the fits' constants once
    # (block fwd 20 + bwd 40 us on each of 8 layers, other 20 + 40)
    calls = 8 * (20.0 + 40.0) + 20.0 + 40.0
    assert b.breakdown_us["compute"] == pytest.approx(a.breakdown_us["compute"] + 2 * calls,
                                                      rel=1e-12)
    assert a.breakdown_us["cp_comm"] == 0 and b.breakdown_us["cp_comm"] > 0
    assert b.memory_bytes[0]["activations"] == pytest.approx(
        a.memory_bytes[0]["activations"] / 2, rel=1e-12)
    assert sum(b.breakdown_us.values()) == pytest.approx(b.iteration_time_us, rel=1e-9)


def test_the_ring_hides_under_attention_until_its_sends_take_longer():
    from orchestrator.choices import CpComm as Flavour
    from orchestrator.planner.terms.cp_comm import ATTENTION_BWD_OVER_FWD, CpComm
    from orchestrator.workload.comm import cp_messages

    _, hw = _planner_inputs()  # 8 ranks a node
    # a rank's K and V: 4096 tokens x 1 KV head of 64 x bf16, twice: 1 MiB a hop
    ring = cp_messages(Flavour.p2p, 4, 1, 4096, 1, 1, 64, 1, "bf16")
    hop = hw.p2p_time_us(1 << 20, True, 2)
    slow = CpComm.from_hardware(hw, ring, 4, 1, 1, attention_fwd_us=0.0, overlap_coe=1.0)
    # forward cp - 1 hops; backward the K/V blocks again and their gradients: 2cp - 1 (issue 40)
    assert (slow.layer.fwd_us, slow.layer.bwd_us) == pytest.approx((3 * hop, 7 * hop))
    hidden = CpComm.from_hardware(hw, ring, 4, 1, 1, attention_fwd_us=1e6, overlap_coe=1.0)
    assert (hidden.layer.fwd_us, hidden.layer.bwd_us) == (0.0, 0.0)
    # across nodes (tp 4 x cp 4 > 8 ranks a node) the same message takes the inter-node link
    far = CpComm.from_hardware(hw, ring, 4, 1, 4, 0.0, overlap_coe=1.0)
    assert far.hop_us > slow.hop_us == pytest.approx(hop)
    assert ATTENTION_BWD_OVER_FWD > 1


def test_gradients_reduce_and_zero_shards_over_dp_times_cp():
    """cp2 x dp2 holds 4 replicas of the weights, as dp4 does: the same states per rank under
    ZeRO-1 and the same gradient sync."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner.cost_model import ConfigKey, StageCosts

    model, hw = _planner_inputs()
    dp4 = ParallelLayout.uniform(4, 1, 1, 8, zero=1, num_micro_batches=2)
    cp2 = ParallelLayout.uniform(4, 1, 1, 8, zero=1, cp=2, num_micro_batches=4)
    a, b = (StageCosts(ConfigKey.of(lay), model, hw, 8192, _options()) for lay in (dp4, cp2))
    assert b.static_bytes(0, 8) == pytest.approx(a.static_bytes(0, 8))
    assert b.dp_sync_us(0, 8) == pytest.approx(a.dp_sync_us(0, 8))


def test_engines_and_sequences_that_cannot_take_cp_are_refused():
    from orchestrator.layout import LayoutError, ParallelLayout
    from orchestrator.planner.prediction import evaluate

    model, hw = _planner_inputs()
    cp2 = ParallelLayout.uniform(8, 1, 1, 8, cp=2, num_micro_batches=4)
    ulysses = ParallelLayout.uniform(8, 1, 1, 8, cp=2, cp_comm="a2a", num_micro_batches=4)
    # every flavour runs in both engines (models/context_parallel.py: the ring, the all-gather
    # and Ulysses' all-to-alls)
    assert evaluate(ulysses, model, hw, 8192).breakdown_us["cp_comm"] > 0
    with pytest.raises(LayoutError, match=r"seq_len\(8190\) % \(2 \* cp\(2\) \* tp\(1\)\)"):
        evaluate(cp2, model, hw, 8190, options=_options())


def test_search_splits_a_long_sequence_over_cp_in_the_flavours_the_engine_runs():
    """A long sequence on a tight budget: without CP only recompute fits; with max_cp both
    engines' picks use CP and are faster; the orchestrator engine's in a flavour it runs (its
    ring's memory is workload/memory.py's, checked against real steps in test_train_engine)."""
    import dataclasses

    from orchestrator.planner.search import SearchSpace, enumerate_configs, search

    model, hw = _planner_inputs()
    space = SearchSpace(world_size=16, memory_budget_bytes=2 * (1 << 30), global_batch_size=4,
                        seq_len=65536, options=_options(), max_tp=2)
    without = search(model, hw, space)
    with_cp = search(model, hw, dataclasses.replace(space, max_cp=8))
    assert without.best.cp == 1
    assert with_cp.best.cp > 1
    assert with_cp.prediction.iteration_time_us < without.prediction.iteration_time_us
    orchestrator = dataclasses.replace(_options(), engine="orchestrator")
    # torch's pipeline schedules need m >= pp: at 4 sequences every cp=1 layout of 16 ranks
    # (tp <= 2, so pp >= 2) has fewer micro-batches than stages; 8 sequences run
    space = dataclasses.replace(space, global_batch_size=8)
    ours_without = search(model, hw, dataclasses.replace(space, options=orchestrator))
    ours = search(model, hw, dataclasses.replace(space, max_cp=8, options=orchestrator))
    assert ours_without.best.cp == 1
    assert ours.best.cp > 1 and ours.best.cp_comm in ("p2p", "a2a")
    assert ours.prediction.iteration_time_us < ours_without.prediction.iteration_time_us
    # the engine runs every flavour: Ulysses is offered to it as to Megatron-LM
    offered = {c.cp_comm for c in enumerate_configs(
        model, hw, dataclasses.replace(space, max_cp=8, options=orchestrator), {})}
    assert offered == {"p2p", "a2a"}


def test_megatron_args_carry_cp_and_galvatron_takes_only_ulysses_without_tp():
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner.exports import ExportError, galvatron_strategy, megatron_args

    cp4 = ParallelLayout.uniform(16, 2, 1, 8, cp=4)
    args = megatron_args(cp4)
    assert args[args.index("--context-parallel-size") + 1] == "4"
    assert args[args.index("--cp-comm-type") + 1] == "p2p"
    assert "--context-parallel-size" not in megatron_args(ParallelLayout.uniform(16, 2, 1, 8))
    with pytest.raises(ExportError, match=r"cp\(4\) with cp_comm p2p.*no ring, all-gather"):
        galvatron_strategy(cp4, strict=False)
    with pytest.raises(ExportError, match=r"use_sp\) replaces TP.*tp\(2\)"):
        galvatron_strategy(ParallelLayout.uniform(16, 2, 1, 8, cp=4, cp_comm="a2a"))
    ulysses = galvatron_strategy(ParallelLayout.uniform(16, 1, 1, 8, cp=4, cp_comm="a2a"))
    assert ulysses["use_sp"] == ",".join(["1"] * 8) and ulysses["tp_sizes_enc"].startswith("4,")


def test_ulysses_all_to_alls_price_four_each_way_and_need_the_heads_to_split():
    """a2a: Q, K, V and the output through an all-to-all over the CP group (stride tp) forward
    and again backward, none hidden; kv_heads must divide over tp x cp."""
    from orchestrator.layout import LayoutError, ParallelLayout
    from orchestrator.planner.cost_model import ConfigKey, StageCosts
    from orchestrator.planner.prediction import evaluate

    model, hw = _planner_inputs()  # 8 heads, 8 KV heads, hidden 256
    a2a = ParallelLayout.uniform(8, 2, 1, 8, cp=4, cp_comm="a2a", num_micro_batches=4)
    costs = StageCosts(ConfigKey.of(a2a), model, hw, 8192, _options())
    tokens = 8192 / 4
    q = hw.collective_time_us("all2all", 4, 2, tokens * 8 / 2 * 32 * 2)  # bf16, head_dim 32
    assert costs.cp.layer.fwd_us == pytest.approx(4 * q)  # K, V as big as Q (no GQA here)
    assert costs.cp.layer.bwd_us == costs.cp.layer.fwd_us
    assert "cp4(a2a)" in a2a.describe()
    too_many = ParallelLayout.uniform(32, 2, 1, 8, cp=8, cp_comm="a2a", num_micro_batches=8)
    with pytest.raises(LayoutError, match=r"tp\(2\) \* cp\(8\) \(cp_comm a2a\) must divide "
                                          r"heads\(8\) and kv_heads\(8\)"):
        evaluate(too_many, model, hw, 8192, options=_options())


def test_the_all_gather_flavour_gathers_k_v_forward_and_reduce_scatters_their_gradients():
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner.cost_model import ConfigKey, StageCosts

    model, hw = _planner_inputs()
    layout = ParallelLayout.uniform(8, 2, 1, 8, cp=4, cp_comm="allgather", num_micro_batches=4)
    costs = StageCosts(ConfigKey.of(layout), model, hw, 8192, _options())
    # K and V of the whole sequence, 8 KV heads / tp, bf16: each its own collective, as the
    # engine runs them (workload/comm.py; issue 40: priced from its list)
    gathered = 8192 * 8 / 2 * 32 * 2
    assert costs.cp.layer.fwd_us == pytest.approx(
        2 * hw.collective_time_us("all_gather", 4, 2, gathered))
    assert costs.cp.layer.bwd_us == pytest.approx(
        2 * hw.collective_time_us("reduce_scatter", 4, 2, gathered))


def test_search_offers_a2a_only_where_the_heads_split():
    import dataclasses

    from orchestrator.planner.search import SearchSpace, enumerate_configs

    model, hw = _planner_inputs()
    space = SearchSpace(world_size=16, memory_budget_bytes=2 * (1 << 30), global_batch_size=4,
                        seq_len=65536, options=_options(), max_tp=2, max_cp=16)
    rejected = {}
    configs = enumerate_configs(model, hw, space, rejected)
    flavours = {(c.tp, c.cp, c.cp_comm) for c in configs}
    assert (1, 8, "a2a") in flavours and (2, 4, "a2a") in flavours
    assert (2, 8, "p2p") in flavours and (2, 8, "a2a") not in flavours  # 16 > 8 heads
    assert rejected["cp_a2a_splits_heads"] >= 1
    only_ring = enumerate_configs(model, hw, dataclasses.replace(space, cp_comms=("p2p",)), {})
    assert {c.cp_comm for c in only_ring} == {"p2p"}


def test_hierarchical_a2a_inside_ring_across_is_validated_priced_searched_and_exported():
    """a2a+p2p (Megatron's --hierarchical-context-parallel-sizes a cp/a): Ulysses over a
    consecutive CP ranks (stride tp), the ring over cp / a of those groups (stride tp x a);
    priced as the two added; searched at every all-to-all degree where tp x a splits the
    heads, in both engines; exported to Megatron, refused by Galvatron."""
    import dataclasses

    from orchestrator.layout import LayoutError, ParallelLayout
    from orchestrator.planner.cost_model import ConfigKey, StageCosts
    from orchestrator.planner.prediction import evaluate
    from orchestrator.planner.exports import ExportError, galvatron_strategy, megatron_args
    from orchestrator.planner.search import SearchSpace, enumerate_configs
    from orchestrator.choices import CpComm as Flavour
    from orchestrator.planner.terms import overlap_extra_us
    from orchestrator.planner.terms.cp_comm import ATTENTION_BWD_OVER_FWD, CpComm
    from orchestrator.workload.comm import cp_messages

    model, hw = _planner_inputs()  # 8 heads, 8 KV heads, hidden 256: head_dim 32, bf16
    layout = ParallelLayout.uniform(32, 2, 1, 8, cp=8, cp_comm="a2a+p2p", cp_a2a=2,
                                    num_micro_batches=4)
    assert "cp8(a2a2+p2p)" in layout.describe()
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert layout.group_ranks("cp_a2a", 2) == range(0, 4, 2)  # stride tp
    assert layout.group_ranks("cp_ring", 2) == range(2, 16, 4)  # stride tp x a
    for bad, match in (({"cp_a2a": 3}, r"1 < cp_a2a\(3\) < cp\(8\), dividing it"),
                       ({"cp_a2a": 8}, r"1 < cp_a2a\(8\) < cp\(8\)"),
                       ({"cp_comm": "p2p"}, r"cp_a2a\(2\) is the all-to-all degree of cp_comm "
                                            r"a2a\+p2p, not of cp_comm p2p")):
        with pytest.raises(LayoutError, match=match):
            dataclasses.replace(layout, **bad)
    costs = StageCosts(ConfigKey.of(layout), model, hw, 8192, _options())
    tokens = 8192 / 8
    attention_us = costs.compute.selective_recompute_us
    inner = CpComm.from_hardware(hw, cp_messages(Flavour.a2a, 2, 1, tokens, 8, 8, 32, 2, "bf16",
                                                 "megatron"), 2, 1, 2, attention_us,
                                 hw.overlap_coe)
    # the ring over the 4 pairs: each hop this rank's K and V (its tokens, 8 / tp KV heads of
    # 32, bf16) across nodes (tp 2 x cp 8 > 8 ranks a node), beside 3 / 4 of its attention
    hop = hw.p2p_time_us(2 * tokens * 4 * 32 * 2, False, 2)
    window_us = attention_us * 3 / 4
    ring = (overlap_extra_us(window_us, 3 * hop, hw.overlap_coe),
            overlap_extra_us(ATTENTION_BWD_OVER_FWD * window_us, 7 * hop, hw.overlap_coe))
    assert costs.cp.layer.fwd_us == pytest.approx(inner.layer.fwd_us + ring[0])
    assert costs.cp.layer.bwd_us == pytest.approx(inner.layer.bwd_us + ring[1])
    assert costs.cp.hop_us == pytest.approx(hop)
    assert inner.layer.fwd_us > 0 and ring[1] > 0
    # stage=train's engine runs it too (models/context_parallel.py)
    assert evaluate(layout, model, hw, 8192).breakdown_us["cp_comm"] > 0
    args = megatron_args(layout)
    assert args[args.index("--cp-comm-type") + 1] == "a2a+p2p"
    assert args[args.index("--hierarchical-context-parallel-sizes") + 1:][:2] == ["2", "4"]
    with pytest.raises(ExportError, match="hierarchical"):
        galvatron_strategy(layout)
    space = SearchSpace(world_size=32, memory_budget_bytes=2 * (1 << 30), global_batch_size=4,
                        seq_len=65536, options=_options(), max_tp=2, max_cp=16,
                        cp_comms=("a2a+p2p",))
    rejected = {}
    flavours = {(c.tp, c.cp, c.cp_a2a) for c in enumerate_configs(model, hw, space, rejected)
                if c.cp > 1}
    assert flavours == {(1, 4, 2), (1, 8, 2), (1, 8, 4), (1, 16, 2), (1, 16, 4), (1, 16, 8),
                        (2, 4, 2), (2, 8, 2), (2, 8, 4), (2, 16, 2), (2, 16, 4)}
    assert rejected["cp_a2a_splits_heads"] >= 1  # tp2 cp16 a8: 16 > 8 heads
    ours = dataclasses.replace(space, options=dataclasses.replace(_options(),
                                                                  engine="orchestrator"))
    # stage=train's engine: the same, less tp1 cp4 (dp x pp = 8 with dp | 4 sequences puts
    # fewer micro-batches than stages in every split, which torch's schedules refuse)
    assert flavours - {(1, 4, 2)} == {(c.tp, c.cp, c.cp_a2a)
                                      for c in enumerate_configs(model, hw, ours, {}) if c.cp > 1}


# ---------------------------------------------------------------- the engine
def test_train_cp_runs_from_the_cli_predicted_checkpoints_and_resumes(chain):
    """stage=train train.cp=2 train.tp=2 (TP+SP inside each CP rank, the ring) on the 4 local
    ranks, predicted from the cluster's profiles, then a rerun with more steps resumes from its
    checkpoint, which also reloads into a layout without CP; a cp that does not tile the ranks,
    Ulysses where tp x cp does not split the heads, the hierarchical flavour without its
    all-to-all degree and variable-length micro-batches are refused in one line before
    launch."""
    import json

    common = ("stage=train", "train.cp=2", "train.tp=2", "train.checkpoint_every=2",
              "train.plot=false")
    run_cli(*common, "train.steps=2", profiles_dir=chain, check=0)
    run_cli(*common, "train.steps=3", profiles_dir=chain, check=0)
    summary = json.loads((chain / "local" / "train" / "tiny" /
                          "pp1-tp2-cp2-dp1-zero0-sp-mbs1x8-1f1b.json").read_text())
    # the ranks' own lines reach the terminal, not always a captured stdout: the summary says it
    assert any(n.startswith("resumed from") and n.endswith(
        "(step 2, of a 2-step run: on to step 3 on this run's learning-rate schedule)")
        for n in summary["notes"]), summary["notes"]
    assert summary["layout"]["cp"] == 2 and summary["layout"]["cp_comm"] == "p2p"
    assert sorted(summary["losses"], key=int) == ["1", "2", "3"]
    assert summary["predicted"]["iteration_ms"] > 0
    # its step-2 checkpoint reloads without CP (tp2 dp2): step 3 trained from it, same loss
    folder = chain / "local" / "train" / "tiny"
    run_cli("stage=train", "train.tp=2", "train.steps=3", "train.plot=false",
            f"train.load={folder}/pp1-tp2-cp2-dp1-zero0-sp-mbs1x8-1f1b.ckpt/step_00000002",
            profiles_dir=chain, check=0)
    resharded = json.loads((folder / "pp1-tp2-dp2-zero0-sp-mbs1x4-1f1b.json").read_text())
    assert resharded["losses"]["3"] == pytest.approx(summary["losses"]["3"], rel=1e-4)
    bad = run_cli("stage=train", "train.cp=3", profiles_dir=chain)
    assert "train.cp(3)" in one_error_line(bad, 2)
    ulysses = run_cli("stage=train", "train.cp=2", "train.tp=2", "train.cp_comm=a2a",
                      profiles_dir=chain)
    assert "train.cp_comm=a2a: tp(2) * cp(2) (cp_comm a2a) must divide heads(4) and " \
        "kv_heads(2)" in one_error_line(ulysses, 2)
    hierarchical = run_cli("stage=train", "train.cp=4", "train.cp_comm=a2a+p2p",
                           profiles_dir=chain)
    assert "train.cp_comm=a2a+p2p needs train.cp_a2a" in one_error_line(hierarchical, 2)
    # train.microbatching=dynamic with cp 2 trains (test_train_microbatching.py)
