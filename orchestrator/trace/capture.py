"""A model chunk's forward and backward captured once and replayed (tracer.py's "each model chunk's
forward and backward are traced once ... and repeated"): the ops of a chunk depend on its shape,
not on which rank or stage holds it, so a capture is keyed by shape and reused by every chunk of
that shape, its layer numbers and TP group renamed. Also Megatron-LM's sequence-parallel habit
of gathering a linear's input again in the backward."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from orchestrator.choices import Group
from orchestrator.models.config import ModelConfig, is_moe_block
from orchestrator.trace.configs import TraceSpec
from orchestrator.trace.recorder import OpRecorder

META = torch.device("meta")
# context parallelism's groups (a2a+p2p: two levels)
CP_GROUPS = (Group.cp, Group.cp_a2a, Group.cp_ring)
# Groups a captured chunk's collectives are renamed to another rank's by their first rank.
RENAMED_GROUPS = (Group.tp, Group.tp_cp, Group.ep, Group.etp)




def _gather_again_in_backward(module: nn.Module, args: tuple) -> None:
    """Megatron-LM's sequence-parallel linears keep their input sharded and all-gather it
    again in the backward, for the weight gradient (DTensor keeps the gathered input): a
    sub-layer's pre-forward hook, after TP's own gathered it, that issues that second gather
    when the gathered input's gradient arrives. Train's layers gather again themselves
    (models/parallelize.sequence_parallel_linears: their input arrives sharded, and this does
    nothing); its LM head is the one that still needs it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = args[0] if args else None
    if not isinstance(x, DTensor) or not x.requires_grad or x.placements != (Replicate(),):
        return
    mesh = x.device_mesh
    shard = list(x.shape)
    shard[1] //= mesh.size()

    def gather_again(grad):
        local = torch.empty(shard, dtype=x.dtype, device=META)
        DTensor.from_local(local, mesh, [Shard(1)], run_check=False).redistribute(
            mesh, [Replicate()])
        return None

    x.register_hook(gather_again)


class _Replay(torch.autograd.Function):
    """A chunk's traced forward (and, in backward, its traced backward) written into the
    recorder again, for the next micro-batch, without running the model."""

    @staticmethod
    def forward(ctx, x, anchor, chunk):
        chunk.emit_forward()
        ctx.chunk = chunk
        ctx.x_spec = (x.shape, x.dtype) if x.is_floating_point() else None
        return chunk.new_output()

    @staticmethod
    def backward(ctx, grad):
        ctx.chunk.emit_backward()
        spec = ctx.x_spec
        gx = None if spec is None else torch.empty(spec[0], dtype=spec[1], device=META)
        return gx, None, None


class ReplayChunk(nn.Module):
    """Stands in for a model chunk in the executor: repeats its captured ops per micro-batch.
    `tracer`: the rank's tracer (tracer.py's _RankTracer: `emit` and `state`)."""

    def __init__(self, index: int, last: bool, forward_ops, backward_ops,
                 new_output: Callable[[], torch.Tensor], tracer):
        super().__init__()
        self.blocks = nn.ModuleDict()  # set_recompute finds nothing to change
        self.recompute_blocks = frozenset()
        self.index, self.last = index, last
        self.forward_ops, self.backward_ops = forward_ops, backward_ops
        self.new_output = new_output  # a stand-in for the chunk's output
        self.tracer = tracer
        self.anchor = torch.empty((), device=META, requires_grad=True)
        self.forwards = self.backwards = 0

    def forward(self, x):
        return _Replay.apply(x, self.anchor, self)

    def emit_forward(self) -> None:
        mb = self.forwards
        self.forwards += 1
        first, rest = self.forward_ops  # micro-batch 0's, and the later ones'
        self.tracer.emit(first if mb == 0 else rest, "F", self.index, mb)
        # What follows on the last stage (until the backward) is the loss of this micro-batch.
        self.tracer.state = {"phase": "loss" if self.last else "F", "chunk": self.index,
                             "mb": mb}

    def emit_backward(self) -> None:
        mb = self.backwards
        self.backwards += 1
        first, rest = self.backward_ops  # the first backward assigns gradients, later ones add
        self.tracer.emit(first if mb == 0 else rest, "B", self.index, mb)


