"""Parallelism applied to a GPT from outside, torch-native (as torchtitan does).

- `apply_tensor_parallel`: Megatron-style tensor parallelism with DTensor on a 1-D DeviceMesh,
  optionally with sequence parallelism (norms and residual stream sharded on the sequence dim).
- `split_pipeline`: contiguous layer ranges per pipeline stage, as modules sharing the model's
  parameters and keeping the model's parameter names.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from orchestrator.models.config import validate_model
from orchestrator.models.gpt import GPT, Rotary, init_parameters, packed_rows
from orchestrator.models.moe import MoE, ExpertParallel


def apply_tensor_parallel(
    model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = True, loss_parallel: bool = False,
    blocks=None,
) -> GPT:
    """Shard `model` in place over the ranks of the 1-D `tp_mesh`; returns the same model.

    Column-wise: wq, wk, wv, w_gate, w_up (each rank owns whole heads / FFN columns).
    Row-wise: wo, w_down (partial sums reduced: all-reduce, or reduce-scatter with SP).
    Embedding: row-wise over the vocabulary, tokens replicated, each rank looking up only its own
    rows (`VocabParallelEmbedding`, Megatron's). LM head: column-wise over vocab. Both hold the
    vocabulary padded for tp (`GPT(cfg, tp=tp)`), an equal share of rows on each rank.
    With `sequence_parallel`, the norms run on a sequence shard and the residual stream between
    layers is this rank's (batch, seq / tp, hidden) slice.
    With `loss_parallel`, logits stay vocab-sharded DTensors; forward and backward must then run
    inside `torch.distributed.tensor.parallel.loss_parallel()`. Without it the logits are gathered
    and `model(tokens, targets)` is an ordinary loss.
    `blocks`: the block indices to shard (None: all); a caller that uses a few blocks only (a
    pipeline stage on the meta device, trace) skips sharding the others.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (e.g. mesh['tp']), got {tp_mesh.ndim} dims")
    tp = tp_mesh.size()
    validate_model(model.cfg, tp=tp)
    rows = model.tok_emb.num_embeddings
    if rows % tp:  # GPT(cfg, tp=tp) pads them (models/config.vocab_rows)
        raise ValueError(f"the embedding's {rows} vocabulary rows do not split over tp({tp}): "
                         f"build the model with GPT(cfg, tp={tp})")

    # Layout of the residual stream between modules: sequence shard with SP, else replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_emb": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=stream),
            **({"norm": SequenceParallel()} if sequence_parallel else {}),
            "lm_head": ColwiseParallel(
                input_layouts=stream,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for index, block in enumerate(model.blocks):
        if blocks is not None and index not in blocks:
            continue
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream),
            "mlp.w_gate": ColwiseParallel(),
            "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            # The sub-layers take the norms' sequence shard; their input projections gather it
            # once per sub-layer and keep only the shard (sequence_parallel_linears).
            plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
        else:
            # The sub-layer's input as one replicated DTensor shared by its projections: their
            # input gradients add up as one Partial, all-reduced once per sub-layer (Megatron's
            # fused QKV and gate/up), not once per projection (5 all-reduces per layer).
            plan |= {
                "attn": PrepareModuleInput(
                    input_layouts=(Replicate(), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "mlp": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                ),
            }
        if isinstance(block.mlp, MoE):
            plan = {key: style for key, style in plan.items()
                    if key != "mlp" and not key.startswith("mlp.")}
            plan |= _moe_plan(block.mlp, sequence_parallel)
            block.mlp.sequence_group, block.mlp.sequence_parts = tp_mesh.get_group(), tp
        parallelize_module(block, tp_mesh, plan)
        if sequence_parallel:
            mlp = block.mlp.shared if isinstance(block.mlp, MoE) else block.mlp
            for sub in (block.attn, mlp):
                if sub is not None:
                    sub.project = functools.partial(sequence_parallel_linears, tp_mesh)
    return model


def sequence_parallel_linears(mesh: DeviceMesh, x: DTensor, linears) -> list:
    """The column-parallel `linears` (ColwiseParallel, no bias) applied to the sequence-sharded
    DTensor x (Shard(1)), Megatron's sequence-parallel linear: x is all-gathered over `mesh`
    once for all of them, and only this rank's shard is kept for the backward, which gathers
    it again for the weights' gradients and reduce-scatters the input's gradient. Returns each
    output as a local tensor (batch, seq, this rank's columns), as ColwiseParallel's."""
    weights = [linear.weight.to_local() for linear in linears]
    return list(_GatheredColumnLinears.apply(mesh, x.shape, x.to_local(), *weights))


def _gather_sequence(local: torch.Tensor, mesh: DeviceMesh, shape: torch.Size) -> torch.Tensor:
    """The whole sequence (dim 1) of a sequence shard, all-gathered over `mesh`."""
    sharded = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=shape,
                                 stride=torch.empty(shape, device="meta").stride())
    return sharded.redistribute(mesh, [Replicate()]).to_local()


class _GatheredColumnLinears(torch.autograd.Function):
    """sequence_parallel_linears' autograd: forward all-gather + one matmul per weight, the
    sequence shard saved; backward all-gather again, the weights' gradients, the input's
    gradient summed over the weights (in the input's dtype) and reduce-scattered."""

    @staticmethod
    def forward(ctx, mesh, shape, x_local, *weights):
        full = _gather_sequence(x_local, mesh, shape)
        outputs = tuple(F.linear(full, w) for w in weights)  # autocast casts, as nn.Linear's
        ctx.mesh, ctx.shape = mesh, shape
        ctx.compute_dtype = outputs[0].dtype
        ctx.save_for_backward(x_local, *weights)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        x_local, *weights = ctx.saved_tensors
        full = _gather_sequence(x_local, ctx.mesh, ctx.shape).to(ctx.compute_dtype)
        rows = full.flatten(0, -2)
        grad_x, grad_w = None, []
        for w, g in zip(weights, grads):
            if g is None:
                grad_w.append(None)
                continue
            g = g.to(ctx.compute_dtype)
            grad_w.append((g.flatten(0, -2).t() @ rows).to(w.dtype))
            part = (g @ w.to(ctx.compute_dtype)).to(x_local.dtype)
            grad_x = part if grad_x is None else grad_x + part
        if grad_x is not None:
            grad_x = DTensor.from_local(grad_x, ctx.mesh, [Partial()], run_check=False)
            grad_x = grad_x.redistribute(ctx.mesh, [Shard(1)]).to_local()
        return (None, None, grad_x, *grad_w)


def _moe_plan(moe: MoE, sequence_parallel: bool) -> dict:
    """The FFN part of a MoE block's TP plan (sequence parallelism required,
    ParallelLayout.check_experts; the attention's is a dense block's): the MoE FFN takes this
    rank's sequence shard as a plain tensor (the residual stream's local shard, as it returns)
    and routes it (router weights replicated over TP, their gradient summed over it as the SP
    norms'); the experts are not TP-sharded (expert parallelism is apply_expert_parallel's);
    the shared expert is a TP-sharded MLP (its sequence shard kept, gathered in
    sequence_parallel_linears; reduce-scatter out)."""
    if not sequence_parallel:
        raise ValueError("a MoE block under tensor parallelism needs sequence_parallel")
    plan = {
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                  use_local_output=True),
        "mlp.router": SequenceParallel(use_local_output=True),
    }
    if moe.shared is not None:
        plan |= {
            # the sequence shard, gathered by sequence_parallel_linears (set by the caller)
            "mlp.shared": PrepareModuleInput(input_layouts=(Shard(1),),
                                             desired_input_layouts=(Shard(1),)),
            "mlp.shared.w_gate": ColwiseParallel(),
            "mlp.shared.w_up": ColwiseParallel(),
            "mlp.shared.w_down": RowwiseParallel(output_layouts=Shard(1), use_local_output=True),
        }
    return plan


