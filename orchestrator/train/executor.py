"""One training iteration over micro-batches of different shapes (dynamic micro-batching).

torch.distributed.pipelining needs every micro-batch to have the same shape; a plan from
planner/dynamic.py gives each micro-batch its own size, padded length and recompute mode. This
runs such a plan:
- pp = 1: a plain loop, forward and backward per micro-batch.
- pp > 1: each rank walks workload.order.stage_order (the op order the planner's simulation
  prices; 1F1B, eager 1F1B with the plan's extra warm-up, or interleaved; chunk c of rank r is
  virtual stage c * pp + r) and moves
  activations forward and gradients backward with isend/irecv. Receive buffers take their shape
  from the micro-batch (batch, padded_len, or padded_len / tp under sequence parallelism), so no
  shape messages travel. Sends never block; a rank waits only on the receive it needs next, so
  the run cannot deadlock where the simulation does not. Every message has its own tag
  (direction, virtual stage, micro-batch), so channels between the same two ranks never mix.
Losses are token sums (padding ignored); the caller divides by the global token count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from orchestrator.choices import Recompute
from orchestrator.models.moe import MoE
from orchestrator.workload.order import stage_order


@dataclass(frozen=True)
class MicroBatchInput:
    """One micro-batch to run: int64 (batch, padded_len) tokens and targets (IGNORE_INDEX at
    padding), its recompute mode ("none" | "selective" | "full"), and for a mixture-of-experts
    model the gradient its MoE layers' balance loss is injected with (aux_grad_scale; None:
    left as set). `segments` (batch, padded_len) int64 for packed rows (several samples back
    to back in a row): each token's sample in its row (train/data.packed_segments), which every
    stage's attention stays within; None: one sample per row, causal over it."""

    tokens: torch.Tensor
    targets: torch.Tensor
    recompute: Recompute = Recompute.none
    aux_grad_scale: Optional[float] = None
    segments: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> "MicroBatchInput":
        segments = None if self.segments is None else self.segments.to(device)
        return dataclasses.replace(self, tokens=self.tokens.to(device),
                                   targets=self.targets.to(device), segments=segments)


def stage_forward(module, x: torch.Tensor, mb: MicroBatchInput) -> torch.Tensor:
    """A stage module's forward of micro-batch `mb` (x: its tokens or the previous stage's
    activations), its packed rows' segments passed where it has them."""
    return module(x) if mb.segments is None else module(x, segments=mb.segments)


def prepare(module, mb: MicroBatchInput) -> None:
    """Set a stage module up for one micro-batch's forward or backward: its recompute mode
    (set_recompute) and its MoE layers' balance-loss gradient (when the micro-batch gives one;
    a forward captures it, so each micro-batch keeps its own)."""
    set_recompute(module, mb.recompute)
    if mb.aux_grad_scale is not None:
        for layer in module.modules():
            if isinstance(layer, MoE):
                layer.aux_grad_scale = mb.aux_grad_scale


def set_recompute(module, mode: Recompute) -> None:
    """Set a pipeline stage module's recompute flags for every block: "full" reruns whole
    blocks in backward, "selective" the attention core, "none" keeps every activation."""
    if mode not in tuple(Recompute):
        raise ValueError(f"recompute must be one of {tuple(Recompute)}, got {mode!r}")
    module.recompute_blocks = (frozenset(module.blocks.keys()) if mode == Recompute.full
                               else frozenset())
    for block in module.blocks.values():
        block.attn.recompute_core = mode == Recompute.selective


