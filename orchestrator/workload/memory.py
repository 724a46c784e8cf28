"""Every byte a rank holds during one training iteration of `stage=train`'s engine, by kind.

Held between iterations (`rank_states`), exact, from the parameter list (params.py) and the
gradient buckets (buckets.py) the engine itself uses:
- ZeRO 0/1/2 (train/grads.py): parameters are fp32 (the masters: autocast only casts matmul
  inputs). A bucket whose parameters are all plain tensors (no TP, or the norms of TP without
  SP) holds them as views of one flat buffer; a bucket with DTensor parameters keeps them as they
  are and a flat fp32 copy for AdamW (its master: the whole bucket for ZeRO 0, this rank's 1/dp
  slice for ZeRO 1/2; plain buckets under ZeRO 0 update the parameters in place, no copy).
  Gradients: the whole flat fp32 bucket for ZeRO 0/1, nothing between steps for ZeRO 2. AdamW's
  two moments cover the master (one 4-byte step counter each). A bucket holding sequence-
  parallel norms (replicated over TP) keeps their elements' indices in this rank's slice and
  their norm weights (8 + 8 bytes each). Every bucket is padded to a multiple of dp elements.
- ZeRO 3 (FSDP2): each parameter's dim-0 shard (1/dp, torch.chunk's sizes) and AdamW's two
  moments of it, with one step counter per parameter.
- Pipeline (torch.distributed.pipelining): each model chunk keeps, per micro-batch, a receive
  buffer of its input (not the first virtual stage) and of its output's gradient (not the last),
  in the residual dtype (fp32), 1/tp of the sequence under SP.
- The rotary tables (cos, sin: seq x head_dim / 2, fp32), the device mesh (int32 per rank) and
  this rank's tokens and targets (int64, micro_batch_size x num_micro_batches x seq each).

The peak of an iteration (`rank_memory`) walks the rank's pipeline op order (workload/order.py)
part by part (embedding, each layer, head and loss), adding what each forward keeps and taking
it back in its backward, with what each step holds only while it runs:
- activations per micro-batch and layer: the model profile's count (the block in the model's
  dtype, SP when tp > 1), plus what the engine keeps beyond it: without SP the norms' and
  residual's tokens are not sharded; under autocast the residual stream stays fp32 (the norms
  keep fp32 inputs: 2 B more per element) and each matmul casts its fp32 input on its own (wq,
  wk, wv and w_gate, w_up: five bf16 copies where a bf16 model keeps two), and each layer keeps
  the bf16 copies of its weights (autocast's cache) until its backward;
- the head (final norm, LM head, loss): its inputs and the log-softmax output of this rank's
  vocabulary shard in fp32 (the loss is vocab-parallel: the logits are never gathered); the
  loss backward holds two more such fp32 tensors (three with TP: torch's loss_parallel computes
  the log-softmax and its backward op by op);
- a layer's backward: the gradients flowing through it, its recompute (full: the layer's
  activations again; selective: the attention core's), its weights' fresh gradients;
- gradients: DTensor parameters accumulate .grad over the micro-batches and copy it into the
  bucket after the last; ZeRO 2 allocates a bucket's flat gradient in the backward (the first
  micro-batch when its parameters are views of it, else the last) and a 1/dp shard for its
  reduce-scatter; FSDP gathers a unit's fp32 parameters for its forward and backward (kept
  gathered all iteration under a pipeline) and accumulates unsharded gradients;
- after the backward: ZeRO 2 waits with every full bucket and shard alive (gloo copies the
  largest bucket once more); the gradient norm squares a float64 slice (16 B per element of the
  largest owned bucket slice, at most NORM_CHUNK); AdamW foreach (CPU) holds one temporary as
  large as the masters, fused AdamW (CUDA) none; ZeRO 1/2 gather each updated DTensor bucket
  into a full fp32 buffer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from orchestrator.choices import CpComm, Dtype, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.workload.buckets import plan_buckets
from orchestrator.workload.cp import score_tile_rows
from orchestrator.workload.order import stage_order
from orchestrator.workload.params import (Param, block_parameters, chunk_size, is_expert,
                                          rank_chunks)

FP32 = 4
FP64 = 8
INT64 = 8
INT32 = 4
STEP_COUNTER_BYTES = 4  # AdamW keeps `step` as a float32 scalar tensor per parameter it updates
NORM_CHUNK = 1 << 24  # elements per float64 slice of the gradient norm (train/grads.py's)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds between iterations, by kind."""

    params: int  # the parameters (fp32), views of the flat buckets where they can be
    master: int  # flat fp32 copies AdamW updates (DTensor buckets; ZeRO 1/2 slices)
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
                   dp: Optional[int] = None) -> dict:
    """The bucketed states of `params` sharded over `dp` ranks (default the dense replicas)."""
    dp, zero = dp or layout.replicas, layout.zero
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
        out["params"] += FP32 * (plan.numel if viewable else sum(p.local_numel for p in members))
        out["master"] += 0 if (viewable and zero == 0) else FP32 * owned
        out["grads"] += FP32 * plan.numel if zero < 2 else 0
        out["optim"] += 2 * FP32 * owned + STEP_COUNTER_BYTES
    return out


def fsdp_shard_numel(p: Param, dp: int, dp_rank: int) -> int:
    """Elements of FSDP2's dim-0 shard of this rank's (TP-local) parameter."""
    rows = p.local_shape[0]
    rest = p.local_numel // rows if rows else 0
    return chunk_size(rows, dp, dp_rank) * rest


