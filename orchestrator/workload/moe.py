"""The mixture-of-experts workload of one rank: tokens, dispatcher messages, expert shards.

One model of what a MoE block (models/moe.py) moves and holds per rank, per layer and
micro-batch; the planner prices it (planner/terms/moe.py) and the tracer is checked against it.
Megatron's all-to-all token dispatcher, as stage=train runs it (nothing of it overlapped with
compute: every message below is exposed):

    router (hidden x experts, softmax, top_k) -> permute -> all-to-all over EP -> all-gather
    over ETP -> experts (SwiGLU of width expert_ffn / etp) -> reduce-scatter over ETP ->
    all-to-all back over EP -> unpermute (+ the shared expert, a TP-sharded dense SwiGLU)

Tokens: a rank routes its own T = micro_batch_size x seq_len / (tp x cp) tokens (sequence
parallelism splits the sequence over tp; a MoE model needs it with tp > 1) and sends T x top_k
token copies ("assignments") to the EP ranks holding their experts. Under uniform load every
rank receives T x top_k; the busiest receives `imbalance` times that (imbalance >= 1, the
search's `moe_imbalance`). With a capacity factor c every expert takes exactly
capacity = ceil(T x top_k / experts x c) assignments of each source rank (Megatron pads
to capacity, --moe-pad-expert-input-to-capacity), so every rank sends and receives
experts x capacity whatever the routing: no imbalance.

Sizes follow nccl-tests' convention (what the hardware profile's fits take): an all-to-all's
buffer is the rank's whole send buffer (its own share included), an all-gather's the gathered
output, a reduce-scatter's the input; `*_sent_bytes` are the bytes that leave the rank.
Backward repeats both all-to-alls (the gradients of the dispatched and of the combined tokens)
and swaps the ETP all-gather and reduce-scatter.

Parameters: a rank holds experts / ep routed experts of each MoE block, each 3 x hidden x
expert_ffn / etp (w_gate, w_up, w_down); they are replicated, and their gradients reduced,
over the edp = tp x cp x dp / (ep x etp) ranks of stride ep x etp (ParallelLayout), the rest of
the block (attention, norms, router, shared expert) over the dense dp x cp replicas.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from orchestrator.choices import Dtype, Engine
from orchestrator.models.config import ModelConfig
from orchestrator.models.config import capacity as expert_capacity
from orchestrator.models.config import (count_attention_params, expert_width, is_moe,
                                        is_moe_block)
from orchestrator.workload.comm import Comm, rank_blocks, rerun, residual_dtype, times

# Bytes per element of the router's logits and probabilities (fp32, models/moe.py).
ROUTER_ELEM_BYTES = 4


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts fields a planner needs, as plain numbers (models/config.py's
    meaning); `width` is one routed expert's FFN width."""

    hidden: int
    experts: int
    top_k: int
    width: int
    shared_width: int = 0
    dense_layers: int = 0
    layers: int = 1
    capacity_factor: Optional[float] = None
    aux_loss_coef: float = 0.01

    @classmethod
    def of(cls, cfg: ModelConfig) -> Optional["MoeShape"]:
        """The shape of `cfg`'s experts; None for a dense model."""
        if not is_moe(cfg):
            return None
        return cls(hidden=int(cfg.hidden), experts=int(cfg.experts), top_k=int(cfg.top_k),
                   width=int(expert_width(cfg)), shared_width=int(cfg.shared_expert_ffn),
                   dense_layers=int(cfg.dense_layers), layers=int(cfg.layers),
                   capacity_factor=cfg.capacity_factor, aux_loss_coef=float(cfg.aux_loss_coef))

    @property
    def moe_layers(self) -> int:
        """Blocks with experts."""
        return self.layers - self.dense_layers


# ---------------------------------------------------------------------------- tokens
def tokens_per_rank(seq_len: int, micro_batch_size: int, tp: int, cp: int = 1) -> float:
    """T: the tokens one rank routes per MoE layer and micro-batch, b x s / (tp x cp)."""
    return micro_batch_size * seq_len / (tp * cp)


def capacity(tokens: float, shape: MoeShape) -> int:
    """Assignments each expert takes from one rank's `tokens` under a capacity factor
    (models/config.capacity; each micro-batch's for a numpy array of tokens)."""
    if np.ndim(tokens):
        return np.vectorize(expert_capacity, otypes=[float])(
            tokens, shape.top_k, shape.experts, shape.capacity_factor)
    return expert_capacity(tokens, shape.top_k, shape.experts, shape.capacity_factor)


