"""The ring's score tiles (models/context_parallel.py), torch-free: the engine computes with them,
the workload model (memory.py) counts them."""
from __future__ import annotations

import numpy as np

# The ring computes a block's scores a tile of query rows at a time, at most this many bytes of
# fp32 scores per tile: its memory stays flat as the sequence grows (flash attention's point).
SCORE_TILE_BYTES = 64 << 20


def score_tile_rows(batch: int, heads: int, rows: int, keys: int,
                    tile_bytes: int = SCORE_TILE_BYTES) -> int:
    """Query rows per tile: as many as keep one fp32 score tile (batch x heads x rows x keys)
    within `tile_bytes` (at least one row); ints, or numpy arrays (the dynamic planner's
    micro-batches)."""
    if np.ndim(rows) or np.ndim(batch) or np.ndim(keys):
        return np.maximum(1, np.minimum(rows, tile_bytes // (4 * batch * heads * keys)))
    return max(1, min(rows, tile_bytes // (4 * batch * heads * keys)))
