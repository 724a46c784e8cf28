"""How many logits the loss (models/loss.py) converts to fp32 at once: torch-free, so workload/
counts the chunks the loss works on (and the planner never imports torch)."""
from __future__ import annotations

CHUNK_ELEMENTS = 1 << 24  # logits converted to fp32 at once (64 MiB)
