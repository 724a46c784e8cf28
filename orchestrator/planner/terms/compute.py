"""Compute time of one micro-batch, from the model profile's fits (communication excluded):
a block's and "other"'s (LayerCompute), and what a layout's stages compute (StageCompute: the
one account of compute that the cost model's stage times and trace's op times both read)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.planner.calibration import contention_factor
from orchestrator.planner.profiles import ModelCost
from orchestrator.planner.terms import FwdBwd
from orchestrator.planner.terms.moe import (MoeParams, linear_scale, moe_block_delta_us,
                                            moe_imbalance)
from orchestrator.planner.terms.pipeline import on_end_stages


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


def _moe_block(compute: LayerCompute, model: ModelCost, key, seq_len: int,
               imbalance: float) -> LayerCompute:
    """`compute` with its block a MoE block on the busiest EP rank (terms/moe.py): profile_model's
    MoE parts when the profile has them, else the profiled block's matmuls scaled."""
    if model.moe_costs is not None:  # profile_model timed its parts beside the block
        extra_fwd, extra_bwd = moe_block_delta_us(model.moe_costs, model.moe, key, seq_len,
                                                  imbalance)
    else:  # the profiled block's matmuls scaled to the MoE block's
        scale = linear_scale(model, model.moe, imbalance) - 1.0
        lin_fwd, lin_bwd = model.block_linear_us(seq_len, key.tp, key.micro_batch_size / key.cp)
        extra_fwd, extra_bwd = scale * lin_fwd, scale * lin_bwd
    return LayerCompute(FwdBwd(compute.block.fwd_us + extra_fwd, compute.block.bwd_us + extra_bwd),
                        compute.selective_recompute_us, compute.other)


@dataclass(frozen=True)
class StageCompute:
    """What the ranks of a layout's stages compute, as the cost model charges it (us on one rank,
    communication excluded). StageCosts builds its stage times on it; trace prices its ops by it
    (trace/timing.py), so both charge the same compute.

    layer: a block per micro-batch (a MoE block on the busiest EP rank for a model with experts:
      routing, its experts, the shared expert; every block of such a model is one), with the
      schedule's contention and the calibrated compute factor applied;
    other_first / other_last: "other" per micro-batch (embedding + final norm + LM head + loss)
      split by CostOptions.other_time_first_share: the first stage's share (the embedding
      lookup) and the last stage's (both on one stage when pp is 1);
    contention: the schedule's contention factor (planner/calibration.contention_factor),
      applied to `layer` with the calibrated compute factor;
    recompute_factor: the calibrated recompute factor;
    block_optim_us / other_optim_us: the optimizer step once per iteration, per block and "other"
      per stage (split by other_memory_first_share), after ZeRO's sharding and calibrated."""

    layer: LayerCompute
    other_first: FwdBwd
    other_last: FwdBwd
    pp: int
    contention: float
    recompute_factor: float
    block_optim_us: float
    other_optim_us: np.ndarray

    @classmethod
    def of(cls, key, model: ModelCost, seq_len: int, options) -> "StageCompute":
        """The compute of ConfigKey `key` (its degrees, micro-batches, schedule) for `model` at
        `seq_len` under CostOptions `options` (shares, calibration, MoE imbalance)."""
        cal = options.calibration
        compute = LayerCompute.from_model(model, seq_len, key.tp, key.micro_batch_size, key.cp)
        if model.moe is not None:
            compute = _moe_block(compute, model, key, seq_len, moe_imbalance(model, options))
        # How much slower (or faster) compute runs with this schedule's ranks busy at once than
        # in the profile (planner/calibration.py), times the cluster's calibrated factor.
        contention = contention_factor(model.concurrency, key.pp, key.num_micro_batches,
                                       key.virtual_stages)
        compute = compute.scaled(contention * cal.compute)
        first = options.other_time_first_share
        c = compute.other
        block_optim_us, other_optim_us = model.optimizer_us(key.tp)
        # ZeRO >= 1: each data-parallel rank steps 1/dp of the masters (1/(dp x cp) with CP).
        optim_shard = key.replicas if key.zero >= 1 else 1
        block_step_us = block_optim_us / optim_shard * cal.optimizer
        if model.moe is not None:  # the dense part's share over dp x cp, the experts' over edp
            counts = MoeParams.of(model, model.moe, key.tp, key.ep, key.etp)
            block_step_us = block_optim_us * cal.optimizer / counts.block0 * (
                counts.dense / optim_shard + counts.experts / (key.edp if key.zero >= 1 else 1))
        share = options.other_memory_first_share
        share = on_end_stages(share, 1.0 - share, key.pp) if key.pp > 1 else np.ones(1)
        return cls(layer=compute,
                   other_first=FwdBwd(first * c.fwd_us, first * c.bwd_us),
                   other_last=FwdBwd((1.0 - first) * c.fwd_us, (1.0 - first) * c.bwd_us),
                   pp=key.pp, contention=contention, recompute_factor=cal.recompute,
                   block_optim_us=block_step_us,
                   other_optim_us=other_optim_us * share / optim_shard * cal.optimizer)

    @property
    def other(self) -> FwdBwd:
        """"Other" per micro-batch on each stage (arrays over the pp stages)."""
        return FwdBwd(on_end_stages(self.other_first.fwd_us, self.other_last.fwd_us, self.pp),
                      on_end_stages(self.other_first.bwd_us, self.other_last.bwd_us, self.pp))

    def recompute_us(self, n, mode_code, k, full_comm_us=0.0):
        """Recompute (us per micro-batch) of a stage of n layers (numpy-friendly; mode codes as
        terms.MODE_CODES): selective reruns every layer's attention core, full the forward of
        k layers, each with `full_comm_us` of communication it repeats (StageCosts' TP, CP and
        dispatcher collectives; 0: compute alone)."""
        n = np.asarray(n, dtype=float)
        k = np.asarray(k, dtype=float)
        mode_code = np.asarray(mode_code)
        return self.recompute_factor * np.where(
            mode_code == 1, n * self.layer.selective_recompute_us,
            np.where(mode_code == 2, k * (self.layer.block.fwd_us + full_comm_us), 0.0))

    def optimizer_us(self, j, n):
        """The optimizer step (us) of stage j holding n layers, on one rank after ZeRO."""
        return np.asarray(n, dtype=float) * self.block_optim_us + self.other_optim_us[j]
