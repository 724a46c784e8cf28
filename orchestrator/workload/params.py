"""The parameters a rank holds, in the engine's order, with their local sizes under TP.

models/gpt.py registers a stage's parameters as: tok_emb (first stage), per block attn_norm,
attn.wq/wk/wv/wo, mlp_norm, mlp.w_gate/w_up/w_down, then norm and lm_head (last stage);
models/parallelize.py shards wq/wk/wv/w_gate/w_up/lm_head by output rows (colwise),
wo/w_down by input columns (rowwise), tok_emb by vocabulary rows, and replicates the norms.
A MoE block (models/moe.py) registers mlp.router, mlp.experts.w_gate/w_up/w_down (stacked over
the experts; expert parallelism keeps experts / ep of them and 1 / etp of their width) and, with
a shared expert, mlp.shared.w_gate/w_up/w_down (TP-sharded as the dense MLP) in its MLP's place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, expert_width, is_moe_block, vocab_rows


@dataclass(frozen=True)
class Param:
    name: str  # the whole model's name, e.g. "blocks.3.attn.wq.weight"
    shape: Tuple[int, ...]  # the whole tensor's
    local_shape: Tuple[int, ...]  # this TP rank's shard (DTensor's chunking: ceil, last short)
    tp_sharded: bool
    unit: str  # the FSDP unit (ZeRO-3) that owns it: "blocks.<i>" or "root"

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def local_numel(self) -> int:
        return _prod(self.local_shape)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def chunk_size(n: int, parts: int, index: int) -> int:
    """Size of piece `index` of a dimension of `n` split into `parts` as torch.chunk does."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


def _local(shape, dim, tp, tp_rank):
    if dim is None or tp == 1:
        return tuple(shape)
    local = list(shape)
    local[dim] = chunk_size(shape[dim], tp, tp_rank)
    return tuple(local)


def is_expert(p: Param) -> bool:
    """A routed expert's weight (models/moe.Experts): sharded over ep and etp, replicated and
    reduced over the expert-data-parallel ranks (train/optimizers.is_expert_param's rule)."""
    return ".mlp.experts." in p.name


def block_parameters(model: ModelConfig, index: int, tp: int, tp_rank: int, ep: int = 1,
                     etp: int = 1) -> List[Param]:
    """Block `index`'s parameters in registration order. A MoE block (models/moe.py) has the
    router (replicated over TP), the routed experts stacked (experts, ...) with this rank's
    experts / ep of them and 1 / etp of their width as local shape, and the shared expert
    (TP-sharded like the dense MLP)."""
    h, f = model.hidden, model.ffn
    kv = model.kv_heads * (h // model.heads)
    prefix = f"blocks.{index}."
    # (name, [out, in] or [n], TP-sharded dim)
    spec = [("attn_norm.weight", (h,), None),
            ("attn.wq.weight", (h, h), 0), ("attn.wk.weight", (kv, h), 0),
            ("attn.wv.weight", (kv, h), 0), ("attn.wo.weight", (h, h), 1),
            ("mlp_norm.weight", (h,), None)]
    if not is_moe_block(model, index):
        spec += [("mlp.w_gate.weight", (f, h), 0), ("mlp.w_up.weight", (f, h), 0),
                 ("mlp.w_down.weight", (h, f), 1)]
        return [Param(prefix + name, shape, _local(shape, dim, tp, tp_rank),
                      dim is not None and tp > 1, f"blocks.{index}") for name, shape, dim in spec]
    e, w, shared = model.experts, expert_width(model), model.shared_expert_ffn
    spec.append(("mlp.router.weight", (e, h), None))
    out = [Param(prefix + name, shape, _local(shape, dim, tp, tp_rank),
                 dim is not None and tp > 1, f"blocks.{index}") for name, shape, dim in spec]
    for name, shape, local in (("w_gate", (e, h, w), (e // ep, h, w // etp)),
                               ("w_up", (e, h, w), (e // ep, h, w // etp)),
                               ("w_down", (e, w, h), (e // ep, w // etp, h))):
        out.append(Param(f"{prefix}mlp.experts.{name}", shape, local, False, f"blocks.{index}"))
    if shared:
        for name, shape, dim in (("w_gate", (shared, h), 0), ("w_up", (shared, h), 0),
                                 ("w_down", (h, shared), 1)):
            out.append(Param(f"{prefix}mlp.shared.{name}.weight", shape,
                             _local(shape, dim, tp, tp_rank), tp > 1, f"blocks.{index}"))
    return out


def chunk_parameters(model: ModelConfig, layers: range, is_first: bool, is_last: bool,
                     tp: int, tp_rank: int, ep: int = 1, etp: int = 1) -> List[Param]:
    """One model chunk's parameters (a PipelineStageModule), in registration order; the
    embedding and LM head with the vocabulary padded for tp (models/config.vocab_rows)."""
    h, vocab = model.hidden, vocab_rows(model, tp)
    out: List[Param] = []
    if is_first:
        out.append(Param("tok_emb.weight", (vocab, h), _local((vocab, h), 0, tp, tp_rank),
                         tp > 1, "root"))
    for i in layers:
        out += block_parameters(model, i, tp, tp_rank, ep, etp)
    if is_last:
        out.append(Param("norm.weight", (h,), (h,), False, "root"))
        out.append(Param("lm_head.weight", (vocab, h), _local((vocab, h), 0, tp, tp_rank),
                         tp > 1, "root"))
    return out


def virtual_stage_ranges(model: ModelConfig, layout: ParallelLayout) -> List[range]:
    """Blocks of each virtual stage s = chunk * pp + pp_rank (pp * v of them), in order."""
    v, pp = layout.virtual_stages, layout.pp
    ranges, start = [], 0
    for s in range(pp * v):
        n = layout.layers_per_stage[s % pp] // v
        ranges.append(range(start, start + n))
        start += n
    if start != model.layers:
        raise ValueError(f"layers_per_stage {list(layout.layers_per_stage)} sums to {start}, "
                         f"not model.layers({model.layers})")
    return ranges


def rank_chunks(model: ModelConfig, layout: ParallelLayout, rank: int) -> List[List[Param]]:
    """The parameters of each model chunk `rank` holds (chunk c is virtual stage
    c * pp + pp_rank), chunks in order."""
    pp_rank, tp_rank = layout.coordinate(rank, "pp"), layout.coordinate(rank, "tp")
    ranges = virtual_stage_ranges(model, layout)
    last = len(ranges) - 1
    stages = [c * layout.pp + pp_rank for c in range(layout.virtual_stages)]
    return [chunk_parameters(model, ranges[s], s == 0, s == last, layout.tp, tp_rank,
                             layout.ep, layout.etp) for s in stages]
