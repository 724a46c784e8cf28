"""Mixture-of-experts training (models/moe.py, the engine's expert parallelism) on real gloo ranks.

- Every EP layout family on 4 ranks (pure dp, ep 2/4, etp, EP folded over TP ranks with
  sequence parallelism, a pipeline (1F1B and interleaved), ZeRO 1/2/3, full and selective
  recompute, context parallelism in three flavours) trains the same MoE model on the same data with the losses (and gradient norms
  and balance losses) of a single-process reference on the whole batch, to 1e-4.
- The MoE block by hand: top-k routing, renormalised weights, capacity, the sequence-wise aux
  loss, the dispatcher's all-to-all splits.
- The CLI: model=tiny_moe with train.ep trains, logs the balance loss and tokens per expert, a
  checkpoint written at ep 4 reloads at ep 2 x etp 2 and continues with the same losses; bad
  input (experts % ep, top_k > experts, capacity_factor <= 0, ep on a dense model) is one line,
  exit 2, before launch.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

from conftest import one_error_line, run_cli, spawn_ranks
from engine_matrix import GBS, WORLD_SIZE
from engine_matrix import MOE_LAYOUTS as LAYOUTS
from engine_matrix import MOE_MODEL as MODEL
from engine_matrix import moe_layout as _layout

STEPS = 3
LR = 5e-3
RECORDED_STEP = 1  # its collectives recorded (the first also sends pipeline metadata)


def _train(rank, out, layouts, world, mbs=1):
    from orchestrator.models.config import ModelConfig
    from orchestrator.trace.recorder import OpRecorder
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    data = make_data(None, model.vocab, model.seq_len, seed=0)
    for pp, tp, extra in layouts:
        layout = _layout(world, pp, tp, extra, mbs)
        engine = Engine(layout, model, torch.device("cpu"), seed=1)
        if layout.zero == 3:
            _count_held_at_step(engine, out, f"held {layout.describe()} rank {rank}")
        steps = []
        for step in range(STEPS):
            tokens, targets = data.rank_batch(step, engine.dp_rank, layout.dp, GBS // layout.dp)
            if step == RECORDED_STEP and layout.ep > 1:
                recorder = OpRecorder()
                with recorder:
                    stats = engine.train_step(tokens, targets, LR, 1.0)
                out[f"a2a {layout.describe()} rank {rank}"] = [
                    (r["group_size"], r["group_stride"], r["bytes"], r["dtype"])
                    for r in recorder.records if r.get("op") == "all_to_all"]
            else:
                stats = engine.train_step(tokens, targets, LR, 1.0)
            steps.append((stats.loss, stats.grad_norm, stats.aux_loss, stats.tokens_per_expert))
        if rank == 0:
            out[layout.describe()] = steps


def _count_held_at_step(engine, out, key) -> None:
    """Record under `key` the bytes reachable from the engine's optimizer at each step (the
    last step's stay): weights, gradient shards and moments (test_train_states' count)."""
    from test_train_states import _held_bytes

    optim, original = engine.optim, engine.optim.step

    def counted(*args, **kwargs):
        out[key] = _held_bytes(optim)
        return original(*args, **kwargs)
    optim.step = counted


@pytest.fixture(scope="module")
def trained():
    """The single-process reference (one micro-batch of the whole batch) and every layout."""
    reference = spawn_ranks(functools.partial(_train, layouts=[(1, 1, {})], world=1, mbs=GBS), 1)
    layouts = spawn_ranks(functools.partial(_train, layouts=LAYOUTS, world=WORLD_SIZE),
                          WORLD_SIZE)
    return next(iter(reference.values())), layouts


def test_every_ep_layout_trains(trained):
    _, layouts = trained
    assert sorted(k for k in layouts if not k.startswith(("a2a ", "held "))) == sorted(
        _layout(WORLD_SIZE, *layout).describe() for layout in LAYOUTS)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_losses_equal_the_single_process_reference(trained, index):
    """fp32, same seed, same data: experts split over ranks change where tokens are computed,
    not the loss, the gradient norm, the balance loss or where tokens went."""
    reference, layouts = trained
    describe = _layout(WORLD_SIZE, *LAYOUTS[index]).describe()
    got = layouts[describe]
    assert len(got) == len(reference) == STEPS
    for step, (want, have) in enumerate(zip(reference, got), start=1):
        for what, w, h in zip(("loss", "grad norm", "aux loss"), want[:3], have[:3]):
            assert abs(h - w) <= 1e-4 * abs(w), f"{describe} step {step} {what}: {h} != {w}"
        assert have[3] == want[3], f"{describe} step {step}: tokens per expert differ"
    assert got[-1][0] < got[0][0], f"{describe}: the loss did not fall"


@pytest.mark.parametrize("index", [i for i, (_, _, extra) in enumerate(LAYOUTS)
                                   if extra.get("ep", 1) > 1 and extra.get("cp_comm", "p2p")
                                   not in ("a2a", "a2a+p2p")])  # Ulysses' own all-to-alls
def test_dispatcher_all_to_alls_are_the_workload_models(trained, index):
    """Per MoE block and micro-batch each rank issues 5 all-to-alls over its EP group (ep
    ranks, stride etp): forward the counts (workload/moe.counts_bytes) and its tokens
    (dispatch_bytes' buffer: T x top_k x hidden, dropless), and the combine; backward the
    combine's gradient (T x top_k x hidden again) and the dispatch's; a block recomputed in
    full reruns the forward's 3. The combine and the dispatch's gradient carry what the rank
    received: routing decides their bytes, so only their count and group are the model's."""
    from orchestrator.models.config import ModelConfig
    from orchestrator.workload.moe import (MoeShape, counts_bytes, dispatch_bytes,
                                           tokens_per_rank)

    _, layouts = trained
    layout = _layout(WORLD_SIZE, *LAYOUTS[index])
    shape = MoeShape.of(ModelConfig(**MODEL))
    tokens = tokens_per_rank(MODEL["seq_len"], layout.micro_batch_size, layout.tp, layout.cp)
    own = dispatch_bytes(tokens, shape, layout.ep, layout.etp, 4).a2a
    m = layout.num_micro_batches
    for rank in range(WORLD_SIZE):
        stage = layout.coordinate(rank, "pp")
        first = sum(layout.layers_per_stage[:stage])
        mode, k = layout.recompute[stage]
        blocks = range(first, first + layout.layers_per_stage[stage])
        moe = [b for b in blocks if b >= MODEL["dense_layers"]]
        rerun = sum(1 for b in moe if mode == "full" and b < first + k)
        got = layouts[f"a2a {layout.describe()} rank {rank}"]
        assert {g[:2] for g in got} <= {(layout.ep, layout.etp)}, (rank, got)
        assert len(got) == (5 * len(moe) + 3 * rerun) * m, (rank, got)
        assert sum(g[2:] == (counts_bytes(shape), "int64") for g in got) == \
            (len(moe) + rerun) * m
        assert sum(g[2:] == (own, "fp32") for g in got) >= (2 * len(moe) + rerun) * m, \
            (rank, own, got)


@pytest.mark.parametrize("index", [i for i, (_, _, extra) in enumerate(LAYOUTS)
                                   if extra.get("zero") == 3])
def test_zero3_states_are_the_workload_models(trained, index):
    """ZeRO-3 (FSDP2) with experts, counted on the engine's real tensors at the step: each
    rank's fp32 shards, their fp32 gradient shards and AdamW's moments are rank_states' bytes
    to the byte; the routed experts shard over the edp ranks holding them, the rest over
    dp x cp."""
    from orchestrator.models.config import ModelConfig
    from orchestrator.workload.states import rank_states

    _, layouts = trained
    layout = _layout(WORLD_SIZE, *LAYOUTS[index])
    for rank in range(WORLD_SIZE):
        held, counters = layouts[f"held {layout.describe()} rank {rank}"]
        states = rank_states(ModelConfig(**MODEL), layout, rank)
        # fp32: the gradient shards are as large as the weight shards
        assert held + counters == 2 * states.params + states.optim, (
            f"{layout.describe()} rank {rank}: {held + counters} B, predicted "
            f"{states.as_dict()}")


def test_reference_routes_every_token_k_times(trained):
    reference, _ = trained
    moe_layers = MODEL["layers"] - MODEL["dense_layers"]
    for _, _, aux, tokens in reference:
        assert sum(tokens) == GBS * MODEL["seq_len"] * MODEL["top_k"] * moe_layers
        assert 0 < aux < 1  # coef x (1 when balanced), a little more when not


# ---------------------------------------------------------------- the block by hand
def _moe(**changes):
    from orchestrator.models.config import ModelConfig
    from orchestrator.models.gpt import GPT

    cfg = ModelConfig(**(MODEL | changes))
    model = GPT(cfg, seed=3)
    return cfg, model.blocks[cfg.dense_layers].mlp


def test_moe_block_is_the_weighted_sum_of_its_top_k_experts():
    """Every token's output, recomputed by hand from the router's top-k and each expert's
    SwiGLU, plus the shared expert."""
    import torch.nn.functional as F

    cfg, moe = _moe()
    x = torch.randn(2, 8, cfg.hidden)
    with torch.no_grad():
        y = moe(x)
        probs = (x @ moe.router.weight.T).softmax(-1)
        for b in range(2):
            for t in range(8):
                w, idx = probs[b, t].topk(cfg.top_k)
                w = w / w.sum()
                want = sum(wi * (F.silu(x[b, t] @ moe.experts.w_gate[e])
                                 * (x[b, t] @ moe.experts.w_up[e])) @ moe.experts.w_down[e]
                           for wi, e in zip(w, idx.tolist()))
                want = want + moe.shared(x[b, t])
                torch.testing.assert_close(y[b, t], want, rtol=1e-5, atol=1e-6)


def test_capacity_keeps_the_first_tokens_of_each_expert():
    from orchestrator.models.moe import capacity

    cfg, moe = _moe(capacity_factor=0.5, shared_expert_ffn=0)
    tokens = 2 * 16
    cap = capacity(tokens, cfg.top_k, cfg.experts, 0.5)
    assert cap == 8  # ceil(32 tokens * top-2 / 4 experts * 0.5)
    x = torch.randn(2, 16, cfg.hidden)
    moe(x)  # a training forward (with gradients): the step log counts those
    with torch.no_grad():
        chosen = (x @ moe.router.weight.T).topk(cfg.top_k, dim=-1).indices.reshape(-1)
    routed = torch.bincount(chosen, minlength=cfg.experts)
    assert moe.tokens_per_expert.tolist() == routed.clamp(max=cap).tolist()
    assert moe.dropped == int((routed - routed.clamp(max=cap)).sum()) > 0
    assert capacity(tokens, cfg.top_k, cfg.experts, 1.0) == 16


def test_aux_loss_is_per_sequence_and_one_when_balanced():
    """The sequence-wise balance loss: coef x sum_i f_i P_i per sequence, averaged; uniform
    router probabilities give exactly coef (f sums to E, P_i = 1/E), and a batch's loss is the
    mean of its sequences' (so any split over ranks and micro-batches agrees)."""
    cfg, moe = _moe(shared_expert_ffn=0)
    seq = 16
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(1, seq, cfg.hidden))
    assert moe.aux_loss_sum == pytest.approx(cfg.aux_loss_coef, rel=1e-6)
    torch.manual_seed(0)
    moe.router.weight.data.normal_()
    x = torch.randn(3, seq, cfg.hidden)
    per_sequence = []
    for b in range(3):
        moe.reset_stats()
        moe(x[b:b + 1])
        per_sequence.append(moe.aux_loss_sum)
    moe.reset_stats()
    moe(x)
    assert moe.aux_loss_sum == pytest.approx(sum(per_sequence) / 3, rel=1e-6)


