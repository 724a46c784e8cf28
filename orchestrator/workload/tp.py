"""Tensor-parallel collectives per layer and micro-batch, by engine: what workload.comm sizes
(tp_messages), lists for a rank (rank_comms) and the planner prices.

engine "orchestrator" (stage=train, DTensor; checked against the real engine by
tests/test_train_engine.py): with sequence parallelism a layer moves 2 all-gathers + 2 reduce-
scatters forward; its column-parallel matmuls keep their input sequence-sharded and gather it
again in the backward (models/parallelize.sequence_parallel_linears), so the backward moves
4 all-gathers + 2 reduce-scatters, as Megatron's; a layer recomputed in full reruns 2 all-
gathers + 1 reduce-scatter (checkpointing stops at the last output the backward needs). Its
LM head keeps its gathered input (DTensor's ColwiseParallel): no gather in its backward.

engine "megatron" (Megatron-LM, and what stage=trace records): backward re-gathers the inputs
SP keeps sharded (4 all-gathers + 2 reduce-scatters; the LM head's too), full recompute reruns
the whole forward.

Both compute the loss vocab-parallel: the logits stay sharded over TP and three fp32 all-reduces
of one value per token (the logits' max, the sum of exponentials, the target's logit) replace an
all-gather of the logits, per micro-batch.

Without SP both move 2 all-reduces forward and 2 backward per layer. The embedding reduce-
scatters (all-reduces) its output forward and, with SP, all-gathers its gradient backward; the
LM head all-gathers its input forward (SP) and reduce-scatters (all-reduces) its gradient back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from orchestrator.choices import Engine

VOCAB_PARALLEL_LOSS_REDUCES = 3  # max, sum of exponentials, target logit: fp32, one per token
LOSS_VALUE_BYTES = 4  # each of them one fp32 value per token


@dataclass(frozen=True)
class TpCounts:
    """Collectives of one micro-batch by op ("all_gather", "reduce_scatter", "all_reduce"), each
    moving one layer activation (s * b * h elements), except `loss_all_reduce` (fp32, s * b)."""

    layer_fwd: Dict[str, int]
    layer_bwd: Dict[str, int]  # the gradients of the forward's collectives
    layer_regather: Dict[str, int]  # backward: SP's sharded inputs gathered again (forward's)
    recompute: Dict[str, int]  # rerun in backward by a layer recomputed in full
    embedding_fwd: Dict[str, int]
    embedding_bwd: Dict[str, int]
    head_fwd: Dict[str, int]
    head_bwd: Dict[str, int]
    loss_all_reduce: int = VOCAB_PARALLEL_LOSS_REDUCES


def check_engine(engine: Engine) -> None:
    if engine not in tuple(Engine):
        raise ValueError(f"engine={engine!r}: the workload model describes {list(Engine)}")


def tp_counts(engine: Engine, sequence_parallel: bool) -> TpCounts:
    """The TP collectives `engine` issues per micro-batch (module docstring)."""
    check_engine(engine)
    ours = engine == Engine.orchestrator
    if sequence_parallel:
        fwd = {"all_gather": 2, "reduce_scatter": 2}
        return TpCounts(
            layer_fwd=fwd, layer_bwd={"all_gather": 2, "reduce_scatter": 2},
            layer_regather={"all_gather": 2},
            recompute={"all_gather": 2, "reduce_scatter": 1} if ours else dict(fwd),
            embedding_fwd={"reduce_scatter": 1}, embedding_bwd={"all_gather": 1},
            head_fwd={"all_gather": 1},
            head_bwd={"reduce_scatter": 1} if ours else {"all_gather": 1, "reduce_scatter": 1})
    return TpCounts(
        layer_fwd={"all_reduce": 2}, layer_bwd={"all_reduce": 2}, layer_regather={},
        recompute={"all_reduce": 1 if ours else 2},
        embedding_fwd={"all_reduce": 1}, embedding_bwd={},
        head_fwd={}, head_bwd={"all_reduce": 1})

