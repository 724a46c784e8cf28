"""Data-parallel gradients and the optimizer step for ZeRO 0/1/2, by hand (as Megatron's DDP and
distributed optimizer do), on the local tensors of plain or tensor-parallel (DTensor) parameters.

Gradients are copied into flat buckets (about `bucket_MiB` each, in backward order) as soon as a
parameter's last micro-batch has accumulated into it (a post-accumulate hook counts micro-batches,
so it works for any pipeline schedule), and each bucket's collective starts at once, overlapping
the rest of the backward. One collective per bucket, not per parameter: per-parameter all-reduces
cost ~10x more on gloo.

- ZeRO-0: all-reduce each bucket; every rank updates the whole bucket.
- ZeRO-1: reduce-scatter in place, into the rank's slice of the bucket (Megatron's distributed
  optimizer: half an all-reduce's traffic, the whole bucket kept from step to step); each rank
  updates its 1/dp slice of every bucket, then all-gathers params.
- ZeRO-2: reduce-scatter into a slice of its own (the whole bucket is freed after), then as
  ZeRO-1.
The optimizer (AdamW) runs on fp32 flat master slices, a few big tensors: the step costs a few
fused kernels instead of one per parameter.

bf16 weights (Megatron's bf16: `accumulate_allreduce_grads_in_fp32`): the buckets stay fp32,
each micro-batch's bf16 gradient is added into them at once (and freed), the masters are always
fp32 copies (the whole bucket for ZeRO-0), plain weights are views of one flat bf16 buffer per
bucket, and ZeRO 1/2 all-gather the updated weights in bf16 (Megatron's distributed optimizer
gathers its bf16 parameter buffer).

The buckets hold summed gradients: their mean's division is folded into the step's one scaling
pass with the clip and the fp16 unscale (`step`), where a division of its own read and wrote
every fp32 element once more each step (8 bytes an element: ~2 ms of an H200's step for
llama2_7b cut to 4 layers); the norm divides its float64 sum instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.dist_names import all_gather_single, reduce_scatter_single
from orchestrator.workload.buckets import plan_buckets




def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def replication_weight(t: torch.Tensor) -> float:
    """1 / (ranks holding the same copy of this tensor's local values), over its DTensor mesh:
    a sum of squares weighted by it and summed over ranks counts every element once."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return 1.0
    copies = 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            copies *= t.device_mesh.size(dim)
    return 1.0 / copies


def full_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """p.grad placed as the parameter: sequence-parallel norm weights accumulate Partial
    gradients over the tensor-parallel group, which this reduces."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(g.device_mesh, p.placements)
    return g




def sumsq(grads: List[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `grads` (float64 scalar), computed as torch's
    clip_grad_norm_ does: an fp32 norm per tensor (foreach kernels on GPUs: one read of each
    element, no temporaries), squared and summed in float64 (a few scalars). A float64 copy of
    the gradients, a slice at a time, cost ~14x these bytes (13.7 ms a step on an H200)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads).double().square()


def _replicated_sumsq(grad: torch.Tensor, rep_index: torch.Tensor,
                      rep_weight: torch.Tensor) -> torch.Tensor:
    """sum(rep_weight * grad[rep_index]^2) in float64: what the elements every TP rank holds
    (the SP norms) add to the bucket's plain sum of squares for their weight 1 + rep_weight
    (a few per layer). The same ops on every rank of a bucket (a rank whose slice holds none
    gathers a padded index of weight 0), so ranks of a stage issue one op stream (the tracer
    relies on it)."""
    part = grad[rep_index].double()
    return (rep_weight * part * part).sum()


def global_norm(local: torch.Tensor, group, reduce: bool = True) -> float:
    """sqrt of the sum of `local` (a float64 scalar on the rank's device) over `group`'s ranks
    (no communication with `reduce` False or one rank): the one host sync of the norm."""
    if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return math.sqrt(float(local))


def _adamw_kernel(device: torch.device) -> dict:
    """Fused AdamW on GPUs: foreach's temporaries are as big as the masters (4 bytes/param
    each) and set the peak memory of the step; foreach on CPUs."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def _viewable(p: torch.Tensor) -> bool:
    """A plain parameter whose storage can be a view of a flat buffer."""
    from torch.distributed.tensor import DTensor

    return not isinstance(p, DTensor)


def _partial_groups(g: torch.Tensor, p: torch.Tensor) -> list:
    """The process groups a gradient placed otherwise than its parameter is a partial sum over
    (sequence-parallel norms: Partial over the TP mesh dimension); [] for any other."""
    from torch.distributed.tensor import DTensor

    if not isinstance(g, DTensor) or tuple(g.placements) == tuple(p.placements):
        return []
    return [g.device_mesh.get_group(dim) for dim, placement in enumerate(g.placements)
            if placement.is_partial()]


@dataclass
class Bucket:
    params: List[nn.Parameter]
    numel: int  # padded to a multiple of dp
    offsets: List[int]
    grad: Optional[torch.Tensor] = None  # full flat gradient (None between steps for ZeRO-2)
    shard_grad: Optional[torch.Tensor] = None  # this rank's reduced slice
    master: Optional[nn.Parameter] = None  # fp32 master of the slice this rank updates
    # Elements of the slice every TP rank holds (SP norms; None: the bucket has none) and their
    # weight less 1 (float64): a few per layer, where a per-element weight of the whole bucket
    # held 4 bytes per element of every bucket holding one.
    rep_index: Optional[torch.Tensor] = None
    rep_weight: Optional[torch.Tensor] = None
    ready: int = 0
    work: object = None
    # Plain parameters (no DTensor): their storage is a view of `flat_params` (fp32: also
    # their .grad a view of `grad`, as DDP's gradient_as_bucket_view), nothing held twice.
    flat_params: Optional[torch.Tensor] = None


class ShardedAdamW:
    """ZeRO 0/1/2 gradient buckets + AdamW on flat fp32 masters, for the given parameters.

    `num_micro_batches` backward passes accumulate into each parameter per step (the hook counts
    them). Call `step(lr, grad_clip)` after the backward of the last micro-batch; it returns the
    gradient norm (before clipping)."""

    def __init__(self, params: List[nn.Parameter], zero: int, dp_group, dp: int,
                 num_micro_batches: int, world_group=None, bucket_MiB: float = 25.0,
                 weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                 replicas_only: bool = False, mean_over: Optional[int] = None):
        if zero not in (0, 1, 2):
            raise ValueError(f"ShardedAdamW handles zero 0/1/2, got {zero}")
        self.zero, self.dp, self.dp_group = zero, dp, dp_group
        # The ranks whose losses the gradients average over (default the dp group's): experts
        # reduce over their own group (edp) but average over the dense replicas (dp x cp).
        self.mean_over = mean_over or dp
        self.dp_rank = dist.get_rank(dp_group) if dp > 1 else 0
        self.world_group = world_group
        # No pipeline or tensor parallelism: with ZeRO-0 every rank holds the whole reduced
        # gradient, so the norm needs no communication.
        self.local_norm = replicas_only and zero == 0
        self.begin_step(num_micro_batches)
        self.params = [p for p in params if p.requires_grad]
        # bf16 weights: fp32 masters and gradient buckets of their own (module docstring)
        self.weight_dtype = local_tensor(self.params[0]).dtype
        self.half = self.weight_dtype != torch.float32
        self.counts: Dict[nn.Parameter, int] = {}
        self.bucket_of: Dict[nn.Parameter, Bucket] = {}
        self.offset_of: Dict[int, int] = {}
        self.buckets = self._make_buckets(bucket_MiB)
        masters = [b.master for b in self.buckets]
        self.optim = torch.optim.AdamW(masters, lr=0.0, betas=betas, eps=eps,
                                       weight_decay=weight_decay,
                                       **_adamw_kernel(masters[0].device))
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def remove_hooks(self) -> None:
        """Stop taking gradients as they arrive (trace: it issues the buckets' collectives
        after the last backward, and a replayed backward gives the parameters none)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def begin_step(self, num_micro_batches: int, grad_divisor: Optional[float] = None) -> None:
        """Before an iteration's backward: this rank's micro-batch count (a parameter's gradient
        is complete after that many) and what the summed gradients are divided by, in the
        step's scaling pass (default dp * m: the mean of equal micro-batches; the global
        batch's real-token count for per-token summed losses)."""
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches({num_micro_batches}) must be >= 1")
        self.m = num_micro_batches
        self.grad_divisor = grad_divisor or float(self.mean_over * num_micro_batches)

    # ------------------------------------------------------------------ buckets
    def _make_buckets(self, bucket_MiB: float) -> List[Bucket]:
        # The plan is workload.buckets' (the planner and the workload list price the same one).
        plans = plan_buckets([local_tensor(p).numel() for p in self.params], self.dp, bucket_MiB)
        buckets = []
        for plan in plans:
            ps = [self.params[i] for i in plan.indices]
            offsets, n = [], 0
            for p in ps:
                offsets.append(n)
                n += local_tensor(p).numel()
            numel = plan.numel
            b = Bucket(params=ps, numel=numel, offsets=offsets)
            lo, hi = self._owned(b)
            flat = torch.zeros(numel, dtype=torch.float32, device=local_tensor(ps[0]).device)
            for p, off in zip(ps, offsets):
                loc = local_tensor(p)
                flat[off:off + loc.numel()] = loc.detach().reshape(-1).float()
            self._replicated_elements(b, lo, hi, flat.device)
            if all(_viewable(p) for p in ps):
                b.flat_params = flat.to(self.weight_dtype)  # flat itself when fp32
                with torch.no_grad():
                    for p, off in zip(ps, offsets):
                        p.data = b.flat_params[off:off + p.numel()].view_as(p)
            # ZeRO-0 updates the whole bucket (fp32: the parameters' own storage); ZeRO-1/2 a
            # copy of this rank's slice.
            b.master = nn.Parameter(flat if self.zero == 0 else flat[lo:hi].clone())
            if self.zero < 2:
                b.grad = torch.zeros_like(flat)
            for p, off in zip(ps, offsets):
                self.bucket_of[p] = b
                self.offset_of[id(p)] = off
            buckets.append(b)
        return buckets

    def _replicated_elements(self, b: Bucket, lo: int, hi: int, device) -> None:
        """b.rep_index / rep_weight: the elements of this rank's slice [lo, hi) that every TP
        rank holds, padded (index 0, weight 0) to the most any dp rank's slice has, so every
        rank of a stage runs the same ops on the same shapes."""
        weights = [(off, local_tensor(p).numel(), replication_weight(p))
                   for p, off in zip(b.params, b.offsets)]
        if all(w == 1.0 for _, _, w in weights):
            return
        size = hi - lo

        def inside(start: int) -> int:
            return sum(max(0, min(off + n, start + size) - max(off, start))
                       for off, n, w in weights if w != 1.0)
        width = max(inside(r * size) for r in range(self.dp if self.zero else 1))
        index = torch.zeros(width, dtype=torch.long)
        weight = torch.zeros(width, dtype=torch.float64)
        at = 0
        for off, n, w in weights:
            start, end = max(off, lo), min(off + n, hi)
            if w != 1.0 and start < end:
                index[at:at + end - start] = torch.arange(start - lo, end - lo)
                weight[at:at + end - start] = w - 1.0
                at += end - start
        b.rep_index, b.rep_weight = index.to(device), weight.to(device)

    def _owned(self, b: Bucket):
        """The slice [lo, hi) of bucket b this rank updates: all of it for ZeRO-0."""
        if self.zero == 0:
            return 0, b.numel
        shard = b.numel // self.dp
        return self.dp_rank * shard, (self.dp_rank + 1) * shard

    def _on_grad(self, p: nn.Parameter) -> None:
        count = self.counts[p] = self.counts.get(p, 0) + 1
        b = self.bucket_of[p]
        if self.half:
            self._accumulate(p, b, count)
            return
        views = b.flat_params is not None
        if count < self.m and not (views and count == 1):
            return
        if b.grad is None:
            b.grad = torch.zeros(b.numel, dtype=torch.float32, device=local_tensor(p).device)
        off = self.offset_of[id(p)]
        if views:
            view = b.grad[off:off + p.numel()].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():  # first micro-batch (or not in place)
                view.copy_(p.grad)
                p.grad = view  # later micro-batches accumulate into the bucket itself
            if count < self.m:
                return
        else:
            g = local_tensor(full_grad(p))
            b.grad[off:off + g.numel()].copy_(g.reshape(-1))
            p.grad = None  # the bucket holds it now
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _accumulate(self, p: nn.Parameter, b: Bucket, count: int) -> None:
        """bf16 weights: add this micro-batch's gradient into the fp32 bucket (Megatron's
        main_grad) and free it; after the last, sum a partial one over its TP ranks (fp32, once
        per step, as the fp32 path's redistribute) and launch the bucket when it is whole."""
        g = p.grad
        partial = _partial_groups(g, p) if count == self.m else []
        loc = local_tensor(g).reshape(-1)
        if b.grad is None:
            b.grad = torch.zeros(b.numel, dtype=torch.float32, device=loc.device)
        off = self.offset_of[id(p)]
        view = b.grad[off:off + loc.numel()]
        if count == 1:
            view.copy_(loc)
        else:
            view.add_(loc)
        p.grad = None
        if count < self.m:
            return
        for group in partial:
            dist.all_reduce(view, group=group)
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        # The sum over replicas of summed gradients (fp32): `step` divides by grad_divisor.
        if self.dp == 1:
            b.work = None
        elif self.zero == 1:  # in place: the other ranks' slices are left partial, unused
            lo, hi = self._owned(b)
            b.work = reduce_scatter_single(b.grad[lo:hi], b.grad, group=self.dp_group,
                                           async_op=True)
        elif self.zero == 2:
            b.shard_grad = torch.empty(b.numel // self.dp, dtype=b.grad.dtype,
                                       device=b.grad.device)
            b.work = reduce_scatter_single(b.shard_grad, b.grad, group=self.dp_group,
                                           async_op=True)
        else:
            b.work = dist.all_reduce(b.grad, group=self.dp_group, async_op=True)

    # ------------------------------------------------------------------ step
    def finish_backward(self) -> None:
        """Wait for every bucket's collective (launching any bucket whose parameters got no
        gradient, e.g. unused ones, so every rank issues the same collectives)."""
        for b in self.buckets:
            if b.ready < len(b.params):
                if b.grad is None:
                    b.grad = torch.zeros(b.numel, dtype=torch.float32,
                                         device=b.master.device)
                for p in b.params:
                    if self.counts.get(p, 0) < self.m:
                        b.ready += 1
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            lo, hi = self._owned(b)
            if self.zero == 2 and self.dp > 1:
                b.grad = None  # the full gradient is not kept (ZeRO-2)
                for p in b.params:
                    p.grad = None
            else:
                b.shard_grad = b.grad[lo:hi]
            b.master.grad = b.shard_grad
        self.counts.clear()
        for b in self.buckets:
            b.ready = 0

    def grad_norm(self) -> float:
        """The global gradient norm: every element once, over data, tensor and pipeline ranks."""
        return self.reduce_norm(self.local_sumsq())

    def reduce_norm(self, local: torch.Tensor) -> float:
        """The global gradient norm from every rank's local_sumsq(): its sum over the ranks
        (none without pipeline or tensor parallelism under ZeRO-0)."""
        return global_norm(local, self.world_group, reduce=not self.local_norm)

    def local_sumsq(self) -> torch.Tensor:
        """This rank's share of the squared global norm (float64): summed over all ranks it
        counts every element once."""
        total = sumsq([b.shard_grad for b in self.buckets])
        for b in self.buckets:
            if b.rep_index is not None:
                total = total + _replicated_sumsq(b.shard_grad, b.rep_index, b.rep_weight)
        if self.zero == 0 and self.dp > 1 and not self.local_norm:
            total = total / self.dp  # every replica holds (and counts) the whole reduced gradient
        return total / self.grad_divisor ** 2  # the mean's, of the buckets' sums

    def step(self, lr: float, grad_clip: float, inv_scale: float = 1.0,
             norm: Optional[float] = None) -> None:
        """After finish_backward: the mean, unscaled (fp16) and clipped to `grad_clip` (<= 0:
        no clipping) given the unscaled global `norm` (grad_norm() * inv_scale), in one pass;
        AdamW at `lr`, parameters updated on every rank."""
        norm = self.grad_norm() * inv_scale if norm is None else norm
        factor = inv_scale / self.grad_divisor * (
            grad_clip / (norm + 1e-6) if 0 < grad_clip < norm else 1.0)
        for b in self.buckets:
            if factor != 1.0:
                b.shard_grad.mul_(factor)
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.step()
        self.zero_grads()
        for b in self.buckets:
            self._write_params(b)

    def zero_grads(self) -> None:
        for b in self.buckets:
            b.master.grad = None
            b.shard_grad = None
            for p in b.params:
                p.grad = None

    def _write_params(self, b: Bucket) -> None:
        """Copy the updated masters into the parameters (after an all-gather for ZeRO-1/2, in
        the weights' dtype: bf16 weights gather bf16)."""
        gather = self.zero > 0 and self.dp > 1
        # this rank's updated slice in the weights' dtype (a bf16 copy of the master's)
        mine = b.master.detach().to(self.weight_dtype) if gather else b.master.detach()
        if b.flat_params is not None:  # the parameters are views of flat_params
            if gather:
                all_gather_single(b.flat_params, mine, group=self.dp_group)
            elif self.half or self.zero > 0:  # fp32 ZeRO-0: AdamW updated them in place
                b.flat_params.copy_(mine)
            return
        if gather:
            full = torch.empty(b.numel, dtype=self.weight_dtype, device=b.master.device)
            all_gather_single(full, mine, group=self.dp_group)
        else:
            full = mine
        with torch.no_grad():
            for p, off in zip(b.params, b.offsets):
                loc = local_tensor(p)
                loc.copy_(full[off:off + loc.numel()].view_as(loc))

    # ------------------------------------------------------------------ checkpoint views
    def state_tensors(self) -> Dict[nn.Parameter, Dict[str, torch.Tensor]]:
        """Per parameter, full local (tensor-parallel shard) exp_avg and exp_avg_sq, gathered
        from the dp slices: what a checkpoint stores, whatever the ZeRO stage."""
        out: Dict[nn.Parameter, Dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            state = self.optim.state.get(b.master, {})
            per_key = {}
            for key in ("exp_avg", "exp_avg_sq"):
                shard = state.get(key, torch.zeros_like(b.master))
                per_key[key] = self._gather(b, shard.detach())
            for p, off in zip(b.params, b.offsets):
                loc = local_tensor(p)
                # Views, not copies: a checkpoint reads them (copies would double the
                # optimizer's memory at every save).
                out[p] = {key: full[off:off + loc.numel()].view_as(loc)
                          for key, full in per_key.items()}
        return out

    def master_tensors(self) -> Dict[nn.Parameter, torch.Tensor]:
        """bf16 weights: per parameter its full local fp32 master, gathered from the dp slices
        (what a checkpoint stores for it, not the bf16 weight); {} for fp32 weights (they are
        the masters)."""
        if not self.half:
            return {}
        out: Dict[nn.Parameter, torch.Tensor] = {}
        for b in self.buckets:
            full = self._gather(b, b.master.detach())
            for p, off in zip(b.params, b.offsets):
                loc = local_tensor(p)
                out[p] = full[off:off + loc.numel()].view_as(loc)
        return out

    def _gather(self, b: Bucket, shard: torch.Tensor) -> torch.Tensor:
        if self.zero == 0 or self.dp == 1:
            return shard
        full = torch.empty(b.numel, dtype=shard.dtype, device=shard.device)
        all_gather_single(full, shard, group=self.dp_group)
        return full

    def load_state_tensors(self, states: Dict[nn.Parameter, Dict[str, torch.Tensor]],
                           step: int,
                           masters: Optional[Dict[nn.Parameter, torch.Tensor]] = None) -> None:
        """Inverse of state_tensors: each rank keeps its slice; masters re-read the params, or
        (bf16 weights) `masters`' full local fp32 values, which the weights are then cast
        from."""
        for b in self.buckets:
            lo, hi = self._owned(b)
            per_key = {}
            for key in ("exp_avg", "exp_avg_sq"):
                full = torch.zeros(b.numel, dtype=torch.float32, device=b.master.device)
                for p, off in zip(b.params, b.offsets):
                    t = states[p][key]
                    full[off:off + t.numel()] = t.reshape(-1)
                per_key[key] = full[lo:hi].clone()
            with torch.no_grad():
                for p, off in zip(b.params, b.offsets):
                    loc = local_tensor(p).reshape(-1)
                    if masters is not None and p in masters:
                        full = masters[p].reshape(-1)
                        loc.copy_(full)
                    else:
                        full = loc
                    s, e = max(off, lo), min(off + loc.numel(), hi)
                    if s < e:
                        b.master[s - lo:e - lo] = full[s - off:e - off]
            self.optim.state[b.master] = {"step": torch.tensor(float(step)), **per_key}
