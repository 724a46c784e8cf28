"""Model profiles without running the model: FLOPs, a device sheet, and shapes under FakeTensorMode.

For a model too large for the machine at hand (a 100B model planned from a laptop):
- Memory stays exact: the same one-layer model is built under FakeTensorMode (tensors with shapes
  and dtypes, no data) and sharded over a fake process group of tp ranks with the real
  tensor-parallel plan; the saved-tensor counter then sees exactly what a real run saves.
- Compute time comes from FLOPs (torch.utils.flop_counter.FlopCounterMode over a forward and a
  backward) and a device sheet (conf/device/<name>.yaml: peak TFLOP/s per dtype and an efficiency
  factor): time_us = flops / (peak_TFLOPs * 1e12 * efficiency) * 1e6. Causal flash attention
  skips the masked half of the scores, so attention FLOPs count half. TP collectives are not in
  analytic times (the search prices them from the hardware profile); every such number is marked
  "source": "analytic".
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Dict, Optional, Tuple

from orchestrator.choices import Dtype
# The device sheets and their FLOP/s live in orchestrator/device.py (train's MFU and trace's
# pricing read them too); re-exported for this module's callers.
from orchestrator.device import (DEVICE_DIR, device_sheets, flops_to_us,  # noqa: F401
                                 load_device_sheet, peak_flops)
from orchestrator.models.config import ModelConfig, count_block_params

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
    kernels = ("flash_attention_for_cpu", "flash_attention", "efficient_attention",
               "cudnn_attention")
    mapping = {}
    for kernel in kernels:
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


def count_flops(pm, seq_len: int) -> Dict[str, float]:
    """FLOPs of one point's parts at `seq_len` on one rank of tp=1 (divide by tp for TP).

    Returns block_fwd, block_bwd, attn_fwd, attn_bwd (the attention core, part of block_*),
    other_fwd, other_bwd. Works on real and FakeTensorMode models alike.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = _flop_mapping()
    cos, sin = pm.rope()
    x = pm.block_input(seq_len)
    out = {}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
        y = pm.block(x, cos, sin)
    out["block_fwd"], out["attn_fwd"] = _split_counts(fc)
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
        y.backward(torch.ones_like(y))
    out["block_bwd"], out["attn_bwd"] = _split_counts(fc)
    tokens, targets = pm.tokens(seq_len)
    with pm.loss_ctx():
        with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
            loss = pm.model.head_loss(pm.model.embed(tokens), targets)
        out["other_fwd"], _ = _split_counts(fc)
        with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
            loss.backward()
        out["other_bwd"], _ = _split_counts(fc)
    return out


def analytic_times_us(flops: Dict[str, float], tp: int, sheet: dict, dtype: str) -> Dict[str, float]:
    """Schema times (block_fwd_us, ...) of a TP rank from tp=1 FLOPs and a device sheet.

    Every matrix product of a block and of the LM head is split evenly over tp ranks (heads, FFN
    columns, vocabulary rows), so a rank executes flops / tp.
    """
    return {f"{part}_us": flops_to_us(flops[part] / tp, sheet, dtype)
            for part in ("block_fwd", "block_bwd", "other_fwd", "other_bwd")}


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
    other_params = 2 * cfg.vocab * cfg.hidden + cfg.hidden
    states = 18 * (block_params + other_params)
    tokens, h = seq_len * batch, cfg.hidden
    g, f = cfg.kv_heads / cfg.heads, cfg.ffn / cfg.hidden
    block_act = tokens * h * (24 + 4 * g + 8 * f) * elem / 2
    other_act = tokens * (3 * 4 * cfg.vocab + 4 * h * elem)
    return float(states + block_act + other_act)


def estimate_point_flops(cfg: ModelConfig, seq_len: int, batch: int = 1) -> float:
    """Forward + backward FLOPs of one block and the LM head at `seq_len` (6 N s + attention)."""
    s = seq_len * batch
    dense = 6 * s * (count_block_params(cfg) + cfg.vocab * cfg.hidden)
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
