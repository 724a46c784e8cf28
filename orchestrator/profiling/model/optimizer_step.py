"""The optimizer phase as profile_model times and counts it: what train's step does to a part's
fp32 elements (train/grads.py: the norm, the clip with the mean, AdamW, the copy into the
parameters), timed on this rank's device (`time_optimizer_step_us`, the profile's *_optim_us)
or counted in bytes for an HBM roofline (`optimizer_step_bytes_per_element`, analytic
profiles), and KernelBytes, the dispatch mode that counts what every op reads and writes."""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.utils._python_dispatch

from orchestrator.profiling.measure import Stopwatch

OPTIM_MIN_NUMEL = 1 << 22  # 4M fp32 elements: master, grad and states well beyond a CPU's cache


# Bytes per element of one fused AdamW kernel (what train runs on a GPU, train/grads.py): reads
# the master, its gradient and both moments, writes the master and the moments, all fp32.
FUSED_ADAMW_BYTES = 7 * 4


def _adamw(master: torch.Tensor) -> torch.optim.AdamW:
    # Fused on GPUs, foreach elsewhere: the kernels train's optimizer uses (train/grads.py).
    kernel = {"fused": True} if master.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW([master], lr=1e-4, weight_decay=0.1, **kernel)


def optimizer_step(master: torch.Tensor, param: torch.Tensor,
                   optim: torch.optim.Optimizer, adamw: bool = True) -> torch.Tensor:
    """What train's optimizer phase does for these fp32 elements (train/grads.py): the
    gradient norm (an fp32 norm, one read per element; the few replicated SP-norm elements
    train weights are left out), clipping to 1, AdamW on the flat master, the copy into the
    parameters. The clip factor stays on the device (works on meta tensors too); returns the
    norm. `adamw=False` leaves the AdamW step out (priced on its own for fused kernels)."""
    # train/grads.sumsq's norm (clip_grad_norm_'s: fp32 per tensor, float64 across them)
    norm = torch.nn.utils.get_total_norm([master.grad]).double()
    master.grad.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0))
    if adamw:
        optim.step()
    with torch.no_grad():
        param.copy_(master)
    return norm


def time_optimizer_step_us(numel: int, device: torch.device, warmup_iters: int,
                           iters: int, model_numel: Optional[int] = None) -> List[float]:
    """Samples (us) of `optimizer_step` for `numel` fp32 elements. Timed on at least
    OPTIM_MIN_NUMEL elements, or the whole model's `model_numel` when smaller, and scaled to
    `numel`: train steps a whole stage's flat master at once, which a block's slice alone (in
    cache) would under-read; a model whose whole master fits in cache is stepped in cache (a
    4M-element floor read a tiny model's step 15x too slow)."""
    floor = OPTIM_MIN_NUMEL if model_numel is None else min(OPTIM_MIN_NUMEL, int(model_numel))
    size = max(int(numel), floor)
    clock = Stopwatch(device)
    master = torch.zeros(size, dtype=torch.float32, device=device, requires_grad=True)
    param = torch.zeros_like(master, requires_grad=False)
    optim = _adamw(master)
    out = []
    for i in range(warmup_iters + iters):
        master.grad = torch.full_like(param, 1e-3)
        clock.sync()
        t0 = clock.mark()
        optimizer_step(master, param, optim)
        t1 = clock.mark()
        if i >= warmup_iters:
            out.append(clock.elapsed_us(t0, t1) * numel / size)
    return out


@functools.lru_cache(maxsize=None)
def optimizer_step_bytes_per_element(fused_adamw: bool) -> float:
    """Bytes `optimizer_step` reads and writes per fp32 element (what an HBM roofline prices):
    every kernel's inputs and outputs, counted on meta tensors after a first step has made
    AdamW's moments; with `fused_adamw` (GPUs) the AdamW step is one kernel of
    FUSED_ADAMW_BYTES."""
    n = 1 << 20
    master = torch.zeros(n, device="meta", requires_grad=True)
    param = torch.zeros_like(master, requires_grad=False)
    optim = torch.optim.AdamW([master], lr=1e-4, weight_decay=0.1, foreach=True)
    master.grad = torch.ones_like(param)
    optimizer_step(master, param, optim)
    master.grad = torch.ones_like(param)
    with KernelBytes() as counted:
        optimizer_step(master, param, optim, adamw=not fused_adamw)
    return counted.bytes / n + (FUSED_ADAMW_BYTES if fused_adamw else 0.0)


class KernelBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the bytes every dispatched op reads (its tensor inputs) and writes (its outputs and
    the inputs it mutates); ops that only make views move none."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:
            def size(tree):
                return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0]
                           if isinstance(t, torch.Tensor))
            self.bytes += size((args, kwargs)) + size(out)  # reads, then what comes back
            if not func._schema.returns:  # foreach_*_: the inputs it writes come back as None
                self.bytes += size([a for a, spec in zip(args, func._schema.arguments)
                                    if spec.alias_info is not None and spec.alias_info.is_write])
        return out
