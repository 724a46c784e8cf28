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

`fused=True` (where train compiles, train.compile) runs the arithmetic as one torch.compile'd
call over all of the logits (torchtitan compiles its loss too): its kernels read the logits in
their own dtype and write the per-token figures (forward) or the gradient (backward), the fp32
conversion fused into the reductions and into the gradient's one pointwise kernel, so it holds
no fp32 copy and needs no chunks. Chunked, each chunk cost a compiled call of host time
(~0.26 ms on the H200 machine, from its profile's synchronised "other" times): at 16K tokens
and a 32K vocabulary 32 calls a forward and 32 a backward, which made a micro-batch's loss
host-bound up to mbs 4 at seq 2048. The eager ops write an fp32 copy of what they work on
(about 10 passes over it against 2): they keep the chunks, as does the fused path after a
compile failure. The saved tensors and the collectives are the same either way; only the local
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
    `fused`: its arithmetic one compiled call each way (the same values to rounding)."""
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


def _run_fused(fn: Callable, *args):
    """`fn(*args)` compiled (one graph; dynamo's automatic dynamic shapes: static for the first
    shape, one dynamic graph once a second one comes, e.g. the variable micro-batches of dynamic
    micro-batching), or None where `fn`'s compile failed (warned once; the caller runs the
    eager chunks from then on)."""
    name = fn.__name__
    if name not in _FUSED:
        _FUSED[name] = torch.compile(fn, fullgraph=True)
    compiled = _FUSED[name]
    if compiled is None:
        return None
    from orchestrator.models.compile import COMPILE_ERRORS, _cause, fallback_line

    try:
        return compiled(*args)
    except COMPILE_ERRORS as e:
        _FUSED[name] = None
        warnings.warn(fallback_line(f"loss ({name})", _cause(e)), stacklevel=3)
        return None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """token_losses' autograd: saves the logits and the fp32 log-sum-exp per token."""

    @staticmethod
    def forward(ctx, logits, targets, group, first, chunk_elements, fused=False):
        vocab_local = logits.shape[-1]
        local = targets - first
        mine = (local >= 0) & (local < vocab_local) & (targets != IGNORE_INDEX)
        local = torch.where(mine, local, 0)
        whole = _run_fused(chunk_forward, logits, local, mine) if fused else None
        if whole is not None:  # one compiled call, no fp32 copy (module docstring)
            lse, target_logit = whole
        else:
            lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
            target_logit = torch.zeros_like(lse)
            rows = _rows_per_chunk(logits, chunk_elements)
            for start in range(0, logits.shape[0], rows):
                end = start + rows
                # one fp32 chunk alive at a time
                lse[start:end], target_logit[start:end] = chunk_forward(
                    logits[start:end], local[start:end], mine[start:end])
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
        grad = torch.where(valid, grad, 0.0)  # a padding token's loss is a constant 0
        if ctx.fused:
            out = _run_fused(chunk_grad, logits, lse, local, mine, grad)
            if out is not None:
                return out, None, None, None, None, None
        out = torch.empty_like(logits)
        rows = _rows_per_chunk(logits, ctx.chunk_elements)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            part = torch.sub(logits[start:end].float(), lse[start:end, None]).exp_()
            part.scatter_add_(1, local[start:end, None],
                              -mine[start:end, None].to(part.dtype))
            out[start:end] = part.mul_(grad[start:end, None])
            del part
        return out, None, None, None, None, None