def assignments_sent(tokens: float, shape: MoeShape) -> float:
    """Token copies one rank sends to the experts per layer and micro-batch: T x top_k
    (dropless), experts x capacity with a capacity factor (padded)."""
    if shape.capacity_factor is not None:
        return shape.experts * capacity(tokens, shape) * 1.0
    return tokens * shape.top_k


def assignments_received(tokens: float, shape: MoeShape, imbalance: float = 1.0) -> float:
    """Token copies the busiest EP rank receives for its experts (before the ETP all-gather):
    T x top_k x imbalance (dropless; 1.0 is uniform load), experts x capacity with a capacity
    factor (padded: the same on every rank)."""
    if shape.capacity_factor is not None:
        return shape.experts * capacity(tokens, shape) * 1.0
    return tokens * shape.top_k * imbalance


def expert_tokens(tokens: float, shape: MoeShape, etp: int, imbalance: float = 1.0) -> float:
    """Token copies the experts of the busiest rank compute on: what it received, gathered over
    its etp ranks (each of them computes 1 / etp of the width on all of them)."""
    return etp * assignments_received(tokens, shape, imbalance)


# ---------------------------------------------------------------------------- messages
def a2a_buffer_bytes(tokens: float, shape: MoeShape, elem_bytes: int,
                     imbalance: float = 1.0) -> float:
    """One dispatcher all-to-all's buffer on the busiest rank (nccl-tests' size: its whole send
    or receive buffer, whichever is larger): assignments x hidden x elem_bytes."""
    sent = assignments_sent(tokens, shape)
    received = assignments_received(tokens, shape, imbalance)
    return np.maximum(sent, received) * shape.hidden * elem_bytes


def counts_bytes(shape: MoeShape) -> int:
    """The all-to-all of the tokens' counts per expert a rank sends before the dispatch (the
    split sizes): one int64 per expert (experts / ep to each EP rank)."""
    return 8 * shape.experts


def a2a_sent_bytes(tokens: float, shape: MoeShape, ep: int, elem_bytes: int,
                   imbalance: float = 1.0) -> float:
    """Bytes one all-to-all moves off the busiest rank (or into it): the buffer's (ep - 1) / ep
    share for the other EP ranks; T x top_k x hidden x elem_bytes x (ep - 1) / ep uniformly."""
    return a2a_buffer_bytes(tokens, shape, elem_bytes, imbalance) * (ep - 1) / ep


@dataclass(frozen=True)
class DispatchBytes:
    """Per MoE layer and micro-batch on the busiest rank (bytes): `a2a` one all-to-all's buffer
    (two forward: dispatch and combine; two backward), `etp` the ETP all-gather's output = the
    reduce-scatter's input (one each forward, one each backward), and what leaves the rank in
    all of them, forward and backward."""

    a2a: float
    etp: float
    sent_fwd: float
    sent_bwd: float


def dispatch_bytes(tokens: float, shape: MoeShape, ep: int, etp: int, elem_bytes: int,
                   imbalance: float = 1.0) -> DispatchBytes:
    """The dispatcher's messages of one MoE layer and micro-batch (see DispatchBytes)."""
    a2a = a2a_buffer_bytes(tokens, shape, elem_bytes, imbalance) if ep > 1 else 0.0
    received = assignments_received(tokens, shape, imbalance)
    gathered = etp * received * shape.hidden * elem_bytes if etp > 1 else 0.0
    a2a_sent = 2 * a2a * (ep - 1) / ep  # dispatch + combine
    etp_sent = 2 * gathered * (etp - 1) / etp  # all-gather + reduce-scatter
    return DispatchBytes(a2a=a2a, etp=gathered, sent_fwd=a2a_sent + etp_sent,
                         sent_bwd=a2a_sent + etp_sent)


@dataclass(frozen=True)
class MoeMessages:
    """The dispatcher's messages of one MoE block and micro-batch on the busiest rank (Comm,
    count per unit): forward and backward; a block recomputed in full reruns the forward."""

    fwd: Tuple[Comm, ...]
    bwd: Tuple[Comm, ...]


