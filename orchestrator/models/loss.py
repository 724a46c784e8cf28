"""Next-token cross-entropy computed in chunks of tokens, vocabulary-parallel over TP.

`token_losses(logits, targets)` -> the loss of every token (fp32; 0 at IGNORE_INDEX). The
logits are (tokens, vocab) on one rank, or this rank's vocabulary shard (a Shard(-1) DTensor
of the TP mesh, the LM head's output under tensor parallelism), in their own dtype.

What it keeps for the backward is the logits as they are (the LM head's output, alive anyway)
and one fp32 log-sum-exp per token: no fp32 copy or log-softmax of the whole logits. Forward
and backward work on at most `chunk_elements` logits at a time in fp32, so the step never holds
the s x b x vocab/tp logits in fp32 (nor their fp32 gradient: the backward writes the gradient
in the logits' dtype, chunk by chunk).

Under TP, as Megatron's vocab-parallel cross-entropy, three all-reduces of one fp32 value per
token cross the TP group: the max of the ranks' log-sum-exps, the sum of their exponentials
(relative to that max), and the target's logit (from the rank that holds its vocabulary row).

`fused=True` (where train compiles, train.compile) runs each chunk's arithmetic as one
torch.compile'd kernel (torchtitan compiles its loss too): it reads the logits' chunk in their
own dtype and writes the per-token figures (forward) or the chunk's gradient (backward), where
the eager ops each write an fp32 copy of the chunk (about 10 passes over it against 2). The
chunks, the saved tensors and the collectives are the same either way; only the local
arithmetic is compiled, so it runs under TP too (on the rank's shard).
"""
from __future__ import annotations

import warnings
from typing import Callable, Tuple

import torch

from orchestrator.models.loss_chunks import CHUNK_ELEMENTS

IGNORE_INDEX = -100  # F.cross_entropy's default: padding counts in no loss


def token_losses(logits: torch.Tensor, targets: torch.Tensor,
                 chunk_elements: int = CHUNK_ELEMENTS, fused: bool = False) -> torch.Tensor:
    """The cross-entropy (nats, fp32) of each target (any shape, flattened) against logits
    (its shape + (vocab,), or a DTensor sharding the vocabulary); 0 where it is IGNORE_INDEX.
    `fused`: each chunk's arithmetic compiled (the same values to rounding)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"vocab-parallel logits must be sharded over a 1-D mesh, got "
                             f"{mesh.ndim} dims")
        # torch.chunk's split of the vocabulary: ceil(vocab / tp) rows per rank
        first = mesh.get_local_rank() * -(-logits.shape[-1] // mesh.size())
        local, group = logits.to_local(), mesh.get_group()
    else:
        local, group, first = logits, None, 0
    return _ChunkedCrossEntropy.apply(local.flatten(0, -2), targets.flatten(), group, first,
                                      chunk_elements, fused)


def _rows_per_chunk(logits: torch.Tensor, chunk_elements: int) -> int:
    """Rows of logits converted to fp32 at once; all of them for logits with no data (meta,
    FakeTensorMode: the analytic profile counts their ops' FLOPs and bytes and the saved
    tensors, which chunking leaves the same, at ~1 ms an op: ~1200 chunks at 128K tokens
    and a 150K vocabulary would cost it a minute)."""
    from torch._subclasses.fake_tensor import is_fake

    if logits.is_meta or is_fake(logits):
        return max(1, logits.shape[0])
    return max(1, chunk_elements // max(1, logits.shape[-1]))


def _all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


def chunk_forward(part: torch.Tensor, local: torch.Tensor,
                  mine: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, the target's logit where this rank holds it, else 0), fp32, of each row of
    one chunk of logits `part` (rows, vocab / tp) in their own dtype; `local` the target's
    column on this rank, `mine` whether it is here (and not padding)."""
    x = part.float()
    picked = x.gather(1, local[:, None]).squeeze(1)
    return torch.logsumexp(x, dim=-1), torch.where(mine, picked, 0.0)


def chunk_grad(part: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, mine: torch.Tensor,
               grad: torch.Tensor) -> torch.Tensor:
    """The loss's gradient for one chunk of logits, in their dtype: (softmax - one-hot of the
    target where it is on this rank) x each row's output gradient; the one-hot as a compare, so
    a compiled kernel fuses it (the eager path scatters into the chunk instead)."""
    x = torch.sub(part.float(), lse[:, None]).exp()
    cols = torch.arange(part.shape[-1], device=part.device)
    x = x - ((cols[None, :] == local[:, None]) & mine[:, None]).to(x.dtype)
    return (x * grad[:, None]).to(part.dtype)


_FUSED: dict = {}  # name -> compiled function, or None after a compile failure (then eager)


def _fused(fn: Callable) -> Callable:
    """`fn` compiled (one graph; dynamo's automatic dynamic shapes: static for the first shape,
    one dynamic graph once a second one comes, e.g. a last short chunk or the variable
    micro-batches of dynamic micro-batching), guarded: a compile failure warns once and runs
    `fn` eager from then on."""
    name = fn.__name__
    if name not in _FUSED:
        _FUSED[name] = torch.compile(fn, fullgraph=True)
    compiled = _FUSED[name]
    if compiled is None:
        return fn

    def guarded(*args):
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            from orchestrator.models.compile import _cause, fallback_line

            _FUSED[name] = None
            warnings.warn(fallback_line(f"loss ({name})", _cause(e)), stacklevel=2)
            return fn(*args)

    return guarded


class _ChunkedCrossEntropy(torch.autograd.Function):
    """token_losses' autograd: saves the logits and the fp32 log-sum-exp per token."""

    @staticmethod
    def forward(ctx, logits, targets, group, first, chunk_elements, fused=False):
        vocab_local = logits.shape[-1]
        local = targets - first
        mine = (local >= 0) & (local < vocab_local) & (targets != IGNORE_INDEX)
        local = torch.where(mine, local, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        target_logit = torch.zeros_like(lse)
        rows = _rows_per_chunk(logits, chunk_elements)
        step = _fused(chunk_forward) if fused else chunk_forward
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            # one fp32 chunk alive at a time (eager; compiled, none)
            lse[start:end], target_logit[start:end] = step(logits[start:end], local[start:end],
                                                           mine[start:end])
        if group is not None:  # the whole vocabulary's log-sum-exp, from every rank's
            top = _all_reduce(lse, "max", group)
            total = _all_reduce((lse - top).exp(), "sum", group)
            lse = top + total.log()
            target_logit = _all_reduce(target_logit, "sum", group)
        valid = targets != IGNORE_INDEX
        ctx.save_for_backward(logits, lse, local, mine, valid)
        ctx.chunk_elements, ctx.fused = chunk_elements, fused
        return torch.where(valid, lse - target_logit, 0.0)

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, mine, valid = ctx.saved_tensors
        out = torch.empty_like(logits)
        rows = _rows_per_chunk(logits, ctx.chunk_elements)
        grad = torch.where(valid, grad, 0.0)  # a padding token's loss is a constant 0
        fused = _fused(chunk_grad) if ctx.fused else None
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            if fused is not None:
                out[start:end] = fused(logits[start:end], lse[start:end], local[start:end],
                                       mine[start:end], grad[start:end])
                continue
            part = torch.sub(logits[start:end].float(), lse[start:end, None]).exp_()
            part.scatter_add_(1, local[start:end, None],
                              -mine[start:end, None].to(part.dtype))
            out[start:end] = part.mul_(grad[start:end, None])
            del part
        return out, None, None, None, None, None
