"""Mixture-of-experts blocks: their compute, the token dispatcher's communication, their memory,
priced from workload/moe.py's counts.

Every block of a MoE model is priced as a MoE block (the first `dense_layers` too: DeepSeek-V3's
three dense blocks do as many FLOPs per token as its MoE blocks; their parameters are counted
as a MoE block's, see docs/stages/search.md).

The model profile's block is a dense one (profile_model times a MoE model's dense block beside
its MoE parts; a profile of the dense twin has only it). Compute, with profile_model's MoE parts
(moe_block_delta_us): the block less its MLP, plus routing, the busiest rank's experts on their
token copies and the shared expert. Without them (a dense twin's profile), scaled from the
block: its fits' constant and attention-core (s^2) terms are kept; the term linear in tokens
(its matmuls) is scaled by the matmul parameters a token goes through on the busiest rank over
the dense block's:

    (attention + router + top_k x imbalance x 3 h w + 3 h w_shared) / (attention + 3 h ffn)

Per rank the experts compute on T x top_k x imbalance token copies of 3 h w / etp x etp
(gathered over etp): the same as a dense MLP of width top_k x imbalance x w over tp, so the
profile's time per matmul parameter and token at that tp carries over (the experts' GEMMs are
taken as efficient as the dense block's: small experts run below it, not modelled).

Communication, per layer and micro-batch, exposed (stage=train does not overlap the dispatcher
with compute; Megatron-LM can, the planner does not price that): the messages of
workload/moe.moe_messages (forward the counts exchange, an all-to-all over the EP group (ep
ranks, stride etp) to dispatch in the residual stream's dtype and one to combine in the compute
dtype, the ETP group's (etp consecutive ranks) gathers and sums; backward their gradients). The
all-to-alls are priced by HardwareModel.all2all_line (a node's NVLink, or the NICs across
nodes), the ETP collectives by collective_line.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.bandwidth import benchmark_of
from orchestrator.models.config import count_attention_params
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.terms import FwdBwd, as_value
from orchestrator.workload.moe import (MoeMessages, MoeShape, default_imbalance,
                                       dense_ffn_params_per_rank,
                                       dense_mlp_activation_bytes,
                                       expert_params_per_rank, expert_tokens,
                                       moe_activation_bytes, moe_dense_params_per_rank,
                                       moe_matmul_params_per_token, tokens_per_rank)


def moe_imbalance(model: ModelCost, options) -> float:
    """The load imbalance the cost model prices a MoE model at (1.0 for a dense one):
    `options.moe_imbalance` (CostOptions) when given, else workload/moe.default_imbalance."""
    if model.moe is None:
        return 1.0
    if options.moe_imbalance is not None:
        return float(options.moe_imbalance)
    return default_imbalance(model.moe)


def attention_params_per_rank(model: ModelCost, tp: int) -> float:
    """A block's attention on one TP rank: wq, wk, wv, wo sharded, the two norms replicated."""
    norms = 2 * model.hidden
    return (count_attention_params(model) - norms) / tp + norms


def linear_scale(model: ModelCost, shape: MoeShape, imbalance: float) -> float:
    """What the profiled dense block's linear (matmul) time is multiplied by for a MoE block on
    the busiest rank (module docstring)."""
    attention = count_attention_params(model) - 2 * model.hidden
    return ((attention + moe_matmul_params_per_token(shape, imbalance))
            / (attention + 3.0 * model.hidden * model.ffn))


def moe_block_delta_us(costs, shape: MoeShape, key, seq_len: int, imbalance: float,
                       micro_batch_size=None):
    """(forward, backward) us a MoE block takes on the busiest rank beyond the profiled dense
    block, from profile_model's MoE parts (profiling/model/moe_costs.MoeCosts): routing of the
    rank's T tokens, its experts / ep experts each on the token copies its EP (and ETP) group
    sends it, T x top_k x ep x etp / experts x imbalance, the shared expert, less the dense
    block's MLP (both on the TP-gathered tokens). Micro-batches of `micro_batch_size` sequences
    (default the key's; numpy arrays with seq_len: the dynamic planner's)."""
    b = key.micro_batch_size if micro_batch_size is None else micro_batch_size
    tokens = tokens_per_rank(seq_len, b, key.tp, key.cp)
    local_experts = shape.experts // key.ep
    per_expert = expert_tokens(tokens, shape, key.etp, imbalance) / local_experts
    return costs.moe_block_delta_us(tokens, tokens * key.tp, per_expert, local_experts,
                                    key.tp, key.etp)


@dataclass(frozen=True)
class MoeParams:
    """A MoE block's parameters on one rank: `dense` (attention, norms, router, shared expert:
    ZeRO shards them over dp x cp) and `experts` (its routed experts' shards: over edp), and
    `block0` the profiled dense block's (what its byte counts scale by)."""

    dense: float
    experts: float
    block0: float

    @classmethod
    def of(cls, model: ModelCost, shape: MoeShape, tp: int, ep: int, etp: int) -> "MoeParams":
        attention = attention_params_per_rank(model, tp)
        return cls(dense=float(attention + moe_dense_params_per_rank(shape, tp)),
                   experts=float(expert_params_per_rank(shape, ep, etp)),
                   block0=float(attention + dense_ffn_params_per_rank(model.hidden, model.ffn,
                                                                      tp)))


def activation_delta_bytes(model: ModelCost, shape: MoeShape, seq_len: int,
                           micro_batch_size: int, tp: int, cp: int, etp: int,
                           imbalance: float) -> float:
    """Bytes a MoE block keeps per micro-batch beyond the profiled dense block (no or selective
    recompute; full recompute keeps the block's input only): the MoE FFN's on the busiest rank
    less the dense MLP's."""
    tokens = tokens_per_rank(seq_len, micro_batch_size, tp, cp)
    elem = model.dtype_bytes
    return (moe_activation_bytes(tokens, shape, tp, etp, elem, imbalance)
            - dense_mlp_activation_bytes(tokens, model.hidden, model.ffn, tp, elem))


@dataclass(frozen=True)
class MoeComm:
    """The dispatcher's time (us per MoE layer and micro-batch), forward and backward, all
    exposed."""

    layer: FwdBwd

    @classmethod
    def from_hardware(cls, hardware: HardwareModel, messages: MoeMessages, ep: int, etp: int,
                      bandwidth_factor: float = 1.0) -> "MoeComm":
        """Price `messages` (workload/moe.moe_messages) on the EP group (ep ranks, stride etp)
        and the ETP group (etp consecutive ranks)."""
        def op_us(comm):
            if comm.op == "all_to_all":
                alpha, per_byte = hardware.all2all_line(ep, etp)
            else:
                alpha, per_byte = hardware.collective_line(benchmark_of(comm.op), etp, 1)
            # nothing to move: no latency (per micro-batch with numpy arrays of sizes)
            return (alpha + comm.bytes * per_byte * bandwidth_factor) * (np.asarray(comm.bytes) > 0)

        def us(comms):
            return as_value(sum(c.count * op_us(c) for c in comms))
        return cls(FwdBwd(us(messages.fwd), us(messages.bwd)))

    def scaled(self, factor: float) -> "MoeComm":
        """Every term times `factor` (the calibration's ep_comm)."""
        if factor == 1.0:
            return self
        return MoeComm(FwdBwd(self.layer.fwd_us * factor, self.layer.bwd_us * factor))