def message_tag(backward: bool, virtual_stage: int, micro_batch: int, num_virtual: int) -> int:
    """A tag unique to one message of an iteration: the activation into (or the gradient out
    of) `virtual_stage` for `micro_batch`."""
    return (micro_batch * num_virtual + virtual_stage) * 2 + int(backward)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A point in time: a recorded CUDA event on a GPU, seconds on a CPU (profiling.measure.Stopwatch
# .mark): the engine reads the spans after the step, so timing syncs nothing mid-step.
Timer = Callable[[], object]
Span = Tuple[object, object]


@dataclass
class _InFlight:
    """A forward whose backward has not run: its input (gradient wanted unless tokens) and its
    output (the loss on the last virtual stage)."""

    inputs: torch.Tensor
    output: torch.Tensor


class PipelineExecutor:
    """Runs this rank's ops of one iteration over its model chunks (`modules[c]` is virtual
    stage c * pp + pp_rank). `run` returns the detached loss sums on the last stage (else [])
    and the (start, end) marks of this rank's own forward/backward work."""

    def __init__(self, modules: Sequence[torch.nn.Module], pp_rank: int, pp: int,
                 schedule: str, group, device: torch.device, hidden: int, seq_divisor: int,
                 loss_fn: LossFn, now: Timer, wire_dtype: torch.dtype = torch.float32):
        self.modules, self.pp_rank, self.pp, self.schedule = list(modules), pp_rank, pp, schedule
        # Activations and gradients travel in this dtype: fp32 under autocast (the residual
        # stream's dtype); the parameters' dtype when they are bf16 themselves (trace).
        self.wire_dtype = wire_dtype
        self.v = len(self.modules)
        self.num_virtual = pp * self.v
        self.device, self.hidden, self.seq_divisor = device, hidden, seq_divisor
        self.loss_fn, self.now = loss_fn, now
        self.peer = [dist.get_global_rank(group, r) for r in range(pp)]

    def run(self, batches: Sequence[MicroBatchInput],
            extra_warmup: int = 0) -> Tuple[List[torch.Tensor], List[Span]]:
        for mb in batches:
            if mb.tokens.shape[1] % self.seq_divisor:
                raise ValueError(f"padded_len({mb.tokens.shape[1]}) must divide by tp"
                                 f"({self.seq_divisor}) under sequence parallelism")
        order = stage_order(self.pp, self.pp_rank, len(batches), self.schedule, self.v,
                            extra_warmup)
        in_flight: Dict[Tuple[int, int], _InFlight] = {}
        sends: List[Tuple[object, torch.Tensor]] = []
        losses: List[torch.Tensor] = []
        spans: List[Span] = []
        for kind, chunk, i in order:
            stage = chunk * self.pp + self.pp_rank
            prepare(self.modules[chunk], batches[i])
            if kind == "F":
                spans.append(self._forward(chunk, stage, i, batches[i], in_flight, sends,
                                           losses))
            else:
                spans.append(self._backward(chunk, stage, i, in_flight.pop((chunk, i)), sends))
        for work, _ in sends:
            work.wait()
        return losses, spans

    def _forward(self, chunk, stage, i, mb, in_flight, sends, losses) -> Span:
        if stage == 0:
            x = mb.tokens
        else:
            x = self._recv(self._activation_shape(mb), stage - 1, False, stage, i)
            x.requires_grad_(True)
        start = self.now()
        out = stage_forward(self.modules[chunk], x, mb)
        if stage == self.num_virtual - 1:
            out = self.loss_fn(out, mb.targets)
            losses.append(out.detach())
        span = (start, self.now())
        if stage < self.num_virtual - 1:
            self._send(out.detach().to(self.wire_dtype), stage + 1, False, stage + 1, i, sends)
        in_flight[(chunk, i)] = _InFlight(x, out)
        return span

    def _backward(self, chunk, stage, i, state: _InFlight, sends) -> Span:
        if stage == self.num_virtual - 1:
            start = self.now()
            state.output.backward()
        else:
            grad = self._recv(state.output.shape, stage + 1, True, stage, i)
            start = self.now()
            state.output.backward(grad.to(state.output.dtype))
        span = (start, self.now())
        if stage > 0:
            self._send(state.inputs.grad, stage - 1, True, stage - 1, i, sends)
        return span

    def _activation_shape(self, mb: MicroBatchInput) -> Tuple[int, int, int]:
        batch, padded_len = mb.tokens.shape
        return batch, padded_len // self.seq_divisor, self.hidden

    def _rank_of(self, virtual_stage: int) -> int:
        return self.peer[virtual_stage % self.pp]

    def _recv(self, shape, src_stage, backward, tag_stage, i) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.wire_dtype, device=self.device)
        tag = message_tag(backward, tag_stage, i, self.num_virtual)
        dist.irecv(buf, src=self._rank_of(src_stage), tag=tag).wait()
        return buf

    def _send(self, tensor, dst_stage, backward, tag_stage, i, sends) -> None:
        tensor = tensor.contiguous()
        tag = message_tag(backward, tag_stage, i, self.num_virtual)
        # Keep the tensor alive until the send completes.
        sends.append((dist.isend(tensor, dst=self._rank_of(dst_stage), tag=tag), tensor))


def run_plain(module, batches: Sequence[MicroBatchInput], loss_fn: LossFn,
              now: Timer) -> Tuple[List[torch.Tensor], List[Span]]:
    """pp = 1: forward and backward of each micro-batch in turn; returns (detached loss sums,
    the (start, end) marks of each one's compute)."""
    losses, spans = [], []
    for mb in batches:
        prepare(module, mb)
        start = now()
        loss = loss_fn(stage_forward(module, mb.tokens, mb), mb.targets)
        loss.backward()
        spans.append((start, now()))
        losses.append(loss.detach())
    return losses, spans