class LiveChunk(nn.Module):
    """A model chunk run for every micro-batch (replay=False), stamping its ops."""

    def __init__(self, chunk: nn.Module, index: int, last: bool, tracer):
        super().__init__()
        self.chunk, self.index, self.last, self.tracer = chunk, index, last, tracer
        self.blocks = nn.ModuleDict()
        self.recompute_blocks = frozenset()
        self.forwards = 0

    def forward(self, x):
        mb = self.forwards
        self.forwards += 1
        self.tracer.state = {"phase": "F", "chunk": self.index, "mb": mb}
        out = self.chunk(x)
        state = {"phase": "B", "chunk": self.index, "mb": mb}

        def backward_starts(grad):
            self.tracer.state = state
        out.register_hook(backward_starts)
        self.tracer.state = {"phase": "loss" if self.last else "F", "chunk": self.index,
                             "mb": mb}
        return out


@dataclass
class Captured:
    """One model chunk's ops, traced once: the first micro-batch's forward and backward (which
    assigns the gradients) and a later one's (which accumulates), as the rank that traced it
    issued them. Every chunk of the same shape issues the same ops (tests/test_trace_symmetry),
    up to its blocks' numbers and its TP (and EP, ETP) groups, which `for_rank` renames."""

    forward_ops: Tuple[List[dict], List[dict]]
    backward_ops: Tuple[List[dict], List[dict]]
    out_shape: torch.Size  # the chunk's output on this rank (its local shard)
    out_dtype: torch.dtype
    # The output as a DTensor over TP (the vocab-sharded logits of the last chunk, for the
    # vocab-parallel loss): its placements and global shape and stride; None when plain.
    out_dtensor: Optional[tuple]
    # Parameters whose gradient is placed unlike the parameter (name -> the gradient's
    # placements and local shape): SP norm weights, replicated over TP, get Partial gradients.
    partial_grads: Dict[str, tuple]
    first_block: int
    group_firsts: Dict[str, int]  # first rank of the tracing rank's TP (EP, ETP) groups
    rank: int  # the rank that traced it
    reusable: bool  # every message in it is a TP, EP, ETP or CP one (renamable)
    seconds: float  # to capture it

    def new_output(self, tp_mesh) -> torch.Tensor:
        """A stand-in for the chunk's output: its shape, and its sharding over `tp_mesh` when a
        DTensor."""
        from torch.distributed.tensor import DTensor

        local = torch.empty(self.out_shape, dtype=self.out_dtype, device=META)
        if self.out_dtensor is None:
            return local
        placements, shape, stride = self.out_dtensor
        return DTensor.from_local(local, tp_mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    def for_rank(self, first_block: int, group_firsts: Dict[str, int], rank: int):
        """(forward_ops, backward_ops, partial_grads) for a chunk whose first block is
        `first_block`, on `rank` (same CP coordinate as the rank that traced it) whose TP (EP,
        ETP) groups start at `group_firsts`: its CP group is the tracer's moved by the ranks'
        distance."""
        if (first_block, group_firsts, rank) == (self.first_block, self.group_firsts,
                                                 self.rank):
            return self.forward_ops, self.backward_ops, self.partial_grads
        shift, moved = first_block - self.first_block, rank - self.rank

        def rename(ops: List[dict]) -> List[dict]:
            out = []
            for r in ops:
                r = dict(r)
                if r.get("group") in group_firsts:
                    r["group_first"] = group_firsts[r["group"]]
                elif r.get("group") in CP_GROUPS:
                    if r["kind"] == "p2p":
                        r["peer"] += moved
                    else:
                        r["group_first"] += moved
                r["module"] = _shift_block(r["module"], shift)
                out.append(r)
            return out

        return (tuple(rename(ops) for ops in self.forward_ops),
                tuple(rename(ops) for ops in self.backward_ops),
                {_shift_block(name, shift): v for name, v in self.partial_grads.items()})


def _shift_block(name: str, shift: int) -> str:
    """"blocks.5.attn" -> "blocks.7.attn" for shift 2; other names unchanged."""
    head, _, rest = name.partition(".")
    if head != "blocks" or not shift:
        return name
    number, dot, tail = rest.partition(".")
    return f"blocks.{int(number) + shift}{dot}{tail}"


def _first_block(chunk: nn.Module) -> int:
    return min((int(k) for k in chunk.blocks.keys()), default=0)


def _capture_key(spec: TraceSpec, model: ModelConfig, chunk: nn.Module, stage: int, last: bool,
                 pp_rank: int, dtype: torch.dtype, rank: int) -> tuple:
    """What a chunk's ops depend on: the model, the micro-batch shape, TP/SP, CP (its flavour,
    and the CP rank: the order of its ring's half blocks), EP/ETP, recompute, and the chunk's
    shape (its blocks, which of them hold experts; embedding first, head last). Not the EP or
    ETP rank: under uniform routing each sends, receives and computes the same shapes."""
    layout = spec.layout
    moe_blocks = tuple(is_moe_block(model, int(i)) for i in chunk.blocks.keys())
    return (repr(model), spec.seq_len, layout.micro_batch_size, layout.tp,
            layout.sequence_parallel, layout.cp, layout.cp_comm, layout.cp_a2a,
            layout.coordinate(rank, "cp"), layout.ep, layout.etp,
            layout.recompute[pp_rank], str(dtype), moe_blocks, stage == 0, last)


def _capture(chunk: nn.Module, x: torch.Tensor, recorder: OpRecorder, tracker,
             group_firsts: Dict[str, int], rank: int) -> Captured:
    """Run `chunk` forward and backward twice under the recorder: micro-batch 0, which assigns
    the gradients, and a later one, which accumulates into them."""
    from torch.distributed.tensor import DTensor

    from torch.utils.checkpoint import set_checkpoint_early_stop

    start = time.perf_counter()
    captured: List[dict] = []
    context = recorder.context
    recorder.records, recorder.tracker, recorder.context = captured, tracker, dict
    try:
        # Megatron's full recompute reruns a layer's whole forward: no early stop.
        with tracker, recorder, set_checkpoint_early_stop(False):
            out = chunk(x)
            n_forward = len(captured)
            out.backward(torch.empty_like(out))
            n_first = len(captured)
            x.grad = None  # a new micro-batch's input has no gradient yet
            again = chunk(x)
            n_second = len(captured)
            again.backward(torch.empty_like(again))
    finally:
        recorder.tracker, recorder.context = None, context
    partial_grads = {name: (tuple(p.grad.placements), p.grad.to_local().shape)
                     for name, p in chunk.named_parameters()
                     if isinstance(p.grad, DTensor)
                     and tuple(p.grad.placements) != tuple(p.placements)}
    for p in chunk.parameters():
        p.grad = None
    reusable = all(r.get("group") in RENAMED_GROUPS + CP_GROUPS
                   for r in captured if r["kind"] != "compute")
    local, out_dtensor = out, None
    if isinstance(out, DTensor):
        local = out.to_local()
        out_dtensor = (tuple(out.placements), out.shape, out.stride())
    return Captured(forward_ops=(captured[:n_forward], captured[n_first:n_second]),
                    backward_ops=(captured[n_forward:n_first], captured[n_second:]),
                    out_shape=local.shape, out_dtype=local.dtype, out_dtensor=out_dtensor,
                    partial_grads=partial_grads,
                    first_block=_first_block(chunk),
                    group_firsts=dict(group_firsts), rank=rank, reusable=reusable,
                    seconds=time.perf_counter() - start)
