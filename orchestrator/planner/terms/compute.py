"""Compute time of one micro-batch, from the model profile's fits (communication excluded):
a block's and "other"'s (LayerCompute), and the pieces StageCosts builds a stage's compute from
(layer_compute, other_split, optimizer_step_us, recompute_rerun_us), which StageCompute gathers
for trace so its op times are the planner's compute."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from orchestrator.choices import Engine
from orchestrator.planner.calibration import contention_factor
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.terms import FwdBwd
from orchestrator.planner.terms.moe import (MoeParams, linear_scale, moe_block_delta_us,
                                            moe_imbalance)
from orchestrator.planner.terms.pipeline import on_end_stages


@dataclass(frozen=True)
class LayerCompute:
    """Compute (us per micro-batch of b sequences) on one rank of a TP group of size tp:

    block: forward and backward of one transformer block;
    selective_recompute_us: the attention core (the s^2 term of the block's forward fit), what
      Megatron's selective recompute reruns in the backward, or what the profile timed it to
      add (a CPU's);
    other: embedding + final norm + LM head + loss, all of it (cost_model splits it over the
      first and the last stage)."""

    block: FwdBwd
    selective_recompute_us: float
    other: FwdBwd
    # what full recompute adds: as the profile timed it (a CPU's), the forward rerun inside
    # the backward's call (a GPU's: TpFit.full_rerun_us); None: one more forward
    full_recompute_us: Optional[float] = None

    @classmethod
    def from_model(cls, model: ModelCost, seq_len: int, tp: int,
                   micro_batch_size: int, cp: int = 1,
                   grad_add: bool = True) -> "LayerCompute":
        """Read the profile's per-sequence fits at `seq_len` for a micro-batch: a fit's
        constant once per call (host and launch overhead does not grow with the batch), the
        rest per sequence; with context parallelism a rank does 1 / cp of the per-sequence
        work (its tokens' linear work, and its balanced half-early, half-late share of the
        causal attention). `grad_add`: each backward adds its gradients into fp32 buckets
        (stage=train's engine), where the profile has that apart (an analytic one's); Megatron
        fuses it into the weight-gradient GEMM."""
        b = micro_batch_size / cp
        selective = model.recompute_us("selective", seq_len, tp, b)
        block_add, other_add = model.grad_add_us(tp) if grad_add else (0.0, 0.0)
        return cls(block=FwdBwd(model.block_fwd_us(seq_len, tp, b),
                                model.block_bwd_us(seq_len, tp, b) + block_add),
                   selective_recompute_us=(b * model.attention_core_fwd_us(seq_len, tp)
                                           if selective is None else selective),
                   other=FwdBwd(model.other_fwd_us(seq_len, tp, b),
                                model.other_bwd_us(seq_len, tp, b) + other_add),
                   full_recompute_us=model.recompute_us("full", seq_len, tp, b))

    def scaled(self, factor: float) -> "LayerCompute":
        """Every time times `factor` (contention, a calibrated efficiency); itself for 1."""
        if factor == 1.0:
            return self
        full = self.full_recompute_us
        return LayerCompute(block=FwdBwd(self.block.fwd_us * factor, self.block.bwd_us * factor),
                            selective_recompute_us=self.selective_recompute_us * factor,
                            other=FwdBwd(self.other.fwd_us * factor, self.other.bwd_us * factor),
                            full_recompute_us=None if full is None else full * factor)

    @property
    def full_rerun_us(self):
        """What full recompute adds to a block: as timed or as its backward call reruns it
        (ModelCost.recompute_us), else its forward once more."""
        return self.block.fwd_us if self.full_recompute_us is None else self.full_recompute_us


def layer_compute(model: ModelCost, key, seq_len, micro_batch_size, imbalance: float,
                  factor: float, engine=Engine.orchestrator) -> LayerCompute:
    """A layer's compute per micro-batch of `micro_batch_size` sequences of `seq_len` tokens
    (floats, or arrays over micro-batches) for ConfigKey `key`, times `factor` (contention x
    calibration): for a MoE model a MoE block on the busiest EP rank at `imbalance` (terms/moe:
    profile_model's MoE parts when the profile has them, else the profiled block's matmuls
    scaled to the MoE block's); `engine`'s gradient accumulation (LayerCompute.from_model)."""
    compute = LayerCompute.from_model(model, seq_len, key.tp, micro_batch_size, key.cp,
                                      grad_add=Engine.parse(engine) == Engine.orchestrator)
    if model.moe is not None:
        if model.moe_costs is not None:  # profile_model timed its parts beside the block
            extra_fwd, extra_bwd = moe_block_delta_us(model.moe_costs, model.moe, key, seq_len,
                                                      imbalance, micro_batch_size)
        else:  # the profiled block's matmuls scaled to the MoE block's
            scale = linear_scale(model, model.moe, imbalance) - 1.0
            lin_fwd, lin_bwd = model.block_linear_us(seq_len, key.tp, micro_batch_size / key.cp)
            extra_fwd, extra_bwd = scale * lin_fwd, scale * lin_bwd
        full = compute.full_recompute_us  # the dense block's, as timed: its MoE part reruns too
        compute = LayerCompute(FwdBwd(compute.block.fwd_us + extra_fwd,
                                      compute.block.bwd_us + extra_bwd),
                               compute.selective_recompute_us, compute.other,
                               None if full is None else full + extra_fwd)
    return compute.scaled(factor)


def other_split(other: FwdBwd, first_share: float) -> Tuple[FwdBwd, FwdBwd]:
    """"Other" (embedding, final norm, LM head, loss) as (the first stage's, the last stage's):
    `first_share` of it (CostOptions.other_time_first_share: the embedding lookup) and the rest."""
    rest = 1.0 - first_share
    return (FwdBwd(first_share * other.fwd_us, first_share * other.bwd_us),
            FwdBwd(rest * other.fwd_us, rest * other.bwd_us))


def other_on_stages(other: FwdBwd, first_share: float, pp: int) -> FwdBwd:
    """"Other" per stage (arrays over the pp stages, other_split's parts on the end stages)."""
    first, last = other_split(other, first_share)
    return FwdBwd(on_end_stages(first.fwd_us, last.fwd_us, pp),
                  on_end_stages(first.bwd_us, last.bwd_us, pp))


def optimizer_step_us(key, model: ModelCost, options) -> Tuple[float, np.ndarray]:
    """(per block, "other" per stage [pp]) optimizer step time (us) on one rank of ConfigKey
    `key`, once per iteration, after ZeRO's sharding, calibrated (CostOptions `options`):
    ZeRO >= 1 steps 1/(dp x cp) of the masters, a MoE block's experts 1/edp; "other" split by
    other_memory_first_share."""
    cal = options.calibration
    block_us, other_us = model.optimizer_us(key.tp)
    optim_shard = key.replicas if key.zero >= 1 else 1
    block_step_us = block_us / optim_shard * cal.optimizer
    if model.moe is not None:  # the dense part's share over dp x cp, the experts' over edp
        counts = MoeParams.of(model, model.moe, key.tp, key.ep, key.etp)
        block_step_us = block_us * cal.optimizer / counts.block0 * (
            counts.dense / optim_shard + counts.experts / (key.edp if key.zero >= 1 else 1))
    share = options.other_memory_first_share
    share = on_end_stages(share, 1.0 - share, key.pp) if key.pp > 1 else np.ones(1)
    return block_step_us, other_us * share / optim_shard * cal.optimizer


def recompute_rerun_us(n, mode_code, k, selective_us, full_us, factor: float):
    """Recompute (us per micro-batch) of a stage of n layers (numpy-friendly; mode codes as
    terms.MODE_CODES): selective reruns every layer's attention core (`selective_us` each),
    full the forward of k layers (`full_us` each: compute, plus whatever it repeats), times
    the calibrated `factor`."""
    n = np.asarray(n, dtype=float)
    k = np.asarray(k, dtype=float)
    mode_code = np.asarray(mode_code)
    return factor * np.where(mode_code == 1, n * selective_us,
                             np.where(mode_code == 2, k * full_us, 0.0))


@dataclass(frozen=True)
class StageCompute:
    """What the ranks of a layout's stages compute, as StageCosts charges it (us on one rank,
    communication excluded), from the same functions; trace prices its ops by it
    (trace/timing.py).

    layer: a block per micro-batch (a MoE block on the busiest EP rank for a model with
      experts), with the schedule's contention and the calibrated compute factor;
    other_first / other_last: "other" per micro-batch on the first stage and on the last;
    recompute_factor: the calibrated recompute factor;
    block_optim_us / other_optim_us: the optimizer step once per iteration, per block and
      "other" per stage."""

    layer: LayerCompute
    other_first: FwdBwd
    other_last: FwdBwd
    recompute_factor: float
    block_optim_us: float
    other_optim_us: np.ndarray

    @classmethod
    def of(cls, key, model: ModelCost, seq_len: int, options) -> "StageCompute":
        """The compute of ConfigKey `key` for `model` at `seq_len` under CostOptions `options`
        (shares, calibration, MoE imbalance), as StageCosts(key, model, ..., seq_len, options)
        prices it."""
        cal = options.calibration
        contention = contention_factor(model.concurrency, key.pp, key.num_micro_batches,
                                       key.virtual_stages)
        layer = layer_compute(model, key, seq_len, key.micro_batch_size,
                              moe_imbalance(model, options), contention * cal.compute,
                              options.engine)
        first, last = other_split(layer.other, options.other_time_first_share)
        block_optim_us, other_optim_us = optimizer_step_us(key, model, options)
        return cls(layer, first, last, cal.recompute, block_optim_us, other_optim_us)

    def recompute_us(self, n, mode_code, k):
        """The compute recompute reruns (us per micro-batch) in a stage of n layers."""
        return recompute_rerun_us(n, mode_code, k, self.layer.selective_recompute_us,
                                  self.layer.full_rerun_us, self.recompute_factor)

    def optimizer_us(self, j, n):
        """The optimizer step (us) of stage j holding n layers, on one rank after ZeRO."""
        return np.asarray(n, dtype=float) * self.block_optim_us + self.other_optim_us[j]
