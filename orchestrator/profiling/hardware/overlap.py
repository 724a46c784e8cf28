"""How much compute and communication slow each other down when they run at the same time.

Galvatron's method: time a matmul loop and an all-reduce loop alone, then each while the other runs
long enough to cover it completely. compute_slowdown = compute time overlapped / alone,
comm_slowdown = comm time overlapped / alone, overlap_coe = max of both, clamped to >= 1 (the cost
model multiplies overlapped times by it). On a GPU the all-reduce runs on its own CUDA stream; on a
CPU it runs in a background thread (torch releases the GIL inside both the matmul and the call).
Loop counts of the collective are derived from times agreed across ranks (MAX), so every rank
issues the same number of all-reduces.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

import numpy as np

from orchestrator.choices import Dtype
from orchestrator.profiling.hardware.collectives import RankInfo, default_dtype
from orchestrator.profiling.hardware.sampling import RankAgreement
from orchestrator.profiling.measure import MiB, is_cuda


@dataclass(frozen=True)
class OverlapConfig:
    """matmul_dim: side of the square matmul (None: 4096 on GPU, 256 on CPU). comm_bytes: all-reduce
    message (None: 64 MiB on GPU, 4 MiB on CPU). window_s: target length of each timed loop.
    cover: how many times longer the covering side runs than the covered one. repeats: timed
    windows per measurement (the median is kept)."""

    matmul_dim: Optional[int] = None
    comm_bytes: Optional[int] = None
    dtype: Optional[str] = None
    window_s: float = 0.3
    cover: float = 2.0
    repeats: int = 3


def overlap_summary(compute_slowdown: float, comm_slowdown: float) -> Dict[str, float]:
    """{"compute_slowdown", "comm_slowdown", "overlap_coe"}: overlap_coe = the larger slowdown,
    at least 1 (dimensionless)."""
    return {"compute_slowdown": compute_slowdown, "comm_slowdown": comm_slowdown,
            "overlap_coe": max(1.0, compute_slowdown, comm_slowdown)}


class _Runner:
    """Times loops of matmuls and all-reduces, alone or together, on one rank."""

    def __init__(self, ctx: RankInfo, cfg: OverlapConfig) -> None:
        self.device = ctx.device
        self.cuda = is_cuda(ctx.device)
        dtype = Dtype.parse(cfg.dtype or default_dtype(ctx.device)).torch
        dim = cfg.matmul_dim or (4096 if self.cuda else 256)
        comm_bytes = cfg.comm_bytes or (64 * MiB if self.cuda else 4 * MiB)
        elem = torch.empty((), dtype=dtype).element_size()
        self.a = torch.randn(dim, dim, device=self.device).to(dtype)
        self.b = torch.randn(dim, dim, device=self.device).to(dtype)
        self.c = torch.empty(dim, dim, dtype=dtype, device=self.device)
        self.comm = torch.zeros(max(1, comm_bytes // elem), dtype=dtype, device=self.device)
        self.ranks = RankAgreement(self.device)
        self.comm_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _compute(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b, out=self.c)

    def _allreduce(self, n: int) -> None:
        for _ in range(n):
            dist.all_reduce(self.comm)

    def run(self, n_compute: int, n_comm: int) -> Dict[str, float]:
        """Seconds taken by the matmul loop and by the all-reduce loop, started together (a loop
        of 0 iterations is not run)."""
        self.ranks.align()
        if self.cuda:
            return self._run_cuda(n_compute, n_comm)
        return self._run_cpu(n_compute, n_comm)

    def _run_cpu(self, n_compute: int, n_comm: int) -> Dict[str, float]:
        out: Dict[str, float] = {}

        def comm() -> None:
            t0 = time.perf_counter()
            self._allreduce(n_comm)
            out["comm"] = time.perf_counter() - t0

        thread = threading.Thread(target=comm) if n_comm else None
        if thread:
            thread.start()
        t0 = time.perf_counter()
        self._compute(n_compute)
        out["compute"] = time.perf_counter() - t0
        if thread:
            thread.join()
        return out

    def _run_cuda(self, n_compute: int, n_comm: int) -> Dict[str, float]:
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("c0", "c1", "m0", "m1")}
        if n_comm:
            with torch.cuda.stream(self.comm_stream):
                ev["c0"].record()
                self._allreduce(n_comm)
                ev["c1"].record()
        ev["m0"].record()
        self._compute(n_compute)
        ev["m1"].record()
        torch.cuda.synchronize(self.device)
        out = {"compute": ev["m0"].elapsed_time(ev["m1"]) / 1e3}
        if n_comm:
            out["comm"] = ev["c0"].elapsed_time(ev["c1"]) / 1e3
        return out


def measure_overlap(ctx: RankInfo, cfg: OverlapConfig = OverlapConfig()) -> Dict[str, float]:
    """Run on every rank together. Returns {"compute_slowdown", "comm_slowdown", "overlap_coe"}
    (dimensionless; slowdowns as measured, maxed over ranks; overlap_coe >= 1), identical on all
    ranks."""
    runner = _Runner(ctx, cfg)
    runner.run(2, 0)
    runner.run(0, 2)
    compute_1, comm_1 = runner.ranks.agreed_max([runner.run(3, 0)["compute"] / 3,
                                                 runner.run(0, 3)["comm"] / 3])

    def times(n_compute: int, n_comm: int, key: str) -> float:
        return float(np.median([runner.run(n_compute, n_comm)[key] for _ in range(cfg.repeats)]))

    def loops(t_one: float) -> int:
        return max(2, math.ceil(cfg.window_s / max(t_one, 1e-9)))

    # Communication slowed by compute: compute covers the whole all-reduce loop.
    n_comm = loops(comm_1)
    n_cover = max(1, math.ceil(cfg.cover * n_comm * comm_1 / compute_1))
    comm_alone = times(0, n_comm, "comm")
    comm_overlapped = times(n_cover, n_comm, "comm")
    # Compute slowed by communication: the all-reduce loop covers the whole compute loop.
    n_compute = loops(compute_1)
    n_cover = max(1, math.ceil(cfg.cover * n_compute * compute_1 / comm_1))
    compute_alone = times(n_compute, 0, "compute")
    compute_overlapped = times(n_compute, n_cover, "compute")

    slowdowns = runner.ranks.agreed_max([compute_overlapped / compute_alone,
                                         comm_overlapped / comm_alone])
    return overlap_summary(*slowdowns)
