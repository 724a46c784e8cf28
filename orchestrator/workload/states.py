"""What a rank holds between iterations of `stage=train`'s engine (`rank_states`), exact, from
the parameter list (params.py) and the gradient buckets (buckets.py) the engine itself uses:
- ZeRO 0/1/2 (train/grads.py): parameters are fp32 (the masters: autocast only casts matmul
  inputs), or bf16 under bf16 (half_weights: Megatron's bf16; then every bucket has an fp32
  master, the whole bucket for ZeRO 0, and plain parameters are views of a flat bf16 buffer:
  2 + 4 + 12 = 18 bytes per parameter for ZeRO 0, 2 + 4 + 12/dp for ZeRO 1, 2 + 12/dp between
  steps for ZeRO 2, its 4/dp fp32 gradient shard alive from the backward to the step). A
  bucket whose parameters are all plain tensors (no TP, or the norms of TP without SP) holds
  them as views of one flat buffer; a bucket with DTensor parameters keeps them as they are
  and a flat fp32 copy for AdamW (its master: the whole bucket for ZeRO 0, this rank's 1/dp
  slice for ZeRO 1/2; fp32 plain buckets under ZeRO 0 update the parameters in place, no copy).
  Gradients: the whole flat fp32 bucket for ZeRO 0/1, nothing between steps for ZeRO 2. AdamW's
  two moments cover the master (one 4-byte step counter each). A bucket holding sequence-
  parallel norms (replicated over TP) keeps their elements' indices in this rank's slice and
  their norm weights (8 + 8 bytes each). Every bucket is padded to a multiple of dp elements.
- ZeRO 3 (FSDP2): each parameter's dim-0 shard (1/dp, torch.chunk's sizes; a routed expert's
  1/edp, its own unit over the ranks holding the same experts; fp32, the master: under bf16
  FSDP2 casts it for its all-gather) and AdamW's two moments of it, with one step counter per
  parameter.
- Pipeline (torch.distributed.pipelining): each model chunk keeps, per micro-batch, a receive
  buffer of its input (not the first virtual stage) and of its output's gradient (not the last),
  in the residual dtype (weight_dtype: fp32, bf16 under bf16), 1/tp of the sequence under SP.
- The rotary tables (cos, sin: seq x head_dim / 2, fp32), the device mesh (int32 per rank) and
  this rank's tokens and targets (int64, micro_batch_size x num_micro_batches x seq each).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional


from orchestrator.choices import CpComm, Dtype, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.workload.buckets import plan_buckets
from orchestrator.workload.params import (Param, chunk_size, is_expert,
                                          rank_chunks)


FP32 = 4
FP64 = 8
INT64 = 8
INT32 = 4
STEP_COUNTER_BYTES = 4  # AdamW keeps `step` as a float32 scalar tensor per parameter it updates


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds between iterations, by kind."""

    params: int  # the parameters (fp32; bf16 weights), views of flat buffers where they can be
    master: int  # flat fp32 copies AdamW updates (DTensor buckets; ZeRO 1/2 slices; bf16)
    grads: int  # fp32 gradient buckets kept between steps (ZeRO 0/1)
    optim: int  # AdamW's exp_avg and exp_avg_sq (and step counters)
    norm_index: int  # the SP norms' elements of this rank's slices and their weights (fp64)
    pipeline_buffers: int  # receive buffers of the pipeline stages, every micro-batch
    inputs: int  # rotary tables, tokens and targets

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def half_weights(dtype: Dtype | str) -> bool:
    """Whether the engine trains in `dtype` with weights in it: bf16, as Megatron-LM's bf16
    (fp32 masters in the optimizer, fp32 gradient buckets); fp32, and fp16 (autocast over fp32
    weights, a dynamic loss scale), keep fp32 weights."""
    return Dtype.parse(dtype) == Dtype.bf16


def weight_dtype(dtype: Dtype | str) -> Dtype:
    """The dtype the engine computes its weights, residual stream and pipeline messages in and
    all-gathers its weights in (ZeRO 1/2 after the step, ZeRO-3's FSDP2): `dtype` for bf16
    weights (half_weights), else fp32 (autocast casts only the matmul inputs)."""
    return Dtype.parse(dtype) if half_weights(dtype) else Dtype.fp32


def weight_bytes(dtype: Dtype | str, zero: int) -> int:
    """Bytes per element of the weights a rank holds between steps: 2 for bf16 weights under
    ZeRO 0/1/2, else 4 (ZeRO-3's FSDP2 shards are the fp32 masters, bf16 only while gathered)."""
    return weight_dtype(dtype).bytes if zero < 3 else FP32


