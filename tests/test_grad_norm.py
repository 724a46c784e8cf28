"""The optimizer's gradient norm (train/grads.py, train/optimizers.py) is torch's
clip_grad_norm_ on the same gradients, to fp32 rounding: plain buckets, the SP norms' weighted
elements, and ZeRO-3's per-parameter gradients; the clipped AdamW step is a plain loop's; and the
norm costs what clip_grad_norm_ costs: one fp32 read of each element, no float64 copy of the
gradients (13.7 ms of every step on an H200 at pp 1, shown as "pipeline wait"). The step's log
counts this rank's own norm as optimizer time: at pp 1 there is no pipeline to wait for."""
from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch import nn

from conftest import spawn_ranks
from orchestrator.profiling.measure import Stopwatch
from orchestrator.profiling.model.optimizer_step import (KernelBytes,
                                                         optimizer_step_bytes_per_element)
from orchestrator.train.grads import ShardedAdamW
from orchestrator.train.optimizers import FsdpAdamW

FP32_REL = 1e-5  # fp32 norms against each other: rounding only
MICRO_BATCHES = 2
CLIP = 0.25


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 32))


def _backward(model: nn.Module) -> None:
    torch.manual_seed(1)
    for _ in range(MICRO_BATCHES):
        model(torch.randn(8, 64)).square().mean().backward()


def _sharded(model: nn.Module) -> ShardedAdamW:
    # a tiny bucket size: several buckets, as a real model's norm sees
    return ShardedAdamW(list(model.parameters()), zero=0, dp_group=None, dp=1,
                        num_micro_batches=MICRO_BATCHES, bucket_MiB=0.01, replicas_only=True)


def _reference_grads(model: nn.Module, weights=None) -> list:
    """A copy of `model`'s mean-over-micro-batches gradients (as the optimizer averages them),
    parameter i's scaled by sqrt(weights[i])."""
    ref = copy.deepcopy(model)
    _backward(ref)
    return [p.grad / MICRO_BATCHES * math.sqrt((weights or {}).get(i, 1.0))
            for i, p in enumerate(ref.parameters())]


def _clip_grad_norm(grads) -> float:
    """torch.nn.utils.clip_grad_norm_'s returned total norm of these gradients."""
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm=1.0))


def test_the_norm_is_clip_grad_norm_s_and_the_clipped_step_a_plain_loop_s():
    model = _model()
    reference = copy.deepcopy(model)
    optim = _sharded(model)
    assert len(optim.buckets) > 1
    _backward(model)
    optim.finish_backward()
    norm = optim.grad_norm()
    assert norm == pytest.approx(_clip_grad_norm(_reference_grads(model)), rel=FP32_REL)
    assert norm > CLIP  # the clip below changes the step
    optim.step(lr=1e-2, grad_clip=CLIP, norm=norm)
    # a plain loop: mean gradients, clip_grad_norm_, AdamW with the same settings
    _backward(reference)
    for p in reference.parameters():
        p.grad /= MICRO_BATCHES
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=CLIP)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
    plain.step()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sp_norms_weighted_elements_count_as_clip_grad_norm_s_of_their_share(tp):
    """Elements every TP rank holds (the SP norms, here the LayerNorm's weight and bias) count
    1/tp each on every rank: this rank's share of the squared norm is clip_grad_norm_'s of its
    gradients with those scaled by sqrt(1/tp)."""
    model = _model()
    optim = _sharded(model)
    params = list(model.parameters())
    replicated = {2: 1.0 / tp, 3: 1.0 / tp}  # the LayerNorm's weight and bias
    by_bucket = {}
    for i in replicated:
        p = params[i]
        off = optim.offset_of[id(p)]
        by_bucket.setdefault(id(optim.bucket_of[p]), (optim.bucket_of[p], []))[1].append(
            torch.arange(off, off + p.numel()))
    for b, parts in by_bucket.values():
        b.rep_index = torch.cat(parts)
        b.rep_weight = torch.full((len(b.rep_index),), 1.0 / tp - 1.0, dtype=torch.float64)
    _backward(model)
    optim.finish_backward()
    expected = _clip_grad_norm(_reference_grads(model, replicated))
    assert optim.grad_norm() == pytest.approx(expected, rel=FP32_REL)
    assert expected < _clip_grad_norm(_reference_grads(model))  # the weights count


def test_zero3_s_norm_is_clip_grad_norm_s():
    model = _model()
    optim = FsdpAdamW(list(model.parameters()), num_micro_batches=MICRO_BATCHES)
    _backward(model)
    optim.finish_backward()
    assert optim.grad_norm() == pytest.approx(_clip_grad_norm(_reference_grads(model)),
                                              rel=FP32_REL)


