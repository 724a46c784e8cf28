"""Issue 42, regional torch.compile: train.compile (auto: on CUDA, off on CPU) compiles each
transformer block on its own (models/compile.py), the same function for train's chunks and for
the block profile_model times; what cannot compile stays eager with one line saying why."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import spawn_ranks

from orchestrator.models.compile import compile_block, eager, eager_parts, is_compiled
from orchestrator.models.compile_setting import compile_wanted

STEPS = 3


# ---------------------------------------------------------------- pure rules
@pytest.mark.parametrize("setting, device, wanted", [
    ("auto", "cuda", True), ("auto", "cpu", False), ("true", "cpu", True), ("True", "cpu", True),
    (True, "cpu", True), ("false", "cuda", False), ("False", "cuda", False),
])
def test_auto_compiles_on_cuda_only_and_true_false_are_taken_as_given(setting, device, wanted):
    assert compile_wanted(setting, device) is wanted


def test_another_setting_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"train.compile\('yes'\) must be one of auto, true, "
                                         r"false"):
        compile_wanted("yes", "cuda")


def test_a_plan_refuses_a_bad_setting_before_launch():
    from test_limits import _cfg

    from orchestrator.errors import ConfigError
    from orchestrator.pipeline import plan_stage

    for stage in ("train", "profile_model"):
        with pytest.raises(ConfigError, match=r"train.compile\('maybe'\)"):
            plan_stage(stage, _cfg(f"stage={stage}", "train.compile=maybe", "train.pp=1"))


def test_the_profiles_hash_follows_whether_the_block_is_compiled():
    """A profile timed eager is stale for a train that compiles (and back); one timed eager
    keeps the hash it had before train compiled (nothing added: CPU profiles stay valid)."""
    from test_limits import _cfg

    from orchestrator.pipeline import plan_stage
    from orchestrator.stages import get_stage

    def profile_hash(*overrides):
        return plan_stage("profile_model", _cfg("stage=profile_model", *overrides)).config_hash

    assert get_stage("profile_model").hash_extra(_cfg("stage=profile_model")) == {}
    eager = {profile_hash(f"train.compile={value}") for value in ("auto", "false")}
    assert len(eager) == 1
    assert profile_hash("train.compile=true") not in eager
    gpu = ("cluster=gpu_node", "launcher=slurm")  # auto compiles on CUDA
    assert profile_hash(*gpu) == profile_hash(*gpu, "train.compile=true")
    assert profile_hash(*gpu) != profile_hash(*gpu, "train.compile=false")


def test_the_parts_that_cannot_compile_stay_eager_with_one_line_each():
    assert eager_parts(is_moe=False, context_parallel=False) == (("",), ())
    units, why = eager_parts(is_moe=True, context_parallel=False)
    assert units == ("attn",) and len(why) == 1 and "MoE FFN stays eager" in why[0]
    units, why = eager_parts(is_moe=False, context_parallel=True)
    assert units == ("mlp",) and len(why) == 1 and "context parallelism" in why[0]
    units, why = eager_parts(is_moe=True, context_parallel=True)
    assert units == () and len(why) == 2


def _tiny_block():
    from orchestrator.models.config import ModelConfig
    from orchestrator.models.gpt import GPT

    model = GPT(ModelConfig(hidden=32, ffn=64, layers=1, heads=2, kv_heads=2, vocab=64,
                            seq_len=8))
    return model.blocks[0], model.rope()


def test_a_block_that_fails_to_compile_runs_eager_and_says_why_once():
    """What dynamo cannot trace at a part's first forward (here a graph break, which a full
    graph refuses) falls back to eager: the same output, one line, no crash."""
    block, (cos, sin) = _tiny_block()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    expected = block(x, cos, sin)

    def breaks(x, linears):
        torch._dynamo.graph_break()
        return [linear(x) for linear in linears]

    block.mlp.project = breaks
    notes = []
    assert compile_block(block, on_note=notes.append) == []
    assert is_compiled(block)
    out = block(x, cos, sin)
    torch.testing.assert_close(out, expected)
    assert len(notes) == 1 and notes[0].startswith("torch.compile failed for the block, which "
                                                   "runs eager: Unsupported")
    assert not is_compiled(block)
    block(x, cos, sin)  # eager from now on: no second line
    assert len(notes) == 1


def test_a_block_past_dynamos_recompile_limit_runs_eager_and_says_why_once(monkeypatch):
    """A compiled block called with more shapes than dynamo's recompile limit allows graphs
    (here 1, automatic dynamic shapes off) raises under a full graph; it runs eager from then on
    with one line, as a block that fails to compile. (Dynamo's graphs run by its eager backend:
    the limit is dynamo's, and inductor's C++ would take the CPU half a minute.)"""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, backend="eager", **kw))
    block, (cos, sin) = _tiny_block()
    notes = []
    compile_block(block, on_note=notes.append)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        for batch in (1, 2, 3):
            x = torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(batch))
            out = block(x, cos, sin)
            with eager(block):
                torch.testing.assert_close(out, block(x, cos, sin))
    assert notes == ["torch.compile failed for the block, which runs eager: Unsupported: "
                     "Dynamo recompile limit exceeded"], notes
    assert not is_compiled(block)


class _ToAsyncCollective(torch.autograd.Function):
    """x as DTensor.to_local() gives it after an async redistribute: an AsyncCollectiveTensor
    that requires grad around an inner tensor that does not."""

    @staticmethod
    def forward(ctx, x):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(x.detach() * 1).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_an_async_collective_input_reaches_a_compiled_part_plain_with_its_gradient():
    """What the first block takes under TP (the embedding's reduce-scattered output) is handed
    to the compiled region as a plain tensor, its gradient flowing back (torch 2.13's
    AOTAutograd drops the gradient of an AsyncCollectiveTensor input)."""
    from orchestrator.models.compile import _plain_inputs

    w = torch.arange(4.0, requires_grad=True)
    (x,) = _plain_inputs((_ToAsyncCollective.apply(w),))
    assert type(x) is torch.Tensor and x.requires_grad
    doubled = torch.compile(lambda t: t * 2, backend="aot_eager", fullgraph=True)
    doubled(x).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, 8 * w.detach())
    plain = torch.ones(2)
    assert _plain_inputs((plain, 3))[0] is plain  # anything else is handed on as it is


# ---------------------------------------------------------------- one compiled run on the CPU
MODEL = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=128, seq_len=32)


def _train_and_profile(cfg, rank: int, out: dict) -> None:
    from torch._dynamo.utils import counters

    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.profiling.model.plan import plan_profile
    from orchestrator.profiling.model.runner import point_runner
    from orchestrator.runtime.context import RankContext
    from orchestrator.stages.train import _tensor_count
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    data = make_data(None, model.vocab, model.seq_len, seed=0)
    layout = ParallelLayout.uniform(1, 1, 1, model.layers, micro_batch_size=2,
                                    num_micro_batches=2)
    for compiled in (False, True):
        engine = Engine(layout, model, torch.device("cpu"), seed=1, compile=compiled)
        losses = []
        for step in range(STEPS):
            tokens, targets = data.rank_batch(step, 0, 1, 4)
            losses.append(engine.train_step(tokens, targets, 1e-3, 1.0).loss)
        out[f"losses {compiled}"] = losses
        out[f"compiled {compiled}"] = engine.compiled
        out[f"notes {compiled}"] = list(engine.compile_notes)
    # train's CPU step that counts every live tensor (a dispatch mode, which dynamo refuses
    # to run under) runs the blocks eager, then they are compiled again
    log = SimpleNamespace(tensor_peak_bytes=None)
    with _tensor_count(engine, tokens, targets, 1, SimpleNamespace(timing_warmup_steps=3), log):
        engine.train_step(tokens, targets, 1e-3, 1.0)
    out["counted step"] = log.tensor_peak_bytes > 0 and engine.compiled
    # both blocks ran one compiled graph (the second reused the first's), and the loss's
    # forward and gradient one each (models/loss.py)
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["fused loss"] = engine.fused_loss
    # profile_model's point of the same shape (train.compile=true): its block compiled by the
    # same function (inductor's cache has the graph), timed, and the record says so
    ctx = RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      num_nodes=1, node_name="here", node_of_rank=[0], hostnames=["here"],
                      backend="gloo", device_spec="cpu")
    runner = point_runner(ctx, cfg, plan_profile(cfg), [1])
    with runner.for_tp(1, model.seq_len):
        point = runner._pm
        record = runner.point(model.seq_len, 1)
    out["point"] = {key: record.get(key) for key in ("compiled", "compile_notes")}
    out["point block compiled"] = is_compiled(point.block)
    out["point timed"] = record["block_fwd_us"] > 0 and record["block_bwd_us"] > 0
    x = point.block_input(model.seq_len, torch.Generator().manual_seed(0))
    cos, sin = point.rope()
    with torch.no_grad():
        y = point.block(x, cos, sin)
        with eager(point.block):
            out["point eager twin"] = bool(torch.allclose(point.block(x, cos, sin), y,
                                                          atol=1e-5))


def test_compiled_blocks_train_as_eager_and_profile_model_times_them_compiled():
    """train.compile=true on the CPU (inductor): a tiny model's losses over its steps are the
    eager run's within float tolerance, its two identical blocks share one compiled graph, its
    loss's arithmetic is compiled too (one graph forward, one for the gradient), the
    step train counts live tensors in runs (eager), and
    profile_model's point block is compiled by the same function, timed, and its record says
    `compiled: true`."""
    import functools

    from test_limits import _cfg

    shape = [f"model.{key}={value}" for key, value in MODEL.items() if key != "layers"]
    cfg = _cfg("stage=profile_model", "train.compile=true", *shape,
               "cluster.tasks_per_node=1", "profile_model.micro_batch_size=2",
               f"profile_model.seq_lens=[{MODEL['seq_len']}]", "profile_model.max_tp=1",
               "profile_model.warmup_iters=1", "profile_model.iters=1")
    out = spawn_ranks(functools.partial(_train_and_profile, cfg), 1)
    assert out["compiled True"] and not out["compiled False"]
    assert out["notes True"] == [] and out["notes False"] == []
    assert out["losses True"] == pytest.approx(out["losses False"], rel=1e-4)
    assert out["losses True"][-1] < out["losses True"][0]  # it trained
    assert out["graphs"] == 3 and out["fused loss"]
    assert out["counted step"]
    assert out["point"] == {"compiled": True, "compile_notes": None}
    assert out["point block compiled"] and out["point timed"] and out["point eager twin"]


# ---------------------------------------------------------------- compiled under TP (2 ranks)
def _train_tp(rank: int, out: dict) -> None:
    from torch._dynamo.utils import counters

    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    data = make_data(None, model.vocab, model.seq_len, seed=0)
    for compiled, recompute in ((False, "none"), (True, "none"), (True, "selective")):
        layout = ParallelLayout.uniform(2, 2, 1, model.layers, micro_batch_size=2,
                                        num_micro_batches=1, sequence_parallel=True,
                                        recompute=recompute)
        engine = Engine(layout, model, torch.device("cpu"), seed=1, compile=compiled)
        steps = []
        for step in range(STEPS):
            tokens, targets = data.rank_batch(step, 0, 1, 2)
            stats = engine.train_step(tokens, targets, 1e-3, 1.0)
            steps.append((stats.loss, stats.grad_norm))
        run = f"{compiled} {recompute} {rank}"
        out[f"steps {run}"] = steps
        out[f"compiled {run}"] = engine.compiled
        out[f"notes {run}"] = list(engine.compile_notes)
    # one graph for both blocks, one each for the loss's two calls (as the run above)
    out[f"graphs {rank}"] = counters["stats"]["unique_graphs"]


def test_compiled_blocks_under_tensor_and_sequence_parallelism_train_as_eager():
    """tp 2 with sequence parallelism, train.compile=true on 2 gloo ranks: the blocks compile
    (no line saying they stay eager, one graph shared by both blocks) and each step's loss and
    gradient norm are the eager run's. The first block's input is the embedding's
    reduce-scattered output, an AsyncCollectiveTensor, whose gradient torch 2.13's compiled
    region drops (models/compile._plain_inputs). With selective recompute the blocks run eager
    (torch 2.13 fails on a compiled TP block that checkpoints), saying so in one line, and
    train as the others."""
    out = spawn_ranks(_train_tp, 2)
    for rank in (0, 1):
        assert out[f"compiled True none {rank}"] and not out[f"compiled False none {rank}"]
        assert out[f"notes True none {rank}"] == [] and out[f"notes False none {rank}"] == []
        assert out[f"graphs {rank}"] == 3
        (line,) = out[f"notes True selective {rank}"]
        assert line.startswith("the block runs eager under tensor parallelism with selective "
                               "recompute")
        eager_steps = out[f"steps False none {rank}"]
        for recompute in ("none", "selective"):
            compiled_steps = out[f"steps True {recompute} {rank}"]
            for (loss, norm), (eager_loss, eager_norm) in zip(compiled_steps, eager_steps):
                assert loss == pytest.approx(eager_loss, rel=1e-4)
                assert norm == pytest.approx(eager_norm, rel=1e-4)
        assert out[f"steps True none {rank}"][-1][0] < out[f"steps True none {rank}"][0][0]
