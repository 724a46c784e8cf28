"""The Megatron-LM command line of a traced configuration (summary.json's `megatron_args`): the
layout's and, for a mixture-of-experts model, the model's MoE arguments (planner/exports.py:
megatron_args, megatron_moe_args), that make Megatron run what the trace records.
"""
from __future__ import annotations

import warnings
from typing import List, Tuple

from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig


def megatron_command_args(model: ModelConfig,
                          layout: ParallelLayout) -> Tuple[List[str], List[str]]:
    """(Megatron-LM arguments for the layout and the model's experts, notes on what the layout
    arguments approximate: planner/exports.megatron_args with strict=False)."""
    from orchestrator.planner.exports import ExportError, megatron_args, megatron_moe_args

    notes: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = megatron_args(layout, strict=False)
        except ExportError as e:
            args, notes = [], [str(e)]
    notes += [str(w.message) for w in caught]
    if layout.zero == 1 and layout.replicas > 1:
        notes.append(ZERO1_NOTE)
    return args + megatron_moe_args(model), notes


# The trace runs train's ZeRO-1 optimizer (train/grads.py), whose gradient sync is not the one
# of Megatron's distributed optimizer that --use-distributed-optimizer asks for.
ZERO1_NOTE = ("trace.zero=1 records stage=train's ZeRO-1: each gradient bucket all-reduced, then "
              "the updated parameters all-gathered. Megatron's distributed optimizer "
              "reduce-scatters the buckets instead (half an all-reduce's traffic), as "
              "search.engine=megatron prices it; trace.zero=2 records those messages")
