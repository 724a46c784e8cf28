"""How a sub-layer applies its input projections (wq, wk, wv; w_gate, w_up): each linear on the
same input. models/gpt.py's attention and MLP and models/moe.py's shared expert hold it as their
`project`; sequence parallelism replaces it (models/parallelize.sequence_parallel_linears)."""
from __future__ import annotations

import torch


def each_linear(x: torch.Tensor, linears) -> list:
    """Each of `linears` applied to x."""
    return [linear(x) for linear in linears]
