"""Every byte a rank holds during one training iteration of `stage=train`'s engine, by kind: what
it holds between iterations is workload/states.py's; the closed form the search prices per stage
is workload/stage_memory.py.

The peak of an iteration (`rank_memory`) walks the rank's pipeline op order (workload/order.py)
part by part (embedding, each layer, head and loss), adding what each forward keeps and taking
it back in its backward, with what each step holds only while it runs:
- activations per micro-batch and layer: the model profile's count (the block in the model's
  dtype, SP when tp > 1), plus what the engine keeps beyond it: without SP the norms' and
  residual's tokens are not sharded; under autocast (fp16) the residual stream stays fp32 (the norms
  keep fp32 inputs: 2 B more per element) and each matmul casts its fp32 input on its own (wq,
  wk, wv and w_gate, w_up: five bf16 copies where a bf16 model keeps two), and each layer keeps
  the bf16 copies of its weights (autocast's cache) until its backward (fp16; bf16 weights,
  half_weights, keep the profile's count in bf16 and no copies);
- the head (final norm, LM head, loss): its inputs and this rank's vocabulary shard of the
  logits in the compute dtype (the loss is vocab-parallel, models/loss.py: the logits are never
  gathered, and never converted to fp32 whole, only in chunks); the loss backward holds their
  gradient in the compute dtype and a chunk's fp32 softmax;
- a layer's backward: the gradients flowing through it, its recompute (full: the layer's
  activations again; selective: the attention core's), its weights' fresh gradients;
- gradients: DTensor parameters accumulate .grad over the micro-batches and copy it into the
  bucket after the last (bf16 weights: every micro-batch's gradient is added into its fp32
  bucket at once, which ZeRO 2 allocates at the first); ZeRO 2 allocates a bucket's flat
  gradient in the backward (the first micro-batch when its parameters are views of it, else
  the last) and a 1/dp shard for its reduce-scatter; FSDP gathers a unit's parameters (bf16
  under bf16) for its forward and backward (kept gathered all iteration under a pipeline) and
  makes its unsharded gradients (under bf16 in bf16, cast to fp32 for the reduce-scatter,
  MixedPrecisionPolicy's reduce_dtype), reduce-scattered every micro-batch into fp32 shards
  that accumulate (under a pipeline accumulated unsharded in fp32, reduced after the last);
- after the backward: ZeRO 2 waits with every full bucket and shard alive (gloo copies the
  largest bucket once more); the gradient norm (fp32 norms per tensor, as clip_grad_norm_)
  holds no temporaries worth counting; AdamW foreach (CPU) holds one temporary as
  large as the masters, fused AdamW (CUDA) none; ZeRO 1/2 gather each updated DTensor bucket
  into a full buffer in the weights' dtype (bf16 weights: from a bf16 copy of the slice).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from orchestrator.choices import CpComm, Dtype, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, vocab_rows
from orchestrator.workload.buckets import plan_buckets
from orchestrator.models.attention_tiles import score_tile_rows
from orchestrator.models.loss_chunks import CHUNK_ELEMENTS as LOSS_CHUNK_ELEMENTS
from orchestrator.workload.order import stage_order
from orchestrator.workload.params import (Param, chunk_size, rank_chunks)

from orchestrator.workload.states import (FP32, INT64,
                                          StateBytes,
                                          cp_split_input_bytes, embedding_bytes,
                                          fsdp_shards, half_weights, is_dtensor,
                                          no_sp_extra_bytes_per_token, rank_parameters,
                                          rank_states, sp_degree, weight_dtype)


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
    #             optimizer
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
    autocast = dtype != Dtype.fp32 and not half_weights(dtype)
    elem = dtype.bytes
    kept = act.at(mode) * (elem / act.elem_bytes)
    if mode != Recompute.full:
        kept += cp_attention_bytes(model, layout, tokens, dtype, micro_batch_size)[2]
    if t > 1 and not layout.sequence_parallel:  # the tokens SP would shard, whole
        kept += no_sp_extra_bytes_per_token(mode, t, h, elem) * tokens
    if autocast:
        if mode == Recompute.full:
            kept += tokens * (FP32 - elem) * h / t_sp  # the kept input is fp32
        elif t_sp > 1:
            # the norms' inputs and the column-parallel matmuls' sharded inputs are fp32; those
            # matmuls cast inside sequence_parallel_linears: only wo's and w_down's weight
            # copies stay in autocast's cache
            kept += tokens * (FP32 - elem) * 4 * h / t_sp
            kept += elem * (block_local_numel - column_parallel_numel(model, t))
        else:
            kept += tokens * ((FP32 - elem) * 2 * h / t_sp + 3 * elem * h)
            kept += elem * block_local_numel  # autocast's weight cache
    return kept


def column_parallel_numel(model: ModelConfig, tp: int) -> int:
    """A dense layer's weights one TP rank holds of the matmuls sequence parallelism runs in
    models/parallelize.sequence_parallel_linears: wq, wk, wv, w_gate, w_up (a MoE model's
    layers: the attention's only)."""
    kv = model.kv_heads * (model.hidden // model.heads)
    attention = model.hidden * (model.hidden + 2 * kv)
    mlp = 0 if getattr(model, "experts", 0) else 2 * model.ffn * model.hidden
    return (attention + mlp) // tp


def _head_bytes(model: ModelConfig, layout: ParallelLayout, dtype: Dtype, tokens: int,
                fused_norm: bool, vocab_local: int) -> Tuple[float, float, float]:
    """(kept, forward transient, backward transient) of the head and loss per micro-batch."""
    h, t_sp = model.hidden, sp_degree(layout)
    autocast = dtype != Dtype.fp32  # logits in the compute dtype, fp32 only in chunks
    elem = dtype.bytes if autocast else FP32
    residual = weight_dtype(dtype).bytes
    norm = tokens / t_sp * (residual * h + FP32 + (0 if fused_norm else residual * h))
    head_in = tokens * elem * h
    if autocast and not half_weights(dtype):
        head_in += elem * vocab_local * h  # autocast's cast of its weight
    # models/loss.py keeps this rank's vocabulary shard of the logits in the compute dtype (the
    # pipeline's stage output too: the same tensor), a log-sum-exp per token, the targets'
    # local ids and two masks; it works on fp32 chunks of at most CHUNK_ELEMENTS logits.
    logits = tokens * vocab_local * elem
    kept = norm + head_in + logits + tokens * (INT64 + FP32 + 2)
    chunk = FP32 * np.minimum(tokens * vocab_local,
                              max(1, LOSS_CHUNK_ELEMENTS // vocab_local) * vocab_local)
    forward = chunk if autocast else 0.0  # a chunk's fp32 copy
    # the logits' gradient, whole; a chunk's softmax (and its fp32 copy under autocast)
    backward = logits + chunk * (2 if autocast else 1)
    return kept, forward, backward


def _block_working(model: ModelConfig, layout: ParallelLayout, tokens: int,
                   dtype: Dtype = Dtype.fp32, micro_batch_size=None) -> float:
    """A layer's backward, beyond its kept activations: the gradients flowing through it (the
    residual's and the MLP's intermediate ones) while its weights' gradients are made, and
    context-parallel attention's own (cp_attention_bytes); with SP, the column-parallel
    matmuls' input gathered again (in the residual stream's dtype, and its cast under autocast
    over fp32 weights)."""
    residual = weight_dtype(dtype).bytes
    regather = 0.0
    if sp_degree(layout) > 1:
        cast = Dtype.parse(dtype) != Dtype.fp32 and not half_weights(dtype)
        regather = tokens * model.hidden * (residual + (Dtype.parse(dtype).bytes if cast else 0))
    return (residual * tokens * (2 * model.hidden / sp_degree(layout) + 2 * model.ffn / layout.tp)
            + regather + cp_attention_bytes(model, layout, tokens, dtype, micro_batch_size)[1])


def cp_attention_bytes(model: ModelConfig, layout, tokens, dtype: Dtype = Dtype.fp32,
                       micro_batch_size=None):
    """(forward working, backward working, kept beyond one-rank attention) bytes of one layer's
    context-parallel attention for a micro-batch of `tokens` of this rank's (0 without CP) in
    `micro_batch_size` sequences (default the layout's; numpy arrays: the dynamic planner's
    micro-batches).

    The ring (p2p) computes in fp32 (models/attention_tiles.py): a tile of a block's scores
    (query rows x seq / cp keys per head) and its exponential; forward the output's running sum
    and the block's K and V expanded to every query head, the block held and the one arriving;
    backward the tile's probabilities and their gradient, expanded K and V, the gradients of q,
    k and v, the block, its gradient and the two arriving; under autocast fp32 copies of q (and
    of the output's gradient). allgather keeps the gathered K and V (cp blocks where one-rank
    attention keeps one) and its backward holds their gradients whole. a2a (Ulysses) keeps what
    one-rank attention keeps (a head split of the whole sequence is as large as all heads of s /
    cp); its all-to-alls' buffers are working memory. a2a+p2p: the ring's, on the head-split
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
    states = rank_states(model, layout, rank, seq_len, bucket_MiB, dtype)
    half = half_weights(dtype)
    weight = weight_dtype(dtype).bytes  # the weights' (ZeRO-3: gathered) and their gradients
    fsdp_grad = FP32 + (weight if half else 0)  # bytes per element of a unit's fresh gradients
    params = rank_parameters(model, layout, rank)
    numel = [p.local_numel for p in params]
    pp_rank = layout.coordinate(rank, "pp")
    dp, zero, m = layout.replicas, layout.zero, layout.num_micro_batches
    tokens = layout.micro_batch_size * seq_len // layout.cp  # this rank's
    vocab_local = chunk_size(vocab_rows(model, layout.tp), layout.tp,
                             layout.coordinate(rank, "tp"))
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
    shards = fsdp_shards(params, layout, rank) if zero == 3 else []

    live = _Live()
    live.add("inputs", cp_split_input_bytes(layout, seq_len))
    if gathered_all:
        live.add("fsdp gathered params", weight * sum(fsdp_units.values()))
    done_backward: Dict[Tuple[int, int], int] = {}  # (chunk, part) -> backwards done
    order = stage_order(layout.pp, pp_rank, m, layout.schedule, layout.virtual_stages)
    for op, c, mb in order:
        tag = f"{'forward' if op == 'F' else 'backward'} F{c}.{mb}"
        if op == "F":
            for part in parts[c]:
                transient = {}
                if zero == 3 and not gathered_all:
                    transient["fsdp gathered params"] = _fsdp_gathered(part, unit_of_part,
                                                                      fsdp_units, weight=weight)
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
            if zero == 3 and not gathered_all:
                # this unit, the next one prefetched, and the root
                transient["fsdp gathered params"] = _fsdp_gathered(
                    part, unit_of_part, fsdp_units, prefetch=True, weight=weight)
                # its unsharded gradients, reduce-scattered every micro-batch (bf16 weights:
                # made in bf16, cast to fp32 for the reduce-scatter); the head's are the root
                # unit's, reduce-scattered with the embedding's after the whole backward
                made = sum(numel[i] for i in part.params)
                transient["fresh gradients"] = (weight if part.kind == "head"
                                                else fsdp_grad) * made
            else:  # a weight's gradient before it is copied into its bucket
                transient["fresh gradients"] = max(numel[i] for i in part.params) * weight
            live.check(tag, transient)
            live.add("activations", -kept(part))
            count = done_backward[(c, j)] = done_backward.get((c, j), 0) + 1
            _gradients(part, count, m, params, numel, layout, plans, bucket_of, viewable, owned,
                       allocated, fsdp_units, unit_of_part, live, half, shards)
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
        shard = sum(shards)
        live.kinds = {"sharded gradients": FP32 * shard}
        live.check("optimizer", {"adamw temporaries": 0 if cuda else FP32 * shard})
    else:
        shards = sum(FP32 * o for o in owned) if (zero == 2 and dp > 1) else 0.0
        live.kinds = {"gradient shards": shards}
        master = sum(FP32 * o for o in owned)
        live.check("optimizer", {"adamw temporaries": 0 if cuda else master})
        # the gathered bucket (DTensor buckets) and, bf16 weights, the slice's bf16 copy
        gather = [weight * ((not viewable[b]) * plans[b].numel + half * owned[b])
                  for b in range(len(plans)) if zero > 0 and dp > 1]
        gather = [g for g in gather if g]
        if gather:
            live.kinds = {}
            live.check("optimizer", {"parameter all-gather": max(gather)})
    return MemoryBytes(states=states, peak=states.total + live.peak, phase=live.phase,
                       at_peak=live.at_peak)


def _fsdp_gathered(part, unit_of_part, fsdp_units, prefetch: bool = False,
                   weight: int = FP32) -> float:
    """FSDP2 parameters gathered while `part` runs without a pipeline: its unit (one more
    block prefetched in the backward) and the root unit, which FSDP2 never reshards between
    forward and backward."""
    unit = unit_of_part[part]
    gathered = fsdp_units.get("root", 0)
    if unit != "root":
        gathered += fsdp_units[unit] * (2 if prefetch else 1)
    return weight * gathered


def _gradients(part, count, m, params, numel, layout, plans, bucket_of, viewable, owned,
               allocated, fsdp_units, unit_of_part, live, half: bool = False,
               shards=()) -> None:
    """What the backward of `part` (its `count`-th of m this iteration) leaves allocated
    (`half`: bf16 weights, whose gradients go into their fp32 bucket every micro-batch;
    `shards`: each parameter's FSDP2 shard, ZeRO 3)."""
    zero, dp = layout.zero, layout.replicas
    size = FP32 * sum(numel[i] for i in part.params)
    if zero == 3 and layout.pp == 1:  # reduce-scattered: the fp32 shards accumulate
        if count == 1:
            live.add("sharded gradients", FP32 * sum(shards[i] for i in part.params))
        return
    if zero == 3:  # a pipeline defers the reduce-scatter to the last micro-batch
        if count == 1 and m > 1:
            live.add("gradient accumulators", FP32 * fsdp_units[unit_of_part[part]]
                     if part.kind == "block" else size)
        return
    own = [] if half else [i for i in part.params if not viewable[bucket_of[i]]]
    own_size = FP32 * sum(numel[i] for i in own)
    if m > 1 and count == 1 and own_size:
        live.add("gradient accumulators", own_size)  # DTensor .grad until the last micro-batch
    if count == m and m > 1 and own_size:
        live.add("gradient accumulators", -own_size)  # copied into its bucket
    if zero != 2 or dp == 1:
        return
    for i in part.params:
        b = bucket_of[i]
        first = (viewable[b] or half) and count == 1
        if b not in allocated and (first or count == m):
            allocated.add(b)
            live.add("gradient buckets", FP32 * plans[b].numel)
        if count == m and -1 - b not in allocated:  # its reduce-scatter's output, at launch
            allocated.add(-1 - b)
            live.add("gradient shards", FP32 * owned[b])
