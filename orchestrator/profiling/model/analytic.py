"""Model profiles without running the model: FLOPs, a device sheet, and shapes under FakeTensorMode.

For a model too large for the machine at hand (a 100B model planned from a laptop):
- Memory stays exact: the same one-layer model is built under FakeTensorMode (tensors with shapes
  and dtypes, no data) and sharded over a fake process group of tp ranks with the real
  tensor-parallel plan; the saved-tensor counter then sees exactly what a real run saves.
- Compute time comes from the ops of a forward and a backward on one rank (`count_ops`: each
  GEMM's shape, each flash-attention call's length and head dim, the bytes of every other op)
  priced by a device sheet (conf/device/<name>.yaml) op by op with orchestrator/device.OpTimer:
  a GEMM at the sheet's gemm curve for its FLOPs, attention at its attention curve, the rest at
  its bytes / hbm_GBps. A sheet with one `efficiency` prices every FLOP at peak x efficiency, as
  before: time_us = flops / (peak_TFLOPs * 1e12 * efficiency) * 1e6. FLOP totals come from
  torch.utils.flop_counter.FlopCounterMode. Causal flash attention skips the masked half of the
  scores, so attention FLOPs count half. TP collectives are not in analytic times (the search
  prices them from the hardware profile); every such number is marked "source": "analytic".
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from orchestrator.choices import Dtype
# The device sheets and their FLOP/s live in orchestrator/device.py (train's MFU and trace's
# pricing read them too); re-exported for this module's callers.
from orchestrator.device import (ATTENTION_KERNELS, DEVICE_DIR,  # noqa: F401
                                 NO_KERNEL_OPS, OpCost, OpTimer, device_sheets, flops_to_us,
                                 has_curves, load_device_sheet, op_kind, peak_flops)
from orchestrator.models.config import ModelConfig, count_block_params, vocab_rows

# Causal attention: a flash kernel computes only the blocks on or below the diagonal.
CAUSAL_ATTENTION_FRACTION = 0.5


# ---------------------------------------------------------------- FLOPs
def _flop_mapping() -> dict:
    """Flop formulas for the attention kernels (the CPU flash op FlopCounterMode does not know)."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def as_query_heads(query_shape, shape):
        # GQA: every query head attends once, so the FLOPs are those of K/V repeated to the
        # query's heads (torch 2.13 counts it so; older torch, the GPU image's 2.11, asserts
        # equal head counts).
        return (*shape[:-3], query_shape[-3], *shape[-2:])

    def fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(query_shape, as_query_heads(query_shape, key_shape),
                                  as_query_heads(query_shape, value_shape))

    def bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad_out_shape, query_shape,
                                           as_query_heads(query_shape, key_shape),
                                           as_query_heads(query_shape, value_shape))

    # The CUDA kernels too: torch knows them, but older torch asserts on GQA shapes.
    mapping = {}
    for kernel in ATTENTION_KERNELS:
        mapping[getattr(aten, f"_scaled_dot_product_{kernel}")] = fwd
        mapping[getattr(aten, f"_scaled_dot_product_{kernel}_backward")] = bwd
    return mapping


def _split_counts(counter) -> Tuple[float, float]:
    """(all FLOPs with causal attention halved, attention FLOPs halved) from a FlopCounterMode."""
    total = attention = 0.0
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        if "attention" in str(op):
            attention += n * CAUSAL_ATTENTION_FRACTION
        else:
            total += n
    return total + attention, attention


@dataclass
class PassOps:
    """The ops of one pass (a block's forward, ...) at tp=1: each GEMM as (batch, m, k, n,
    element bytes), each flash-attention call as (FLOPs with causal halved, keys, head dim,
    bytes), and the bytes every other op reads and writes."""

    gemms: List[Tuple[int, int, int, int, int]] = field(default_factory=list)
    attention: List[Tuple[float, int, int, float]] = field(default_factory=list)
    other_bytes: float = 0.0