def test_aux_loss_gradient_reaches_the_router():
    """The balance loss is not in the returned activations, yet backward carries its gradient:
    with a zero LM-side gradient only the aux loss moves the router."""
    cfg, moe = _moe(shared_expert_ffn=0)
    y = moe(torch.randn(2, 8, cfg.hidden))
    (y * 0).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    _, dense = _moe(shared_expert_ffn=0, aux_loss_coef=0.0)
    y = dense(torch.randn(2, 8, cfg.hidden))
    (y * 0).sum().backward()
    assert dense.router.weight.grad.abs().sum() == 0


def _dispatch_worker(rank, out):
    """Two EP ranks, 2 experts each: what each sends to and receives from the other."""
    import torch.distributed as dist

    from orchestrator.models.moe import Experts, ExpertParallel

    dispatch = ExpertParallel(dist.group.WORLD, 2)
    experts = Experts(2, 4, 8)
    torch.manual_seed(rank)
    for p in experts.parameters():
        p.data.normal_()
    # rank r sends 1 + r tokens to expert 0, 2 to 1, 0 to 2, 3 to expert 3
    counts = torch.tensor([1 + rank, 2, 0, 3])
    tokens = torch.arange(int(counts.sum()) * 4, dtype=torch.float32).view(-1, 4) + 100 * rank
    recv = dispatch._exchange_counts(counts.view(2, 2), tokens)
    y = dispatch(tokens, counts, experts)
    out[rank] = (recv.tolist(), tuple(y.shape))