def rank_parameters(model: ModelConfig, layout: ParallelLayout, rank: int) -> List[Param]:
    """This rank's parameters in the engine's order (its chunks in order)."""
    return [p for chunk in rank_chunks(model, layout, rank) for p in chunk]


def is_dtensor(p: Param, layout: ParallelLayout) -> bool:
    """Whether the engine holds `p` as a DTensor: TP-sharded, or a norm under SP (replicated
    over TP; a MoE block's router alike); the norms of TP without SP stay plain tensors.
    A routed expert's weight is a DTensor on the expert mesh when ep x etp > 1."""
    if is_expert(p):
        return layout.ep * layout.etp > 1
    if layout.tp == 1:
        return False
    return p.tp_sharded or (layout.sequence_parallel
                            and p.name.endswith(("norm.weight", "router.weight")))


def replicated_over_tp(p: Param, layout: ParallelLayout) -> bool:
    """A DTensor whose local values every TP rank holds (the SP norms, a MoE router)."""
    return is_dtensor(p, layout) and not p.tp_sharded and not is_expert(p)


def _bucket_states(params: List[Param], layout: ParallelLayout, bucket_MiB: float,
                   dp: Optional[int] = None, dtype: Dtype | str = Dtype.fp32) -> dict:
    """The bucketed states of `params` sharded over `dp` ranks (default the dense replicas),
    training in `dtype`."""
    dp, zero = dp or layout.replicas, layout.zero
    weight, half = weight_bytes(dtype, zero), half_weights(dtype)
    out = dict(params=0, master=0, grads=0, optim=0, norm_index=0)
    plans = plan_buckets([p.local_numel for p in params], dp, bucket_MiB)
    for plan in plans:
        members = [params[i] for i in plan.indices]
        viewable = not any(is_dtensor(p, layout) for p in members)
        owned = plan.numel if zero == 0 else plan.numel // dp
        # The replicated elements of a rank's slice (an index and a weight each), padded to
        # the most any dp rank's slice holds: every rank keeps the same shapes.
        spans, off = [], 0
        for p in members:
            if replicated_over_tp(p, layout):
                spans.append((off, off + p.local_numel))
            off += p.local_numel
        if spans:
            width = max(sum(max(0, min(end, lo + owned) - max(start, lo)) for start, end in spans)
                        for lo in range(0, plan.numel, owned))
            out["norm_index"] += (INT64 + FP64) * width
        out["params"] += weight * (plan.numel if viewable
                                   else sum(p.local_numel for p in members))
        # fp32 ZeRO-0 updates plain parameters in place
        out["master"] += 0 if (viewable and zero == 0 and not half) else FP32 * owned
        out["grads"] += FP32 * plan.numel if zero < 2 else 0
        out["optim"] += 2 * FP32 * owned + STEP_COUNTER_BYTES
    return out


def fsdp_shard_numel(p: Param, dp: int, dp_rank: int) -> int:
    """Elements of FSDP2's dim-0 shard of this rank's (TP-local) parameter."""
    rows = p.local_shape[0]
    rest = p.local_numel // rows if rows else 0
    return chunk_size(rows, dp, dp_rank) * rest


def fsdp_shards(params: List[Param], layout: ParallelLayout, rank: int) -> List[int]:
    """Elements of each parameter's FSDP2 shard on `rank` (train/build.apply_fsdp's units): a
    routed expert's over the edp ranks holding the same experts, the rest over dp x cp."""
    dp_rank, edp_rank = layout.coordinate(rank, "dp_cp"), layout.coordinate(rank, "edp")
    return [fsdp_shard_numel(p, layout.edp, edp_rank) if is_expert(p)
            else fsdp_shard_numel(p, layout.replicas, dp_rank) for p in params]


def _fsdp_states(params: List[Param], layout: ParallelLayout, rank: int) -> dict:
    shard = sum(fsdp_shards(params, layout, rank))
    return dict(params=FP32 * shard, master=0, grads=0,
                optim=2 * FP32 * shard + STEP_COUNTER_BYTES * len(params), norm_index=0)


def sp_degree(layout) -> int:
    """The ranks sequence parallelism splits a sequence over: tp under SP, else 1."""
    return layout.tp if layout.tp > 1 and layout.sequence_parallel else 1


def sequence_shard(seq_len: int, layout: ParallelLayout) -> int:
    """Tokens of a sequence one rank's residual stream holds between layers (1 / cp of them
    under context parallelism, 1 / tp of those under SP)."""
    return seq_len // layout.cp // sp_degree(layout)


