"""The Megatron-LM command line of a traced configuration (summary.json's `megatron_args`): the
layout's (planner/exports.megatron_args) and, for a mixture-of-experts model, the MoE arguments
that make Megatron run what the trace records.

MoE names and meanings are Megatron-LM's (megatron/training/arguments.py, _add_moe_args):
--num-experts, --moe-router-topk, --expert-model-parallel-size, --expert-tensor-parallel-size,
--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, --moe-layer-freq (a Python list
expression, "([0]*3+[1]*58)": 0 a dense block, 1 a MoE block), --moe-token-dispatcher-type,
--moe-aux-loss-coeff, --moe-router-load-balancing-type, --moe-expert-capacity-factor and
--moe-token-drop-policy. Our router is Megatron's default one (top-k of the logits, softmax
over the k: the same weights as softmax over all then renormalising the k, models/moe.py), so
--moe-router-pre-softmax is not given; our experts are a loop of GEMMs, so --moe-grouped-gemm
is not given either (it is a flag: off when absent).
"""
from __future__ import annotations

import warnings
from typing import List, Tuple

from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, expert_width, is_moe


def moe_layer_freq(model: ModelConfig) -> str:
    """Megatron's --moe-layer-freq list for `model`: "([0]*d+[1]*m)" with d dense blocks first
    ("([1]*m)" without)."""
    moe = model.layers - model.dense_layers
    return f"([0]*{model.dense_layers}+[1]*{moe})" if model.dense_layers else f"([1]*{moe})"


def megatron_moe_args(model: ModelConfig, layout: ParallelLayout) -> List[str]:
    """The MoE arguments of `model` under `layout` (empty for a dense model), as strings."""
    if not is_moe(model):
        return []
    args = ["--num-experts", str(model.experts),
            "--moe-router-topk", str(model.top_k),
            "--expert-model-parallel-size", str(layout.ep),
            "--expert-tensor-parallel-size", str(layout.etp),
            "--moe-ffn-hidden-size", str(expert_width(model)),
            "--moe-layer-freq", moe_layer_freq(model),
            "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-aux-loss-coeff", f"{model.aux_loss_coef:g}"]
    if model.shared_expert_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(model.shared_expert_ffn)]
    if model.capacity_factor is not None:
        # models/moe.py keeps each expert's first tokens (Megatron's "position" policy), and
        # pads nothing (no --moe-pad-expert-input-to-capacity)
        args += ["--moe-expert-capacity-factor", f"{model.capacity_factor:g}",
                 "--moe-token-drop-policy", "position"]
    return args


def megatron_command_args(model: ModelConfig,
                          layout: ParallelLayout) -> Tuple[List[str], List[str]]:
    """(Megatron-LM arguments for the layout and the model's experts, notes on what the layout
    arguments approximate: planner/exports.megatron_args with strict=False)."""
    from orchestrator.planner.exports import ExportError, megatron_args

    notes: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = megatron_args(layout, strict=False)
        except ExportError as e:
            args, notes = [], [str(e)]
    notes += [str(w.message) for w in caught]
    return args + megatron_moe_args(model, layout), notes