def ops_mode(mapping: Optional[dict] = None):
    """A dispatch mode that files every op of a pass into a PassOps (`.ops`, its other ops'
    bytes in `.bytes`): the ops that launch a kernel, as the trace records them (aten ops, no
    views nor device.NO_KERNEL_OPS). `mapping`: the attention FLOP formulas (_flop_mapping)."""
    import torch

    from orchestrator.profiling.model.optimizer_step import KernelBytes

    mapping = mapping if mapping is not None else _flop_mapping()

    class OpsMode(KernelBytes):
        def __init__(self):
            super().__init__()
            self.ops = PassOps()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = f"{func.namespace}.{func.overloadpacket.__name__}"
            if func.namespace != "aten" or name in NO_KERNEL_OPS:
                return func(*args, **(kwargs or {}))
            kind = op_kind(name)
            if kind == "gemm":
                a, b = args[-2], args[-1]  # addmm / baddbmm: (bias, a, b)
                batch = a.shape[0] if a.dim() == 3 else 1
                self.ops.gemms.append((batch, a.shape[-2], a.shape[-1], b.shape[-1],
                                       a.element_size()))
                return func(*args, **(kwargs or {}))
            if kind == "attention":
                before = self.bytes
                out = super().__torch_dispatch__(func, types, args, kwargs)
                backward = name.endswith("_backward")
                query, key = args[1:3] if backward else args[0:2]
                flops = mapping[func.overloadpacket](
                    *[a.shape for a in args[:4] if isinstance(a, torch.Tensor)])
                self.ops.attention.append((flops * CAUSAL_ATTENTION_FRACTION, key.shape[-2],
                                           query.shape[-1], self.bytes - before))
                self.bytes = before
                return out
            if name == "aten.embedding":  # reads the rows it gathers, not the whole table
                out = func(*args, **(kwargs or {}))
                self.bytes += 2 * out.numel() * out.element_size() \
                    + args[1].numel() * args[1].element_size()
                return out
            return super().__torch_dispatch__(func, types, args, kwargs)

    return OpsMode()


def count_flops(pm, seq_len: int) -> Dict[str, float]:
    """FLOPs of one point's parts at `seq_len` on one rank of tp=1 (divide by tp for TP).

    Returns block_fwd, block_bwd, attn_fwd, attn_bwd (the attention core, part of block_*),
    other_fwd, other_bwd. Works on real and FakeTensorMode models alike.
    """
    return count_ops(pm, seq_len)[0]