def moe_messages(tokens: float, shape: MoeShape, ep: int, etp: int, engine: Engine,
                 compute: Dtype | str, imbalance: float = 1.0) -> MoeMessages:
    """What a rank routing `tokens` tokens (T) moves per MoE block and micro-batch: forward the
    tokens' counts per expert (int64, the all-to-all's split sizes) and the tokens over EP (the
    residual stream's dtype: the block's input), over ETP the counts and the tokens gathered and
    the experts' partial outputs summed back (the compute dtype: matmul outputs; our engine
    all-reduces the gathered rows and keeps its own, Megatron reduce-scatters), and the
    combine back over EP (compute dtype); backward the combine's and the dispatch's gradients
    over EP and the ETP pair swapped, each in its forward's dtype. Sizes: module docstring
    (all-to-all: the busiest rank's buffer; `imbalance` 1.0 is uniform routing)."""
    compute = Dtype.parse(compute)
    residual = residual_dtype(engine, compute)
    fwd: list = []
    bwd: list = []
    if ep > 1:
        def a2a(dtype: Dtype) -> float:
            return a2a_buffer_bytes(tokens, shape, dtype.bytes, imbalance)
        fwd += [Comm("all_to_all", "ep", counts_bytes(shape), "int64", "fwd", 1,
                     "tokens per expert"),
                Comm("all_to_all", "ep", a2a(residual), residual.value, "fwd", 1,
                     "token dispatch")]
        bwd += [Comm("all_to_all", "ep", a2a(compute), compute.value, "bwd", 1,
                     "token combine gradient")]
    if etp > 1:
        received = assignments_received(tokens, shape, imbalance)

        def gathered(dtype: Dtype) -> float:
            return etp * received * shape.hidden * dtype.bytes
        reduce = "reduce_scatter" if engine == Engine.megatron else "all_reduce"
        fwd += [Comm("all_gather", "etp", etp * (shape.experts // ep) * 8, "int64", "fwd", 1,
                     "ETP tokens per expert"),
                Comm("all_gather", "etp", gathered(residual), residual.value, "fwd", 1,
                     "ETP tokens"),
                Comm(reduce, "etp", gathered(compute), compute.value, "fwd", 1,
                     "ETP expert outputs")]
        bwd += [Comm("all_gather", "etp", gathered(compute), compute.value, "bwd", 1,
                     "ETP expert output gradients"),
                Comm(reduce, "etp", gathered(residual), residual.value, "bwd", 1,
                     "ETP token gradients")]
    if ep > 1:
        fwd.append(Comm("all_to_all", "ep", a2a(compute), compute.value, "fwd", 1,
                        "token combine"))
        bwd.append(Comm("all_to_all", "ep", a2a(residual), residual.value, "bwd", 1,
                        "token dispatch gradient"))
    return MoeMessages(tuple(fwd), tuple(bwd))


def rank_moe_comms(model: ModelConfig, layout, rank: int,
                   engine: Engine = Engine.orchestrator,
                   dtype: Dtype | str = Dtype.fp32) -> List[Comm]:
    """The dispatcher's messages `rank` issues in one iteration (counts per iteration) under
    uniform routing, every rank sending and receiving T x top_k token copies: moe_messages for
    each of its MoE blocks and micro-batches, and the forward's again for each block recomputed
    in full. With real routing the combine's and the dispatch gradient's buffers follow the
    load (what the rank received); their op, group, dtype and count do not. Not here: the
    experts' gradient buckets over edp and the balance statistics' reductions."""
    shape = MoeShape.of(model)
    if shape is None:
        return []
    tokens = tokens_per_rank(model.seq_len, layout.micro_batch_size, layout.tp, layout.cp)
    messages = moe_messages(tokens, shape, layout.ep, layout.etp, engine, dtype)
    blocks = [again for block, again in rank_blocks(model, layout, rank)
              if is_moe_block(model, block)]
    m = layout.num_micro_batches
    out = (times(messages.fwd + messages.bwd, len(blocks) * m)
           + times(rerun(messages.fwd), sum(blocks) * m))
    return [dataclasses.replace(c, bytes=int(c.bytes)) if float(c.bytes).is_integer() else c
            for c in out if c.count > 0]


# ---------------------------------------------------------------------------- parameters
def expert_params_per_rank(shape: MoeShape, ep: int, etp: int) -> int:
    """Routed-expert parameters one rank holds of one MoE block: experts / ep experts of
    3 x hidden x width / etp each."""
    return (shape.experts // ep) * 3 * shape.hidden * (shape.width // etp)


def moe_dense_params_per_rank(shape: MoeShape, tp: int) -> int:
    """A MoE block's parameters outside the routed experts on one TP rank: the router
    (hidden x experts, replicated over TP) and the shared expert (TP-sharded)."""
    return shape.hidden * shape.experts + 3 * shape.hidden * shape.shared_width // tp


def dense_ffn_params_per_rank(hidden: int, ffn: int, tp: int) -> int:
    """A dense block's SwiGLU MLP on one TP rank."""
    return 3 * hidden * ffn // tp


def moe_block_params_per_rank(cfg: ModelConfig, tp: int, ep: int, etp: int) -> int:
    """All parameters of one MoE block on one rank: attention (TP-sharded, norms replicated),
    router, shared expert and its routed experts."""
    shape = MoeShape.of(cfg)
    attention = count_attention_params(cfg)
    norms = 2 * cfg.hidden
    return ((attention - norms) // tp + norms + moe_dense_params_per_rank(shape, tp)
            + expert_params_per_rank(shape, ep, etp))


def expert_grad_sync_bytes(shape: MoeShape, ep: int, etp: int, grad_elem_bytes: int = 4,
                           layers: Optional[int] = None) -> float:
    """Gradient bytes one rank reduces over its expert-data-parallel group (edp ranks of stride
    ep x etp) for `layers` MoE blocks (default all of the model's): their routed experts'
    shards, in the engine's gradient dtype (fp32 for stage=train)."""
    count = shape.moe_layers if layers is None else layers
    return float(count * expert_params_per_rank(shape, ep, etp) * grad_elem_bytes)


# ---------------------------------------------------------------------------- compute, memory
def moe_matmul_params_per_token(shape: MoeShape, imbalance: float = 1.0) -> float:
    """Matmul parameters one token goes through in a MoE FFN (its FLOPs / 2), on the busiest
    rank: the router, top_k x imbalance routed experts, the shared expert (with a capacity
    factor: the padded experts x capacity per token)."""
    if shape.capacity_factor is not None:
        routed = shape.top_k * shape.capacity_factor  # padded to capacity, ceil() aside
    else:
        routed = shape.top_k * imbalance
    return (shape.hidden * shape.experts + routed * 3 * shape.hidden * shape.width
            + 3 * shape.hidden * shape.shared_width)


def moe_activation_bytes(tokens: float, shape: MoeShape, tp: int, etp: int, elem_bytes: int,
                         imbalance: float = 1.0) -> float:
    """Bytes one MoE FFN keeps for its backward per micro-batch on the busiest rank (no
    recompute): the router's logits and probabilities (fp32, T x experts each), the permuted
    token copies and each expert's intermediates (input, gate, up and their SwiGLU product:
    hidden + 3 x width / etp per copy it computes on), the experts' outputs before the weighted
    sum (T x top_k x hidden), and the shared expert's (its gathered input and 3 intermediates
    of width / tp per token of the sequence, T x tp of them)."""
    router = 2 * ROUTER_ELEM_BYTES * tokens * shape.experts
    copies = expert_tokens(tokens, shape, etp, imbalance)
    experts = copies * (shape.hidden + 3 * shape.width / etp) * elem_bytes
    combine = assignments_sent(tokens, shape) * shape.hidden * elem_bytes
    shared = (tokens * tp * (shape.hidden / tp + 3 * shape.shared_width / tp) * elem_bytes
              if shape.shared_width else 0.0)
    return router + experts + combine + shared


def dense_mlp_activation_bytes(tokens: float, hidden: int, ffn: int, tp: int,
                               elem_bytes: int) -> float:
    """What a dense SwiGLU MLP keeps per micro-batch on one rank under sequence parallelism
    (T = this rank's share of the tokens): its input (sharded, gathered again in backward) and
    gate, up and their product (width / tp for every token of the sequence)."""
    return tokens * (hidden + 3 * ffn) * elem_bytes


# Load imbalance the search assumes when search.moe_imbalance is not given: the busiest EP
# rank's assignments over the mean, by how hard the auxiliary loss balances (a prior, not a
# measurement; stage=train's step log prints the tokens per expert to check it against).
IMBALANCE_BY_AUX_COEF = ((1e-2, 1.1), (1e-3, 1.2), (0.0, 1.3))


def default_imbalance(shape: MoeShape) -> float:
    """The busiest rank's load over the mean the planner assumes: 1.0 with a capacity factor
    (padded to capacity: every rank computes the same), else by aux_loss_coef
    (IMBALANCE_BY_AUX_COEF: 1.1 from 1e-2, 1.2 from 1e-3, 1.3 below)."""
    if shape.capacity_factor is not None:
        return 1.0
    for coef, imbalance in IMBALANCE_BY_AUX_COEF:
        if shape.aux_loss_coef >= coef:
            return imbalance
    return IMBALANCE_BY_AUX_COEF[-1][1]
