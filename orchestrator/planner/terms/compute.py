"""Compute time of one micro-batch, from the model profile's fits (communication excluded)."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner.profiles import ModelCost
from orchestrator.planner.terms import FwdBwd


@dataclass(frozen=True)
class LayerCompute:
    """Compute (us per micro-batch of b sequences) on one rank of a TP group of size tp:

    block: forward and backward of one transformer block;
    selective_recompute_us: the attention core (the s^2 term of the block's forward fit), what
      Megatron's selective recompute reruns in the backward;
    other: embedding + final norm + LM head + loss, all of it (cost_model splits it over the
      first and the last stage)."""

    block: FwdBwd
    selective_recompute_us: float
    other: FwdBwd

    @classmethod
    def from_model(cls, model: ModelCost, seq_len: int, tp: int,
                   micro_batch_size: int, cp: int = 1) -> "LayerCompute":
        """Read the profile's per-sequence fits at `seq_len` and scale by the micro-batch; with
        context parallelism a rank does 1 / cp of it (its tokens' linear work, and its
        balanced half-early, half-late share of the causal attention)."""
        b = micro_batch_size / cp
        return cls(block=FwdBwd(b * model.block_fwd_us(seq_len, tp),
                                b * model.block_bwd_us(seq_len, tp)),
                   selective_recompute_us=b * model.attention_core_fwd_us(seq_len, tp),
                   other=FwdBwd(b * model.other_fwd_us(seq_len, tp),
                                b * model.other_bwd_us(seq_len, tp)))
