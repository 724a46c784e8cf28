"""How ZeRO 0/1/2 gradients are grouped into flat buckets (train/grads.py uses this plan)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

FP32_BYTES = 4


@dataclass(frozen=True)
class BucketPlan:
    indices: List[int]  # positions in the parameter list, in backward order
    numel: int  # padded to a multiple of dp (each rank owns numel / dp)

    @property
    def bytes(self) -> int:
        return self.numel * FP32_BYTES  # buckets hold fp32 gradients


def plan_buckets(local_numels: Sequence[int], dp: int, bucket_MiB: float) -> List[BucketPlan]:
    """Buckets of about `bucket_MiB` (fp32) over parameters of these local sizes, filled in
    backward order (the last parameters' gradients come first), at least 4 of them so a small
    model's first collectives still start during the backward."""
    total = sum(local_numels)
    limit = max(1, min(int(bucket_MiB * 2**20 / FP32_BYTES), -(-total // 4)))
    plans, current, size = [], [], 0
    for index in reversed(range(len(local_numels))):
        current.append(index)
        size += local_numels[index]
        if size >= limit:
            plans.append((current, size))
            current, size = [], 0
    if current:
        plans.append((current, size))
    return [BucketPlan(indices, -(-n // dp) * dp) for indices, n in plans]
