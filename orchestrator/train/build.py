"""One rank's model chunks and optimizer for a ParallelLayout, in the manner of torchtitan's
parallelize_fn: the one builder train's Engine runs and trace records.

`build_chunks`: the GPT on the meta device, TP/SP-sharded over the rank's TP group
(models/parallelize.py; only the blocks this rank holds), its routed experts over its ep x etp
block of the expert grid, cut into this rank's pipeline chunks (virtual stage c * pp + pp_rank),
attention context-parallel over its CP group, MoE balance statistics summed over a sequence's
ranks, the layout's recompute, then (train) materialised on the rank's device, each block
compiled (train.compile: models/compile.py; torchtitan's order, after TP and the recompute
flags, before FSDP) and FSDP-wrapped for ZeRO-3. `build_optimizer`: train's ZeRO 0/1/2
(train/grads.py) over the replicas (dp x cp), the routed experts' over the EDP group, or FSDP's
AdamW for ZeRO-3.

trace (trace/tracer.py) calls both on its fake process group, on meta, with its own CP attention
(Megatron's) and then adds its recording hooks to the chunks (Megatron's second all-gather in the
backward, the dispatcher issuing its collectives on meta): what it records is what train runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from orchestrator.choices import Group, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.mesh import LayoutMesh
from orchestrator.models.config import ModelConfig, is_moe
from orchestrator.models.compile import compile_block
from orchestrator.models.context_parallel import ContextParallel
from orchestrator.models.gpt import GPT, Attention
from orchestrator.models.moe import MoE
from orchestrator.models.parallelize import (apply_expert_parallel, apply_tensor_parallel,
                                             split_pipeline, stage_layer_ranges)
from orchestrator.train.executor import set_recompute
from orchestrator.train.grads import ShardedAdamW
from orchestrator.train.optimizers import ExpertAdamW, FsdpAdamW, is_expert_param


@dataclass(frozen=True)
class OptimSettings:
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    bucket_MiB: float = 25.0


def virtual_stage_layers(layout: ParallelLayout) -> List[int]:
    """Layers of each virtual stage s = chunk * pp + rank (pp * v of them); LayoutError for
    short chunks (ParallelLayout.check_equal_chunks: Megatron-LM's, not built here)."""
    layout.check_equal_chunks()
    v, pp = layout.virtual_stages, layout.pp
    return [layout.layers_per_stage[s % pp] // v for s in range(pp * v)]


def context_parallel(layout: ParallelLayout, mesh: LayoutMesh, kind=ContextParallel):
    """The attention context of this rank's CP group (`kind`: models/context_parallel's, or
    trace's Megatron one), a2a+p2p with its two levels; None without context parallelism."""
    if layout.cp == 1:
        return None
    levels = None
    if Group.cp_a2a in mesh.groups:
        levels = (mesh.group(Group.cp_a2a), mesh.group(Group.cp_ring))
    return kind(mesh.group(Group.cp), layout.cp_comm, levels=levels)


def build_chunks(layout: ParallelLayout, model: ModelConfig, mesh: LayoutMesh, pp_rank: int, *,
                 context=None, device: Optional[torch.device] = None, seed: int = 0,
                 autocast: Optional[torch.dtype] = None,
                 fsdp_dtype: Optional[torch.dtype] = None, compile: bool = False,
                 notes: Optional[List[str]] = None) -> List[nn.Module]:
    """This rank's model chunks (module doc), parameters in `model`'s dtype: on meta, or
    materialised on `device` with the whole model's initial values for `seed`; `context` the
    attention's (context_parallel), `autocast` the forward's dtype (None: the parameters'),
    `fsdp_dtype` the dtype ZeRO-3 gathers and computes the weights in (None: theirs).
    `compile`: each block compiled (apply_compile); `notes` gets its lines (what stays eager
    and why, now and at a part's first forward)."""
    with torch.device("meta"):
        whole = GPT(model, seed, tp=layout.tp)  # its vocabulary padded for tp
    per_virtual = virtual_stage_layers(layout)
    ranges = stage_layer_ranges(per_virtual, model.layers)
    stages = [c * layout.pp + pp_rank for c in range(layout.virtual_stages)]
    blocks = {i for s in stages for i in ranges[s]}  # only these are sharded
    if layout.tp > 1:
        # Vocab-parallel loss (Megatron's): the logits stay sharded over the vocabulary.
        apply_tensor_parallel(whole, mesh.mesh(Group.tp), layout.sequence_parallel,
                              loss_parallel=True, blocks=blocks)
    moe = is_moe(model)
    if moe and layout.ep * layout.etp > 1:
        apply_expert_parallel(whole, mesh.experts, layout.ep, layout.etp,
                              mesh.groups.get(Group.ep), mesh.groups.get(Group.etp),
                              blocks=blocks)
    parts = split_pipeline(whole, per_virtual)
    chunks = [parts[s] for s in stages]
    # The ranks holding a sequence's other tokens (TP's shards, CP's chunks): a MoE layer's
    # balance loss sums its statistics over them.
    sequence = mesh.sequence_group() if moe else None
    for chunk in chunks:
        if device is not None and device.type != "meta":
            chunk.to_empty(device=device)
            chunk.init_weights(seed)
        chunk.autocast_dtype = autocast
        for sub in chunk.modules():
            if isinstance(sub, Attention):
                sub.context = context
            elif isinstance(sub, MoE) and sequence is not None:
                sub.sequence_group, sub.sequence_parts = sequence, layout.tp * layout.cp
    apply_recompute(chunks, layout, pp_rank)
    if compile:
        apply_compile(chunks, context is not None, notes)
    if layout.zero == 3:
        apply_fsdp(chunks, layout, mesh, fsdp_dtype)
    return chunks


def apply_compile(chunks: List[nn.Module], context_parallel: bool,
                  notes: Optional[List[str]] = None) -> None:
    """torch.compile each block of this rank's chunks (models/compile.compile_block, the
    function profile_model times the block with); `notes` gets each distinct line about what
    stays eager, now and when a part falls back at its first forward."""
    sink = notes if notes is not None else []

    def note(text: str) -> None:
        if text not in sink:  # identical blocks fail alike: one line
            sink.append(text)

    for chunk in chunks:
        for block in chunk.blocks.values():
            for text in compile_block(block, context_parallel, note):
                note(text)


def apply_recompute(chunks: List[nn.Module], layout: ParallelLayout, pp_rank: int) -> None:
    """The layout's recompute on this rank's chunks: selective (the attention core of every
    layer) or full (the first k layers of the stage, k / v per chunk); also what restores
    them after a step of per-micro-batch modes."""
    mode, k = layout.recompute[pp_rank]
    per_chunk = k // layout.virtual_stages
    for chunk in chunks:
        set_recompute(chunk, Recompute.none)
        if mode == Recompute.selective:
            for block in chunk.blocks.values():
                block.attn.recompute_core = True
        elif mode == Recompute.full:
            chunk.recompute_blocks = frozenset(list(chunk.blocks.keys())[:per_chunk])


def apply_fsdp(chunks: List[nn.Module], layout: ParallelLayout, mesh: LayoutMesh,
               param_dtype: Optional[torch.dtype] = None) -> None:
    """ZeRO-3: FSDP2 `fully_shard` per block and per chunk over the replicas (the routed
    experts over the ranks holding them, EDP, a unit of their own). `param_dtype` (bf16):
    the fp32 shards are the masters, gathered and computed in it, gradients reduced in fp32
    (Megatron-FSDP's bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replicas = mesh.mesh(layout.replica_group)
    # With a pipeline, keep parameters gathered between a micro-batch's forward and backward
    # (torchtitan's choice): resharding would all-gather them again for every micro-batch.
    reshard = layout.pp == 1
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32
                                  if param_dtype is not None else None)
    for chunk in chunks:
        for block in chunk.blocks.values():
            if isinstance(block.mlp, MoE):
                # FSDP averages their gradients over edp: FsdpAdamW rescales them to the dense
                # replicas' mean, dp x cp (gloo has no pre-multiplied reduce).
                fully_shard(block.mlp.experts, mesh=mesh.mesh(Group.edp),
                            reshard_after_forward=reshard, mp_policy=policy)
            fully_shard(block, mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(chunk, mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)


def build_optimizer(chunks: List[nn.Module], layout: ParallelLayout, mesh: LayoutMesh,
                    optim: OptimSettings = OptimSettings(), moe: bool = False):
    """Train's optimizer for this rank's chunks: ZeRO 0/1/2's ShardedAdamW over the replicas
    (gradients averaged over them; with no pipeline and no TP, ZeRO-0's norm needs no
    all-reduce), for a mixture-of-experts model (`moe`) ExpertAdamW with the routed experts'
    own ShardedAdamW over EDP averaging over the replicas' losses; ZeRO-3 FsdpAdamW."""
    adamw = dict(weight_decay=optim.weight_decay, betas=optim.betas, eps=optim.eps)
    m = layout.num_micro_batches
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    if layout.zero == 3:
        rescale = {}
        if moe:
            factor = layout.edp / layout.replicas
            rescale = {p: factor for n, p in named if is_expert_param(n)}
        return FsdpAdamW([p for _, p in named], m, rescale=rescale, **adamw)
    replicas = mesh.group(layout.replica_group)
    kwargs = dict(bucket_MiB=optim.bucket_MiB, **adamw)
    if not moe:
        return ShardedAdamW([p for _, p in named], layout.zero, replicas, layout.replicas, m,
                            replicas_only=layout.pp * layout.tp == 1, **kwargs)
    dense = ShardedAdamW([p for n, p in named if not is_expert_param(n)], layout.zero,
                         replicas, layout.replicas, m, **kwargs)
    routed = [p for n, p in named if is_expert_param(n)]
    experts = (ShardedAdamW(routed, layout.zero, mesh.group(Group.edp), layout.edp, m,
                            mean_over=layout.replicas, **kwargs)
               if routed else None)  # a stage of dense blocks only
    return ExpertAdamW(dense, experts)
