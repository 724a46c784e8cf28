"""Memory of one block and of the "other" parts: states (exact from parameters) and activations.

Activations are counted, not estimated: during a forward pass every tensor autograd saves for
backward goes through `torch.autograd.graph.saved_tensors_hooks`; the bytes of the distinct
storages they live in (parameters and buffers excluded) are what the layer keeps until its
backward. A storage saved twice, or saved through several views, counts once. Inputs a checkpoint
keeps for its recompute are added explicitly (checkpoint holds them by reference, not through the
hooks). This works on real tensors and on FakeTensorMode tensors alike (shapes only), so the same
code gives exact figures for a 100B model on a laptop.

Recompute modes (Megatron's names):
- none: nothing recomputed.
- selective: the attention core (scaled_dot_product_attention: QK^T, softmax, x V) is recomputed
  in backward; torch.utils.checkpoint wraps every sdpa call of the forward.
- full: the whole block is recomputed; only its input is kept.

On a GPU the allocator gives a second, independent figure: memory_allocated() after the forward
minus before it (the block's output stands in for its input, which was allocated before).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from orchestrator.choices import Recompute

BYTES_PER_PARAM_NOTE = ("Adam, mixed precision (Megatron): params in model dtype, fp32 gradient "
                        "buffer, fp32 master weights + exp_avg + exp_avg_sq (12 B); an fp32 model "
                        "keeps no master copy (8 B)")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes: a DTensor's local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage_key(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(_local(t).untyped_storage())


class SavedTensorCounter:
    """Bytes of the distinct storages autograd saves inside `with counter.hooks():`.

    `exclude`: tensors never counted (the module's parameters and buffers: they are states, not
    activations). Tensors stay referenced until `release()`, so no storage is freed and reused
    while counting (which would make two storages look like one).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_storage_key(t) for t in exclude}
        self._kept: Dict[object, int] = {}
        self._refs: list = []

    def add(self, t) -> None:
        """Count `t`'s storage (once), unless excluded; non-tensors are ignored."""
        if not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key in self._exclude or key in self._kept:
            return
        self._kept[key] = int(_local(t).untyped_storage().nbytes())
        self._refs.append(t)

    def _pack(self, t):
        self.add(t)
        return t

    @staticmethod
    def _unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def total_bytes(self) -> int:
        return sum(self._kept.values())

    @property
    def tensors(self) -> int:
        return len(self._kept)

    def release(self) -> None:
        self._refs.clear()


class CheckpointAttention(TorchFunctionMode):
    """Inside this mode every F.scaled_dot_product_attention call runs under
    torch.utils.checkpoint (Megatron's selective recompute of the attention core); the inputs the
    checkpoint keeps are reported to `counter`."""

    def __init__(self, counter: Optional[SavedTensorCounter] = None):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if self.counter is not None:
                for a in list(args) + list(kwargs.values()):
                    self.counter.add(a)
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


class _FusedRMSNormFn(torch.autograd.Function):
    """What CUDA's fused RMSNorm kernel keeps for backward: its input, the weight and 1/rms (fp32).

    On CPU torch decomposes RMSNorm (fp32 copy of the input and the normalised fp32 tensor are
    saved); this stand-in gives the GPU kernel's saved set when counting for a GPU on CPU.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        out = (xf * rstd).type_as(x)
        return out * weight if weight is not None else out

    @staticmethod
    def backward(ctx, grad):  # only the shapes matter here (counting), but keep it correct
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        xhat = xf * rstd
        g = grad.float() * (weight.float() if weight is not None else 1.0)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (grad.float() * xhat).sum(dim=tuple(range(grad.dim() - 1))) if weight is not None else None
        return dx.type_as(x), None if dw is None else dw.type_as(weight), None


class GpuKernelsMode(TorchFunctionMode):
    """Count activations as CUDA kernels save them while running on CPU (analytic GPU targets).

    Only RMSNorm differs in what it saves between torch's CPU and CUDA paths (sdpa uses a flash
    kernel on both and saves q, k, v, out and logsumexp).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            x, _shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")
            eps = torch.finfo(torch.float32).eps if eps is None else eps
            return _FusedRMSNormFn.apply(x, weight, eps)
        return func(*args, **kwargs)


def states_of(module: torch.nn.Module) -> list:
    """The module's parameters and buffers (never counted as activations)."""
    return list(module.parameters()) + list(module.buffers())


