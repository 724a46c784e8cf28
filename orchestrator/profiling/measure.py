"""What every profiler shares: units, the bandwidth conventions, sample statistics and the timer.

Units: sizes in bytes (KiB = 1024 B), times in microseconds, bandwidths in GB/s (1e9 B/s).
Bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw x an op's factor. The factor
turns algbw into the bandwidth each rank's link actually carries, so busbw is comparable across
group sizes: allreduce 2(n-1)/n; reduce_scatter, all_gather, all2all (n-1)/n; p2p (send/recv) 1.

Torch-free at import; the timer imports torch only on a GPU. The bandwidth conventions live in
orchestrator/bandwidth.py, which the planner also prices with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

# The conventions themselves live in orchestrator/bandwidth.py (the planner prices with them).
from orchestrator.bandwidth import OPS, busbw_factor  # noqa: F401 (re-exported)
from orchestrator.errors import ConfigError

# A profiling loop's progress callback: (benchmark name, points done, points in total).
OnPoint = Callable[[str, int, int], None]

KiB = 1024
MiB = 1024 * KiB



# ---------------------------------------------------------------- units
def format_bytes(n: float) -> str:
    """`n` bytes for people: "512 B", "64 KiB", "1.5 MiB", ... (binary units, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def algbw_GBps(size_bytes: float, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s) of moving `size_bytes` in `time_us` microseconds."""
    if time_us <= 0:
        raise ValueError(f"time must be positive, got {time_us} us for {size_bytes} bytes")
    return size_bytes / time_us / 1e3


def busbw_GBps(op: str, n: int, algbw: float) -> float:
    """Bus bandwidth in GB/s: `algbw` (GB/s) times the nccl-tests factor of `op` on `n` ranks."""
    return algbw * busbw_factor(op, n)


def algbw_from_busbw_GBps(op: str, n: int, busbw: float) -> float:
    """Inverse of busbw_GBps. A group of one rank moves nothing: its algbw is undefined (error)."""
    factor = busbw_factor(op, n)
    if factor == 0:
        raise ConfigError(f"{op} over a group of {n} rank has no bus traffic; busbw is undefined")
    return busbw / factor


# ---------------------------------------------------------------- statistics
@dataclass(frozen=True)
class SampleStats:
    """Statistics of timed samples, in the samples' unit (us throughout the profilers)."""

    min: float
    p10: float
    median: float
    p90: float

    @property
    def rel_spread(self) -> float:
        """(p90 - p10) / median (inf when the median is not positive)."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else float("inf")


def summarize(samples: Sequence[float]) -> SampleStats:
    """Minimum, p10, median and p90 of the samples (numpy's linear percentiles)."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples to summarize")
    p10, median, p90 = np.percentile(a, [10, 50, 90])
    return SampleStats(min=float(a.min()), p10=float(p10), median=float(median), p90=float(p90))


def median_of_group_max(per_rank: Sequence[float], group_size: int) -> float:
    """Ranks in consecutive groups of `group_size` run one step together: a group takes as long
    as its slowest rank; groups timed at once are summarised by their median (the input's unit)."""
    a = np.asarray(per_rank, dtype=np.float64)
    if a.size == 0 or a.size % group_size:
        raise ValueError(f"{a.size} ranks do not form groups of {group_size}")
    return float(np.median(a.reshape(-1, group_size).max(axis=1)))


def nonneg_rel_lsq(basis: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Coefficients c >= 0 minimising sum(((basis @ c - values) / values)^2).

    `basis` is (points, terms), `values` (points,) and positive. Each column is scaled to unit
    norm before the solve (terms such as 1 and size_bytes differ by 1e8), then scaled back.
    """
    from scipy.optimize import nnls

    a = basis / values[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(a / norms, np.ones_like(values))
    return coef / norms


# ---------------------------------------------------------------- the timer
def is_cuda(device) -> bool:
    """Whether `device` (a torch.device or its name) is a GPU."""
    return getattr(device, "type", str(device)).startswith("cuda")


class Stopwatch:
    """Elapsed microseconds between marks: CUDA events on a GPU (the host returns before the
    kernel ends, so host clocks would time the launch), perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = is_cuda(device)

    def mark(self):
        """A point in time (a recorded CUDA event on a GPU, seconds on a CPU)."""
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_us(self, start, end) -> float:
        """Microseconds from mark `start` to mark `end` (waits for `end` on a GPU)."""
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end)) * 1e3
        return (end - start) * 1e6

    def sync(self) -> None:
        """Wait for queued GPU work (no-op on a CPU), so that a mark is not queued behind it."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
