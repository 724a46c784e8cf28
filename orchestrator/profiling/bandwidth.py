"""Bandwidth conventions of nccl-tests: algbw = bytes / time, busbw = algbw x an op's factor.

GB means 1e9 bytes. The factor turns algbw into the bandwidth each rank's link actually carries, so
busbw is comparable across group sizes: allreduce 2(n-1)/n; reduce_scatter, all_gather, all2all
(n-1)/n; p2p (send/recv) 1.
"""
from __future__ import annotations

from orchestrator.errors import ConfigError

OPS = ("allreduce", "p2p", "reduce_scatter", "all_gather", "all2all")


def busbw_factor(op: str, n: int) -> float:
    """The nccl-tests factor busbw / algbw for `op` over a group of `n` ranks (dimensionless)."""
    if op not in OPS:
        raise ConfigError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
    if op == "p2p":
        return 1.0
    if n < 1:
        raise ConfigError(f"group size must be >= 1 for {op}, got {n}")
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


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