def apply_expert_parallel(model: nn.Module, expert_mesh, ep: int, etp: int, ep_group=None,
                          etp_group=None, blocks=None) -> nn.Module:
    """Shard the routed experts of every MoE block of `model` (a GPT or a pipeline stage) over
    the expert grid, in place: each rank keeps experts / ep consecutive experts (dim 0) and
    1/etp of their width (w_gate, w_up columns; w_down rows), as DTensors on `expert_mesh`
    (1-D "ep" or "etp", or 2-D ("ep", "etp")), and tokens reach them by all-to-all
    (models/moe.ExpertParallel over `ep_group` / `etp_group`). ep = etp = 1 changes nothing.
    `blocks`: the block indices to shard (None: all)."""
    from torch.distributed.tensor import distribute_tensor

    if ep * etp == 1:
        return model
    named = model.blocks.items() if isinstance(model.blocks, nn.ModuleDict) else \
        enumerate(model.blocks)
    for index, block in named:
        if not isinstance(block.mlp, MoE) or (blocks is not None and int(index) not in blocks):
            continue
        experts = block.mlp.experts
        for name, width_dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
            placements = ([Shard(0)] if ep > 1 else []) + ([Shard(width_dim)] if etp > 1 else [])
            param = getattr(experts, name)
            sharded = distribute_tensor(param.data, expert_mesh, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        block.mlp.dispatch = ExpertParallel(ep_group, ep, etp_group, etp)
    return model


class VocabParallelEmbedding(RowwiseParallel):
    """An embedding sharded by vocabulary rows whose lookup touches only this rank's rows:
    ids outside them give zeros, and the partial sums are reduced as RowwiseParallel does
    (reduce-scatter to a sequence shard with SP, all-reduce without). Its backward makes the
    gradient of this rank's rows only; DTensor's own embedding backward makes the whole
    [vocab, hidden] gradient on every rank and keeps it as the accumulated gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding shards an nn.Embedding, not "
                            f"{type(module).__name__}")
        module = super()._apply(module, device_mesh)
        module.forward = functools.partial(_local_rows_lookup, module)
        return module


def _local_rows_lookup(module: nn.Embedding, ids: DTensor) -> DTensor:
    weight = module.weight  # Shard(0): rows [first, first + len) of ceil(vocab / tp) each
    mesh = weight.device_mesh
    rows = weight.to_local()
    first = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
    local = ids.to_local() - first
    outside = (local < 0) | (local >= rows.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), rows)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def stage_layer_ranges(layers_per_stage: list[int], layers: int) -> list[range]:
    """Block indices owned by each pipeline stage, in order; a stage may own none."""
    if not layers_per_stage:
        raise ValueError("layers_per_stage is empty; give one entry per pipeline stage")
    if any(not isinstance(n, int) or n < 0 for n in layers_per_stage):
        raise ValueError(f"layers_per_stage {list(layers_per_stage)} must be integers >= 0")
    if sum(layers_per_stage) != layers:
        raise ValueError(
            f"sum(layers_per_stage {list(layers_per_stage)}) = {sum(layers_per_stage)} "
            f"!= model.layers({layers})"
        )
    ranges, start = [], 0
    for n in layers_per_stage:
        ranges.append(range(start, start + n))
        start += n
    return ranges


class PipelineStageModule(nn.Module):
    """One pipeline stage of a GPT: [tok_emb] -> blocks[first..last] -> [norm -> lm_head].

    Holds the model's own submodules (no copy) under the model's parameter names, so
    `stage.state_dict()` keys are a subset of the model's. Input: token ids on the first stage,
    hidden states otherwise. Output: logits on the last stage (loss via `cross_entropy_loss`),
    hidden states otherwise.
    """

    def __init__(self, model: GPT, layer_range: range, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.layer_range, self.is_first, self.is_last = layer_range, is_first, is_last
        self.rope: Rotary = model.rope
        self.tok_emb = model.tok_emb if is_first else None
        # Keyed by the global block index, so names match the whole model's ("blocks.5.attn...").
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layer_range})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        # Set from outside (train): blocks whose forward is rerun in backward (full recompute),
        # and the autocast dtype of the forward (None: the parameters' own dtype).
        self.recompute_blocks: frozenset = frozenset()
        self.autocast_dtype: torch.dtype | None = None

    def init_weights(self, seed: int = 0) -> None:
        """Initialise this stage's parameters to the values the whole model would get."""
        init_parameters(self, self.cfg, seed)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """`segments` (batch, seq) int: packed rows (several samples back to back in a row),
        each token's sample in its row, on every stage: attention stays within each sample and
        positions restart at 0 per sample (models/gpt.packed_rows); None: causal over the row."""
        if self.autocast_dtype is None:
            return self._forward(x, segments)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._forward(x, segments)

    def _forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope()
        extra = ()
        if segments is not None:
            cos, sin, mask = packed_rows(segments, cos, sin)
            extra = (mask,)
        h = self.tok_emb(x) if self.is_first else x
        recompute = torch.is_grad_enabled() and self.recompute_blocks
        for name, block in self.blocks.items():
            if recompute and name in self.recompute_blocks:
                h = checkpoint(block, h, cos, sin, *extra, use_reentrant=False)
            else:
                h = block(h, cos, sin, *extra)
        return self.lm_head(self.norm(h)) if self.is_last else h


def split_pipeline(model: GPT, layers_per_stage: list[int]) -> list[PipelineStageModule]:
    """Split `model` into len(layers_per_stage) stages of consecutive blocks (uneven allowed).

    The first stage also owns the embedding, the last the final norm and LM head. Raises
    ValueError unless every entry is >= 0 and they sum to model.cfg.layers.
    """
    ranges = stage_layer_ranges(list(layers_per_stage), model.cfg.layers)
    last = len(ranges) - 1
    return [
        PipelineStageModule(model, r, is_first=(i == 0), is_last=(i == last))
        for i, r in enumerate(ranges)
    ]