def test_the_norm_reads_each_gradient_element_once_in_fp32():
    """Bytes the norm's kernels move per gradient element: clip_grad_norm_'s 4 (it moved 56:
    a float64 copy, squared, weighted and summed); the analytic profile prices the optimizer
    phase with the same count (the fused AdamW 28, the clip 8, the parameter copy 8, the norm
    4)."""
    model = _model()
    optim = _sharded(model)
    _backward(model)
    optim.finish_backward()
    numel = sum(b.numel for b in optim.buckets)
    with KernelBytes() as counted:
        optim.local_sumsq()
    assert counted.bytes / numel < 4.5
    assert optimizer_step_bytes_per_element(True) == pytest.approx(52.0, abs=0.01)


def test_the_mean_the_unscale_and_the_clip_are_one_pass_over_the_gradients():
    """The buckets hold summed gradients: the step divides them into their mean together with
    the clip (and an fp16 loss scale's unscale), one mul_ per bucket (ZeRO-3: per
    parameter), where a division of its own read and wrote every element once more each step;
    the clipped step stays a plain loop's (the tests above and below)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model()
    optim = _sharded(model)
    sizes = {b.numel for b in optim.buckets}
    passes = []

    class Passes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            scaling = func.overloadpacket in (torch.ops.aten.div_, torch.ops.aten.mul_)
            if scaling and args[0].numel() in sizes:
                passes.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Passes():
        _backward(model)  # a bucket is launched from the last gradient hook it waits for
        optim.finish_backward()
        optim.step(1e-3, CLIP, inv_scale=0.5)
    assert passes == ["mul_"] * len(optim.buckets)
    # ZeRO-3's per-parameter gradients (FSDP's mean over dp, the micro-batches summed) alike
    model = _model()
    optim = FsdpAdamW(list(model.parameters()), num_micro_batches=MICRO_BATCHES)
    _backward(model)
    grads = {p.grad.data_ptr() for p in model.parameters()}
    passes.clear()
    sizes = {p.numel() for p in model.parameters()}
    with Passes():
        optim.finish_backward()
        optim.step(1e-3, CLIP, inv_scale=0.5)
    assert passes == ["mul_"] * len(grads)


SLOW_NORM_S = 0.3  # this rank's own sum of squares, slowed down to be seen


class _RecordingClock(Stopwatch):
    """The engine's clock, logging when it marks a point and when a span is read."""

    def __init__(self, device, log: list):
        super().__init__(device)
        self.log = log

    def mark(self):
        self.log.append("mark")
        return super().mark()

    def elapsed_us(self, start, end) -> float:
        self.log.append("read")
        return super().elapsed_us(start, end)


def _slow_norm_step(rank: int, out) -> None:
    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.engine import Engine

    model = ModelConfig(hidden=32, ffn=64, layers=2, heads=2, kv_heads=2, vocab=64, seq_len=16)
    layout = ParallelLayout.uniform(1, 1, 1, 2, micro_batch_size=1, num_micro_batches=2)
    engine = Engine(layout, model, torch.device("cpu"))
    local_sumsq = engine.optim.local_sumsq

    def slow():
        time.sleep(SLOW_NORM_S)
        return local_sumsq()
    engine.optim.local_sumsq = slow
    log = []
    engine.clock = _RecordingClock(engine.device, log)
    tokens = torch.randint(0, 64, (2, 16))
    stats = engine.train_step(tokens, tokens, 1e-3, 1.0)
    out["stats"] = {"norm_s": stats.norm_s, "optimizer_s": stats.optimizer_s,
                    "fwd_bwd_s": stats.fwd_bwd_s, "compute_s": stats.compute_s,
                    "sync_wait_s": stats.sync_wait_s, "step_s": stats.step_s}
    out["clock"] = log


def test_at_pp_1_the_norm_is_optimizer_time_and_no_span_is_read_inside_the_step():
    """One rank, pp 1: the step log's "pipeline wait" holds no norm (it held the whole norm's
    time: 13.7 ms on an H200), the optimizer phase does. The step's parts are marks (CUDA
    events on a GPU) read after its end: timing them synchronises nothing inside the step (it
    synchronised the GPU at every mark, twice per micro-batch)."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.train.report import measured_parts

    out = spawn_ranks(_slow_norm_step, 1)
    stats, clock = out["stats"], list(out["clock"])
    assert clock.count("mark") >= 2 * 2 + 6  # each micro-batch's span, the step's parts
    assert "mark" not in clock[clock.index("read"):]
    layout = ParallelLayout.uniform(1, 1, 1, 2, micro_batch_size=1, num_micro_batches=2)
    (stage,) = measured_parts([{"rank": 0, "medians_s": stats, "peak_MiB": 0.0,
                                "process_peak_MiB": 0.0}], layout)["stages"]
    assert stage["optimizer_ms"] >= SLOW_NORM_S * 1e3
    assert stage["pipeline_wait_ms"] < SLOW_NORM_S * 1e3 / 3
