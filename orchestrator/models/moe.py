"""A mixture-of-experts FFN (models/config.py's MoE fields), readable top to bottom.

    x (tokens, hidden) -> router -> softmax -> top_k experts per token, weights renormalised
      -> [capacity: keep the first `capacity` tokens of each expert] -> sort by expert (permute)
      -> dispatch: the experts' SwiGLU on their tokens -> weighted sum back per token (unpermute)
      (+ shared expert on every token)

`MoE.dispatch` is how the permuted tokens reach their experts: None runs every expert here
(one process, or ep = etp = 1); train and trace set an `ExpertParallel` (all-to-all over the EP
group, all-gather / reduce-scatter over the ETP group, Megatron's all-to-all token dispatcher).
The experts are a loop of per-expert GEMMs (not a grouped GEMM: torch's `_grouped_mm` is
CUDA-only and private), each on its own tokens.

Load balancing: the sequence-wise auxiliary loss of DeepSeek-V3, per sequence
sum_i f_i P_i with f_i = experts / (top_k * S) * (tokens of the sequence routed to i) and
P_i = the mean router probability of i, averaged over sequences and weighed by aux_loss_coef.
Per sequence, so that a batch split over data-parallel ranks and micro-batches has the loss of
the whole batch (a single-process reference gives the same numbers); a sequence split over TP
ranks (sequence parallelism) sums its statistics over `sequence_group`. The loss is not added
to the language-model loss: its gradient is injected in backward at the MoE output (Megatron's
MoEAuxLossAutoScaler), scaled by `aux_grad_scale` (the loss scale), and its value is kept for
the step log with the tokens each expert received.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orchestrator.dist_names import all_gather_single
from orchestrator.models.config import ModelConfig, capacity, expert_width
from orchestrator.models.projections import each_linear


class Experts(nn.Module):
    """`experts` SwiGLU FFNs as stacked weights: w_gate, w_up (experts, hidden, width) and
    w_down (experts, width, hidden). Expert parallelism keeps a slice of dim 0 (and of the width
    with etp) on each rank: `forward` reads the local shapes."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, width))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, width))
        self.w_down = nn.Parameter(torch.empty(experts, width, hidden))

    def local_weights(self):
        """This rank's shards (plain tensors) of the three stacks."""
        from torch.distributed.tensor import DTensor

        return tuple(w.to_local() if isinstance(w, DTensor) else w
                     for w in (self.w_gate, self.w_up, self.w_down))

    def forward(self, tokens: torch.Tensor, counts: list) -> torch.Tensor:
        """tokens (sum(counts), hidden) grouped by local expert, counts[e] of expert e -> the
        experts' outputs in the same order (partial sums over the width with etp)."""
        # unbind, not w[e]: the backward of w[e] is a zero tensor of the whole stack per expert,
        # unbind's one stack of every expert's gradient
        w_gate, w_up, w_down = (w.unbind(0) for w in self.local_weights())
        outs = []
        for e, chunk in enumerate(tokens.split(counts)):
            outs.append((F.silu(chunk @ w_gate[e]) * (chunk @ w_up[e])) @ w_down[e])
        # an expert with no tokens still joins the graph: its weights get a zero gradient
        return torch.cat(outs) if outs else tokens[:0]


