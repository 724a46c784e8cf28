"""How the context-parallel attention (models/context_parallel.py) tiles its fp32 scores:
torch-free, so workload/ counts the same tiles the model computes."""
from __future__ import annotations

import numpy as np

SCORE_TILE_BYTES = 64 << 20


def score_tile_rows(batch: int, heads: int, rows: int, keys: int,
                    tile_bytes: int = SCORE_TILE_BYTES) -> int:
    """Query rows per tile: as many as keep one fp32 score tile (batch x heads x rows x keys)
    within `tile_bytes` (at least one row); ints, or numpy arrays (the dynamic planner's
    micro-batches)."""
    if np.ndim(rows) or np.ndim(batch) or np.ndim(keys):
        return np.maximum(1, np.minimum(rows, tile_bytes // (4 * batch * heads * keys)))
    return max(1, min(rows, tile_bytes // (4 * batch * heads * keys)))
