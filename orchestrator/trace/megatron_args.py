"""The Megatron-LM command line of a traced configuration (summary.json's `megatron_args`): the
layout's, the vocabulary's padding and, for a mixture-of-experts model, the model's MoE
arguments (planner/exports.py: megatron_args, megatron_model_args), that make Megatron run what
the trace records.
"""
from __future__ import annotations

import warnings
from typing import List, Tuple

from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig


def megatron_command_args(model: ModelConfig, layout: ParallelLayout,
                          overlap=None) -> Tuple[List[str], List[str]]:
    """(Megatron-LM arguments for the layout, the vocabulary's padding and the model's experts,
    notes on what the layout arguments approximate: planner/exports.megatron_args with
    strict=False). `overlap`: the search.* overlap knobs' Overlap, as search's export writes
    them (None: all on, their default)."""
    from orchestrator.planner.exports import ExportError, megatron_args, megatron_model_args

    notes: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = megatron_args(layout, strict=False, overlap=overlap)
        except ExportError as e:
            args, notes = [], [str(e)]
    notes += [str(w.message) for w in caught]
    return args + megatron_model_args(model), notes
