"""Trace one rank of a configuration in this process, at the configuration's full world size.

- A fake process group (torch's "fake" backend) of WORLD_SIZE ranks with this process as `rank`;
  this rank's own groups (mesh.rank_mesh: the members train's mesh gives it, from the layout's
  rank order; only these, so the set-up costs the same at any world size); train's model and
  optimizer builder (train/build.py: TP/SP sharding, experts, pipeline split, recompute, ZeRO
  buckets) with the tracer's hooks added (trace_chunks), and train's pipeline executor
  (train/executor.py), on meta tensors: no memory for weights or activations, no
  communication.
- Parameters are in the model's dtype (Megatron's bf16 training: bf16 weights and activations,
  fp32 gradient buckets and optimizer masters), attention is the fused kernel a GPU runs (flash
  attention's meta kernels), not the CPU's math fallback, and the loss is vocab-parallel
  (Megatron's: logits stay sharded over TP, three small all-reduces per micro-batch).
- Tensor parallelism is DTensor's with two of Megatron-LM's habits added: a sequence-parallel
  linear all-gathers its sharded input again in the backward (for the weight gradient: 4
  all-gathers + 2 reduce-scatters per layer backward, and one more for the LM head), and a full
  recompute reruns a layer's whole forward (torch's checkpoint would stop at the last output
  the backward needs).
- Every micro-batch of a configuration has the same shape, so each model chunk's forward and
  backward are traced once (twice: the first micro-batch assigns the gradients, the others
  accumulate into them) and repeated by the executor, which issues every micro-batch's p2p
  messages and loss itself in schedule order (`replay=False` runs each micro-batch through the
  model instead; tests check both give the same trace). A chunk's ops depend on its shape, not
  on which rank or stage holds it, so a capture is reused by every chunk of that shape
  (`captures`, shared over a run), its layer numbers and TP group renamed.
- After the last backward: the TP all-reduce of the SP norm weights' partial gradients, the
  data-parallel gradient collectives of train's ZeRO 0/1/2 optimizer (train/grads.py: one per
  bucket), the gradient-norm all-reduce and the optimizer step with its parameter all-gather.
- Mixture of experts (models/moe.py): the rank's own expert groups too (ETP, EP, EDP of the
  layout's expert grid, the groups train's expert mesh (pp, edp, ep, etp) gives it), its experts
  sharded over them (parallelize.apply_expert_parallel) and train's all-to-all dispatcher issuing
  its collectives on meta (`issue_on_meta`): per MoE layer and micro-batch forward the counts
  exchange over EP (int64, experts per rank), the tokens' all-to-all over EP, with etp > 1 the
  counts' and the tokens' all-gather over ETP, the experts, the reduce-scatter over ETP and the
  all-to-all back; backward the reverse of each. Routing is uniform (meta tensors carry no
  values): each EP peer gets T x top_k / ep tokens of `hidden` elements (T = the rank's tokens,
  micro-batch x seq / (tp x cp)), written per peer on the all-to-all's record. Train reduces over
  ETP with an all-reduce and keeps its slice; the trace records it as the reduce-scatter
  Megatron issues (same input bytes). The optimizer is train's ExpertAdamW: the routed experts'
  gradient buckets over the EDP group (stride etp x ep), the rest over DP (x CP).

Which ranks: a dense model's ranks of one pipeline stage issue the same ops to their own groups,
so TP rank 0 / CP rank 0 / DP rank 0 of each stage stands for the stage. With experts, under
uniform routing every EP rank of a stage sends and receives the same token counts and every ETP
rank computes the same slice, so the same one rank per stage still stands for every (stage, EP
rank); a load imbalance would make the busiest EP rank differ, and it would be traced on its own
(not done: the trace routes uniformly).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.choices import Group
from orchestrator.mesh import EXPERT_GROUPS, LayoutMesh, rank_mesh
from orchestrator.models.config import ModelConfig, is_moe, is_moe_block
from orchestrator.trace.configs import TraceSpec
from orchestrator.trace.recorder import OpRecorder

META = torch.device("meta")
# context parallelism's groups (a2a+p2p: two levels)
CP_GROUPS = (Group.cp, Group.cp_a2a, Group.cp_ring)
# Groups a captured chunk's collectives are renamed to another rank's by their first rank.
RENAMED_GROUPS = (Group.tp, Group.tp_cp, Group.ep, Group.etp)
# The groups a record is named after by its ranks, in this order: where two have the same
# ranks the later name wins (tp_cp first: a sequence's ranks spanning the world stay "world").
NAMED_BY_RANKS = (Group.tp_cp, Group.world, Group.pp, Group.dp, Group.dp_cp, Group.cp,
                  Group.cp_a2a, Group.cp_ring, Group.tp)


@dataclass
class RankTrace:
    rank: int
    stage: int
    records: List[dict]
    seconds: float
    # What this rank would take alone (one process per rank, as other tools trace): its own
    # seconds plus those of the chunk captures it reused.
    seconds_alone: float


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as `rank` of a fake process group of `world_size` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; trace "
                           "runs in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Drop DTensor's caches keyed by mesh: the next rank's mesh can compare equal to this one's
    (a TP group in common) but holds the groups of a new process group."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as the fused flash kernel (what SDPA runs on a GPU); grouped-query KV
    heads are repeated to the query heads first."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]


@contextlib.contextmanager
def gpu_attention():
    from orchestrator.models import gpt

    original = gpt._attention_core
    gpt._attention_core = _flash_attention
    try:
        yield
    finally:
        gpt._attention_core = original


def trace_chunks(spec: TraceSpec, model: ModelConfig, mesh: LayoutMesh,
                 pp_rank: int) -> List[nn.Module]:
    """This rank's model chunks as train builds them (train/build.build_chunks) on meta, in the
    model's dtype, attention context-parallel as Megatron's (trace/cp.py), with the tracer's
    hooks added: a sequence-parallel sub-layer's and the LM head's second all-gather in the
    backward (Megatron's), and the experts' dispatcher issuing its collectives on meta."""
    from orchestrator.models.moe import MoE
    from orchestrator.trace.cp import MegatronContextParallel
    from orchestrator.train.build import build_chunks, context_parallel

    layout = spec.layout
    chunks = build_chunks(layout, dataclasses.replace(model, seq_len=spec.seq_len), mesh,
                          pp_rank, context=context_parallel(layout, mesh,
                                                            MegatronContextParallel))
    for chunk in chunks:
        if layout.sequence_parallel:
            for block in chunk.blocks.values():
                # a MoE block's shared expert is a TP-sharded SwiGLU too
                for sub in (block.attn, block.mlp, getattr(block.mlp, "shared", None)):
                    if sub is not None:
                        sub.register_forward_pre_hook(_gather_again_in_backward)
            if chunk.lm_head is not None:
                chunk.lm_head.register_forward_pre_hook(_gather_again_in_backward)
        for sub in chunk.modules():
            if isinstance(sub, MoE) and sub.dispatch is not None:
                sub.dispatch.issue_on_meta = True  # train's collectives, on the fake groups
    return chunks


def _expert_group_names(mesh: LayoutMesh) -> Dict[str, str]:
    """Process-group name -> Group for the expert groups, which have groups of their own even
    where their ranks are a dense group's (ep = tp, edp = dp): the recorder names their
    collectives by group, not by ranks."""
    return {mesh.groups[name].group_name: name.value for name in EXPERT_GROUPS
            if name in mesh.groups and mesh.groups[name] is not dist.group.WORLD}


def _gather_again_in_backward(module: nn.Module, args: tuple) -> None:
    """Megatron-LM's sequence-parallel linears keep their input sharded and all-gather it
    again in the backward, for the weight gradient (DTensor keeps the gathered input): a
    sub-layer's pre-forward hook, after TP's own gathered it, that issues that second gather
    when the gathered input's gradient arrives."""
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
    """Stands in for a model chunk in the executor: repeats its captured ops per micro-batch."""

    def __init__(self, index: int, last: bool, forward_ops, backward_ops,
                 new_output: Callable[[], torch.Tensor], tracer: "_RankTracer"):
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

    def __init__(self, chunk: nn.Module, index: int, last: bool, tracer: "_RankTracer"):
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


class _RankTracer:
    def __init__(self, spec: TraceSpec, model: ModelConfig, rank: int, bucket_MiB: float,
                 captures: Optional[Dict[tuple, "Captured"]] = None):
        self.spec, self.model, self.rank, self.bucket_MiB = spec, model, rank, bucket_MiB
        self.captures = {} if captures is None else captures
        self.reused_seconds = 0.0
        self.state: Dict[str, object] = {"phase": "setup", "chunk": None, "mb": None}
        self.records: List[dict] = []

    def emit(self, template: List[dict], phase: str, chunk: int, mb: int) -> None:
        stamp = {"phase": phase, "chunk": chunk, "mb": mb}
        self.records.extend({**r, **stamp} for r in template)

    def context(self) -> dict:
        return dict(self.state)

    def run(self, replay: bool = True) -> List[dict]:
        from torch.distributed.tensor.parallel import loss_parallel
        from torch.distributed.tensor import DTensor
        from torch.utils.checkpoint import set_checkpoint_early_stop
        from torch.utils.module_tracker import ModuleTracker

        from orchestrator.models.gpt import token_loss_sum
        from orchestrator.train.executor import MicroBatchInput, PipelineExecutor, run_plain
        from orchestrator.train.build import OptimSettings, build_optimizer
        from orchestrator.train.grads import full_grad

        spec, layout = self.spec, self.spec.layout
        experts = is_moe(self.model)
        mesh = rank_mesh(layout, self.rank, experts=experts)
        ranks = layout.rank_groups(self.rank, experts)
        tp_mesh = mesh.mesh(Group.tp)
        # A group is named by its ranks; where two coincide (a degree of 1, or one spanning the
        # world) the later name wins.
        names = {ranks[name]: name.value for name in NAMED_BY_RANKS if name in ranks}
        pp_rank = layout.coordinate(self.rank, Group.pp)
        chunks = trace_chunks(spec, self.model, mesh, pp_rank)
        dtype = next(p.dtype for c in chunks for p in c.parameters())
        # a CP rank holds s / cp of each sequence
        mbs, seq = layout.micro_batch_size, spec.seq_len // layout.cp
        seq_divisor = layout.tp if layout.sequence_parallel else 1
        num_virtual = layout.pp * layout.virtual_stages
        tracker = ModuleTracker()
        recorder = OpRecorder(names, context=self.context, group_ranks={
            mesh.groups[name].group_name: members
            for name, members in ranks.items() if name in mesh.groups},
            process_group_names=_expert_group_names(mesh))
        recorder.records = self.records
        recorder.watch_weights(p.to_local() if isinstance(p, DTensor) else p
                               for c in chunks for p in c.parameters())

        def tokens():
            return torch.zeros((mbs, seq), dtype=torch.int64, device=META)

        modules: List[nn.Module] = chunks
        group_firsts = {name.value: ranks[name][0] for name in RENAMED_GROUPS
                        if name in ranks}
        partial_grads = []  # replayed chunks: (chunk, its partial_grads)
        with gpu_attention():
            if replay:
                modules = []
                for c, chunk in enumerate(chunks):
                    stage = c * layout.pp + pp_rank
                    last = stage == num_virtual - 1
                    key = _capture_key(spec, self.model, chunk, stage, last, pp_rank, dtype,
                                       self.rank)
                    captured = self.captures.get(key)
                    if captured is not None:
                        self.reused_seconds += captured.seconds
                    else:
                        x = tokens() if stage == 0 else torch.empty(
                            (mbs, seq // seq_divisor, self.model.hidden), dtype=dtype,
                            device=META, requires_grad=True)
                        captured = _capture(chunk, x, recorder, tracker, group_firsts,
                                            self.rank)
                        if captured.reusable:
                            self.captures[key] = captured
                    forward_ops, backward_ops, partial = captured.for_rank(
                        _first_block(chunk), group_firsts, self.rank)
                    partial_grads.append((chunk, partial))
                    modules.append(ReplayChunk(
                        c, last, forward_ops, backward_ops,
                        functools.partial(captured.new_output, tp_mesh), self))
                recorder.records = self.records
            else:
                modules = [LiveChunk(chunk, c, c * layout.pp + pp_rank == num_virtual - 1, self)
                           for c, chunk in enumerate(chunks)]
                recorder.tracker = tracker
            # Made outside the recorder: building the buckets is set-up, not the iteration.
            params = [p for chunk in chunks for p in chunk.parameters()]
            optim = build_optimizer(chunks, layout, mesh, OptimSettings(bucket_MiB=self.bucket_MiB),
                                    moe=experts)
            # No gradient reaches a parameter during a replayed run, and the buckets' collectives
            # are issued after the last backward (finish_backward), in bucket order.
            optim.begin_step(10**9)
            batches = [MicroBatchInput(tokens(), tokens(), layout.recompute[pp_rank][0])
                       for _ in range(layout.num_micro_batches)]
        # The loss's forward and backward both run inside loss_parallel (vocab-sharded logits).
        with gpu_attention(), loss_parallel(), recorder, \
                set_checkpoint_early_stop(False), (
                contextlib.nullcontext() if replay else tracker):
            self.state = {"phase": "F", "chunk": 0, "mb": 0}
            if layout.pp > 1:
                executor = PipelineExecutor(modules, pp_rank, layout.pp, layout.schedule,
                                            mesh.group(Group.pp), META, self.model.hidden,
                                            seq_divisor, token_loss_sum, lambda: 0.0,
                                            wire_dtype=dtype)
                executor.run(batches)
            else:
                run_plain(modules[0], batches, token_loss_sum, lambda: 0.0)
            self.state = {"phase": "dp", "chunk": None, "mb": None}
            # Train reduces these over TP as their last micro-batch's gradient arrives
            # (grads.full_grad in the bucket hook), Megatron once per iteration before the
            # data-parallel sync (_allreduce_layernorm_grads): here, just before it.
            _set_partial_grads(partial_grads)
            for p in params:
                if p.grad is not None:
                    full_grad(p)
                    p.grad = None
            optim.finish_backward()
            self.state = {"phase": "optimizer", "chunk": None, "mb": None}
            try:
                optim.grad_norm()
            except (RuntimeError, NotImplementedError) as e:  # float() of a meta tensor
                if "meta" not in str(e).lower():
                    raise
            optim.step(0.0, 1.0, norm=1.0)
        _fix_p2p(self.records, layout.pp, num_virtual)
        _etp_reduce_scatter(self.records)
        return self.records


def _etp_reduce_scatter(records: List[dict]) -> None:
    """Train sums the experts' partial outputs (and the gathered tokens' gradients) over ETP
    with an all-reduce and keeps its own rows, the work of a reduce-scatter (models/moe.py);
    Megatron issues the reduce-scatter. Record it as one: same input bytes, the recorder's
    convention for both."""
    for r in records:
        if r["kind"] == "coll" and r.get("group") == "etp" and r["op"] == "all_reduce":
            r["op"] = "reduce_scatter"


def _set_partial_grads(partial_grads) -> None:
    """Give the replayed chunks' parameters the Partial gradients their backward leaves (the
    replay itself gives them none)."""
    from torch.distributed.tensor import DTensor

    for chunk, partial in partial_grads:
        params = dict(chunk.named_parameters())
        for name, (placements, local_shape) in partial.items():
            p = params[name]
            local = torch.empty(local_shape, dtype=p.dtype, device=META)
            p.grad = DTensor.from_local(local, p.device_mesh, placements, run_check=False,
                                        shape=p.shape, stride=p.stride())


def _fix_p2p(records: List[dict], pp: int, num_virtual: int) -> None:
    """Stamp p2p messages with the phase, micro-batch and this rank's model chunk that their
    tag encodes (train/executor.message_tag: the receiver's virtual stage)."""
    for r in records:
        if r["kind"] == "p2p" and r.get("group") not in CP_GROUPS and r.get("tag", 0) >= 0:
            rest, backward = divmod(r["tag"], 2)
            mb, receiver = divmod(rest, num_virtual)
            own = receiver if r["op"] == "recv" else receiver + (1 if backward else -1)
            r.update(phase="B" if backward else "F", mb=mb, chunk=own // pp)


def trace_rank(spec: TraceSpec, model: ModelConfig, rank: int, replay: bool = True,
               bucket_MiB: float = 25.0,
               captures: Optional[Dict[tuple, Captured]] = None) -> RankTrace:
    """Every op `rank` of `spec` issues in one iteration, in order (see module doc).

    `captures`: chunk captures to reuse and add to; pass the same dict for every rank (and
    configuration) of a run, so each chunk shape is traced once."""
    start = time.perf_counter()
    with fake_world(rank, spec.world_size):
        tracer = _RankTracer(spec, model, rank, bucket_MiB, captures)
        records = tracer.run(replay)
    for i, r in enumerate(records):
        r["i"] = i
    seconds = time.perf_counter() - start
    return RankTrace(rank=rank, stage=spec.stage_of(rank), records=records, seconds=seconds,
                     seconds_alone=seconds + tracer.reused_seconds)
