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
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.choices import Group
from orchestrator.mesh import EXPERT_GROUPS, LayoutMesh, rank_mesh
from orchestrator.models.config import ModelConfig, is_moe
from orchestrator.trace.configs import TraceSpec
from orchestrator.trace.capture import (CP_GROUPS, META, RENAMED_GROUPS, Captured, LiveChunk, ReplayChunk, _capture,
                                        _capture_key, _first_block,
                                        _gather_again_in_backward)
from orchestrator.trace.recorder import OpRecorder

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
            # are issued after the last backward (finish_backward), in bucket order: the
            # optimizer takes no gradient as it arrives in either run (bf16 weights would add
            # each micro-batch's into the fp32 buckets in a live run only).
            optim.remove_hooks()
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
