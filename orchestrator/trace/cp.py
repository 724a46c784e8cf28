"""Context-parallel attention as a Megatron-Core rank on a GPU issues it (TransformerEngine's
flash-attention kernels per block), on meta tensors, for the trace (`trace.cp`).

The sequence is cut into 2 * cp chunks and CP rank r holds chunks r and 2cp - 1 - r (the causal
load balance, models/context_parallel.py); q, k, v are (batch, heads / tp, s / cp, head_dim).
Per layer and micro-batch, by `--cp-comm-type`:
- p2p (TransformerEngine's AttnFuncWithCPAndKVP2P): cp steps; at step i the rank computes on
  the K/V block of CP rank r - i while it sends that block on to rank r + 1 and receives the next
  (cp - 1 sends of its K and V, stacked). Step 0 is causal over both chunks; a block from an
  earlier rank is seen by both query chunks through its first chunk only, a block from a later
  rank by the second query chunk only (both of its chunks): every step after the first is half
  a block, so every CP rank does the same work, in a different order of the two half shapes.
  Blocks are merged by their log-sum-exp. The backward walks the ring again: the K/V block
  (cp - 1 sends) and the gradient accumulated for it (cp sends: the last brings it home), the
  messages stage=train's ring sends too (workload/comm.py).
- allgather (AttnFuncWithCPAndKVAllGather): K and V all-gathered over the CP group, put back in
  sequence order, and each query chunk attends causally to the keys up to its own end; the
  backward reduce-scatters dK and dV.
- a2a (AttnFuncWithCPAndQKVOA2A, DeepSpeed's Ulysses): an all-to-all each for Q, K and V trades
  the sequence split for a head split (all s tokens, heads / (tp x cp)), causal attention over
  the whole sequence, one all-to-all brings the output back; the backward the same four for the
  gradients.
- a2a+p2p (hierarchical, Megatron's --hierarchical-context-parallel-sizes a cp/a): Ulysses'
  all-to-alls over the `a` consecutive CP ranks of group cp_a2a (a head split of their tokens),
  and the ring above over the cp / a ranks of group cp_ring on those tensors.
Grouped-query K/V heads are repeated to the query heads before a kernel, as the trace's attention
without CP does (tracer._flash_attention), and their gradients summed back.

Which CP ranks differ: every CP rank issues the same kernels and messages of the same sizes
(p2p: the two half-block shapes come in a rank-dependent order), to its own ring neighbours;
the trace's representative rank of a stage is CP rank 0.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from orchestrator.choices import CpComm
from orchestrator.dist_names import all_gather_single, reduce_scatter_single
from orchestrator.models.context_parallel import SwapSplit, ring_of

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_backward


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _flash(q, k, v, causal: bool):
    """(output, log-sum-exp, what the backward kernel needs besides them)."""
    out, lse, cq, ck, mq, mk, seed, offset, _ = _FLASH(q, _expand(k, q.shape[1]),
                                                       _expand(v, q.shape[1]), 0.0, causal)
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _flash_backward(grad, q, k, v, out, lse, saved, causal: bool):
    """(dq, dk, dv) of one kernel, dk and dv folded onto the K/V heads."""
    cq, ck, mq, mk, seed, offset = saved
    heads, kv_heads = q.shape[1], k.shape[1]
    dq, dk, dv = _FLASH_BWD(grad, q, _expand(k, heads), _expand(v, heads), out, lse, cq, ck,
                            mq, mk, 0.0, causal, seed, offset)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


class MegatronContextParallel:
    """This rank's CP group in the fake world and Megatron's attention over it (module doc);
    set as `Attention.context` of the traced model, like models/context_parallel's in train.
    a2a+p2p: `levels` is (the cp_a2a group, the cp_ring group)."""

    def __init__(self, group, comm: CpComm, levels=None):  # as models/context_parallel's
        self.group, self.comm = group, comm
        if comm == CpComm["a2a+p2p"]:
            inner, ring = levels
            self.inner = SimpleNamespace(group=inner, cp=dist.get_world_size(inner))
            self.ring = MegatronContextParallel(ring, CpComm.p2p)
        self.cp, self.cp_rank, self.next_rank, self.prev_rank = ring_of(group)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, local_len: int):
        # The positions' values do not matter on meta: the tables' shape does (a view).
        return cos[:local_len], sin[:local_len]

    def attention(self, q, k, v):
        if self.comm == CpComm.p2p:
            return _Ring.apply(q, k, v, self)
        if self.comm == CpComm.allgather:
            return _AllGather.apply(q, k, v, self)
        if self.comm == CpComm["a2a+p2p"]:
            return _head_split(q, k, v, self.inner,
                               lambda *qkv: _Ring.apply(*qkv, self.ring))
        return _head_split(q, k, v, self, lambda *qkv: _flash(*qkv, True)[0])

    def shift(self, t: torch.Tensor):
        """Send `t` to the next CP rank, receive the previous one's: (works, received)."""
        received = torch.empty_like(t)
        works = [dist.isend(t, dst=self.next_rank, group=self.group),
                 dist.irecv(received, src=self.prev_rank, group=self.group)]
        return works, received

    def block_part(self, step: int) -> str:
        """Which part of step `step`'s block the rank computes: "causal" (its own), "first_kv"
        (an earlier rank's: all queries, the block's first chunk) or "late_q" (a later rank's:
        the second query chunk, the whole block)."""
        if step == 0:
            return "causal"
        return "first_kv" if step <= self.cp_rank else "late_q"


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _block_views(part: str, q, kv):
    """(queries, keys, values) of a ring step's kernel; the query rows it writes."""
    half = q.shape[2] // 2
    if part == "causal":
        return q, kv[0], kv[1], slice(None)
    if part == "first_kv":
        return q, kv[0][:, :, :half], kv[1][:, :, :half], slice(None)
    return q[:, :, half:], kv[0], kv[1], slice(half, None)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, context):
        out = lse = None
        rests = []  # each kernel's bookkeeping, for its backward
        kv = torch.stack([k, v])
        for step in range(context.cp):
            if step < context.cp - 1:
                works, incoming = context.shift(kv)
            part = context.block_part(step)
            bq, bk, bv, rows = _block_views(part, q, kv)
            block_out, block_lse, rest = _flash(bq, bk, bv, part == "causal")
            rests.append(rest)
            if out is None:
                out, lse = block_out.float(), block_lse
            else:  # the log-sum-exp merge of the rows this block wrote
                merged = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                                   + block_out * torch.exp(block_lse - merged)[..., None])
                lse[:, :, rows] = merged
            if step < context.cp - 1:
                _wait(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.context, ctx.rests = context, rests
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        context = ctx.context
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv, dkv = torch.stack([k, v]), None
        for step in range(context.cp):
            if step < context.cp - 1:
                works, incoming = context.shift(kv)
            part = context.block_part(step)
            bq, bk, bv, rows = _block_views(part, q, kv)
            bdq, bdk, bdv = _flash_backward(grad[:, :, rows], bq, bk, bv, out[:, :, rows],
                                            lse[:, :, rows], ctx.rests[step], part == "causal")
            dq[:, :, rows] += bdq
            mine = torch.zeros_like(kv)
            if part == "first_kv":
                half = q.shape[2] // 2
                mine[0][:, :, :half], mine[1][:, :, :half] = bdk, bdv
            else:
                mine[0], mine[1] = bdk, bdv
            dkv = mine if dkv is None else dkv + mine
            grad_works, grad_incoming = context.shift(dkv)
            if step < context.cp - 1:
                _wait(works)
                kv = incoming
            _wait(grad_works)
            dkv = grad_incoming
        return dq.to(q.dtype), dkv[0], dkv[1], None


def _chunk_ends(context, local_len: int):
    """Global end (exclusive) of each of this rank's two chunks, in tokens."""
    size = local_len // 2
    return ((context.cp_rank + 1) * size, (2 * context.cp - context.cp_rank) * size)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, context):
        k_all, v_all = (_gather(t, context) for t in (k, v))
        half = q.shape[2] // 2
        outs, saved = [], []
        for c, end in enumerate(_chunk_ends(context, q.shape[2])):
            bq = q[:, :, c * half:(c + 1) * half]
            out, lse, rest = _flash(bq, k_all[:, :, :end], v_all[:, :, :end], True)
            outs.append(out)
            saved.append((lse, rest))
        out = torch.cat(outs, dim=2)
        ctx.context, ctx.saved = context, saved
        ctx.save_for_backward(q, k_all, v_all, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        context = ctx.context
        q, k_all, v_all, out = ctx.saved_tensors
        half = q.shape[2] // 2
        dq = torch.empty_like(q)
        dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
        for c, end in enumerate(_chunk_ends(context, q.shape[2])):
            rows = slice(c * half, (c + 1) * half)
            lse, rest = ctx.saved[c]
            bdq, bdk, bdv = _flash_backward(grad[:, :, rows], q[:, :, rows],
                                            k_all[:, :, :end], v_all[:, :, :end],
                                            out[:, :, rows], lse, rest, True)
            dq[:, :, rows] = bdq
            dk_all[:, :, :end] += bdk
            dv_all[:, :, :end] += bdv
        return dq, _scatter(dk_all, context), _scatter(dv_all, context), None


def _gather(t: torch.Tensor, context) -> torch.Tensor:
    """(b, h, s / cp, d) -> (b, h, s, d) all-gathered along the sequence, in sequence order."""
    mine = t.permute(2, 0, 1, 3).contiguous()
    gathered = mine.new_empty((context.cp * mine.shape[0],) + mine.shape[1:])
    all_gather_single(gathered, mine, group=context.group)
    # CP-rank order to sequence order (the chunks of 2cp): a gather of the rows
    return gathered.index_select(0, torch.arange(gathered.shape[0], device=t.device)
                                 ).permute(1, 2, 0, 3)


def _scatter(t: torch.Tensor, context) -> torch.Tensor:
    whole = t.permute(2, 0, 1, 3).contiguous()
    mine = whole.new_empty((whole.shape[0] // context.cp,) + whole.shape[1:])
    reduce_scatter_single(mine, whole, group=context.group)
    return mine.permute(1, 2, 0, 3)


def _head_split(q, k, v, level, core):
    """Ulysses over `level` (its group and size): Q, K, V to a head split of its ranks' tokens,
    `core` on them (autograd: its backward kernels are recorded), the output back."""
    hq, hk, hv = (SwapSplit.apply(t, level, True) for t in (q, k, v))
    return SwapSplit.apply(core(hq, hk, hv), level, False)