def test_dispatcher_exchanges_split_sizes_and_returns_every_token():
    got = spawn_ranks(_dispatch_worker, 2)
    # rank 0 receives, per source rank, the counts for its experts 0 and 1; rank 1 for 2 and 3
    assert got[0][0] == [[1, 2], [2, 2]]
    assert got[1][0] == [[0, 3], [0, 3]]
    assert got[0][1] == (6, 4) and got[1][1] == (7, 4)  # each token back where it came from


# ---------------------------------------------------------------- the CLI
SHORT = ["model=tiny_moe", "train.seq_len=64", "train.plot=false",
         "train.memory_interval_s=0.2"]


def test_tiny_moe_trains_with_ep_and_a_checkpoint_reshards_across_ep(profiles):
    common = ["stage=train", "train.pp=1", "train.tp=1", "train.steps=4",
              "train.checkpoint_every=2", *SHORT]
    proc = run_cli(*common, "train.ep=4", profiles_dir=profiles, check=0)
    assert "aux " in proc.stdout and "expert load max/mean" in proc.stdout
    folder = profiles / "local" / "train" / "tiny_moe"
    ep4 = folder / "pp1-tp1-dp4-ep4-zero0-mbs1x2-1f1b"
    want = json.loads(ep4.with_suffix(".json").read_text())
    moe = want["moe"]
    assert sorted(moe["tokens_per_expert"], key=int) == ["1", "2", "3", "4"]
    # 8 sequences of 64 tokens, top-2, 3 MoE blocks: every assignment counted once
    assert all(sum(counts) == 8 * 64 * 2 * 3 for counts in moe["tokens_per_expert"].values())
    assert all(v >= 1.0 for v in moe["expert_load_max_over_mean"].values())
    # the experts' DTensors resharded over another ep and etp (and ZeRO-1's states)
    run_cli(*common, "train.ep=2", "train.etp=2", "train.zero=1",
            f"train.load={ep4}.ckpt/step_00000002", profiles_dir=profiles, check=0)
    got = json.loads((folder / "pp1-tp1-dp4-ep2-etp2-zero1-mbs1x2-1f1b.json").read_text())
    for step in ("3", "4"):  # trained at ep 2 x etp 2 from ep 4's state
        assert abs(got["losses"][step] - want["losses"][step]) <= \
            1e-4 * abs(want["losses"][step]), step


