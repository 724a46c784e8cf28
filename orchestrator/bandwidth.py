"""The collective bandwidth conventions every part shares (nccl-tests'), pure functions: what
profiling measures with and what the planner prices with, so neither imports the other.

busbw = algbw x an op's factor: allreduce 2(n-1)/n; reduce_scatter, all_gather, all2all
(n-1)/n; p2p (send/recv) 1.
"""
from __future__ import annotations

from typing import Tuple

from orchestrator.errors import ConfigError

OPS = ("allreduce", "p2p", "reduce_scatter", "all_gather", "all2all")
# The workload's and the trace's op names (torch's) -> the benchmark that measured the op in
# hardware.json (nccl-tests' names, also Galvatron's files'): the one place the two meet.
BENCHMARK_OF_OP = {"all_reduce": "allreduce", "all_gather": "all_gather",
                   "reduce_scatter": "reduce_scatter", "all_to_all": "all2all",
                   "send": "p2p", "recv": "p2p"}


def benchmark_of(op: str) -> str:
    """The hardware profile's benchmark for a workload op (all_reduce -> allreduce)."""
    if op not in BENCHMARK_OF_OP:
        raise ConfigError(f"unknown workload op {op!r}; expected one of "
                          f"{', '.join(BENCHMARK_OF_OP)}")
    return BENCHMARK_OF_OP[op]


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


def half_allreduce_line(alpha_us: float, algbw_GBps: float) -> Tuple[float, float]:
    """(alpha_us, algbw_GBps) of a reduce-scatter or an all-gather of the same buffer on the same
    group, from an all-reduce's line: a ring all-reduce is a reduce-scatter followed by an
    all-gather, each with half its steps and half its traffic (equal bus bandwidth), so each
    takes half the time: alpha / 2 and twice the algorithm bandwidth. The stated rule wherever
    only all-reduce was measured (Galvatron's files; groups that cross nodes)."""
    return alpha_us / 2.0, algbw_GBps * 2.0
