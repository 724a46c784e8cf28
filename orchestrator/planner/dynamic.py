"""Execution plans for variable-length batches (DynaPipe-style dynamic micro-batching).

The types train consumes are fixed here first; the planner fills this module in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a plan: `samples` index this data-parallel rank's sequences of the
    iteration (in the order given to the planner), each padded to `padded_len` tokens;
    `recompute` ("none" | "selective" | "full": every layer of every stage) applies to this
    micro-batch on every pipeline stage."""

    samples: Tuple[int, ...]
    padded_len: int
    recompute: str = "none"

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def padded_tokens(self) -> int:
        return len(self.samples) * self.padded_len