def _fsdp_states(params: List[Param], layout: ParallelLayout, dp_rank: int) -> dict:
    shard = sum(fsdp_shard_numel(p, layout.replicas, dp_rank) for p in params)
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


def stage_buffer_bytes(model: ModelConfig, layout, pp_rank: int, seq_len: int) -> int:
    """The pipeline receive buffers of pipeline rank `pp_rank` (fp32 residual stream, every
    micro-batch): each chunk's input (not the first virtual stage) and its output's gradient
    (not the last)."""
    if layout.pp == 1:
        return 0
    last = layout.pp * layout.virtual_stages - 1
    per = layout.micro_batch_size * sequence_shard(seq_len, layout) * model.hidden * FP32
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
                seq_len: int | None = None, bucket_MiB: float = 25.0) -> StateBytes:
    """What `rank` holds between iterations of `layout` training `model` at `seq_len`
    (default the model's) on the orchestrator engine, by kind (bytes)."""
    seq_len = seq_len or model.seq_len
    params = rank_parameters(model, layout, rank)
    if layout.zero == 3:
        kinds = _fsdp_states(params, layout, layout.coordinate(rank, "dp_cp"))
    else:
        # a MoE model's experts have an optimizer of their own over the edp ranks
        # (train/grads.ExpertAdamW); a dense model has none
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        kinds = _bucket_states(dense, layout, bucket_MiB)
        if experts:
            for kind, size in _bucket_states(experts, layout, bucket_MiB, layout.edp).items():
                kinds[kind] += size
    buffers = stage_buffer_bytes(model, layout, layout.coordinate(rank, "pp"), seq_len)
    return StateBytes(**kinds, pipeline_buffers=buffers,
                      inputs=input_bytes(model, layout, seq_len))


# ---------------------------------------------------------------------------- the peak


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one layer keeps for its backward, per micro-batch on one rank, by recompute mode,
    as profile_model counts them (the model profile's block_act_bytes at the micro-batch's
    tokens): the block in `elem_bytes` (the model's dtype), sequence parallel when tp > 1."""

    none: float
    selective: float
    full: float
    elem_bytes: int = 4

    def at(self, mode: Recompute) -> float:
        return getattr(self, mode)


@dataclass(frozen=True)
class MemoryBytes:
    """One rank's memory in one iteration (bytes): what it holds between iterations, its peak,
    where the peak falls and what is alive then beyond the states, by kind."""

    states: StateBytes
    peak: float
    phase: str  # "forward F<chunk>.<micro-batch>" ... | "backward ..." | finish_backward |
    #             grad_norm | optimizer
    at_peak: Mapping[str, float]  # kind -> bytes above the states at the peak

    def as_dict(self) -> dict:
        return {"states": self.states.as_dict(), "peak": self.peak, "phase": self.phase,
                "at_peak": dict(self.at_peak)}


class _Live:
    """Bytes alive above the states, by kind, and the highest total seen (with its moment)."""

    def __init__(self):
        self.kinds: Dict[str, float] = {}
        self.peak, self.phase, self.at_peak = 0.0, "start", {}

    def add(self, kind: str, size: float) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0.0) + size

    def check(self, phase: str, transient: Optional[Mapping[str, float]] = None) -> None:
        total = sum(self.kinds.values()) + sum((transient or {}).values())
        if total > self.peak:
            self.peak, self.phase = total, phase
            snapshot = dict(self.kinds)
            for kind, size in (transient or {}).items():
                snapshot[kind] = snapshot.get(kind, 0.0) + size
            self.at_peak = {k: v for k, v in snapshot.items() if v}


@dataclass(frozen=True)
class _Part:
    """A piece of a model chunk a forward runs through in order: the embedding, a layer, the
    head (final norm, LM head and loss)."""

    kind: str  # embed | block | head
    mode: Recompute  # of a block
    params: Tuple[int, ...]  # positions in the rank's parameter list


def _chunk_parts(chunk: List[Param], offset: int, modes: List[str]) -> List[_Part]:
    parts: List[_Part] = []
    blocks: Dict[str, List[int]] = {}
    head: List[int] = []
    for i, p in enumerate(chunk):
        if p.name.startswith("tok_emb"):
            parts.append(_Part("embed", Recompute.none, (offset + i,)))
        elif p.unit.startswith("blocks."):
            blocks.setdefault(p.unit, []).append(offset + i)
        else:
            head.append(offset + i)
    for b, (unit, idx) in enumerate(blocks.items()):
        parts.append(_Part("block", modes[b], tuple(idx)))
    if head:
        parts.append(_Part("head", Recompute.none, tuple(head)))
    return parts


def _chunk_modes(layout: ParallelLayout, pp_rank: int, layers: int) -> List[Recompute]:
    """Recompute mode of each layer of one chunk: the stage's mode, full for its first k / v."""
    mode, k = layout.recompute[pp_rank]
    if mode == Recompute.full:
        per_chunk = k // layout.virtual_stages
        return [Recompute.full if i < per_chunk else Recompute.none for i in range(layers)]
    return [mode] * layers