def count_ops(pm, seq_len: int) -> Tuple[Dict[str, float], Dict[str, PassOps]]:
    """(count_flops' FLOPs, the ops of each part: {"block_fwd": PassOps, "block_bwd", "other_fwd",
    "other_bwd"}) at `seq_len` on one rank of tp=1, from one forward and one backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = _flop_mapping()
    cos, sin = pm.rope()
    x = pm.block_input(seq_len)
    out, ops = {}, {}

    @contextlib.contextmanager
    def counted(part):
        with FlopCounterMode(display=False, custom_mapping=mapping) as fc, \
                ops_mode(mapping) as mode:
            yield
        out[part], attention = _split_counts(fc)
        if part.startswith("block"):
            out[f"attn{part[len('block'):]}"] = attention
        ops[part] = mode.ops
        ops[part].other_bytes = float(mode.bytes)

    with counted("block_fwd"):
        y = pm.block(x, cos, sin)
    with counted("block_bwd"):
        y.backward(torch.ones_like(y))
    tokens, targets = pm.tokens(seq_len)
    with pm.loss_ctx():
        with counted("other_fwd"):
            loss = pm.model.head_loss(pm.model.embed(tokens), targets)
        with counted("other_bwd"):
            loss.backward()
    return out, ops


def sharded_gemm(gemm: Tuple[int, int, int, int, int], tokens: int, hidden: int,
                 tp: int) -> Tuple[float, float]:
    """(FLOPs, bytes read and written) of one tp=1 GEMM (batch, m, k, n, element bytes) on one
    of `tp` ranks. Megatron's plan splits every block GEMM and the LM head along the dimension
    that is neither the tokens nor the hidden size (heads, FFN columns, vocabulary rows): drop
    one dimension equal to `tokens`, split the remaining one that is not `hidden` (when both or
    neither are, the larger: the bytes are the same either way for equal ones)."""
    batch, m, k, n, elem = gemm
    dims = [m, k, n]
    if tp > 1:
        rest = list(range(3))
        if tokens in dims:
            rest.remove(dims.index(tokens))
        others = [i for i in rest if dims[i] != hidden] or rest
        split = max(others, key=lambda i: dims[i]) if len(others) > 1 else others[0]
        dims[split] = dims[split] / tp
    m, k, n = dims
    return 2.0 * batch * m * k * n, float(elem * batch * (m * k + k * n + m * n))


def analytic_times_us(flops: Dict[str, float], tp: int, sheet: dict, dtype: str,
                      ops: Optional[Dict[str, PassOps]] = None, tokens: int = 0,
                      hidden: int = 0) -> Dict[str, float]:
    """Schema times (block_fwd_us, ...) of a TP rank from tp=1 counts and a device sheet.

    A sheet with efficiency curves prices each op of `ops` (count_ops) on one of tp ranks with
    device.OpTimer: a GEMM split as sharded_gemm says (`tokens`: the point's batch x seq, `hidden`:
    the model's), attention and every other op's bytes split evenly (heads; sequence-parallel
    tokens). A sheet with one efficiency prices the FLOPs: every matrix product of a block and
    of the LM head is split evenly over tp ranks (heads, FFN columns, vocabulary rows), so a
    rank executes flops / tp.
    """
    parts = ("block_fwd", "block_bwd", "other_fwd", "other_bwd")
    if ops is None or not has_curves(sheet):
        return {f"{part}_us": flops_to_us(flops[part] / tp, sheet, dtype) for part in parts}
    timer = OpTimer(sheet)
    times = {}
    for part in parts:
        p = ops[part]
        us = timer.us(OpCost("memory", 0.0, p.other_bytes / tp, dtype))
        for gemm in p.gemms:
            f, b = sharded_gemm(gemm, tokens, hidden, tp)
            us += timer.us(OpCost("gemm", f, b, dtype))
        for f, seq, head_dim, b in p.attention:
            us += timer.us(OpCost("attention", f / tp, b / tp, dtype, seq, head_dim))
        times[f"{part}_us"] = us
    return times


# ---------------------------------------------------------------- fake world
@contextlib.contextmanager
def fake_world(tp: int):
    """A fake process group of `tp` ranks in this process (rank 0) and a 1-D DeviceMesh on it.

    Collectives are no-ops, so DTensor tensor parallelism runs with the real sharding plan on
    FakeTensorMode tensors. Yields the mesh (None for tp == 1, which needs no group).
    """
    if tp == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("analytic profiling needs its own (fake) process group; this process "
                           "already has one: run the analytic stage in its own process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (tp,))
    finally:
        dist.destroy_process_group()


def fake_tensors_mode():
    """A FakeTensorMode: tensors created inside it have a shape, a dtype and no data. Enter the
    same instance again to use tensors made in it (fake tensors belong to their mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# ---------------------------------------------------------------- auto: measure or compute?
def estimate_point_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1) -> float:
    """A quick upper estimate (bytes) of what profiling one point at tp=1 holds: one block's and
    the other parts' states (18 B/param), the block's activations term by term as
    docs/model-memory.md derives them (flash attention: no s^2 term; +12 sbh for CPU norms)
    and fp32 logits with their gradient and softmax."""
    elem = Dtype.parse(cfg.dtype).bytes
    block_params = count_block_params(cfg)
    vocab = vocab_rows(cfg, 1)
    other_params = 2 * vocab * cfg.hidden + cfg.hidden
    states = 18 * (block_params + other_params)
    tokens, h = seq_len * batch, cfg.hidden
    g, f = cfg.kv_heads / cfg.heads, cfg.ffn / cfg.hidden
    block_act = tokens * h * (24 + 4 * g + 8 * f) * elem / 2
    other_act = tokens * (3 * 4 * vocab + 4 * h * elem)
    return float(states + block_act + other_act)


def estimate_point_flops(cfg: ModelConfig, seq_len: int, batch: int = 1) -> float:
    """Forward + backward FLOPs of one block and the LM head at `seq_len` (6 N s + attention)."""
    s = seq_len * batch
    dense = 6 * s * (count_block_params(cfg) + vocab_rows(cfg, 1) * cfg.hidden)
    attention = 3 * 4 * seq_len * s * cfg.hidden * CAUSAL_ATTENTION_FRACTION
    return float(dense + attention)


# What "a big model" means on a CPU: one timed iteration of the largest point above this many
# FLOPs (about a second at a CPU's ~100 GFLOP/s), or a point above this share of host memory.
CPU_MAX_POINT_FLOPS = 1e11
CPU_MAX_MEM_SHARE = 0.25


def choose_source(source: str, cfg: ModelConfig, max_seq_len: int, batch: int, gpu: bool,
                  device_mem_GiB: float, ranks_per_host: int,
                  host_mem_bytes: Optional[float] = None,
                  gpu_reachable: bool = True) -> Tuple[str, str]:
    """("measured" | "analytic", why) for profile_model.source = auto | measured | analytic.

    auto is analytic when the cluster's GPUs cannot be reached (a GPU cluster with the local
    launcher on a machine without one: planning from a laptop), when the block at the largest
    length does not fit the device (GPU), or when the device is a CPU and the model is big (a
    point would take over ~1 s per iteration or a quarter of this host's memory per rank).
    """
    if source in ("measured", "analytic"):
        return source, f"profile_model.source={source}"
    need = estimate_point_bytes(cfg, max_seq_len, batch)
    if gpu and not gpu_reachable:
        return "analytic", ("a GPU cluster (backend nccl) with launcher=local, and this machine "
                            "has no GPU")
    if gpu:
        cap = (device_mem_GiB or 80.0) * 2**30
        if need > 0.9 * cap:
            return "analytic", (f"one block at seq {max_seq_len} needs ~{need / 2**30:.1f} GiB, "
                                f"more than the device's {cap / 2**30:.0f} GiB")
        return "measured", f"one block at seq {max_seq_len} fits the GPU (~{need / 2**30:.1f} GiB)"
    flops = estimate_point_flops(cfg, max_seq_len, batch)
    if host_mem_bytes is None:
        host_mem_bytes = _host_mem_bytes()
    per_rank = host_mem_bytes / max(1, ranks_per_host)
    if flops > CPU_MAX_POINT_FLOPS or need > CPU_MAX_MEM_SHARE * per_rank:
        return "analytic", (f"no GPU and a big model: one block at seq {max_seq_len} is "
                            f"~{flops / 1e9:.0f} GFLOP per step and ~{need / 2**30:.1f} GiB")
    return "measured", f"small enough to run on CPU (~{flops / 1e9:.1f} GFLOP per step)"


def _host_mem_bytes() -> float:
    import os

    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def model_for_point(cfg: ModelConfig, seq_len: int) -> ModelConfig:
    """The shape profiled at one point: the model's (its dense block for a mixture-of-experts
    model, moe.dense_twin), one layer, at `seq_len`."""
    from orchestrator.models.config import dense_twin

    return replace(dense_twin(cfg), layers=1, seq_len=seq_len)


def block_efficiency(cfg: ModelConfig, seq_len: int, tp: int, sheet: dict,
                     batch: int = 1) -> float:
    """The share of the dense peak one block's forward and backward reach in an analytic
    profile on `sheet`: block FLOPs / (time x peak) on one of `tp` ranks at `seq_len` (the
    FLOPs and times profile_model would record; causal attention counted half)."""
    from orchestrator.device import dense_peak_flops
    from orchestrator.profiling.model.timing import build_point_model

    with fake_tensors_mode():
        pm = build_point_model(model_for_point(cfg, seq_len), seq_len, 1, None, "cpu", batch)
        flops, ops = count_ops(pm, seq_len)
    times = analytic_times_us(flops, tp, sheet, cfg.dtype, ops, tokens=batch * seq_len,
                              hidden=cfg.hidden)
    us = times["block_fwd_us"] + times["block_bwd_us"]
    return (flops["block_fwd"] + flops["block_bwd"]) / tp / (us * 1e-6) \
        / dense_peak_flops(sheet, cfg.dtype)
