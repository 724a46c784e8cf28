"""A hardware profile from published link figures, for clusters too big (or too busy) to profile.

The model (nccl ring/tree behaviour at large scale, rough but explainable):
- A group inside one node moves data over NVLink at `intra_busbw_GBps` (nccl-tests busbw).
- A group spanning k nodes with at least m of its ranks on each is limited by the NICs of those m
  GPUs: NCCL runs one ring per NIC, so ring collectives reach busbw = m x nic_GBps_per_gpu x
  inter_efficiency (8 x 400 Gb/s per node, m = 8: ~360 GB/s; a data-parallel group with one rank
  per node: ~45 GB/s). all2all sends (n-m)/n of each buffer off-node through the rank's own NIC:
  busbw = nic_GBps_per_gpu x inter_efficiency x (n-1)/(n-m).
- Latency: a tree of ceil(log2 m) intra-node and ceil(log2 k) inter-node hops, twice for allreduce
  (reduce then broadcast): alpha_us = steps x (intra_latency_us x ceil(log2 m) +
  inter_latency_us x ceil(log2 k)).
- p2p between pipeline stages: intra_p2p_GBps on a node, one NIC (nic_GBps_per_gpu x
  inter_efficiency) across nodes.
All groups of a shape run at once, so the slowest group (fewest ranks per node) sets the numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from orchestrator.config import LinkSheetConfig
from orchestrator.errors import ConfigError
from orchestrator.profiling.hardware.fit import predict_time_us
from orchestrator.profiling.hardware.groups import group_sizes, layouts_for, pp_sizes
from orchestrator.profiling.measure import KiB, busbw_GBps, busbw_factor
from orchestrator.store.schema import (ClusterSummary, HardwareBenchmarks, HardwareProfile,
                                       Inventory, Source)


@dataclass
class LinkSheet(LinkSheetConfig):
    """The published link figures of `cluster.links` (LinkSheetConfig: DGX/HGX H100 by
    default), on nodes of `gpus_per_node` GPUs."""

    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "intra_busbw_GBps", "intra_p2p_GBps", "nics_per_node",
                     "nic_Gbps", "inter_efficiency"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"link sheet: {name} must be > 0, got {getattr(self, name)}")
        if self.overlap_coe < 1:
            raise ConfigError(f"link sheet: overlap_coe must be >= 1, got {self.overlap_coe}")

    @property
    def nic_GBps_per_gpu(self) -> float:
        """Line rate of the NIC share of one GPU, GB/s (1e9 B/s)."""
        return self.nics_per_node * self.nic_Gbps / 8.0 / self.gpus_per_node


_STEPS = {"allreduce": 2, "reduce_scatter": 1, "all_gather": 1, "all2all": 1, "p2p": 1}


def _span(start: int, stride: int, count: int, gpus_per_node: int) -> Tuple[int, int]:
    """(nodes spanned, fewest ranks on one of them) of ranks start + stride * range(count)."""
    _, counts = np.unique((start + stride * np.arange(count)) // gpus_per_node,
                          return_counts=True)
    return len(counts), int(counts.min())


def worst_span(layout: str, world_size: int, group_size: int,
               gpus_per_node: int) -> Tuple[int, int]:
    """(nodes spanned, ranks per node) of the slowest group of a shape: most nodes, then fewest
    ranks on a node. Groups repeat with period gpus_per_node in their start, so at most
    gpus_per_node groups are examined."""
    if layout == "consec":
        count, stride, start_step = world_size // group_size, 1, group_size
    elif layout == "strided":
        count, stride, start_step = world_size // group_size, world_size // group_size, 1
    else:
        raise ConfigError(f"unknown layout {layout!r}")
    spans = {_span(i * start_step, stride, group_size, gpus_per_node)
             for i in range(min(count, gpus_per_node))}
    return max(spans, key=lambda km: (km[0], -km[1]))


def collective_fit(op: str, group_size: int, nodes: int, per_node: int,
                   sheet: LinkSheet) -> Tuple[float, float]:
    """(alpha_us, algbw_GBps) of `op` over `group_size` ranks on `nodes` nodes with at least
    `per_node` ranks on each."""
    if nodes == 1:
        busbw = sheet.intra_busbw_GBps
    else:
        nic = sheet.nic_GBps_per_gpu * sheet.inter_efficiency
        if op == "all2all":
            busbw = nic * (group_size - 1) / (group_size - per_node)
        else:
            busbw = per_node * nic
        busbw = min(busbw, sheet.intra_busbw_GBps)
    hops = (sheet.intra_latency_us * math.ceil(math.log2(per_node)) +
            sheet.inter_latency_us * math.ceil(math.log2(nodes)))
    alpha = _STEPS[op] * max(hops, sheet.intra_latency_us)
    return alpha, busbw / busbw_factor(op, group_size)


def _fit_record(op: str, group_size: int, layout: str, alpha: float, algbw: float) -> Dict:
    return {"op": op, "group_size": group_size, "layout": layout, "alpha_us": alpha,
            "algbw_GBps": algbw, "max_rel_err": 0.0}


def _points(fit: Dict, sizes: List[int], dtype: str) -> List[Dict[str, Any]]:
    out = []
    for size in sizes:
        t = predict_time_us(fit["alpha_us"], fit["algbw_GBps"], size)
        algbw = size / t / 1e3
        out.append({"op": fit["op"], "group_size": fit["group_size"], "layout": fit["layout"],
                    "size_bytes": size, "dtype": dtype, "time_us_median": t, "time_us_p10": t,
                    "time_us_p90": t, "algbw_GBps": algbw,
                    "busbw_GBps": busbw_GBps(fit["op"], fit["group_size"], algbw), "iters": 0})
    return out


def analytic_benchmarks(world_size: int, sheet: LinkSheet = LinkSheet(), *,
                        max_tp: Optional[int] = None, max_pp: Optional[int] = None,
                        sizes: Optional[List[int]] = None) -> Dict[str, Any]:
    """hardware.json "benchmarks" for `world_size` ranks: fits (max_rel_err 0: exact by
    construction) and points evaluated from them at `sizes` (default 1 KiB..256 MiB x2, iters 0)."""
    g = sheet.gpus_per_node
    if world_size < 2 or world_size % g and world_size > g:
        raise ConfigError(f"analytic profile: world size {world_size} must be >= 2 and a multiple "
                          f"of gpus_per_node ({g}) when it spans nodes")
    sizes = sizes if sizes is not None else [KiB * 2 ** i for i in range(19)]
    benchmarks: Dict[str, Any] = {}
    for op in ("allreduce", "reduce_scatter", "all_gather", "all2all"):
        fits = []
        sizes_n = group_sizes(world_size) if op == "allreduce" else group_sizes(world_size, max_tp)
        for n in sizes_n:
            for layout in (layouts_for(world_size, n) if op == "allreduce" else ("consec",)):
                nodes, per_node = worst_span(layout, world_size, n, g)
                alpha, algbw = collective_fit(op, n, nodes, per_node, sheet)
                fits.append(_fit_record(op, n, layout, alpha, algbw))
        benchmarks[op] = {"points": [p for f in fits for p in _points(f, sizes, sheet.dtype)],
                          "fits": fits}
    fits = []
    for pp in pp_sizes(world_size, max_pp):
        step = world_size // pp
        # Pair (r, r + step) is intra-node iff both fall in one node: possible only if step < g.
        layouts = ["inter"] if step >= g else (["intra", "inter"] if world_size > g else ["intra"])
        for layout in layouts:
            if layout == "intra":
                alpha, algbw = sheet.intra_latency_us, sheet.intra_p2p_GBps
            else:
                alpha = sheet.inter_latency_us
                algbw = sheet.nic_GBps_per_gpu * sheet.inter_efficiency
            fits.append(_fit_record("p2p", pp, layout, alpha, algbw))
    benchmarks["p2p"] = {"points": [p for f in fits for p in _points(f, sizes, sheet.dtype)],
                         "fits": fits}
    coe = sheet.overlap_coe
    benchmarks["overlap"] = {"compute_slowdown": coe, "comm_slowdown": coe, "overlap_coe": coe}
    return benchmarks


def analytic_hardware(name: str, world_size: int, sheet: LinkSheet = LinkSheet(), *,
                      max_tp: Optional[int] = None, max_pp: Optional[int] = None) -> HardwareProfile:
    """A hardware profile ("source": "analytic", no provenance: the stage adds it) for a cluster
    `name` of `world_size` GPUs described by `sheet`; the sheet is kept under "sheet" so a
    reader can see where the numbers came from."""
    nodes = max(1, world_size // sheet.gpus_per_node)
    benchmarks = analytic_benchmarks(world_size, sheet, max_tp=max_tp, max_pp=max_pp)
    return HardwareProfile(
        source=Source.analytic,
        cluster=ClusterSummary(name=name, nodes=nodes,
                               tasks_per_node=min(world_size, sheet.gpus_per_node),
                               world_size=world_size, backend="nccl"),
        inventory=Inventory(), sheet=asdict(sheet),
        benchmarks=HardwareBenchmarks.from_dict(benchmarks, "benchmarks"))