def engine_block_bytes(act: BlockActivations, mode: Recompute, model: ModelConfig,
                       layout: ParallelLayout, dtype: Dtype, tokens: int,
                       block_local_numel: int, micro_batch_size=None) -> float:
    """What one layer of the engine keeps per micro-batch of `tokens` tokens in
    `micro_batch_size` sequences (default the layout's) (the model profile's count plus the
    engine's own, see the module's docstring)."""
    h, t, t_sp = model.hidden, layout.tp, sp_degree(layout)
    autocast = dtype != Dtype.fp32
    elem = dtype.bytes if autocast else FP32
    kept = act.at(mode) * (elem / act.elem_bytes)
    if mode != Recompute.full:
        kept += cp_attention_bytes(model, layout, tokens, dtype, micro_batch_size)[2]
    if t > 1 and not layout.sequence_parallel:  # the tokens SP would shard, whole
        kept += no_sp_extra_bytes_per_token(mode, t, h, elem) * tokens
    if autocast:
        if mode == Recompute.full:
            kept += tokens * (FP32 - elem) * h / t_sp  # the kept input is fp32
        else:
            kept += tokens * ((FP32 - elem) * 2 * h / t_sp + 3 * elem * h)
            kept += elem * block_local_numel  # autocast's weight cache
    return kept


def _head_bytes(model: ModelConfig, layout: ParallelLayout, dtype: Dtype, tokens: int,
                fused_norm: bool, vocab_local: int) -> Tuple[float, float, float]:
    """(kept, forward transient, backward transient) of the head and loss per micro-batch."""
    h, t_sp = model.hidden, sp_degree(layout)
    autocast = dtype != Dtype.fp32
    elem = dtype.bytes if autocast else FP32
    norm = tokens / t_sp * (FP32 * h + FP32 + (0 if fused_norm else FP32 * h))
    if autocast:
        head_in = tokens * elem * h + elem * vocab_local * h  # its cast input and weight
    else:
        head_in = tokens * FP32 * h
    logits = tokens * vocab_local * FP32  # this rank's vocabulary shard, fp32 for the loss
    kept = norm + head_in + logits + tokens * INT64  # log-softmax output, the targets
    if layout.pp > 1:  # torch.distributed.pipelining keeps a stage's output until its backward
        kept += tokens * vocab_local * elem
    if layout.tp == 1:  # torch's fused log-softmax and its backward
        forward = logits + tokens * vocab_local * elem  # the logits, and their fp32 cast
        backward = 2 * logits
    else:
        # loss_parallel's log-softmax runs op by op: the fp32 logits, less their max, and its
        # exponential are alive at once (and the compute-dtype logits under autocast); its
        # backward holds a zero gradient, the exponential of the output and their sum.
        forward = 2 * logits + (tokens * vocab_local * elem if autocast else 0)
        backward = 3 * logits
    return kept, forward, backward


def _block_working(model: ModelConfig, layout: ParallelLayout, tokens: int,
                   dtype: Dtype = Dtype.fp32, micro_batch_size=None) -> float:
    """A layer's backward, beyond its kept activations: the gradients flowing through it (the
    residual's and the MLP's intermediate ones) while its weights' gradients are made, and
    context-parallel attention's own (cp_attention_bytes)."""
    return (FP32 * tokens * (2 * model.hidden / sp_degree(layout) + 2 * model.ffn / layout.tp)
            + cp_attention_bytes(model, layout, tokens, dtype, micro_batch_size)[1])


