"""Megatron-Core's memory on one rank (search.engine=megatron): what a transformer layer keeps
for its backward, the loss's logits, and the parameter, gradient and optimizer bytes.

Activations: what Megatron-Core's layer saves as it runs in training recipes (Transformer Engine
spec: LayerNorm fused into the QKV and fc1 linears, flash/fused attention, fused SwiGLU, no
dropout), per token of a rank's micro-batch (its s / cp tokens), with t = tp, e the compute
dtype's bytes (2: bf16),
h hidden, a heads, g KV heads, d head width, f the SwiGLU width:

    rows  = 4 h e             layer input (norm 1's), norm 1's output (QKV input), norm 2's input
                              and output (fc1 input); / t with sequence parallelism, which keeps
                              them sharded and gathers again in the backward
    attn  = (2 a + 2 g) d e / t   Q, K, V (flash attention's inputs; GQA: K and V at g heads) and
                              the attention output (linear_proj's input), + 4 a / t (the fp32
                              log-sum-exp flash attention keeps per head)
    mlp   = 3 f e / t         fc1's output (gate and up: SwiGLU's input) and fc2's input

none = rows + attn + mlp. Selective (`--recompute-granularity selective`, default
`--recompute-modules core_attn`) reruns the attention core: its output is linear_proj's input
all the same, and the log-sum-exp goes, but the checkpoint saves its inputs as given, and V is
a view into the fused QKV projection's output (attention.py, get_query_key_value_tensors;
Transformer Engine's attention makes its inputs contiguous, a reading of its layout checks not
yet seen on a GPU; the checkpoint does not), so that whole output stays, (a + 2g)
d e / t, where none keeps a contiguous copy of V: selective = none - 4 a / t + (a + g) d e / t,
more than none (Megatron warns that fused attention needs no core_attn recompute). Full
(`--recompute-granularity full --recompute-method uniform|block --recompute-num-layers 1|k`)
keeps the layer input, h e (/ t with SP). With `gated_ffn=False` (a plain 2-matrix FFN) mlp is
2 f e / t, and `dropout=True` adds the two 1-byte masks (h / t each with SP): Korthikanti et
al.'s 34 s b h / t (Megatron-LM's theoretical_memory_usage.py: s b h (18 + 4 f / h) / t) is
none at f = 4h, g = a, no gate, with dropout, less the log-sum-exp (their attention is unfused:
its 5 a s^2 b / t, which flash attention removes, is all selective recompute drops there).

States (Megatron's DistributedOptimizer, bf16) are the model profile's bytes per rank, which
profile_model counts as Megatron holds them (profiling/model/memory.state_bytes: parameters in
the model's dtype, fp32 main gradients, since bf16 forces fp32 accumulation and reduction in
megatron/training/arguments.py, and an fp32 master and two Adam moments, 12 B): 18 B per
parameter with ZeRO 0, 6 + 12 / dp with the distributed optimizer (ZeRO 1, sharded over dp x
cp, Megatron-Core's intra_dp_cp_group), ZeRO 2/3 as Megatron-FSDP's optim_grads /
optim_grads_params (gradients, then parameters too, sharded the same way): terms/zero.py's
ZeroSharding.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.choices import Recompute

LSE_BYTES = 4  # flash attention's softmax statistics: fp32, one per head and token
MASK_BYTES = 1  # a dropout mask element (Korthikanti's count)
TOKEN_ID_BYTES = 8  # the embedding's saved int64 token ids
LOSS_BYTES = 4  # vocab-parallel cross entropy keeps its softmax in fp32


@dataclass(frozen=True)
class LayerShape:
    """The widths of one transformer layer that its activations depend on."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = 0  # 0: hidden // heads

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads


def layer_activation_bytes_per_token(shape: LayerShape, tp: int, sequence_parallel: bool,
                                     mode: Recompute | str, elem_bytes: int = 2,
                                     gated_ffn: bool = True, dropout: bool = False) -> float:
    """Bytes one Megatron-Core layer keeps for its backward per token of a rank's micro-batch
    (its s / cp tokens), on one TP rank, for recompute `mode` (the module docstring's sums)."""
    mode = Recompute.parse(mode)
    t = tp
    rows_per = t if sequence_parallel or t == 1 else 1  # residual-stream rows: SP shards them
    row = shape.hidden * elem_bytes / rows_per
    if mode == Recompute.full:
        return row
    masks = 2 * MASK_BYTES * shape.hidden / rows_per if dropout else 0.0
    qkvo = (2 * shape.heads + 2 * shape.kv_heads) * shape.d * elem_bytes / t
    mlp = (3 if gated_ffn else 2) * shape.ffn * elem_bytes / t
    kept = 4 * row + masks + qkvo + mlp
    if mode == Recompute.selective:  # the fused QKV output in V's copy's place, no statistics
        return kept + (shape.heads + shape.kv_heads) * shape.d * elem_bytes / t
    return kept + LSE_BYTES * shape.heads / t


def embedding_activation_bytes_per_token() -> float:
    """What the first stage's embedding keeps per token of an in-flight micro-batch: the token
    ids (its output is the first layer's input, counted there)."""
    return float(TOKEN_ID_BYTES)


def loss_activation_bytes_per_token(hidden: int, vocab: int, tp: int, sequence_parallel: bool,
                                    elem_bytes: int = 2) -> float:
    """The last stage's peak beyond its layers per token of one micro-batch (bytes): the final
    norm's input and output (the output layer's input; / tp with SP), and the vocab-parallel
    cross entropy's fp32 softmax of V / tp logits kept for the backward beside the bf16 logits
    it is cast from."""
    rows = 2 * hidden * elem_bytes / (tp if sequence_parallel or tp == 1 else 1)
    return rows + (LOSS_BYTES + elem_bytes) * vocab / tp
