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
        """Read the profile's per-sequence fits at `seq_len` for a micro-batch: a fit's
        constant once per call (host and launch overhead does not grow with the batch), the
        rest per sequence; with context parallelism a rank does 1 / cp of the per-sequence
        work (its tokens' linear work, and its balanced half-early, half-late share of the
        causal attention)."""
        b = micro_batch_size / cp
        return cls(block=FwdBwd(model.block_fwd_us(seq_len, tp, b),
                                model.block_bwd_us(seq_len, tp, b)),
                   selective_recompute_us=b * model.attention_core_fwd_us(seq_len, tp),
                   other=FwdBwd(model.other_fwd_us(seq_len, tp, b),
                                model.other_bwd_us(seq_len, tp, b)))

    def scaled(self, factor: float) -> "LayerCompute":
        """Every time times `factor` (contention, a calibrated efficiency); itself for 1."""
        if factor == 1.0:
            return self
        return LayerCompute(block=FwdBwd(self.block.fwd_us * factor, self.block.bwd_us * factor),
                            selective_recompute_us=self.selective_recompute_us * factor,
                            other=FwdBwd(self.other.fwd_us * factor, self.other.bwd_us * factor))