def cp_attention_bytes(model: ModelConfig, layout, tokens, dtype: Dtype = Dtype.fp32,
                       micro_batch_size=None):
    """(forward working, backward working, kept beyond one-rank attention) bytes of one layer's
    context-parallel attention for a micro-batch of `tokens` of this rank's (0 without CP) in
    `micro_batch_size` sequences (default the layout's; numpy arrays: the dynamic planner's
    micro-batches).

    The ring (p2p) computes in fp32 (workload/cp.py): a tile of a block's scores (query rows x
    seq / cp keys per head) and its exponential; forward the output's running sum and the
    block's K and V expanded to every query head, the block held and the one arriving; backward
    the tile's probabilities and their gradient, expanded K and V, the gradients of q, k and v,
    the block, its gradient and the two arriving; under autocast fp32 copies of q (and of the
    output's gradient). allgather keeps the gathered K and V (cp blocks where one-rank attention
    keeps one) and its backward holds their gradients whole. a2a (Ulysses) keeps what one-rank
    attention keeps (a head split of the whole sequence is as large as all heads of s / cp);
    its all-to-alls' buffers are working memory. a2a+p2p: the ring's, on the head-split
    tensors, or the all-to-alls' where larger."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0, 0.0
    autocast = Dtype.parse(dtype) != Dtype.fp32
    elem = Dtype.parse(dtype).bytes if autocast else FP32
    head_dim = model.hidden // model.heads
    kv = 2.0 * tokens * (model.kv_heads // layout.tp) * head_dim * elem  # one ring message
    if layout.cp_comm == CpComm.allgather:
        return 0.0, cp * kv, (cp - 1) * kv
    b = layout.micro_batch_size if micro_batch_size is None else micro_batch_size
    heads = model.heads // layout.tp
    # an all-to-all's contiguous send buffer and its receive buffer, then the head-split copy:
    # 3 of the tensor at once (Q the largest); the backward the same for the gradient
    swap = 2.0 * tokens * heads * head_dim * elem
    if layout.cp_comm == CpComm.a2a:
        return swap, swap, 0.0
    # the ring: over every CP rank, or (a2a+p2p) over groups of a, each member holding its
    # group's a x seq / cp tokens of 1 / a of the heads
    a = layout.cp_a2a if layout.cp_comm == CpComm["a2a+p2p"] else 1
    # a sequence's tokens on a ring member
    rows = np.floor(tokens) // b * a if np.ndim(tokens) else int(tokens) // b * a
    scores = FP32 * b * (heads // a) * score_tile_rows(b, heads // a, rows, rows) * rows
    one = FP32 * tokens * heads * head_dim  # a query-sized fp32 tensor
    copies = one if autocast else 0.0
    ring = (2 * scores + 3 * one + copies + 2 * kv, 2 * scores + 5 * one + 2 * copies + 4 * kv)
    if a > 1:  # the all-to-alls come before and after the ring, not beside it
        return np.maximum(swap, ring[0]), np.maximum(swap, ring[1]), 0.0
    return ring[0], ring[1], 0.0


def _bucket_of(plans) -> Dict[int, int]:
    out = {}
    for b, plan in enumerate(plans):
        for i in plan.indices:
            out[i] = b
    return out


def rank_memory(model: ModelConfig, layout: ParallelLayout, rank: int, act: BlockActivations,
                dtype: Dtype | str = Dtype.fp32, device: str = "cpu",
                seq_len: Optional[int] = None, bucket_MiB: float = 25.0) -> MemoryBytes:
    """`rank`'s states and the peak of one iteration of `layout` training `model` on the
    orchestrator engine in `dtype` on a `device` ("cpu" or "cuda"), with `act` the profile's
    per-layer activations at this micro-batch size and sequence length (see the module's
    docstring for every term)."""
    dtype = Dtype.parse(dtype)
    seq_len = seq_len or model.seq_len
    cuda = device.startswith("cuda")
    states = rank_states(model, layout, rank, seq_len, bucket_MiB)
    params = rank_parameters(model, layout, rank)
    numel = [p.local_numel for p in params]
    pp_rank, dp_rank = layout.coordinate(rank, "pp"), layout.coordinate(rank, "dp_cp")
    dp, zero, m = layout.replicas, layout.zero, layout.num_micro_batches
    tokens = layout.micro_batch_size * seq_len // layout.cp  # this rank's
    vocab_local = chunk_size(model.vocab, layout.tp, layout.coordinate(rank, "tp"))
    head_kept, head_fwd, head_bwd = _head_bytes(model, layout, dtype, tokens, cuda, vocab_local)
    attention_fwd = cp_attention_bytes(model, layout, tokens, dtype)[0]

    # Chunks and their parts, with what each keeps per micro-batch.
    chunks, parts, offset = rank_chunks(model, layout, rank), [], 0
    for chunk in chunks:
        layers = len({p.unit for p in chunk if p.unit.startswith("blocks.")})
        parts.append(_chunk_parts(chunk, offset, _chunk_modes(layout, pp_rank, layers)))
        offset += len(chunk)

    def kept(part: _Part) -> float:
        if part.kind == "block":
            return engine_block_bytes(act, part.mode, model, layout, dtype, tokens,
                                      sum(numel[i] for i in part.params))
        if part.kind == "head":
            return head_kept
        return embedding_bytes(model, layout, tokens)

    # Gradients: which parameters accumulate a .grad of their own, where buckets appear.
    plans = plan_buckets(numel, dp, bucket_MiB) if zero < 3 else []
    bucket_of = _bucket_of(plans)
    viewable = [not any(is_dtensor(params[i], layout) for i in plan.indices) for plan in plans]
    owned = [plan.numel if zero == 0 else plan.numel // dp for plan in plans]
    allocated = set()
    fsdp_units: Dict[str, int] = {}
    for p in params:
        fsdp_units[p.unit] = fsdp_units.get(p.unit, 0) + p.local_numel
    unit_of_part = {}
    for chunk_parts in parts:
        for part in chunk_parts:
            unit_of_part[part] = params[part.params[0]].unit
    gathered_all = zero == 3 and layout.pp > 1  # kept gathered between forward and backward

    live = _Live()
    live.add("inputs", cp_split_input_bytes(layout, seq_len))
    if gathered_all:
        live.add("fsdp gathered params", FP32 * sum(fsdp_units.values()))
    done_backward: Dict[Tuple[int, int], int] = {}  # (chunk, part) -> backwards done
    order = stage_order(layout.pp, pp_rank, m, layout.schedule, layout.virtual_stages)
    for op, c, mb in order:
        tag = f"{'forward' if op == 'F' else 'backward'} F{c}.{mb}"
        if op == "F":
            for part in parts[c]:
                transient = {}
                if zero == 3 and not gathered_all:
                    transient["fsdp gathered params"] = _fsdp_gathered(part, unit_of_part,
                                                                      fsdp_units)
                if part.kind == "head":
                    transient["logits"] = head_fwd
                elif part.kind == "block" and part.mode != Recompute.none:
                    # A recomputed layer's forward holds what it does not keep while it runs.
                    transient["recompute"] = (kept(_Part("block", Recompute.none, part.params))
                                              - kept(part))
                if part.kind == "block":
                    transient["attention working"] = attention_fwd
                live.add("activations", kept(part))
                live.check(tag, transient)
            continue
        for j, part in reversed(list(enumerate(parts[c]))):
            transient = {}
            if part.kind == "block":
                transient["backward working"] = _block_working(model, layout, tokens, dtype)
                if part.mode != Recompute.none:
                    transient["recompute"] = (kept(_Part("block", Recompute.none, part.params))
                                              - kept(part))
            elif part.kind == "head":
                transient["loss backward"] = head_bwd
            else:  # the embedding's backward makes the gradient of this rank's rows
                transient["backward working"] = FP32 * vocab_local * model.hidden
            if zero == 3:
                if not gathered_all:  # this unit, the next one prefetched, and the root
                    transient["fsdp gathered params"] = _fsdp_gathered(
                        part, unit_of_part, fsdp_units, prefetch=True)
                if not gathered_all and not done_backward.get((c, j)):  # its unsharded grads
                    transient["fresh gradients"] = FP32 * sum(numel[i] for i in part.params)
            else:  # a weight's gradient before it is copied into its bucket
                transient["fresh gradients"] = max(numel[i] for i in part.params) * FP32
            live.check(tag, transient)
            live.add("activations", -kept(part))
            count = done_backward[(c, j)] = done_backward.get((c, j), 0) + 1
            _gradients(part, count, m, params, numel, layout, plans, bucket_of, viewable, owned,
                       allocated, fsdp_units, unit_of_part, live)
    # After the backward.
    tail = {}
    if zero == 2 and dp > 1:
        full = sum(FP32 * plan.numel for b, plan in enumerate(plans) if b not in allocated)
        live.add("gradient buckets", full)
        tail["gloo copy"] = 0 if cuda else FP32 * max(plan.numel for plan in plans)
        live.check("finish_backward", tail)
        live.kinds.pop("gradient buckets", None)
    live.kinds.pop("activations", None)
    live.kinds.pop("fsdp gathered params", None)
    live.kinds.pop("gradient accumulators", None)
    if zero == 3:
        shard = sum(fsdp_shard_numel(p, dp, dp_rank) for p in params)
        live.kinds = {"sharded gradients": FP32 * shard}
        biggest = max(fsdp_shard_numel(p, dp, dp_rank) for p in params)
        live.check("grad_norm", {"norm temporaries": 16 * biggest})
        live.check("optimizer", {"adamw temporaries": 0 if cuda else FP32 * shard})
    else:
        shards = sum(FP32 * o for o in owned) if (zero == 2 and dp > 1) else 0.0
        live.kinds = {"gradient shards": shards}
        live.check("grad_norm", {"norm temporaries": 16 * min(max(owned), NORM_CHUNK)})
        master = sum(FP32 * o for o in owned)
        live.check("optimizer", {"adamw temporaries": 0 if cuda else master})
        gather = [FP32 * plans[b].numel for b in range(len(plans))
                  if zero > 0 and dp > 1 and not viewable[b]]
        if gather:
            live.kinds = {}
            live.check("optimizer", {"parameter all-gather": max(gather)})
    return MemoryBytes(states=states, peak=states.total + live.peak, phase=live.phase,
                       at_peak=live.at_peak)


def _fsdp_gathered(part, unit_of_part, fsdp_units, prefetch: bool = False) -> float:
    """FSDP2 parameters gathered while `part` runs without a pipeline: its unit (one more
    block prefetched in the backward) and the root unit, which FSDP2 never reshards between
    forward and backward."""
    unit = unit_of_part[part]
    gathered = fsdp_units.get("root", 0)
    if unit != "root":
        gathered += fsdp_units[unit] * (2 if prefetch else 1)
    return FP32 * gathered


def _gradients(part, count, m, params, numel, layout, plans, bucket_of, viewable, owned,
               allocated, fsdp_units, unit_of_part, live) -> None:
    """What the backward of `part` (its `count`-th of m this iteration) leaves allocated."""
    zero, dp = layout.zero, layout.replicas
    size = FP32 * sum(numel[i] for i in part.params)
    if zero == 3:
        if count == 1 and m > 1:
            live.add("gradient accumulators", FP32 * fsdp_units[unit_of_part[part]]
                     if part.kind == "block" else size)
        return
    own = [i for i in part.params if not viewable[bucket_of[i]]]
    own_size = FP32 * sum(numel[i] for i in own)
    if m > 1 and count == 1 and own_size:
        live.add("gradient accumulators", own_size)  # DTensor .grad until the last micro-batch
    if count == m and m > 1 and own_size:
        live.add("gradient accumulators", -own_size)  # copied into its bucket
    if zero != 2 or dp == 1:
        return
    for i in part.params:
        b = bucket_of[i]
        first = viewable[b] and count == 1
        if b not in allocated and (first or count == m):
            allocated.add(b)
            live.add("gradient buckets", FP32 * plans[b].numel)
        if count == m and -1 - b not in allocated:  # its reduce-scatter's output, at launch
            allocated.add(-1 - b)
            live.add("gradient shards", FP32 * owned[b])


# ---------------------------------------------------------------------------- closed form


def _b_events(pp: int, stage: int, m: int, schedule: str, v: int) -> List[Tuple[int, int, bool]]:
    """Each distinct (model chunks in flight, backwards done before, whether it is a last
    micro-batch's) at the start of a backward of `stage`, in the rank's op order: where its
    activation peak can be."""
    live, backwards, seen = 0, 0, []
    for op, _, mb in stage_order(pp, stage, m, schedule, v):
        if op == "F":
            live += 1
            continue
        event = (live, min(backwards, 1), mb == m - 1)
        if event not in seen:
            seen.append(event)
        live -= 1
        backwards += 1
    return seen


@functools.lru_cache(maxsize=4096)
def _stage_events(pp: int, m: int, schedule: str, v: int):
    """Every stage's distinct backwards (_b_events) as arrays [pp, events] of chunks in flight,
    gradients accumulated before, last micro-batch, padded with each stage's first (the max is
    unchanged); the same for every config of this schedule shape (cached: the search builds a
    StageMemory per config)."""
    events = [_b_events(pp, j, m, schedule, v) for j in range(pp)]
    width = max(len(e) for e in events)
    padded = [e + [e[0]] * (width - len(e)) for e in events]
    arrays = (np.array([[live for live, _, _ in e] for e in padded], dtype=float),
              np.array([[done for _, done, _ in e] for e in padded], dtype=bool),
              np.array([[last for _, _, last in e] for e in padded], dtype=bool))
    for a in arrays:
        a.flags.writeable = False  # shared between configs
    return arrays


@dataclass(frozen=True)
class StageNumels:
    """A rank's parameter elements by stage: per block, its routed experts' (`expert`: their
    states shard over edp) and the rest (`layer`); the embedding's on the first stage (`first`)
    and the final norm and LM head's on the last (`last`), arrays over the stages (`other`,
    their sum). What the planner's data-parallel traffic moves (no activations: cheap)."""

    layer: float
    expert: float
    first: np.ndarray
    last: np.ndarray

    @property
    def other(self) -> np.ndarray:
        return self.first + self.last

    @classmethod
    def of(cls, model: ModelConfig, layout: ParallelLayout) -> "StageNumels":
        params = _block_params(model, layout)
        expert = float(sum(p.local_numel for p in params if is_expert(p)))
        h, pp = model.hidden, layout.pp
        vocab_local = chunk_size(model.vocab, layout.tp, 0)
        first = np.zeros(pp)
        first[0] += vocab_local * h
        last = np.zeros(pp)
        last[-1] += h + vocab_local * h
        return cls(float(sum(p.local_numel for p in params)) - expert, expert, first, last)


