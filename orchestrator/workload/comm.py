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
  (2 reduce-scatters in the residual dtype, 2 all-gathers in the compute dtype): DTensor keeps
  the gathered inputs for the weight gradients, so nothing is gathered twice;
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
  all-reduced over TP (fp32: the parameters are fp32 masters).
The residual stream is in the parameters' dtype (fp32: autocast casts only the matmul inputs);
matmul outputs are in the compute dtype (bf16/fp16 under autocast).

Pipeline (torch.distributed.pipelining): per micro-batch, each model chunk that is not the last
virtual stage sends its output forward and receives its gradient back; each that is not the
first receives its input and sends its input's gradient back (residual dtype, 1/tp of the
sequence with SP).

Data parallel (train/grads.py): ZeRO 0/1 all-reduce each fp32 gradient bucket
(workload/buckets.py), ZeRO 2 reduce-scatters it, during the backward once the last micro-batch
has accumulated; ZeRO 1/2 all-gather the updated fp32 parameters after the step. ZeRO 3 (FSDP2,
one unit per block and one per chunk for the rest) all-gathers each unit's parameters in forward
and again in backward for every micro-batch without a pipeline (resharded after forward), once
per iteration with one (kept gathered, torchtitan's choice), and reduce-scatters its gradients
once, after the last micro-batch.

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

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Tuple

from orchestrator.choices import CpComm, Dtype, Engine, Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.workload.buckets import plan_buckets
from orchestrator.workload.params import rank_chunks, virtual_stage_ranges
from orchestrator.workload.tp import tp_counts

RESIDUAL = Dtype.fp32  # the engine keeps fp32 parameters and residual stream (autocast)


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
    megatron = engine == Engine.megatron
    residual = compute if megatron else RESIDUAL
    out: List[Comm] = []
    out += _tp_comms(model, layout, rank, compute, residual, engine)
    out += _cp_comms(model, layout, rank, compute, engine)
    out += _pp_comms(model, layout, rank, residual)
    out += _dp_comms(model, layout, rank, bucket_MiB)
    if layout.world_size > 1:
        if not (layout.pp * layout.tp == 1 and layout.zero == 0):
            out.append(Comm("all_reduce", "world", 8, "fp64", "step", 1, "gradient norm"))
    if not megatron:
        out.append(Comm("all_reduce", "world", 16, "fp64", "step", 1, "loss and stop flag"))
    return [c for c in out if c.count > 0]


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
    if layout.cp_comm == CpComm["a2a+p2p"]:  # Ulysses over cp_a2a ranks, then the ring
        a = layout.cp_a2a
        return (_cp_messages(model, layout, rank, compute, engine, CpComm.a2a, a, "cp_a2a")
                + _cp_messages(model, layout, rank, compute, engine, CpComm.p2p, layout.cp // a,
                               "cp_ring"))
    return _cp_messages(model, layout, rank, compute, engine, layout.cp_comm, layout.cp, "cp")


def _cp_messages(model, layout, rank, compute: Dtype, engine: Engine, comm: CpComm, cp: int,
                 group: str) -> List[Comm]:
    """The messages of one CP flavour `comm` over a group of `cp` ranks named `group`; sizes
    from the rank's tokens of the layout (the ring of a2a+p2p moves cp_a2a x the tokens and
    1 / cp_a2a of the KV heads: the same bytes)."""
    m = layout.num_micro_batches
    layers, recomputed = _layers(model, layout, rank)
    mode = layout.recompute[layout.coordinate(rank, "pp")][0]
    reruns = layers if mode == Recompute.selective else recomputed  # the core's forward, again
    head_bytes = rank_tokens(model, layout) * (model.hidden // model.heads) * compute.bytes
    kv = 2 * head_bytes * (model.kv_heads // layout.tp)
    dt = compute.value
    if comm == CpComm.a2a:
        q = head_bytes * (model.heads // layout.tp)  # Q or the output
        # torch's checkpoint stops a selective rerun once the core's saved tensors are back:
        # the output's all-to-all back is not rerun (Megatron reruns all four)
        out_reruns = recomputed + (reruns - recomputed) * (engine == Engine.megatron)
        out = []
        for size, what, again in ((q, "Q, output", reruns + out_reruns),
                                  (kv // 2, "K, V", 2 * reruns)):
            out += [Comm("all_to_all", group, size, dt, "fwd", 2 * layers * m, what),
                    Comm("all_to_all", group, size, dt, "bwd", again * m,
                         f"{what}, recomputed"),
                    Comm("all_to_all", group, size, dt, "bwd", 2 * layers * m,
                         f"{what} gradients")]
        return out
    if comm == CpComm.allgather:
        gathered = kv // 2 * cp
        return [Comm("all_gather", group, gathered, dt, "fwd", 2 * layers * m, "K, V"),
                Comm("all_gather", group, gathered, dt, "bwd", 2 * reruns * m,
                     "K, V, recomputed"),
                Comm("reduce_scatter", group, gathered, dt, "bwd", 2 * layers * m,
                     "K, V gradients")]
    out = []
    for phase, sends, what in (("fwd", (cp - 1) * layers, "K/V block"),
                               ("bwd", (cp - 1) * (layers + reruns), "K/V block, again"),
                               ("bwd", cp * layers, "K/V block gradient")):
        out += [Comm("send", group, kv, dt, phase, sends * m, what, "next"),
                Comm("recv", group, kv, dt, phase, sends * m, what, "prev")]
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


def _tp_comms(model, layout, rank, compute: Dtype, residual_dtype: Dtype,
              engine: Engine) -> List[Comm]:
    tp, m = layout.tp, layout.num_micro_batches
    if tp == 1:
        return []
    tokens = rank_tokens(model, layout)
    act = tokens * model.hidden  # elements of one layer activation of a micro-batch
    layers, recomputed = _layers(model, layout, rank)
    flags = [(is_first, is_last) for _, _, is_first, is_last in _chunk_flags(model, layout, rank)]
    first, last = any(f for f, _ in flags), any(la for _, la in flags)
    counts = tp_counts(engine, layout.sequence_parallel)
    # forward: gathers move norm outputs (residual dtype), reductions matmul outputs (compute
    # dtype); each backward collective moves the gradient of a forward one, in its dtype
    fwd = {"all_gather": residual_dtype, "reduce_scatter": compute, "all_reduce": compute}
    bwd = {"all_gather": compute, "reduce_scatter": residual_dtype, "all_reduce": residual_dtype}
    residual = dict.fromkeys(fwd, residual_dtype)
    out: List[Comm] = []

    def add(ops, times, dtypes, phase, what, elements=act):
        for op, n in ops.items():
            out.append(Comm(op, "tp", elements * dtypes[op].bytes, dtypes[op].value, phase,
                            n * times, what))

    add(counts.layer_fwd, layers * m, fwd, "fwd", "layer activations")
    add(counts.recompute, recomputed * m, fwd, "bwd", "layer activations, recomputed")
    add(counts.layer_bwd, layers * m, bwd, "bwd", "layer activation gradients")
    if first:
        add(counts.embedding_fwd, m, residual, "fwd", "embedding output")
        add(counts.embedding_bwd, m, residual, "bwd", "embedding output gradient")
    if last:
        add(counts.head_fwd, m, residual, "fwd", "LM head input")
        add(counts.head_bwd, m, residual, "bwd", "LM head input gradient")
        add({"all_reduce": counts.loss_all_reduce}, m, {"all_reduce": Dtype.fp32}, "fwd",
            "vocab-parallel loss: per-token max, sum, target logit", elements=tokens)
    if layout.sequence_parallel:
        norms = 2 * layers + (1 if last else 0)
        out.append(Comm("all_reduce", "tp", model.hidden * residual_dtype.bytes,
                        residual_dtype.value, "bwd", norms,
                        "SP norm weight gradients (partial over TP)"))
    return out


def _pp_comms(model, layout, rank, residual_dtype: Dtype) -> List[Comm]:
    if layout.pp == 1:
        return []
    m = layout.num_micro_batches
    size = rank_tokens(model, layout) * model.hidden * residual_dtype.bytes
    if layout.sequence_parallel:
        size //= layout.tp
    rn = residual_dtype.value
    counts: Counter = Counter()
    for _, _, is_first, is_last in _chunk_flags(model, layout, rank):
        if not is_last:
            counts["send", "next", "fwd"] += m
            counts["recv", "next", "bwd"] += m
        if not is_first:
            counts["recv", "prev", "fwd"] += m
            counts["send", "prev", "bwd"] += m
    what = {"fwd": "activations", "bwd": "activation gradients"}
    return [Comm(op, "pp", size, rn, phase, n, what[phase], peer)
            for (op, peer, phase), n in sorted(counts.items())]


def _dp_comms(model, layout, rank, bucket_MiB: float) -> List[Comm]:
    dp = layout.replicas  # gradients reduced, ZeRO sharded over them
    if dp == 1:
        return []
    chunks = rank_chunks(model, layout, rank)
    if layout.zero == 3:
        return _fsdp_comms(chunks, layout)
    params = [p for chunk in chunks for p in chunk]
    out = []
    group = layout.replica_group
    for plan in plan_buckets([p.local_numel for p in params], dp, bucket_MiB):
        grad_op = "reduce_scatter" if layout.zero == 2 else "all_reduce"
        out.append(Comm(grad_op, group, plan.bytes, "fp32", "bwd", 1, "gradient bucket"))
        if layout.zero >= 1:
            out.append(Comm("all_gather", group, plan.bytes, "fp32", "step", 1,
                            "updated parameters (ZeRO-1/2)"))
    return _merge(out)


def _fsdp_comms(chunks, layout) -> List[Comm]:
    dp, m, group = layout.replicas, layout.num_micro_batches, layout.replica_group
    gathers = 1 if layout.pp > 1 else 2 * m  # kept gathered under a pipeline
    out = []
    for chunk in chunks:
        units: Dict[str, int] = {}
        for p in chunk:
            # FSDP2 pads each parameter's first dimension to a multiple of dp
            rows = -(-p.local_shape[0] // dp) * dp
            row_numel = p.local_numel // max(1, p.local_shape[0])
            units[p.unit] = units.get(p.unit, 0) + rows * row_numel
        for unit, numel in units.items():
            out += [Comm("all_gather", group, numel * 4, "fp32", "fwd", gathers,
                         f"ZeRO-3 parameters of {'a block' if unit != 'root' else 'the rest'}"),
                    Comm("reduce_scatter", group, numel * 4, "fp32", "bwd", 1,
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