@pytest.mark.parametrize("overrides,words", [
    (["model.experts=6", "train.ep=4"], "experts(6) of tiny_moe is not divisible by ep(4)"),
    (["train.ep=3"], "ep(3) * etp(1) must divide the tp(1) * cp(1) * dp(4) = 4 ranks"),
    (["model.top_k=9"], "model.top_k(9) must be in 1..model.experts(8)"),
    (["model.capacity_factor=0"], "model.capacity_factor(0.0) must be > 0"),
    (["model=tiny", "train.ep=2"], "need a mixture-of-experts model"),
    (["train.zero=3", "train.ep=2", "train.etp=2"], "zero 3 with etp(2)"),
])
def test_bad_moe_input_is_one_line_before_launch(profiles, overrides, words):
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", *SHORT, *overrides,
                   profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert words in line, line
    assert not (profiles / "local" / "runs").exists()  # nothing launched


def test_experts_not_divisible_by_ep_is_refused():
    from orchestrator.layout import LayoutError, ParallelLayout

    layout = ParallelLayout.uniform(8, 1, 1, 4, ep=4, num_micro_batches=1)
    with pytest.raises(LayoutError, match=r"experts\(6\) of m is not divisible by ep\(4\)"):
        layout.check_experts(6, 64, "m")
    with pytest.raises(LayoutError, match=r"by etp\(2\)"):
        ParallelLayout.uniform(8, 1, 1, 4, ep=2, etp=2).check_experts(8, 63, "m")
