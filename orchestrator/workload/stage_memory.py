"""The closed form of a stage's memory the search prices (StageMemory): the peak of
workload/memory.py's walk, per stage and per layer count at once, held equal to it by tests."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from orchestrator.choices import Dtype, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, vocab_rows
from orchestrator.workload.order import stage_order
from orchestrator.workload.params import (Param, block_parameters, chunk_size, is_expert)

from orchestrator.workload.memory import (BlockActivations, _block_working, _head_bytes,
                                          engine_block_bytes)
from orchestrator.workload.states import (FP32, FP64, INT64,
                                          cp_split_input_bytes, embedding_bytes, half_weights,
                                          input_bytes, stage_buffer_bytes, weight_dtype)


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
    # A backward's bytes grow with the chunks in flight (each keeps >= 0 bytes) and otherwise
    # depend only on (gradients accumulated before, last micro-batch): the most chunks in flight
    # of each such pair has the pair's peak, so at most 4 events per stage are kept.
    events = []
    for j in range(pp):
        most: Dict[Tuple[int, bool], int] = {}
        for live, done, last in _b_events(pp, j, m, schedule, v):
            most[(done, last)] = max(live, most.get((done, last), live))
        events.append([(live, done, last) for (done, last), live in most.items()])
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
        vocab_local = chunk_size(vocab_rows(model, layout.tp), layout.tp, 0)
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
        h, vocab = model.hidden, vocab_rows(model, layout.tp)
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
        # ZeRO 3 without a pipeline: the head's fresh gradients in the loss backward (the root
        # unit's, reduce-scattered after the whole backward: in the weights' dtype until then)
        self.head_fresh = (weight_dtype(dtype).bytes * last
                           if (layout.zero == 3 and layout.pp == 1) else 0.0 * last)
        self.other_numel = counts.other
        largest_other = np.maximum(np.where(first > 0, vocab_local * h, 0),
                                   np.where(last > 0, vocab_local * h, 0))
        self.largest_block_param = float(max(block))
        self.largest_param = np.maximum(max(block), largest_other)

        # States per element of this rank's parameters (bf16 weights: an fp32 master always).
        owned_div = dp if zero >= 1 else 1
        half = self.half = half_weights(dtype)
        weight = self.weight = weight_dtype(dtype).bytes  # weights, gathered, their gradients
        # ZeRO 3: bytes per element of a unit's fresh gradients (bf16 ones and their fp32 cast)
        self.fsdp_grad = FP32 + (weight if half else 0)
        if zero == 3:
            self.per_elem = {"params": FP32 / dp, "grads": 0.0, "optim": 2 * FP32 / dp}
        else:
            master = (FP32 if tp > 1 or half else 0.0) if zero == 0 else FP32 / dp
            self.per_elem = {"params": weight + master, "grads": FP32 if zero < 2 else 0.0,
                             "optim": 2 * FP32 / owned_div}
        edp = layout.edp
        self.expert_per_elem = dict(self.per_elem)
        if self.expert_numel and zero == 3:  # FSDP2 units of their own over edp
            self.expert_per_elem = {"params": FP32 / edp, "grads": 0.0, "optim": 2 * FP32 / edp}
        elif self.expert_numel:  # DTensors on the expert mesh, sharded over edp
            split = layout.ep * layout.etp > 1
            master = (FP32 if split or half else 0.0) if zero == 0 else FP32 / edp
            self.expert_per_elem = {"params": weight + master,
                                    "grads": FP32 if zero < 2 else 0.0,
                                    "optim": 2 * FP32 / (edp if zero >= 1 else 1)}
        sp_norms = tp > 1 and layout.sequence_parallel and zero < 3
        self.norm_index_per_elem = (INT64 + FP64) / owned_div if sp_norms else 0.0
        self.buffers = np.array([stage_buffer_bytes(model, layout, j, seq_len, dtype)
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
        weight, early = self.weight, self._buckets_early()
        accum = np.zeros_like(numel)
        always = np.zeros_like(numel)
        if zero == 3 and pp == 1:  # every micro-batch's reduce-scatter: the fp32 shards
            accum = FP32 * self._fsdp_shard(j, n)
        elif zero == 3:  # under a pipeline: unsharded until the last micro-batch, kept gathered
            if m > 1:
                accum = FP32 * numel
            always = weight * numel
        elif zero == 2 and dp > 1 and early:
            accum = FP32 * numel  # the buckets, from the first backward
        elif self.tp > 1 and m > 1 and not self.half:
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
            gathered = weight * (self.other_numel.sum() + 2 * self.block_numel)
        if zero == 3:  # a unit's unsharded gradients (kept gathered under a pipeline: none)
            fresh = fresh_end = 0.0 if pp > 1 else self.fsdp_grad * self.block_numel
        else:  # a weight's gradient before it is copied into its bucket
            fresh, fresh_end = (weight * self.largest_block_param,
                                weight * self.largest_param[j])
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
        if zero == 2 and early and dp > 1:
            start_accum = np.where(done, x(bucket_only), 0.0)
        else:
            start_accum = np.where(done, x(accum), 0.0)
        inflight = live * x(per_chunk) + start_accum
        start = inflight + x(block) + x(fresh) + x(gathered)
        root = weight * self.other_numel.sum() if (zero == 3 and pp == 1) else 0.0
        loss = (inflight + x(self.head_kept[j] + self.end_working[j] + self.head_fresh[j])
                + (x(fresh_end) if zero < 3 else 0.0) + root)
        start = np.where(x(last_stage), np.maximum(start, loss), start)
        # It ends: one chunk fewer, the gradients it made (ZeRO 2's buckets on the last
        # micro-batch), the embedding's gradient of its vocabulary rows on the first stage.
        if zero == 2 and dp > 1:
            end_accum = np.where(last_mb, x(buckets), x(bucket_only) if early else x(accum))
        elif zero < 3:
            end_accum = np.where(last_mb, 0.0, x(accum))
        else:
            end_accum = x(accum) + 0.0 * last_mb
        end_working = np.where(first_stage, FP32 * self.vocab_local * self.model.hidden, block)
        end = ((live - 1) * x(per_chunk) + end_accum + x(end_working)
               + x(np.where(first_stage, fresh_end, fresh)) + x(gathered))
        peak = np.maximum(start, end).max(axis=-1)
        return np.maximum(peak + always, self.tail_above_states(j, n))

    def _buckets_early(self) -> bool:
        """Whether ZeRO 2's buckets exist from the first micro-batch's backward: plain
        parameters' gradients are views of them (no TP), bf16 weights add into them."""
        return self.tp == 1 or self.half

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
        fresh = (self.weight * self.largest_block_param if self.zero < 3 else
                 (0.0 if pp > 1 else self.fsdp_grad * self.block_numel))
        fresh_end = self.weight * self.largest_param[:, None] if self.zero < 3 else 0.0
        block = (_block_working(self.model, layout, tokens, self.dtype, micro_batch_size)
                 + recompute + fresh)
        end = np.where(first, FP32 * self.vocab_local * self.model.hidden + fresh_end, 0.0)
        extra = np.maximum(np.maximum(block, end),
                           np.where(last, head_kept + head_bwd + fresh_end
                                    + self.head_fresh[:, None], 0.0))
        numel = n[:, 0] * self.block_numel + self.other_numel
        fixed = np.zeros(pp)
        if self.zero == 3 and pp == 1:  # the fp32 shards; the root, a unit and the next
            fixed = (FP32 * self._fsdp_shard(np.arange(pp), n[:, 0])
                     + self.weight * (self.other_numel.sum() + 2 * self.block_numel))
        elif self.zero == 3:
            fixed = numel * (self.weight + FP32 * (self.m > 1))
        elif self.zero == 2 and self.dp > 1:
            fixed = FP32 * numel * (1 + 1 / self.dp)
        elif self.tp > 1 and self.m > 1 and not self.half:
            fixed = FP32 * numel
        return stored, extra, fixed

    def _fsdp_shard(self, j, n):
        """Elements of stage j's FSDP2 shards with n layers: the routed experts' over edp,
        the rest over dp x cp."""
        n = np.asarray(n, dtype=float)
        return ((n * self.layer_numel + self.other_numel[j]) / self.dp
                + n * self.expert_numel / self.layout.edp)

    def tail_above_states(self, j, n):
        """After the backward: ZeRO 2's buckets and shards, AdamW's foreach temporary (CPU),
        ZeRO 1/2's parameter all-gather (the gradient norm holds no temporaries)."""
        numel = np.asarray(n, dtype=float) * self.block_numel + self.other_numel[j]
        zero, dp, cuda = self.zero, self.dp, self.cuda
        if zero == 3:
            shard = self._fsdp_shard(j, n)
            return FP32 * shard + (0.0 if cuda else FP32 * shard)
        bucket = np.maximum(np.minimum(self.bucket_limit, np.ceil(numel / 4)),
                            self.largest_param[j])
        owned = bucket / dp if zero >= 1 else bucket
        master = numel / dp if zero >= 1 else numel
        shards = FP32 * numel / dp if (zero == 2 and dp > 1) else 0.0
        # the optimizer step (an array per n, also when it holds nothing more)
        tail = shards + np.where(cuda, 0.0, FP32 * master)
        if zero >= 1 and dp > 1 and (self.tp > 1 or self.half):
            # the gathered bucket (DTensor buckets), bf16 weights' copy of the owned slice
            tail = np.maximum(tail, self.weight * ((self.tp > 1) * bucket + self.half * owned))
        if zero == 2 and dp > 1:
            tail = np.maximum(tail, FP32 * numel + shards + (0.0 if cuda else FP32 * bucket))
        return tail


def _block_params(model: ModelConfig, layout: ParallelLayout) -> List[Param]:
    """The parameters of one block the closed form prices every layer as: a MoE block's for a
    MoE model (the first `dense_layers` blocks too: docs/stages/search.md), block 0's
    otherwise."""
    index = getattr(model, "dense_layers", 0) if getattr(model, "experts", 0) else 0
    return block_parameters(model, index, layout.tp, 0, layout.ep, layout.etp)
