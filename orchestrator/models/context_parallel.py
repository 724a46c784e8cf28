"""Context parallelism: one sequence split over the `cp` ranks of a group, attention over all of it.

The split balances the causal mask (Megatron-Core's): the sequence is cut into 2 * cp equal
chunks and CP rank r keeps chunks r and 2cp - 1 - r, so that every rank holds as many early
(cheap) as late (expensive) queries. Everything but attention is per token and runs on the
rank's own tokens unchanged; rotary embeddings take the tokens' global positions.

Attention reaches the other ranks' keys and values in one of two flavours (Megatron's
`--cp-comm-type`); per layer and micro-batch, with kv = 2 x b x (s / cp) x kv_heads/tp x head_dim
elements (this rank's K and V, in their dtype):
- "p2p", the ring (the default): cp steps; at step i a rank computes its queries against the K/V
  block of CP rank r - i while it sends that block on to rank r + 1 and receives the next
  (cp - 1 sends of kv forward). The backward walks the ring again: each block's K/V (cp - 1
  sends) and the gradient accumulated for it (cp sends: the last one brings the block's gradient
  home). Blocks are merged by their log-sum-exp (flash attention's rule); a rank keeps for the
  backward only what one-rank attention keeps (its q, k, v, the output and the log-sum-exp).
- "allgather" (what Llama 3 trained with): the keys and values of the whole sequence are
  all-gathered over the CP group (2 all-gathers of cp x kv / 2) before the attention core, and
  the core's backward reduce-scatters their gradients; the gathered K/V stay alive until the
  layer's backward.
- "a2a" (DeepSpeed's Ulysses, Megatron's a2a): an all-to-all each for Q, K and V trades the
  sequence split for a head split (all s tokens, heads / cp of the rank's: tp x cp must divide
  the heads and the KV heads), the attention core runs on the whole sequence, and one
  all-to-all brings the output back to the sequence split; the backward the same four for the
  gradients. What stays for the backward is as large as one-rank attention's.
- "a2a+p2p" (Megatron's hierarchical): Ulysses over groups of `cp_a2a` consecutive CP ranks, then
  the ring above over the cp / cp_a2a groups on the head-split tensors: each ring member holds
  its group's tokens (cp_a2a x s / cp of each sequence, 1 / cp_a2a of the rank's heads), so its
  ring messages are as large as the plain ring's, cp / cp_a2a - 1 of them per pass.
A query attends to a key when the key's global position is not after its own: masks of seq / cp
x seq booleans in all per sequence length (one per ring block, or one for the gathered
sequence; seq x seq for a2a), made once and kept with the rotary tables at this rank's
positions.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from orchestrator.choices import CpComm
from orchestrator.dist_names import all_gather_single, reduce_scatter_single
from orchestrator.models.attention_tiles import SCORE_TILE_BYTES, score_tile_rows


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions (int64, ascending) of the tokens CP rank `cp_rank` of `cp` keeps: chunks
    cp_rank and 2cp - 1 - cp_rank of 2cp equal chunks. ValueError unless 2cp divides seq_len."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank({cp_rank}) must be in 0..cp({cp})-1")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len({seq_len}) % (2 * cp({cp})) != 0: context parallelism cuts "
                         f"the sequence into 2 * cp equal chunks")
    size = seq_len // (2 * cp)
    first, second = cp_rank * size, (2 * cp - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def ring_of(group):
    """(size, this rank's index, the next rank's and the previous rank's global rank) of a ring
    over the ranks of `group`, in group order."""
    import torch.distributed as dist

    size, index = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    return size, index, ranks[(index + 1) % size], ranks[(index - 1) % size]


class ContextParallel:
    """This rank's share of context-parallel sequences: its CP group and flavour (one of
    CpComm), and for a sequence of `seq_len` tokens the global positions of its
    tokens and of the all-gathered sequence's (every rank's chunks, in CP-rank order)."""

    def __init__(self, group, comm: CpComm = CpComm.p2p, score_tile_bytes: int = SCORE_TILE_BYTES,
                 levels=None):
        """`levels`: for a2a+p2p, (this rank's group of cp_a2a CP ranks, its ring group)."""
        import torch.distributed as dist

        if comm not in tuple(CpComm):
            raise ValueError(f"cp_comm {comm!r}: context parallelism runs "
                             f"{' or '.join(CpComm)}")
        comm = CpComm(comm)
        self.group, self.comm, self.score_tile_bytes = group, comm, score_tile_bytes
        self.cp, self.cp_rank, self.next_rank, self.prev_rank = ring_of(group)
        self._positions = {}
        self._cache = {}  # masks and rotary tables, per sequence length and device
        if comm == CpComm["a2a+p2p"]:
            inner, ring = levels
            self.inner = SimpleNamespace(group=inner, cp=dist.get_world_size(inner))
            self.ring = _RingLevel(self, ring, self.inner.cp)

    def positions(self, seq_len: int) -> torch.Tensor:
        """(seq_len / cp,) the global positions of this rank's tokens."""
        return self._both(seq_len)[0]

    def gathered_positions(self, seq_len: int) -> torch.Tensor:
        """(seq_len,) the global positions of the all-gathered tokens, in gathered order."""
        return self._both(seq_len)[1]

    def _both(self, seq_len: int):
        if seq_len not in self._positions:
            gathered = torch.cat([chunk_positions(seq_len, self.cp, r) for r in range(self.cp)])
            self._positions[seq_len] = (chunk_positions(seq_len, self.cp, self.cp_rank), gathered)
        return self._positions[seq_len]

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (tokens, targets, a full activation)."""
        return x.index_select(dim, self.positions(x.shape[dim]).to(x.device))

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, local_len: int):
        """The rotary tables at the positions of this rank's `local_len` tokens (made once per
        length and device: every layer uses them)."""
        key = ("rotary", local_len, str(cos.device))
        if key not in self._cache:
            index = self.positions(local_len * self.cp).to(cos.device)
            self._cache[key] = (cos.index_select(0, index), sin.index_select(0, index))
        return self._cache[key]

    def block_mask(self, seq_len: int, source, device) -> torch.Tensor:
        """(seq / cp, seq / cp) bool: which keys of CP rank `source`'s tokens this rank's
        queries attend to; source "all": (seq / cp, seq), the all-gathered sequence's; "whole":
        (seq, seq), the gathered sequence's queries against its keys (a2a). Made once per
        sequence length and device."""
        key = (seq_len, source, str(device))
        if key not in self._cache:
            mine = (self.gathered_positions(seq_len) if source == "whole"
                    else self.positions(seq_len))
            theirs = (self.gathered_positions(seq_len) if source in ("all", "whole")
                      else chunk_positions(seq_len, self.cp, source))
            self._cache[key] = (mine[:, None] >= theirs[None, :]).to(device)
        return self._cache[key]

    def shift(self, t: torch.Tensor):
        """Send `t` to the next rank of the ring and receive the previous rank's tensor of the
        same shape: (requests to wait for, the receive buffer)."""
        import torch.distributed as dist

        received = torch.empty_like(t)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t, self.next_rank, self.group),
            dist.P2POp(dist.irecv, received, self.prev_rank, self.group)])
        return requests, received

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values:
        q, k, v (batch, heads, local seq, head_dim), K/V heads may be fewer (GQA)."""
        if self.comm == CpComm.p2p:
            return _RingAttention.apply(q, k, v, self)
        if self.comm == CpComm.a2a:
            return self._ulysses_attention(q, k, v)
        if self.comm == CpComm["a2a+p2p"]:
            hq, hk, hv = (SwapSplit.apply(t, self.inner, True) for t in (q, k, v))
            return SwapSplit.apply(_RingAttention.apply(hq, hk, hv, self.ring), self.inner,
                                   False)
        return self._gathered_attention(q, k, v)

    def _ulysses_attention(self, q, k, v):
        seq_len = q.shape[2] * self.cp
        hq, hk, hv = (SwapSplit.apply(t, self, True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(hq, hk, hv, enable_gqa=True,
                                             attn_mask=self.block_mask(seq_len, "whole", q.device))
        return SwapSplit.apply(out, self, False)

    def _gathered_attention(self, q, k, v):
        seq_len = q.shape[2] * self.cp
        k_all, v_all = (_GatherSequence.apply(t, self) for t in (k, v))
        return F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=True,
                                              attn_mask=self.block_mask(seq_len, "all", q.device))


class _GatherSequence(torch.autograd.Function):
    """K or V (batch, heads, seq / cp, dim) all-gathered over the CP group along the sequence
    (CP-rank order), its gradient reduce-scattered back, by blocking c10d collectives like the
    rest of the engine's (torch's functional all-gather, whose backward reduce-scatters
    asynchronously, crashed gloo ranks twice in ~15 runs of the test layouts on a loaded
    machine: free(): invalid size, a segfault)."""

    @staticmethod
    def forward(ctx, t, context):

        ctx.context = context
        mine = t.permute(2, 0, 1, 3).contiguous()  # the sequence first: the gathered dim
        gathered = mine.new_empty((context.cp * mine.shape[0],) + mine.shape[1:])
        all_gather_single(gathered, mine, group=context.group)
        return gathered.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):

        context = ctx.context
        whole = grad.permute(2, 0, 1, 3).contiguous()
        mine = whole.new_empty((whole.shape[0] // context.cp,) + whole.shape[1:])
        reduce_scatter_single(mine, whole, group=context.group)
        return mine.permute(1, 2, 0, 3), None


class _RingLevel:
    """The ring of a2a+p2p, over the cp / a groups of a consecutive CP ranks (`group`: this
    rank's ring); after the all-to-all a member holds its group's tokens, its CP ranks' chunks
    in CP-rank order. What _RingAttention asks of a context: cp, cp_rank, score_tile_bytes,
    block_mask, shift."""

    def __init__(self, context: ContextParallel, group, a: int):
        self.context, self.a, self.group = context, a, group
        self.score_tile_bytes = context.score_tile_bytes
        self.cp, self.cp_rank, self.next_rank, self.prev_rank = ring_of(group)
        self._cache = {}

    def _positions(self, seq_len: int, member: int) -> torch.Tensor:
        cp = self.context.cp
        return torch.cat([chunk_positions(seq_len, cp, member * self.a + j)
                          for j in range(self.a)])

    def block_mask(self, seq_len: int, source: int, device) -> torch.Tensor:
        """(a x seq / cp, a x seq / cp) bool: which keys of ring member `source` this member's
        queries attend to. Made once per sequence length and device."""
        key = (seq_len, source, str(device))
        if key not in self._cache:
            mine = self._positions(seq_len, self.cp_rank)
            theirs = self._positions(seq_len, source)
            self._cache[key] = (mine[:, None] >= theirs[None, :]).to(device)
        return self._cache[key]

    shift = ContextParallel.shift


def all_to_all_heads(t: torch.Tensor, group, cp: int, to_heads: bool) -> torch.Tensor:
    """Ulysses' exchange over a CP group of `cp` ranks, by a blocking all-to-all: (b, h, s / cp,
    d) -> (b, h / cp, s, d) when `to_heads` (head group j to CP rank j; every rank's tokens of
    ours back, in CP-rank order: the gathered sequence), else the reverse."""
    import torch.distributed as dist

    b, h, s, d = t.shape
    if to_heads:
        send = t.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    send = t.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 0, 2, 3, 4).reshape(b, cp * h, s // cp, d)


class SwapSplit(torch.autograd.Function):
    """Sequence split -> head split (`to_heads`) or back (all_to_all_heads); the gradient comes
    back the other way."""

    @staticmethod
    def forward(ctx, t, context, to_heads: bool):
        ctx.context, ctx.to_heads = context, to_heads
        return all_to_all_heads(t, context.group, context.cp, to_heads)

    @staticmethod
    def backward(ctx, grad):
        c = ctx.context
        return all_to_all_heads(grad.contiguous(), c.group, c.cp, not ctx.to_heads), None, None


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (flash attention's accumulation), fp64 for fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V (batch, kv_heads, seq, dim) in the math dtype for every query head (GQA's
    grouping)."""
    return t.to(_math_dtype(t)).repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient for every query head summed back onto its K/V head."""
    b, h, s, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """The ring (module docstring): fp32 math on each block (fp64 for fp64 inputs), merged by
    log-sum-exp, a tile of query rows at a time (ContextParallel.score_tile_bytes of scores)."""

    @staticmethod
    def forward(ctx, q, k, v, context):
        with torch.autocast(q.device.type, enabled=False):
            batch, heads, rows, _ = q.shape
            seq_len, scale = rows * context.cp, q.shape[-1] ** -0.5
            tile = score_tile_rows(batch, heads, rows, rows, context.score_tile_bytes)
            math = _math_dtype(q)
            qf = q.to(math)
            top = torch.full((batch, heads, rows, 1), float("-inf"), dtype=math, device=q.device)
            total = torch.zeros_like(top)
            acc = torch.zeros_like(qf)
            kv = torch.stack([k, v])
            for step in range(context.cp):
                if step < context.cp - 1:  # the next block travels while this one computes
                    requests, incoming = context.shift(kv)
                mask = context.block_mask(seq_len, (context.cp_rank - step) % context.cp,
                                          q.device)
                keys, values = _expand(kv[0], heads), _expand(kv[1], heads)
                for r in range(0, rows, tile):
                    rs = slice(r, r + tile)
                    scores = (qf[:, :, rs] @ keys.transpose(-1, -2)) * scale
                    scores.masked_fill_(~mask[rs], float("-inf"))
                    # the own block (step 0) holds every query's diagonal: `top` is finite
                    # after it, and a row a later block hides entirely adds exp(-inf) = 0
                    new_top = torch.maximum(top[:, :, rs], scores.amax(-1, keepdim=True))
                    weights = torch.exp(scores.sub_(new_top))
                    rescale = torch.exp(top[:, :, rs] - new_top)
                    total[:, :, rs] = total[:, :, rs] * rescale + weights.sum(-1, keepdim=True)
                    acc[:, :, rs] = acc[:, :, rs] * rescale + weights @ values
                    top[:, :, rs] = new_top
                    del scores, weights
                del keys, values
                if step < context.cp - 1:
                    _wait(requests)
                    kv = incoming
            out = (acc / total).to(q.dtype)
            lse = (top + torch.log(total)).squeeze(-1)
        ctx.context = context
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        context = ctx.context
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            batch, heads, rows, _ = q.shape
            kv_heads, seq_len, scale = k.shape[1], rows * context.cp, q.shape[-1] ** -0.5
            tile = score_tile_rows(batch, heads, rows, rows, context.score_tile_bytes)
            math = _math_dtype(q)
            qf, dout = q.to(math), grad_out.to(math)
            delta = (dout * out.to(math)).sum(-1, keepdim=True)
            lse = lse.unsqueeze(-1)
            dq = torch.zeros_like(qf)
            kv, dkv = torch.stack([k, v]), None
            for step in range(context.cp):
                if step < context.cp - 1:
                    requests, incoming = context.shift(kv)
                mask = context.block_mask(seq_len, (context.cp_rank - step) % context.cp,
                                          q.device)
                keys, values = _expand(kv[0], heads), _expand(kv[1], heads)
                dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
                for r in range(0, rows, tile):
                    rs = slice(r, r + tile)
                    scores = (qf[:, :, rs] @ keys.transpose(-1, -2)) * scale
                    scores.masked_fill_(~mask[rs], float("-inf"))
                    probs = torch.exp(scores.sub_(lse[:, :, rs]))
                    del scores
                    dv += probs.transpose(-1, -2) @ dout[:, :, rs]
                    dscores = (dout[:, :, rs] @ values.transpose(-1, -2)).sub_(delta[:, :, rs])
                    dscores.mul_(probs)
                    del probs
                    dq[:, :, rs] += (dscores @ keys) * scale
                    dk += (dscores.transpose(-1, -2) @ qf[:, :, rs]) * scale
                    del dscores
                mine = torch.stack([_fold(dk, kv_heads), _fold(dv, kv_heads)])
                del keys, values, dk, dv
                # the gradient so far of the block held travels on with it: after cp steps
                # each block's is back with its owner, whole
                dkv = (mine if dkv is None else dkv.to(math) + mine).to(k.dtype)
                grad_requests, grad_incoming = context.shift(dkv)
                if step < context.cp - 1:
                    _wait(requests)
                    kv = incoming
                _wait(grad_requests)
                dkv = grad_incoming
        return dq.to(q.dtype), dkv[0], dkv[1], None
