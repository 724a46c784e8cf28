"""Every collective and point-to-point message of one training iteration on one rank.

`rank_comms(model, layout, rank)` is what `stage=train`'s engine issues in a steady-state
iteration (the first one also sends shape metadata between pipeline stages), for engine
"orchestrator" (train/engine.py): the planner prices this list and tests check it against the
real engine. Sizes follow the recorder's convention (trace/recorder.py): an all-gather counts
its gathered output, every other op its input.

Engine "megatron" is what `stage=trace` records of a Megatron-style rank (trace/tracer.py,
trace/cp.py), checked against it: parameters and the residual stream in the compute dtype (bf16, fp32 main
gradients), no loss all-reduce at the step, and Megatron-LM's TP (workload/tp.py): with SP each
linear all-gathers its sharded input again in the backward for the weight gradient (4
all-gathers + 2 reduce-scatters per layer backward, 2 for the LM head), and a full recompute
reruns the layer's whole forward (2 all-gathers + 2 reduce-scatters).

Tensor parallelism (DTensor, models/parallelize.py), per layer and micro-batch:
- with sequence parallelism: forward 2 all-gathers (the norm outputs, the residual dtype) and 2
  reduce-scatters (attention and MLP outputs, the compute dtype); backward the reverse of each
  (2 reduce-scatters in the residual dtype, 2 all-gathers in the compute dtype) and 2 all-
  gathers of the norm outputs again (the residual dtype): the column-parallel matmuls keep
  their input sequence-sharded and gather it for the weight gradients, as Megatron-LM's;
- without: forward 2 all-reduces (compute dtype), backward 2 (residual dtype);
- a layer recomputed in full repeats its forward collectives during the backward up to the last
  one whose output the backward needs (torch.utils.checkpoint stops there): with SP 2
  all-gathers and 1 reduce-scatter (the MLP's output is not needed), without SP 1 all-reduce;
- the embedding reduce-scatters (all-reduces without SP) its output; its backward all-gathers
  (SP only); the LM head all-gathers the final norm's output (SP), and its backward reduce-
  scatters it (all-reduces it without SP); the loss is vocab-parallel (both engines,
  Megatron's): per micro-batch 3 fp32 all-reduces over TP of one value per token (the logits'
  max, the sum of their exponentials, the target's logit), the logits never gathered;
- after the last micro-batch, each sequence-parallel norm weight's partial gradient is
  all-reduced over TP (fp32: the gradient buckets'; ZeRO 3 without a pipeline: after every
  micro-batch, with its reduce-scatter).
The residual stream is in the weights' dtype (workload/states.weight_dtype): bf16 under bf16
(bf16 weights, fp32 masters in the optimizer, as Megatron's), fp32 under fp32 and fp16 (autocast
casts only the matmul inputs); matmul outputs are in the compute dtype.

Pipeline (torch.distributed.pipelining): per micro-batch, each model chunk that is not the last
virtual stage sends its output forward and receives its gradient back; each that is not the
first receives its input and sends its input's gradient back (residual dtype, 1/tp of the
sequence with SP).

Data parallel (train/grads.py): ZeRO 0 all-reduces each fp32 gradient bucket
(workload/buckets.py), ZeRO 1 and 2 reduce-scatter it (Megatron's distributed optimizer), during
the backward once the last micro-batch has accumulated; ZeRO 1/2 all-gather the updated parameters after the step, in the weights'
dtype (bf16 under bf16: Megatron's distributed optimizer gathers bf16). ZeRO 3 (FSDP2,
one unit per block and one per chunk for the rest) all-gathers each unit's parameters (in the
weights' dtype; gradients reduce-scattered in fp32) in forward
and again in backward for every micro-batch without a pipeline (resharded after forward), once
per iteration with one (kept gathered, torchtitan's choice), and reduce-scatters its gradients
after every micro-batch's backward without a pipeline (the
shards accumulate), once after the last with one (torch.distributed.pipelining defers it).

Context parallelism (models/context_parallel.py; cp > 1): every per-token message above moves
the rank's s / cp tokens, and the data-parallel ones run over the dp x cp ranks holding the same
weights (group "dp_cp"). Per layer and micro-batch, with kv this rank's K and V (2 x b x s / cp x
kv_heads / tp x head_dim elements, the compute dtype):
- p2p (the ring): forward cp - 1 sends of kv to the next CP rank and as many receives from the
  previous; backward cp - 1 of kv again and cp of its gradient (same size and dtype);
- allgather: forward 2 all-gathers (K, V: cp x kv / 2 each gathered), backward 2
  reduce-scatters of their gradients;
- a2a (Ulysses): forward an all-to-all each for Q, K, V (to a head split) and one for the output
  (back to the sequence split): 2 of q = b x s / cp x heads / tp x head_dim elements, 2 of kv / 2;
  backward the same four for the gradients (a selective rerun of the core: Q, K, V's again, not
  the output's, where torch's checkpoint stops; Megatron's reruns all four);
- a2a+p2p (Megatron's hierarchical): a2a's messages over the cp_a2a ranks of group "cp_a2a",
  then p2p's over the cp / cp_a2a ranks of group "cp_ring" (each K/V message cp_a2a x the
  tokens and 1 / cp_a2a of the KV heads: kv bytes, as the plain ring's);
- recompute (full, or selective: the attention core) reruns the forward's messages in the
  backward.

Every iteration ends with one all-reduce over all ranks of the global gradient norm (fp64; none
when pp = tp = 1 with ZeRO 0, where every rank holds the whole gradient) and one of the loss and
the stop flag (2 x fp64).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Tuple

from orchestrator.choices import CpComm, Dtype, Engine, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.workload.buckets import plan_buckets
from orchestrator.workload.params import rank_chunks, virtual_stage_ranges
from orchestrator.workload.states import weight_dtype
from orchestrator.workload.tp import LOSS_VALUE_BYTES, tp_counts

GRADIENT_NORM = "gradient norm"
LOSS_AND_STOP = "loss and stop flag"
NORM_WEIGHT_GRADIENTS = "SP norm weight gradients (partial over TP)"
# What the planner does not price (planner/cost_model.StageCosts.messages): scalars and norm
# weights, once per iteration, latency only (2 world all-reduces, and 2 x layers + 1 TP
# all-reduces of hidden fp32 values with SP).
UNPRICED = frozenset({GRADIENT_NORM, LOSS_AND_STOP, NORM_WEIGHT_GRADIENTS})


@dataclass(frozen=True)
class Comm:
    """One kind of message a rank issues, `count` times per iteration."""

    op: str  # all_reduce | all_gather | reduce_scatter | send | recv
    group: str  # tp | cp (cp_a2a, cp_ring: a2a+p2p) | dp (dp_cp with CP) | pp | world
    bytes: int  # per message (all_gather: the gathered output; others: the input)
    dtype: str  # fp32 | bf16 | fp16 | fp64
    phase: str  # fwd | bwd | step (after the backward)
    count: int
    what: str  # what it moves, for people
    peer: str = ""  # send/recv: "next" or "prev" rank of the group (pipeline, CP ring)

    def key(self) -> Tuple:
        """What the recorder can tell apart (phase and `what` it cannot see)."""
        return (self.op, self.group, self.bytes, self.dtype, self.peer)


def rank_comms(model: ModelConfig, layout: ParallelLayout, rank: int,
               engine: Engine = Engine.orchestrator, dtype: Dtype | str = Dtype.fp32,
               bucket_MiB: float = 25.0) -> List[Comm]:
    """Every message `rank` issues in one iteration of `layout` training `model` with the
    given compute dtype and gradient buckets of `bucket_MiB` (train's OptimSettings); see the
    module docstring."""
    if engine not in tuple(Engine):
        raise ValueError(f"engine={engine!r}: the per-rank message list describes "
                         f"{' and '.join(Engine)}")
    compute = Dtype.parse(dtype)
    out: List[Comm] = []
    out += _tp_comms(model, layout, rank, compute, engine)
    out += _cp_comms(model, layout, rank, compute, engine)
    out += _pp_comms(model, layout, rank, residual_dtype(engine, compute))
    out += _dp_comms(model, layout, rank, bucket_MiB, weight_dtype(compute))
    out += step_comms(layout, engine)
    return [c for c in out if c.count > 0]


def step_comms(layout: ParallelLayout, engine: Engine = Engine.orchestrator) -> List[Comm]:
    """The scalars every rank all-reduces over all ranks once per iteration, after the
    backward: the global gradient norm (fp64; none when pp = tp = 1 with ZeRO 0, where every
    rank holds the whole gradient) and, in our engine, the loss and the stop flag."""
    if layout.world_size == 1:
        return []
    out = []
    if not (layout.pp * layout.tp == 1 and layout.zero == 0):
        out.append(Comm("all_reduce", "world", 8, "fp64", "step", 1, GRADIENT_NORM))
    if engine != Engine.megatron:
        out.append(Comm("all_reduce", "world", 16, "fp64", "step", 1, LOSS_AND_STOP))
    return out


def residual_dtype(engine: Engine, compute: Dtype | str) -> Dtype:
    """The residual stream's dtype (norm inputs and outputs, the embedding's output, pipeline
    messages): the compute dtype in Megatron's; in our engine its weights' (weight_dtype: bf16
    under bf16, fp32 under autocast)."""
    return Dtype.parse(compute) if engine == Engine.megatron else weight_dtype(compute)


def times(comms, count) -> List[Comm]:
    """`comms` (counts per unit: a layer, a micro-batch) issued `count` times each."""
    return [dataclasses.replace(c, count=c.count * count) for c in comms]


# ---------------------------------------------------------------- per layer and micro-batch
# What one layer, the embedding or the LM head moves per micro-batch: Comm with `count` per unit,
# the sizes from a rank's `tokens` (b x s / cp; floats or numpy arrays work too). rank_comms
# multiplies them out for a rank; the planner (planner/terms/) prices the same objects.
@dataclass(frozen=True)
class TpMessages:
    """Tensor-parallel messages of one micro-batch (module docstring): each layer's forward and
    backward, what a layer recomputed in full reruns in the backward, the embedding's and the LM
    head's (its forward with the vocab-parallel loss's all-reduces)."""

    layer_fwd: Tuple[Comm, ...]
    layer_bwd: Tuple[Comm, ...]
    recompute: Tuple[Comm, ...]
    embedding_fwd: Tuple[Comm, ...]
    embedding_bwd: Tuple[Comm, ...]
    head_fwd: Tuple[Comm, ...]
    head_bwd: Tuple[Comm, ...]


def layer_activation_bytes(tokens, hidden: int, dtype: Dtype):
    """One layer activation of a micro-batch on a rank: tokens x hidden elements of `dtype`."""
    return tokens * hidden * dtype.bytes


def tp_messages(engine: Engine, sequence_parallel: bool, tokens, hidden: int,
                compute: Dtype | str) -> TpMessages:
    """The TP messages of one micro-batch (workload/tp.py's counts) for a rank of `tokens`
    tokens: forward gathers move norm outputs (the residual dtype), reductions matmul outputs
    (the compute dtype); each backward collective moves the gradient of a forward one, in its
    dtype, and SP's re-gathers of the sharded layer inputs the forward's; the embedding's and LM
    head's move the residual stream; the loss reduces three fp32 values per token."""
    compute = Dtype.parse(compute)
    residual = residual_dtype(engine, compute)
    counts = tp_counts(engine, sequence_parallel)
    fwd = {"all_gather": residual, "reduce_scatter": compute, "all_reduce": compute}
    bwd = {"all_gather": compute, "reduce_scatter": residual, "all_reduce": residual}
    same = dict.fromkeys(fwd, residual)

    def comms(ops, dtypes, phase, what):
        return tuple(Comm(op, "tp", layer_activation_bytes(tokens, hidden, dtypes[op]),
                          dtypes[op].value, phase, n, what) for op, n in ops.items())

    loss = Comm("all_reduce", "tp", tokens * LOSS_VALUE_BYTES, Dtype.fp32.value, "fwd",
                counts.loss_all_reduce, "vocab-parallel loss: per-token max, sum, target logit")
    return TpMessages(
        layer_fwd=comms(counts.layer_fwd, fwd, "fwd", "layer activations"),
        layer_bwd=comms(counts.layer_bwd, bwd, "bwd", "layer activation gradients")
        + comms(counts.layer_regather, fwd, "bwd", "layer inputs, gathered again"),
        recompute=comms(counts.recompute, fwd, "bwd", "layer activations, recomputed"),
        embedding_fwd=comms(counts.embedding_fwd, same, "fwd", "embedding output"),
        embedding_bwd=comms(counts.embedding_bwd, same, "bwd", "embedding output gradient"),
        head_fwd=comms(counts.head_fwd, same, "fwd", "LM head input") + (loss,),
        head_bwd=comms(counts.head_bwd, same, "bwd", "LM head input gradient"))


def pp_message_bytes(tokens, hidden: int, tp: int, sequence_parallel: bool,
                     residual: Dtype):
    """One pipeline send (a chunk's output or its input's gradient): the rank's tokens x hidden
    of the residual stream, 1 / tp of them with sequence parallelism (each TP rank sends its
    shard)."""
    size = layer_activation_bytes(tokens, hidden, residual)
    if not sequence_parallel:
        return size
    return size // tp if isinstance(size, int) and size % tp == 0 else size / tp


@dataclass(frozen=True)
class CpMessages:
    """Context-parallel messages of one layer and micro-batch (module docstring): forward,
    backward, and what the backward reruns first under selective recompute (the attention
    core) and under full recompute (the whole forward)."""

    fwd: Tuple[Comm, ...]
    bwd: Tuple[Comm, ...]
    selective_rerun: Tuple[Comm, ...]
    full_rerun: Tuple[Comm, ...]

    def __add__(self, other: "CpMessages") -> "CpMessages":
        return CpMessages(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self):
        return self.fwd, self.bwd, self.selective_rerun, self.full_rerun


NO_CP = CpMessages((), (), (), ())


def cp_messages(comm: CpComm, cp: int, cp_a2a: int, tokens, heads: int, kv_heads: int,
                head_dim: int, tp: int, compute: Dtype | str,
                engine: Engine = Engine.orchestrator) -> CpMessages:
    """The CP messages of one layer and micro-batch for flavour `comm` over `cp` ranks (a2a+p2p:
    all-to-alls over `cp_a2a` of them, the ring over cp / cp_a2a), a rank holding `tokens`
    tokens (b x s / cp) of `heads` / tp query and `kv_heads` / tp KV heads in the compute
    dtype; nothing for cp = 1."""
    if cp == 1:
        return NO_CP
    compute = Dtype.parse(compute)
    head_bytes = tokens * head_dim * compute.bytes  # one head of the rank's tokens
    kv = 2 * head_bytes * (kv_heads // tp)  # this rank's K and V
    q = head_bytes * (heads // tp)  # its Q, or the attention's output
    if comm == CpComm["a2a+p2p"]:  # Ulysses over cp_a2a ranks, then the ring (as many bytes)
        return (_cp_flavour(CpComm.a2a, cp_a2a, "cp_a2a", q, kv, compute, engine)
                + _cp_flavour(CpComm.p2p, cp // cp_a2a, "cp_ring", q, kv, compute, engine))
    return _cp_flavour(comm, cp, "cp", q, kv, compute, engine)


def _cp_flavour(comm: CpComm, cp: int, group: str, q, kv, compute: Dtype,
                engine: Engine) -> CpMessages:
    dt = compute.value
    k = kv // 2 if isinstance(kv, int) else kv / 2  # K or V alone
    if comm == CpComm.a2a:
        fwd = (Comm("all_to_all", group, q, dt, "fwd", 2, "Q, output"),
               Comm("all_to_all", group, k, dt, "fwd", 2, "K, V"))
        # torch's checkpoint stops a selective rerun once the core's saved tensors are back:
        # the output's all-to-all back is not rerun (Megatron reruns all four)
        selective = (Comm("all_to_all", group, q, dt, "bwd", 2 if engine == Engine.megatron
                          else 1, "Q, output, recomputed"),
                     Comm("all_to_all", group, k, dt, "bwd", 2, "K, V, recomputed"))
        return CpMessages(fwd,
                          (Comm("all_to_all", group, q, dt, "bwd", 2, "Q, output gradients"),
                           Comm("all_to_all", group, k, dt, "bwd", 2, "K, V gradients")),
                          selective, rerun(fwd))
    if comm == CpComm.allgather:
        gathered = k * cp
        fwd = (Comm("all_gather", group, gathered, dt, "fwd", 2, "K, V"),)
        again = rerun(fwd)
        return CpMessages(fwd, (Comm("reduce_scatter", group, gathered, dt, "bwd", 2,
                                     "K, V gradients"),), again, again)
    # the ring: cp - 1 hops forward; backward the K/V blocks again and cp - 1 + 1 hops of their
    # gradients (each block's gradient returns to its owner)
    fwd = _ring(group, kv, dt, "fwd", cp - 1, "K/V block")
    bwd = (_ring(group, kv, dt, "bwd", cp - 1, "K/V block, again")
           + _ring(group, kv, dt, "bwd", cp, "K/V block gradient"))
    again = rerun(fwd)
    return CpMessages(fwd, bwd, again, again)


def _ring(group: str, size, dt: str, phase: str, hops: int, what: str) -> Tuple[Comm, ...]:
    return (Comm("send", group, size, dt, phase, hops, what, "next"),
            Comm("recv", group, size, dt, phase, hops, what, "prev"))


def rerun(fwd) -> Tuple[Comm, ...]:
    """The forward's messages again, in the backward (recompute)."""
    return tuple(dataclasses.replace(c, phase="bwd", what=f"{c.what}, recomputed") for c in fwd)


def rank_tokens(model: ModelConfig, layout: ParallelLayout) -> int:
    """Tokens of one micro-batch a rank holds: b x s, s / cp of each sequence under CP."""
    return layout.micro_batch_size * model.seq_len // layout.cp


def _layers(model, layout, rank) -> Tuple[int, int]:
    """(layers this rank holds, how many of them rerun their forward in the backward)."""
    layers = recomputed = 0
    for _, blocks, _, _ in _chunk_flags(model, layout, rank):
        layers += len(blocks)
        recomputed += _recomputed_blocks(layout, rank, len(blocks))
    return layers, recomputed


def _cp_comms(model, layout, rank, compute: Dtype,
              engine: Engine = Engine.orchestrator) -> List[Comm]:
    if layout.cp == 1:
        return []
    m = layout.num_micro_batches
    layers, recomputed = _layers(model, layout, rank)
    mode = layout.recompute[layout.coordinate(rank, "pp")][0]
    msgs = cp_messages(layout.cp_comm, layout.cp, layout.cp_a2a, rank_tokens(model, layout),
                       model.heads, model.kv_heads, model.hidden // model.heads, layout.tp,
                       compute, engine)
    selective = layers if mode == Recompute.selective else 0  # the core's forward, again
    return (times(msgs.fwd, layers * m) + times(msgs.bwd, layers * m)
            + times(msgs.selective_rerun, selective * m)
            + times(msgs.full_rerun, recomputed * m))


def rank_blocks(model: ModelConfig, layout: ParallelLayout, rank: int) -> List[Tuple[int, bool]]:
    """(block index, recomputed in full?) of every block `rank` holds, chunk by chunk (a full
    recompute of k layers reruns the first k / v blocks of each of the v chunks)."""
    out = []
    for _, blocks, _, _ in _chunk_flags(model, layout, rank):
        again = _recomputed_blocks(layout, rank, len(blocks))
        out += [(block, i < again) for i, block in enumerate(blocks)]
    return out


def _chunk_flags(model: ModelConfig, layout: ParallelLayout, rank: int):
    """(virtual stage, its blocks, first?, last?) for each chunk `rank` holds."""
    pp_rank = layout.coordinate(rank, "pp")
    ranges = virtual_stage_ranges(model, layout)
    last = len(ranges) - 1
    for c in range(layout.virtual_stages):
        s = c * layout.pp + pp_rank
        yield s, ranges[s], s == 0, s == last


def _recomputed_blocks(layout: ParallelLayout, rank: int, blocks_in_chunk: int) -> int:
    """Blocks of a chunk whose forward reruns in backward (full recompute: the first k / v)."""
    mode, k = layout.recompute[layout.coordinate(rank, "pp")]
    return min(blocks_in_chunk, k // layout.virtual_stages) if mode == Recompute.full else 0


def _tp_comms(model, layout, rank, compute: Dtype, engine: Engine) -> List[Comm]:
    tp, m = layout.tp, layout.num_micro_batches
    if tp == 1:
        return []
    layers, recomputed = _layers(model, layout, rank)
    flags = [(is_first, is_last) for _, _, is_first, is_last in _chunk_flags(model, layout, rank)]
    first, last = any(f for f, _ in flags), any(la for _, la in flags)
    msgs = tp_messages(engine, layout.sequence_parallel, rank_tokens(model, layout),
                       model.hidden, compute)
    out = (times(msgs.layer_fwd, layers * m) + times(msgs.recompute, recomputed * m)
           + times(msgs.layer_bwd, layers * m))
    if first:
        out += times(msgs.embedding_fwd + msgs.embedding_bwd, m)
    if last:
        out += times(msgs.head_fwd + msgs.head_bwd, m)
    if layout.sequence_parallel:
        # ours sums them in its fp32 gradient buckets (bf16 weights too), the tracer's
        # Megatron in the residual dtype
        grads = (Dtype.fp32 if engine == Engine.orchestrator
                 else residual_dtype(engine, compute))
        norms = 2 * layers + (1 if last else 0)
        if engine == Engine.orchestrator and layout.zero == 3 and layout.pp == 1:
            norms *= m  # with every micro-batch's reduce-scatter
        out.append(Comm("all_reduce", "tp", model.hidden * grads.bytes, grads.value,
                        "bwd", norms, NORM_WEIGHT_GRADIENTS))
    return out


def _pp_comms(model, layout, rank, residual: Dtype) -> List[Comm]:
    if layout.pp == 1:
        return []
    m = layout.num_micro_batches
    size = pp_message_bytes(rank_tokens(model, layout), model.hidden, layout.tp,
                            layout.sequence_parallel, residual)
    counts: Counter = Counter()
    for _, _, is_first, is_last in _chunk_flags(model, layout, rank):
        if not is_last:
            counts["send", "next", "fwd"] += m
            counts["recv", "next", "bwd"] += m
        if not is_first:
            counts["recv", "prev", "fwd"] += m
            counts["send", "prev", "bwd"] += m
    what = {"fwd": "activations", "bwd": "activation gradients"}
    return [Comm(op, "pp", size, residual.value, phase, n, what[phase], peer)
            for (op, peer, phase), n in sorted(counts.items())]


def _dp_comms(model, layout, rank, bucket_MiB: float, weights: Dtype) -> List[Comm]:
    """Gradients fp32; parameters gathered in `weights`' dtype."""
    dp = layout.replicas  # gradients reduced, ZeRO sharded over them
    if dp == 1:
        return []
    chunks = rank_chunks(model, layout, rank)
    if layout.zero == 3:
        return _fsdp_comms(chunks, layout, weights)
    params = [p for chunk in chunks for p in chunk]
    out = []
    group = layout.replica_group
    for plan in plan_buckets([p.local_numel for p in params], dp, bucket_MiB):
        grad_op = "reduce_scatter" if layout.zero in (1, 2) else "all_reduce"
        out.append(Comm(grad_op, group, plan.bytes, "fp32", "bwd", 1, "gradient bucket"))
        if layout.zero >= 1:
            out.append(Comm("all_gather", group, plan.numel * weights.bytes, weights.value,
                            "step", 1, "updated parameters (ZeRO-1/2)"))
    return _merge(out)


def _fsdp_comms(chunks, layout, weights: Dtype) -> List[Comm]:
    dp, m, group = layout.replicas, layout.num_micro_batches, layout.replica_group
    gathers = 1 if layout.pp > 1 else 2 * m  # kept gathered under a pipeline
    scatters = 1 if layout.pp > 1 else m  # every micro-batch's without a pipeline
    out = []
    for chunk in chunks:
        units: Dict[str, int] = {}
        for p in chunk:
            # FSDP2 pads each parameter's first dimension to a multiple of dp
            rows = -(-p.local_shape[0] // dp) * dp
            row_numel = p.local_numel // max(1, p.local_shape[0])
            units[p.unit] = units.get(p.unit, 0) + rows * row_numel
        for unit, numel in units.items():
            out += [Comm("all_gather", group, numel * weights.bytes, weights.value, "fwd",
                         gathers,
                         f"ZeRO-3 parameters of {'a block' if unit != 'root' else 'the rest'}"),
                    Comm("reduce_scatter", group, numel * 4, "fp32", "bwd", scatters,
                         "ZeRO-3 gradients")]
    return _merge(out)


def _merge(comms: List[Comm]) -> List[Comm]:
    """One entry per distinct message (counts added)."""
    merged: Dict[Tuple, Comm] = {}
    for c in comms:
        k = (c.op, c.group, c.bytes, c.dtype, c.phase, c.what, c.peer)
        if k in merged:
            old = merged[k]
            merged[k] = Comm(old.op, old.group, old.bytes, old.dtype, old.phase,
                             old.count + c.count, old.what, old.peer)
        else:
            merged[k] = c
    return list(merged.values())


def counts_by_key(comms: List[Comm]) -> Counter:
    """{Comm.key(): count per iteration}: what a recorder's view is compared with."""
    out: Counter = Counter()
    for c in comms:
        out[c.key()] += c.count
    return out
