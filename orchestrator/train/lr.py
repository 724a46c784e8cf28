"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""
from __future__ import annotations

import math
from typing import Optional

DEFAULT_WARMUP_STEPS = 5


def warmup_steps(warmup: Optional[int], steps: int) -> int:
    """train.warmup_steps, or when unset (None) DEFAULT_WARMUP_STEPS, at most `steps`: a short
    run still reaches its learning rate."""
    return min(DEFAULT_WARMUP_STEPS, steps) if warmup is None else warmup


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int,
          min_ratio: float = 0.1) -> float:
    """The learning rate of step `step` (counted from 0), in the units of base_lr.

    Steps 0 .. warmup_steps-1 rise linearly: step s gets base_lr * (s+1) / warmup_steps, so the
    first step already moves and step warmup_steps-1 reaches base_lr. Then a cosine decays from
    base_lr (at step warmup_steps) to min_ratio * base_lr (at step total_steps); later steps stay
    at that floor. warmup_steps=0 means no warm-up."""
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"lr_at(step={step}, warmup_steps={warmup_steps}, "
                         f"total_steps={total_steps}): all must be >= 0")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio={min_ratio} must be in [0, 1]")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    min_lr = min_ratio * base_lr
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / (total_steps - warmup_steps)  # warmup <= step < total
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