class SharedExpert(nn.Module):
    """The dense SwiGLU every token goes through (same names as models/gpt.MLP, TP-sharded alike)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden, width, bias=False)
        self.w_up = nn.Linear(hidden, width, bias=False)
        self.w_down = nn.Linear(width, hidden, bias=False)
        self.project = each_linear  # as models/gpt.MLP's (sequence parallelism sets its own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, (self.w_gate, self.w_up))
        return self.w_down(F.silu(gate) * up)


def uniform_counts(assignments: int, experts: int) -> torch.Tensor:
    """`assignments` (tokens x top_k) spread as evenly as possible over `experts` (the first
    take the remainder): the routing a meta tensor (trace) stands for."""
    base, extra = divmod(assignments, experts)
    return torch.tensor([base + (1 if e < extra else 0) for e in range(experts)], device="cpu")


class MoE(nn.Module):
    """The MoE FFN of a block: forward(x (batch, seq, hidden)) -> (batch, seq, hidden)."""

    # The loss scale of the backward (fp16); the aux loss's gradient is injected times it.
    aux_grad_scale: float = 1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.experts_total, self.top_k = cfg.experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, expert_width(cfg))
        self.shared = (SharedExpert(cfg.hidden, cfg.shared_expert_ffn)
                       if cfg.shared_expert_ffn else None)
        # Set from outside (train, trace): how tokens reach experts on other ranks, and the
        # group a sequence is split over (TP with sequence parallelism) for the aux loss.
        self.dispatch: Optional["ExpertParallel"] = None
        self.sequence_group = None
        self.sequence_parts = 1
        # Off while a pipeline stage infers its shapes with a forward of empty tensors (train).
        self.record_stats = True
        self.reset_stats()

    def reset_stats(self) -> None:
        """Clear what the step log reads: summed aux loss, calls, tokens per expert (local)."""
        self.aux_loss_sum = 0.0
        self.aux_calls = 0
        self.tokens_per_expert = torch.zeros(self.experts_total, dtype=torch.long, device="cpu")
        self.dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        logits = self.router(x).float()  # (batch, seq, experts)
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (batch, seq, k)
        weights = weights / weights.sum(-1, keepdim=True)
        aux = self._aux_loss(probs, chosen, seq)

        expert_of = chosen.reshape(-1)  # assignment a = token * k + j
        keep = (self._within_capacity(expert_of)
                if self.capacity_factor and not x.is_meta else None)
        if x.is_meta:  # no values: uniform routing (capped at capacity)
            counts = uniform_counts(expert_of.numel(), self.experts_total)
            if self.capacity_factor:
                counts = counts.clamp(max=capacity(batch * seq, self.top_k, self.experts_total,
                                                   self.capacity_factor))
            order = torch.arange(int(counts.sum()), device=x.device)
        else:
            if keep is not None:
                expert_of = expert_of.masked_fill(~keep, self.experts_total)  # to a bin dropped
            order = expert_of.argsort(stable=True)
            counts = torch.bincount(expert_of, minlength=self.experts_total + 1)
            counts = counts[:self.experts_total].cpu()
            order = order[:int(counts.sum())]
        token_of = order // self.top_k
        permuted = flat[token_of]
        if self.dispatch is None:
            out = self.experts(permuted, counts.tolist())
        else:
            out = self.dispatch(permuted, counts, self.experts)
        gate = weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(flat).index_add(0, token_of, (out * gate).to(flat.dtype))
        y = y.view(batch, seq, hidden)
        if self.shared is not None:
            y = y + self.shared(x)
        self._record(aux, counts, expert_of.numel() - int(counts.sum()))
        if aux is not None and torch.is_grad_enabled():
            y = _InjectAuxLoss.apply(y, aux, self.aux_grad_scale)
        return y

    def _within_capacity(self, expert_of: torch.Tensor) -> torch.Tensor:
        """Keep the first `capacity` assignments of each expert, in token order."""
        cap = capacity(expert_of.numel() // self.top_k, self.top_k, self.experts_total,
                       self.capacity_factor)
        one_hot = F.one_hot(expert_of, self.experts_total)
        position = (one_hot.cumsum(0) * one_hot).sum(-1)  # 1-based rank within its expert
        return position <= cap

    def _aux_loss(self, probs: torch.Tensor, chosen: torch.Tensor, seq: int):
        """The sequence-wise balance loss (times aux_loss_coef), or None when the coef is 0."""
        if not self.aux_loss_coef or probs.is_meta:
            return None
        routed = torch.zeros_like(probs).scatter_(-1, chosen, 1.0).sum(1)  # (batch, experts)
        prob_sum = probs.sum(1)
        if self.sequence_group is not None:  # the sequence's other tokens are on other ranks
            routed = _SumOverGroup.apply(routed, self.sequence_group)
            prob_sum = _SumOverGroup.apply(prob_sum, self.sequence_group)
        seq_total = seq * self.sequence_parts
        f = routed * (self.experts_total / (self.top_k * seq_total))
        p = prob_sum / seq_total
        return self.aux_loss_coef * (f * p).sum(-1).mean()

    def _record(self, aux, counts: torch.Tensor, dropped: int) -> None:
        # A recomputation in backward (full recompute) routes the same tokens again, and a
        # pipeline stage's first forward without gradients infers shapes: count training ones.
        if (not self.record_stats or not torch.is_grad_enabled()
                or torch._C._current_graph_task_id() != -1):
            return
        if aux is not None:
            self.aux_loss_sum += float(aux.detach())
            self.aux_calls += 1
        self.tokens_per_expert += counts
        self.dropped += dropped


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on the activations; in backward, the aux loss gets gradient `scale` (as if it
    were added to the loss) (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: each rank of the group holds the same
    downstream loss and back-propagates it through its own share only (Megatron's
    reduce-from-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ExpertParallel:
    """Megatron's all-to-all token dispatcher over an EP group of `ep` ranks (each holding
    experts / ep consecutive experts) and an ETP group of `etp` ranks (each holding 1/etp of
    every local expert's width): `__call__(tokens sorted by expert, counts per expert (all
    experts), experts module) -> outputs in the same order`.

    1. counts per destination EP rank; the counts matrix is exchanged first (split sizes),
    2. all-to-all of the tokens over EP (autograd: backward is the reverse all-to-all),
    3. regroup the received tokens by local expert (they arrive grouped by source rank),
    4. all-gather over ETP (each ETP rank computes its width slice for all of them),
    5. experts, 6. reduce-scatter over ETP (sum of the width slices, each rank its own tokens),
    7. undo 3 and the all-to-all back.
    On meta tensors (trace, `issue_on_meta`) counts are uniform and no values move; every
    collective, the counts' too, is issued with its split sizes all the same.
    """

    def __init__(self, ep_group, ep: int, etp_group=None, etp: int = 1):
        self.ep_group, self.ep = ep_group, ep
        self.etp_group, self.etp = etp_group, etp
        # Meta tensors are a pipeline stage's shape inference (nothing to move: the output has
        # the input's shape) unless a tracer records the collectives (fake process groups).
        self.issue_on_meta = False

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts):
        if tokens.is_meta and not self.issue_on_meta:
            return torch.empty_like(tokens)
        total = counts.numel()
        local = total // self.ep
        send = counts.view(self.ep, local)  # [dst ep rank, its local expert]
        recv = self._exchange_counts(send, tokens)  # [src ep rank, my local expert]
        x = tokens
        if self.ep > 1:
            x = _all_to_all(x, recv.sum(1).tolist(), send.sum(1).tolist(), self.ep_group)
        # arrive as [src][expert] blocks; experts want [expert][src]
        x, back = _regroup(x, recv)
        per_expert = recv.sum(0)
        if self.etp > 1:
            x, per_expert, gathered = _gather_etp(x, per_expert, self.etp_group, self.etp)
        y = experts(x, per_expert.tolist())
        if self.etp > 1:
            y = _ScatterEtp.apply(y, gathered, self.etp_group)
        y = y[back]
        if self.ep > 1:
            y = _all_to_all(y, send.sum(1).tolist(), recv.sum(1).tolist(), self.ep_group)
        return y

    def _exchange_counts(self, send: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return send.clone()
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send.contiguous(), group=self.ep_group)
        # a traced step (meta tokens, fake process groups) moves no values: under uniform
        # routing every rank sends what this one does
        return send.clone() if tokens.is_meta else out


def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _regroup(x: torch.Tensor, blocks: torch.Tensor):
    """Reorder rows stored as blocks[i][j]-sized runs in (i, j) order into (j, i) order; returns
    the reordered rows and the index that undoes it."""
    rows, cols = blocks.shape
    if rows == 1 or cols == 1:
        index = torch.arange(x.shape[0], device=x.device)
        return x, index
    sizes = blocks.reshape(-1).tolist()
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    pieces = [torch.arange(starts[i * cols + j], starts[i * cols + j] + sizes[i * cols + j])
              for j in range(cols) for i in range(rows)]
    order = torch.cat(pieces).to(x.device) if pieces else torch.arange(0, device=x.device)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=x.device)
    return x[order], back


def _gather_etp(x: torch.Tensor, per_expert: torch.Tensor, group, etp: int):
    """All-gather the ETP group's tokens (each rank's grouped by local expert), regrouped by
    expert over the ranks: returns the tokens, their count per expert, and (sizes per rank and
    expert, the regrouping) for the reduce-scatter back."""
    sizes = torch.empty(etp * per_expert.numel(), dtype=per_expert.dtype)
    all_gather_single(sizes, per_expert.contiguous(), group=group)
    # traced (meta, fake groups: no values): uniform routing, every rank's counts are these
    sizes = per_expert.unsqueeze(0).repeat(etp, 1) if x.is_meta else sizes.view(etp, -1)
    gathered = _GatherEtp.apply(x, sizes.sum(1).tolist(), group)
    y, back = _regroup(gathered, sizes)  # [rank][expert] -> [expert][rank]
    return y, sizes.sum(0), (sizes.sum(1).tolist(), back)


class _GatherEtp(torch.autograd.Function):
    """All-gather rows of different counts per rank (padded to the largest); backward sums the
    ranks' gradients of this rank's rows (every rank used them)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        rank = dist.get_rank(group)
        ctx.sizes, ctx.group, ctx.rank = sizes, group, rank
        return _padded_all_gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


class _ScatterEtp(torch.autograd.Function):
    """Partial outputs of every rank's rows -> the sum over ranks of this rank's rows; backward
    gathers every rank's output gradient (this rank's partials fed all of them)."""

    @staticmethod
    def forward(ctx, y, gathered, group):
        sizes, back = gathered
        rank = dist.get_rank(group)
        ctx.sizes, ctx.group, ctx.back = sizes, group, back
        full = y[back].contiguous()  # [expert][rank] -> [rank][expert]
        dist.all_reduce(full, group=group)
        start = sum(sizes[:rank])
        return full[start:start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        full = _padded_all_gather(grad.contiguous(), ctx.sizes, ctx.group)
        order = torch.empty_like(ctx.back)
        order[ctx.back] = torch.arange(ctx.back.numel(), device=ctx.back.device)
        return full[order], None, None




def _padded_all_gather(x: torch.Tensor, sizes: list, group) -> torch.Tensor:
    most = max(sizes)
    padded = x.new_zeros((most,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((len(sizes) * most,) + tuple(x.shape[1:]))
    all_gather_single(out, padded, group=group)
    return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)])