def count_block_activations(block, x, cos, sin, mode: str, exclude: Iterable[torch.Tensor],
                            gpu_kernels: bool = False) -> int:
    """Bytes one block keeps for backward under recompute `mode`, for its input `x`.

    Counted on this rank (a DTensor's local shard); the block's input is included (the previous
    layer's output, which the layer saves for its first norm).
    """
    if mode not in tuple(Recompute):
        raise ValueError(f"recompute mode {mode!r}; allowed: {tuple(Recompute)}")
    counter = SavedTensorCounter(exclude)
    modes = contextlib.ExitStack()
    with modes:
        if gpu_kernels:
            modes.enter_context(GpuKernelsMode())
        modes.enter_context(counter.hooks())
        if mode == Recompute.full:
            counter.add(x)  # the one tensor full recompute keeps (cos/sin are buffers)
            y = checkpoint(block, x, cos, sin, use_reentrant=False)
        elif mode == Recompute.selective:
            with CheckpointAttention(counter):
                y = block(x, cos, sin)
        else:
            y = block(x, cos, sin)
    total = counter.total_bytes
    counter.release()
    del y
    return total


def count_other_activations(model, tokens, targets, exclude: Iterable[torch.Tensor],
                            loss_ctx=contextlib.nullcontext, gpu_kernels: bool = False) -> int:
    """Bytes the embedding, final norm, LM head and loss keep for backward (this rank).

    The same in every recompute mode: Megatron-style recompute covers transformer blocks only.
    """
    counter = SavedTensorCounter(exclude)
    with contextlib.ExitStack() as modes:
        if gpu_kernels:
            modes.enter_context(GpuKernelsMode())
        modes.enter_context(counter.hooks())
        modes.enter_context(loss_ctx())
        h = model.embed(tokens)
        loss = model.head_loss(h, targets)
    total = counter.total_bytes
    counter.release()
    del h, loss
    return total


def forward_in_mode(block, x, cos, sin, mode: str):
    """The block's forward under recompute `mode` (no counting)."""
    if mode == Recompute.full:
        return checkpoint(block, x, cos, sin, use_reentrant=False)
    if mode == Recompute.selective:
        with CheckpointAttention():
            return block(x, cos, sin)
    return block(x, cos, sin)


@contextlib.contextmanager
def watch_saved(t: torch.Tensor):
    """Yields a dict whose "saved" turns True if autograd saves a tensor sharing `t`'s storage."""
    key = _storage_key(t)
    seen = {"saved": False}

    def pack(s):
        if isinstance(s, torch.Tensor) and _storage_key(s) == key:
            seen["saved"] = True
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        yield seen


def live_to_layer_bytes(live_bytes: int, x: torch.Tensor, y: torch.Tensor, x_saved: bool) -> int:
    """A layer's activations from the bytes its forward left allocated (`live_bytes`).

    Those include the output y (the next layer's input, counted there) and exclude the input x
    (allocated before): subtract y, and add x back only when the layer saves it (an fp32 model's
    norm keeps x; a bf16 norm on CPU keeps an fp32 copy instead, and x is freed in a real chain).
    """
    return int(live_bytes - _local(y).untyped_storage().nbytes()
               + (_local(x).untyped_storage().nbytes() if x_saved else 0))


def allocator_block_activations(block, x, cos, sin, mode: str) -> Dict[str, int]:
    """GPU only: the block's activations from the CUDA allocator (see live_to_layer_bytes) and
    the forward's peak above its starting point, in bytes: {"act", "peak"}."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with watch_saved(x) as seen:
        y = forward_in_mode(block, x, cos, sin, mode)
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated() - start
    peak = torch.cuda.max_memory_allocated() - start
    act = live_to_layer_bytes(live, x, y, seen["saved"] or mode == Recompute.full)
    del y
    return {"act": act, "peak": int(peak)}


def state_bytes(params: Iterable[torch.Tensor]) -> Dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of `params` on this rank (local shards).

    Adam with mixed precision: parameters in their own dtype, an fp32 gradient buffer, and fp32
    master weights + two moments (12 B per parameter) when parameters are 16-bit, two moments
    (8 B) when they are fp32. Returns {"param_bytes", "grad_bytes", "optim_bytes", "numel"}.
    """
    numel = param_bytes = optim_bytes = 0
    for p in params:
        local = _local(p)
        n = local.numel()
        numel += n
        param_bytes += n * local.element_size()
        optim_bytes += n * (8 if local.dtype == torch.float32 else 12)
    return {"param_bytes": int(param_bytes), "grad_bytes": int(4 * numel),
            "optim_bytes": int(optim_bytes), "numel": int(numel)}


def megatron_act_bytes(seq_len: int, batch: int, hidden: int, heads: int, tp: int, mode: str,
                       elem_bytes: int = 2) -> float:
    """Megatron's activation bytes per layer (Korthikanti et al. 2022), tensor + sequence parallel.

    none: sbh/t (34 + 5as/h); selective: 34sbh/t; full: 2sbh/t (the layer input). The paper counts
    16-bit activations (and 1-byte dropout masks); `elem_bytes` = 4 scales it to an fp32 model.
    """
    s, b, h, a, t = seq_len, batch, hidden, heads, tp
    if mode == Recompute.none:
        base = s * b * h * (34 + 5 * a * s / h) / t
    elif mode == Recompute.selective:
        base = 34 * s * b * h / t
    elif mode == Recompute.full:
        base = 2 * s * b * h / t
    else:
        raise ValueError(f"recompute mode {mode!r}; allowed: {tuple(Recompute)}")
    return base * elem_bytes / 2


