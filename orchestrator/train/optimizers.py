"""The optimizers built on ShardedAdamW (grads.py): a mixture-of-experts model's (the dense part
over the replicas, the routed experts over edp, one norm) and ZeRO-3's over FSDP2 shards."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from orchestrator.train.grads import (ShardedAdamW, _adamw_kernel, full_grad, global_norm,
                                     local_tensor, replication_weight, sumsq)


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (models/moe.Experts): reduced over the expert-data-parallel
    ranks, not the dense replicas."""
    return ".mlp.experts." in name


class ExpertAdamW:
    """ZeRO 0/1/2 for a mixture-of-experts model: the dense parameters' ShardedAdamW over the
    dense replicas (dp x cp) and the routed experts' over the expert-data-parallel group (edp
    ranks holding the same experts); both average over the dense replicas' losses. One global
    norm (one all-reduce) and one clipping factor for both."""

    def __init__(self, dense: ShardedAdamW, experts: Optional[ShardedAdamW]):
        # experts None: this rank's stage holds dense blocks only (the first dense_layers)
        self.parts = (dense,) if experts is None else (dense, experts)
        for part in self.parts:
            part.local_norm = False

    def begin_step(self, num_micro_batches: int, grad_divisor: Optional[float] = None) -> None:
        for part in self.parts:
            part.begin_step(num_micro_batches, grad_divisor)

    def remove_hooks(self) -> None:
        for part in self.parts:
            part.remove_hooks()

    def finish_backward(self) -> None:
        for part in self.parts:
            part.finish_backward()

    def grad_norm(self) -> float:
        return self.reduce_norm(self.local_sumsq())

    def local_sumsq(self) -> torch.Tensor:
        return sum(part.local_sumsq() for part in self.parts)

    def reduce_norm(self, local: torch.Tensor) -> float:
        return global_norm(local, None)

    def step(self, lr: float, grad_clip: float, inv_scale: float = 1.0,
             norm: Optional[float] = None) -> None:
        norm = self.grad_norm() * inv_scale if norm is None else norm
        for part in self.parts:
            part.step(lr, grad_clip, inv_scale, norm)

    def zero_grads(self) -> None:
        for part in self.parts:
            part.zero_grads()

    def state_tensors(self) -> Dict[nn.Parameter, Dict[str, torch.Tensor]]:
        return {p: t for part in self.parts for p, t in part.state_tensors().items()}

    def master_tensors(self) -> Dict[nn.Parameter, torch.Tensor]:
        return {p: t for part in self.parts for p, t in part.master_tensors().items()}

    def load_state_tensors(self, states, step: int, masters=None) -> None:
        for part in self.parts:
            part.load_state_tensors({p: states[p] for p in part.params}, step, masters)


class FsdpAdamW:
    """ZeRO-3: parameters are FSDP2 shards (DTensors); FSDP reduce-scatters the gradients (mean
    over dp). Same interface as ShardedAdamW."""

    def __init__(self, params: List[nn.Parameter], num_micro_batches: int, world_group=None,
                 weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                 rescale: Optional[Dict[nn.Parameter, float]] = None):
        self.params = [p for p in params if p.requires_grad]
        # FSDP's mean over its group, times this: the experts' (reduced over edp) to the mean
        # over the dense replicas
        self.rescale = rescale or {}
        self.begin_step(num_micro_batches)
        self.world_group = world_group
        self.optim = torch.optim.AdamW(self.params, lr=0.0, betas=betas, eps=eps,
                                       weight_decay=weight_decay,
                                       **_adamw_kernel(local_tensor(self.params[0]).device))

    def begin_step(self, num_micro_batches: int) -> None:
        """Before an iteration's backward: this rank's micro-batch count."""
        self.m = num_micro_batches

    def remove_hooks(self) -> None:
        """None to remove: FSDP2 reduces the gradients itself."""

    def finish_backward(self) -> None:
        """Partial sums (sequence-parallel norms) reduced. FSDP averaged over dp and the
        micro-batches summed: `step` divides by `_divisor` in its one scaling pass (as
        ShardedAdamW's)."""
        for p in self.params:
            if p.grad is not None:
                p.grad = full_grad(p)

    def _divisor(self, p: nn.Parameter) -> float:
        """What p's gradient is divided by into the mean over the micro-batches (and the
        dense replicas, for the experts)."""
        return self.m / self.rescale.get(p, 1.0)

    def grad_norm(self) -> float:
        return self.reduce_norm(self.local_sumsq())

    def local_sumsq(self) -> torch.Tensor:
        """This rank's share of the squared global norm (float64): each local gradient's sum
        of squares weighted by its replication (one fp32 foreach norm per weight)."""
        by_weight: Dict[float, List[torch.Tensor]] = {}
        for p in self.params:
            g = full_grad(p)
            if g is not None:  # the mean's: the sum's over its divisor squared
                weight = replication_weight(g) / self._divisor(p) ** 2
                by_weight.setdefault(weight, []).append(local_tensor(g))
        total = torch.zeros((), dtype=torch.float64, device=local_tensor(self.params[0]).device)
        for weight, grads in by_weight.items():
            total = total + sumsq(grads) * weight
        return total

    def reduce_norm(self, local: torch.Tensor) -> float:
        return global_norm(local, self.world_group)

    def step(self, lr: float, grad_clip: float, inv_scale: float = 1.0,
             norm: Optional[float] = None) -> None:
        """As ShardedAdamW.step."""
        norm = self.grad_norm() * inv_scale if norm is None else norm
        clip = inv_scale * (grad_clip / (norm + 1e-6) if 0 < grad_clip < norm else 1.0)
        for p in self.params:
            factor = clip / self._divisor(p)
            if p.grad is not None and factor != 1.0:
                p.grad.mul_(factor)
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.step()
        self.zero_grads()

    def zero_grads(self) -> None:
        self.optim.zero_grad(set_to_none=True)

    def state_tensors(self) -> Dict[nn.Parameter, Dict[str, torch.Tensor]]:
        """Per parameter, exp_avg and exp_avg_sq placed as the parameter (DTensors)."""
        return {p: {key: self.optim.state.get(p, {}).get(key, torch.zeros_like(p))
                    for key in ("exp_avg", "exp_avg_sq")} for p in self.params}

    def master_tensors(self) -> Dict[nn.Parameter, torch.Tensor]:
        """{}: FSDP2's fp32 shards are the masters (bf16 only while gathered)."""
        return {}

    def load_state_tensors(self, states, step: int, masters=None) -> None:
        for p in self.params:
            self.optim.state[p] = {"step": torch.tensor(float(step)),
                                   **{k: v for k, v in states[p].items()}}