class StageMemory:
    """rank_memory's peak in closed form, for every stage size at once (numpy arrays over the
    layers n, recompute code 0/1/2 = none/selective/full and k full layers): what the planner's
    search prices for the orchestrator engine. Same terms as the walk; where the walk knows the
    moment (the loss backward happens with the last stage's one micro-batch in flight), this
    adds the largest transient to the largest in-flight activations, so it can only be above:
    tests/test_workload_memory.py keeps it within a few percent of rank_memory."""

    def __init__(self, model: ModelConfig, layout: ParallelLayout, act: BlockActivations,
                 dtype: Dtype | str, device: str, seq_len: int, bucket_MiB: float = 25.0):
        self.model, self.layout = model, layout
        dtype = Dtype.parse(dtype)
        tp, pp, dp, zero = layout.tp, layout.pp, layout.replicas, layout.zero
        m, v = layout.num_micro_batches, layout.virtual_stages
        cuda = device.startswith("cuda")
        h, vocab = model.hidden, model.vocab
        tokens = layout.micro_batch_size * seq_len // layout.cp  # a rank's
        params = _block_params(model, layout)
        block = [p.local_numel for p in params]
        counts = StageNumels.of(model, layout)
        self.layer_numel, self.expert_numel = counts.layer, counts.expert
        self.block_numel = layer = self.layer_numel + self.expert_numel  # all of a block's
        # a MoE router is replicated over TP as the SP norms are (their indices for the norm)
        self.router_numel = sum(p.local_numel for p in params if p.name.endswith("router.weight"))
        vocab_local = chunk_size(vocab, tp, 0)
        first, last = counts.first, counts.last
        self.other_numel = counts.other
        largest_other = np.maximum(np.where(first > 0, vocab_local * h, 0),
                                   np.where(last > 0, vocab_local * h, 0))
        self.largest_block_param = float(max(block))
        self.largest_param = np.maximum(max(block), largest_other)

        # States per element of this rank's parameters.
        owned_div = dp if zero >= 1 else 1
        if zero == 3:
            self.per_elem = {"params": FP32 / dp, "grads": 0.0, "optim": 2 * FP32 / dp}
        else:
            master = (FP32 if tp > 1 else 0.0) if zero == 0 else FP32 / dp
            self.per_elem = {"params": FP32 + master, "grads": FP32 if zero < 2 else 0.0,
                             "optim": 2 * FP32 / owned_div}
        edp = layout.edp
        self.expert_per_elem = dict(self.per_elem)
        if self.expert_numel and zero < 3:  # DTensors on the expert mesh, sharded over edp
            split = layout.ep * layout.etp > 1
            master = (FP32 if split else 0.0) if zero == 0 else FP32 / edp
            self.expert_per_elem = {"params": FP32 + master,
                                    "grads": FP32 if zero < 2 else 0.0,
                                    "optim": 2 * FP32 / (edp if zero >= 1 else 1)}
        sp_norms = tp > 1 and layout.sequence_parallel and zero < 3
        self.norm_index_per_elem = (INT64 + FP64) / owned_div if sp_norms else 0.0
        self.buffers = np.array([stage_buffer_bytes(model, layout, j, seq_len)
                                 for j in range(pp)], dtype=float) + (
                                     input_bytes(model, layout, seq_len)
                                     + cp_split_input_bytes(layout, seq_len))

        # Activations per micro-batch.
        self.act = np.array([engine_block_bytes(act, mode, model, layout, dtype, tokens, layer)
                             for mode in Recompute])
        head_kept, head_fwd, head_bwd = _head_bytes(model, layout, dtype, tokens, cuda,
                                                    vocab_local)
        self.head_kept = np.where(last > 0, head_kept, 0.0)
        self.emb_kept = np.where(first > 0, embedding_bytes(model, layout, tokens), 0.0)
        self.block_working = _block_working(model, layout, tokens, dtype)
        self.end_working = np.maximum(np.where(last > 0, max(head_fwd, head_bwd), 0.0),
                                      np.where(first > 0, FP32 * vocab_local * h, 0.0))
        # Each stage's distinct backwards (padded with its first: the max is unchanged).
        self.ev_live, self.ev_done, self.ev_last = _stage_events(pp, m, layout.schedule, v)
        self.v, self.m, self.zero, self.dp, self.tp, self.cuda = v, m, zero, dp, tp, cuda
        self.dtype, self.profile_elem, self.vocab_local = dtype, act.elem_bytes, vocab_local
        self.bucket_limit = bucket_MiB * 2**20 / FP32  # elements (workload/buckets.py)

    def states(self, j, n) -> Dict[str, np.ndarray]:
        """Bytes held between iterations by stage j's ranks holding n layers, by kind."""
        n = np.asarray(n, dtype=float)
        numel = n * self.layer_numel + self.other_numel[j]
        out = {kind: per * numel for kind, per in self.per_elem.items()}
        if self.expert_numel:
            for kind, per in self.expert_per_elem.items():
                out[kind] = out[kind] + per * n * self.expert_numel
        # the SP norms' indices and weights for the gradient norm, with the optimizer's
        out["optim"] = out["optim"] + self.norm_index_per_elem * (
            (2 * self.model.hidden + self.router_numel) * n + np.where(j == self.layout.pp - 1, self.model.hidden, 0))
        out["buffers"] = np.broadcast_to(self.buffers[j], np.shape(numel)).astype(float)
        return out

    def peak_above_states(self, j, n, mode_code, k):
        """The most bytes stage j holds at once beyond its states (numpy, elementwise: j, n,
        mode_code and k broadcast together)."""
        j, n, code, k = np.broadcast_arrays(np.asarray(j), np.asarray(n, dtype=float),
                                            np.asarray(mode_code), np.asarray(k, dtype=float))
        a_none, a_sel, a_full = self.act
        stored = np.where(code == 1, n * a_sel,
                          np.where(code == 2, k * a_full + (n - k) * a_none, n * a_none))
        numel = n * self.block_numel + self.other_numel[j]
        zero, dp, m, pp = self.zero, self.dp, self.m, self.layout.pp
        accum = np.zeros_like(numel)
        always = np.zeros_like(numel)
        if zero == 3:
            if m > 1:
                accum = FP32 * numel
            if pp > 1:
                always = FP32 * numel  # kept gathered between forward and backward
        elif zero == 2 and dp > 1 and self.tp == 1:
            accum = FP32 * numel  # the buckets, from the first backward (views of them)
        elif self.tp > 1 and m > 1:
            accum = FP32 * numel  # DTensor .grad until the last micro-batch
        per_chunk = (stored + self.emb_kept[j]) / self.v
        # A recomputed layer holds its activations again; under full recompute of k < n layers
        # those are each chunk's first, whose backward comes after its (n - k) / v kept layers'
        # were freed (so memory never grows with k: the search relies on it).
        recompute = np.where(code == 1, a_none - a_sel,
                             np.where(code == 2, np.maximum(
                                 0.0, (a_none - a_full) - (n - k) / self.v * a_none), 0.0))
        block = self.block_working + recompute
        gathered = 0.0
        if zero == 3 and pp == 1:  # the root, this unit and the next (backward)
            gathered = FP32 * (self.other_numel.sum() + 2 * self.block_numel)
        if zero == 3:  # a unit's unsharded gradients (kept gathered under a pipeline: none)
            fresh = fresh_end = 0.0 if pp > 1 else FP32 * self.block_numel
        else:  # a weight's gradient before it is copied into its bucket
            fresh, fresh_end = FP32 * self.largest_block_param, FP32 * self.largest_param[j]
        # ZeRO 2: the full buckets, and their reduce-scatters' shards from the last backward on
        buckets = FP32 * numel * (1 + 1 / dp) if (zero == 2 and dp > 1) else np.zeros_like(numel)
        bucket_only = FP32 * numel if (zero == 2 and dp > 1) else np.zeros_like(numel)
        first_stage, last_stage = j == 0, j == pp - 1

        # Every distinct backward of the stage (last axis): chunks in flight, whether gradients
        # were accumulated before it, whether it is a last micro-batch's.
        live, done, last_mb = self.ev_live[j], self.ev_done[j], self.ev_last[j]

        def x(a):
            return np.asarray(a, dtype=float)[..., None]
        # The backward starts: every chunk in flight, the loss (last stage) or a layer.
        if zero == 2 and self.tp == 1 and dp > 1:
            start_accum = np.where(done, x(bucket_only), 0.0)
        else:
            start_accum = np.where(done, x(accum), 0.0)
        inflight = live * x(per_chunk) + start_accum
        fresh_start = np.where(done, 0.0, x(fresh)) if zero == 3 else x(fresh)
        start = inflight + x(block) + fresh_start + x(gathered)
        root = FP32 * self.other_numel.sum() if (zero == 3 and pp == 1) else 0.0
        loss = (inflight + x(self.head_kept[j] + self.end_working[j])
                + (x(fresh_end) if zero < 3 else 0.0) + root)
        start = np.where(x(last_stage), np.maximum(start, loss), start)
        # It ends: one chunk fewer, the gradients it made (ZeRO 2's buckets on the last
        # micro-batch), the embedding's gradient of its vocabulary rows on the first stage.
        if zero == 2 and dp > 1:
            end_accum = np.where(last_mb, x(buckets),
                                 x(bucket_only) if self.tp == 1 else x(accum))
        elif zero < 3:
            end_accum = np.where(last_mb, 0.0, x(accum))
        else:
            end_accum = x(accum) + 0.0 * last_mb
        end_working = np.where(first_stage, FP32 * self.vocab_local * self.model.hidden, block)
        end = ((live - 1) * x(per_chunk) + end_accum + x(end_working)
               + x(np.where(first_stage, fresh_end, fresh)) + x(gathered))
        peak = np.maximum(start, end).max(axis=-1)
        return np.maximum(peak + always, self.tail_above_states(j, n))

    def micro_batch_bytes(self, layers, act: BlockActivations, tokens, micro_batch_size,
                          code):
        """For K micro-batches of their own sizes (the dynamic planner's): (stored [p, K],
        extra [p, K], fixed [p]) bytes: what one in flight keeps on each stage (its layers, the
        embedding's), what it needs on top while its backward runs (a layer's working set and
        recompute, or the loss and the head's activations on the last stage, the embedding's
        gradient on the first), and per stage what does not depend on the micro-batch (DTensor
        or FSDP gradients accumulated, FSDP's gathered units). `layers`: each stage's layer
        count; `act`: a layer's activations of each micro-batch by mode (the model profile's,
        arrays [K]); `tokens`: each one's on this rank (b x s / cp) in `micro_batch_size`
        sequences; `code`: its recompute."""
        tokens = np.asarray(tokens, dtype=float)
        code = np.asarray(code)
        layout, pp = self.layout, self.layout.pp
        n = np.asarray(layers, dtype=float)[:, None]
        kept = [engine_block_bytes(act, mode, self.model, layout, self.dtype, tokens,
                                   self.block_numel, micro_batch_size) for mode in Recompute]
        layer = np.where(code == 1, kept[1], np.where(code == 2, kept[2], kept[0]))
        recompute = np.where(code == 1, kept[0] - kept[1],
                             np.where(code == 2, kept[0] - kept[2], 0.0))
        first = (np.arange(pp) == 0)[:, None]
        last = (np.arange(pp) == pp - 1)[:, None]
        stored = n * layer + np.where(first, embedding_bytes(self.model, layout, tokens), 0.0)
        head_kept, _, head_bwd = _head_bytes(self.model, layout, self.dtype, tokens, self.cuda,
                                             self.vocab_local)
        fresh = (FP32 * self.largest_block_param if self.zero < 3 else
                 (0.0 if pp > 1 else FP32 * self.block_numel))
        fresh_end = FP32 * self.largest_param[:, None] if self.zero < 3 else 0.0
        block = (_block_working(self.model, layout, tokens, self.dtype, micro_batch_size)
                 + recompute + fresh)
        end = np.where(first, FP32 * self.vocab_local * self.model.hidden + fresh_end, 0.0)
        extra = np.maximum(np.maximum(block, end),
                           np.where(last, head_kept + head_bwd + fresh_end, 0.0))
        numel = n[:, 0] * self.block_numel + self.other_numel
        fixed = np.zeros(pp)
        if self.zero == 3:
            fixed = FP32 * numel * ((pp > 1) + (self.m > 1))
            if pp == 1:
                fixed = fixed + FP32 * (self.other_numel.sum() + 2 * self.block_numel)
        elif self.zero == 2 and self.dp > 1:
            fixed = FP32 * numel * (1 + 1 / self.dp)
        elif self.tp > 1 and self.m > 1:
            fixed = FP32 * numel
        return stored, extra, fixed

    def tail_above_states(self, j, n):
        """After the backward: ZeRO 2's buckets and shards, the gradient norm's float64 slice,
        AdamW's foreach temporary (CPU), ZeRO 1/2's parameter all-gather."""
        numel = np.asarray(n, dtype=float) * self.block_numel + self.other_numel[j]
        zero, dp, cuda = self.zero, self.dp, self.cuda
        if zero == 3:
            shard = numel / dp
            return FP32 * shard + np.maximum(16 * self.largest_param[j] / dp,
                                             0.0 if cuda else FP32 * shard)
        bucket = np.maximum(np.minimum(self.bucket_limit, np.ceil(numel / 4)),
                            self.largest_param[j])
        owned = bucket / dp if zero >= 1 else bucket
        master = numel / dp if zero >= 1 else numel
        shards = FP32 * numel / dp if (zero == 2 and dp > 1) else 0.0
        norm = shards + 16 * np.minimum(owned, NORM_CHUNK)
        step = shards + (0.0 if cuda else FP32 * master)
        tail = np.maximum(norm, step)
        if zero >= 1 and dp > 1 and self.tp > 1:
            tail = np.maximum(tail, FP32 * bucket)
        if zero == 2 and dp > 1:
            tail = np.maximum(tail, FP32 * numel + shards + (0.0 if cuda else FP32 * bucket))
        return tail


def _block_params(model: ModelConfig, layout: ParallelLayout) -> List[Param]:
    """The parameters of one block the closed form prices every layer as: a MoE block's for a
    MoE model (the first `dense_layers` blocks too: docs/stages/search.md), block 0's
    otherwise."""
    index = getattr(model, "dense_layers", 0) if getattr(model, "experts", 0) else 0
    return block_parameters(model, index, layout.tp, 0, layout.ep, layout.etp)