def megatron_core_act_bytes_per_token(hidden: int, ffn: int, heads: int, kv_heads: int,
                                      tp: int, mode: str) -> float:
    """Bytes one llama-style layer (RMSNorm, GQA + RoPE, SwiGLU, no dropout) keeps per token on
    one rank of Megatron-Core with sequence parallelism, bf16 and flash attention, tensor by
    tensor (Korthikanti's 34sbh/t less the s x s terms flash attention removes, at GQA and
    SwiGLU widths; read from megatron/core/transformer: TE's LayerNormLinear keeps the norm's
    input and its sharded output, the fused RoPE nothing, flash attention q, k, v, its output
    (linear_proj's input, one storage) and an fp32 logsumexp per head, the fused bias_swiglu its
    input (fc1's output), linear_fc2 its input):

        none:      (2h + 2h  +  2h + 4kv  +  2h + 4a  +  2h + 2h  +  4f + 2f) / t
        selective: none less the logsumexp (the core reruns; its output is linear_proj's input)
        full:      2h / t (the layer input, sequence-sharded)

    with h hidden, kv = kv_heads x head_dim, a heads, f ffn, t = tp."""
    h, f, a = hidden, ffn, heads
    kv = kv_heads * (hidden // heads)
    if mode == Recompute.full:
        return 2 * h / tp
    lse = 4 * a if mode == Recompute.none else 0
    if mode not in tuple(Recompute):
        raise ValueError(f"recompute mode {mode!r}; allowed: {tuple(Recompute)}")
    attention = 2 * h + 2 * h + 2 * h + 4 * kv + 2 * h + lse
    mlp = 2 * h + 2 * h + 4 * f + 2 * f
    return (attention + mlp) / tp


def memory_summary(points, model, batch: int) -> dict:
    """The schema's "memory" section from profile points (each carrying "states").

    Per TP degree and part ("block", "other"): param/grad/optim bytes of one rank, and
    act_bytes_per_token per recompute mode at the model's seq_len (bytes on one rank / tokens of
    the micro-batch), exact when that length was profiled, else from "act_bytes_fit" (bytes per
    micro-batch as c0 + c1 s + c2 s^2, fitted through the profiled lengths). The block also
    carries its ratio to Megatron's formula at that length ("megatron_ratio").
    """
    from orchestrator.models.gpt import torch_dtype
    from orchestrator.profiling.model.fit import fit_activation_bytes, predict_poly

    elem = torch_dtype(model.dtype).itemsize
    by_tp: Dict[int, list] = {}
    for p in points:
        by_tp.setdefault(int(p["tp"]), []).append(p)
    out = {}
    length = int(model.seq_len)
    for tp in sorted(by_tp):
        pts = sorted(by_tp[tp], key=lambda p: p["seq_len"])
        seqs = [p["seq_len"] for p in pts]
        exact = next((p for p in pts if p["seq_len"] == length), None)
        entry = {}
        for part in ("block", "other"):
            states = dict(pts[-1]["states"][part])
            numel = states.pop("numel")
            fits, per_token = {}, {}
            for mode in Recompute:
                values = [p[f"{part}_act_bytes"][mode] for p in pts]
                fits[mode] = fit_activation_bytes(seqs, values)
                at = (exact[f"{part}_act_bytes"][mode] if exact is not None
                      else predict_poly(fits[mode], length))
                per_token[mode] = at / (length * batch)
            entry[part] = {**states, "params": numel, "act_bytes_per_token": per_token,
                           "act_seq_len": length, "act_from": "point" if exact else "fit",
                           "act_bytes_fit": fits}
        entry["block"]["megatron_ratio"] = {
            mode: entry["block"]["act_bytes_per_token"][mode] * length * batch
            / megatron_act_bytes(length, batch, model.hidden, model.heads, tp, mode, elem)
            for mode in Recompute}
        sources = sorted({p.get("source", "measured") for p in pts})
        entry["source"] = sources[0] if len(sources) == 1 else "mixed"
        out[str(tp)] = entry
    return out


def megatron_comparison(seq_len: int, tp: int, block_act_bytes: Dict[str, float],
                        model, batch: int) -> dict:
    """A point's "megatron_act_bytes" (Megatron's formula per recompute mode, bytes on one rank)
    and "megatron_ratio" (the point's block_act_bytes over it)."""
    from orchestrator.models.gpt import torch_dtype

    elem = torch_dtype(model.dtype).itemsize
    mega = {m: megatron_act_bytes(seq_len, batch, model.hidden, model.heads, tp, m, elem)
            for m in Recompute}
    return {"megatron_act_bytes": mega,
            "megatron_ratio": {m: block_act_bytes[m] / mega[m] for m in Recompute}}