# Bytes per token and hidden unit (of a 2-byte dtype) a layer keeps whole without SP that SP
# would shard over tp (Korthikanti et al.): the norms' inputs and outputs, the residual, the
# gathered matmul inputs; full recompute keeps only the layer input.
NO_SP_EXTRA_BYTES_PER_HIDDEN = {Recompute.none: 10.0, Recompute.selective: 10.0,
                                Recompute.full: 2.0}


def no_sp_extra_bytes_per_token(mode: Recompute, tp: int, hidden: int, dtype_bytes: int) -> float:
    """Bytes per token and layer that plain TP keeps whole and sequence parallelism would shard
    over tp: NO_SP_EXTRA_BYTES_PER_HIDDEN[mode] * h * (1 - 1/t), scaled to the dtype."""
    return NO_SP_EXTRA_BYTES_PER_HIDDEN[mode] * hidden * (dtype_bytes / 2.0) * (1.0 - 1.0 / tp)


def stage_buffer_bytes(model: ModelConfig, layout, pp_rank: int, seq_len: int,
                       dtype: Dtype | str = Dtype.fp32) -> int:
    """The pipeline receive buffers of pipeline rank `pp_rank` (the residual stream's dtype,
    weight_dtype, every micro-batch): each chunk's input (not the first virtual stage) and its
    output's gradient (not the last)."""
    if layout.pp == 1:
        return 0
    last = layout.pp * layout.virtual_stages - 1
    per = (layout.micro_batch_size * sequence_shard(seq_len, layout) * model.hidden
           * weight_dtype(dtype).bytes)
    buffers = sum((stage > 0) + (stage < last)
                  for stage in (c * layout.pp + pp_rank for c in range(layout.virtual_stages)))
    return buffers * per * layout.num_micro_batches


def input_bytes(model: ModelConfig, layout, seq_len: int) -> int:
    """The rotary tables, the device mesh and a rank's tokens and targets; under context
    parallelism also what models/context_parallel.py keeps per sequence length: its tokens'
    positions and the gathered sequence's, the masks (seq / cp x seq booleans in all, seq x seq
    for a2a) and the rotary tables at its positions."""
    samples = layout.micro_batch_size * layout.num_micro_batches
    half_dim = model.hidden // model.heads // 2
    out = (2 * model.seq_len * half_dim * FP32 + INT32 * layout.world_size
           + 2 * samples * seq_len * INT64)
    if layout.cp > 1:
        local = seq_len // layout.cp
        # a2a: the whole sequence's queries; a2a+p2p: its ring member's (a x its own)
        queries = {CpComm.a2a: seq_len,
                   CpComm["a2a+p2p"]: local * layout.cp_a2a}.get(layout.cp_comm, local)
        out += (local + seq_len) * INT64 + queries * seq_len + 2 * local * half_dim * FP32
    return out


def cp_split_input_bytes(layout, seq_len: int) -> int:
    """This rank's tokens and targets of the step's sequences under context parallelism (made
    by the step, alive through it)."""
    if layout.cp == 1:
        return 0
    return 2 * layout.micro_batch_size * layout.num_micro_batches * (seq_len // layout.cp) * INT64


def embedding_bytes(model: ModelConfig, layout, tokens):
    """What the embedding keeps per micro-batch beyond its input ids (held already): under TP
    its vocabulary-parallel lookup's partial output (every token) stays alive with the reduced
    one (1/tp of the tokens under SP) until the micro-batch's backward."""
    if layout.tp == 1:
        return 0.0
    return FP32 * tokens * model.hidden * (1 + 1 / sp_degree(layout))


def rank_states(model: ModelConfig, layout: ParallelLayout, rank: int,
                seq_len: int | None = None, bucket_MiB: float = 25.0,
                dtype: Dtype | str = Dtype.fp32) -> StateBytes:
    """What `rank` holds between iterations of `layout` training `model` at `seq_len`
    (default the model's) in `dtype` on the orchestrator engine, by kind (bytes)."""
    seq_len = seq_len or model.seq_len
    params = rank_parameters(model, layout, rank)
    if layout.zero == 3:
        kinds = _fsdp_states(params, layout, rank)
    else:
        # a MoE model's experts have an optimizer of their own over the edp ranks
        # (train/optimizers.ExpertAdamW); a dense model has none
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        kinds = _bucket_states(dense, layout, bucket_MiB, dtype=dtype)
        if experts:
            for kind, size in _bucket_states(experts, layout, bucket_MiB, layout.edp,
                                             dtype).items():
                kinds[kind] += size
    buffers = stage_buffer_bytes(model, layout, layout.coordinate(rank, "pp"), seq_len, dtype)
    return StateBytes(**kinds, pipeline_buffers=buffers,
                      inputs=input_bytes(model, layout, seq_len))
