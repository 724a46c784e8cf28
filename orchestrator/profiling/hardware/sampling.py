"""Timing a collective on every rank: warm up, then barrier-aligned iterations until stable.

Every rank runs the same number of iterations (a rank that stopped alone would leave the others
waiting in the collective forever), so the stop is decided from data all ranks share: after each
chunk of iterations the per-iteration times are all-reduced with MAX (a collective ends when its
slowest rank does) together with the elapsed time, and every rank applies the same pure rule
(`should_stop`) to the same numbers. All ranks therefore return identical results.

A sample times `ops_per_sample` calls back to back and keeps the mean: short collectives are run
several times per sample (chosen once per point from a calibration, agreed across ranks) so that
the skew of ranks leaving the barrier and the launch cost of one kernel are spread over many calls,
as nccl-tests does; long ones run once per sample.

Samples are taken with measure.Stopwatch (CUDA events on a GPU, perf_counter on a CPU) and
summarised with measure.summarize.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist

from orchestrator.profiling.measure import Stopwatch, is_cuda, summarize


@dataclass(frozen=True)
class StopRule:
    """When to stop timing one point.

    warmup_iters: untimed calls first (connection setup, allocator, NCCL channels).
    min_iters / max_iters: bounds on timed iterations. max_time_s: wall-clock cap on timed
    iterations (checked between chunks, so a point may run over by one chunk).
    rel_spread: stop once (p90 - p10) / median is below this. chunk_iters: iterations between two
    agreements across ranks (each agreement is one small all-reduce, outside the timed region).
    min_sample_us: a sample repeats the call until it lasts about this long (at most
    max_ops_per_sample calls); 0 times every call alone. An "iteration" is one sample.
    """

    warmup_iters: int = 3
    min_iters: int = 5
    max_iters: int = 100
    max_time_s: float = 2.0
    rel_spread: float = 0.10
    chunk_iters: int = 5
    min_sample_us: float = 1000.0
    max_ops_per_sample: int = 100

    def __post_init__(self) -> None:
        if self.min_iters < 1 or self.max_iters < self.min_iters:
            raise ValueError(f"need 1 <= min_iters ({self.min_iters}) <= max_iters "
                             f"({self.max_iters})")
        if self.chunk_iters < 1 or self.warmup_iters < 0 or self.max_ops_per_sample < 1:
            raise ValueError("chunk_iters and max_ops_per_sample must be >= 1, warmup_iters >= 0")


@dataclass(frozen=True)
class Timing:
    """Statistics of one timed point, in microseconds per call, over samples (each the mean of
    ops_per_sample back-to-back calls); iters = calls timed (samples x ops_per_sample)."""

    time_us_median: float
    time_us_p10: float
    time_us_p90: float
    iters: int
    ops_per_sample: int = 1


def should_stop(samples_us: Sequence[float], elapsed_s: float, rule: StopRule) -> bool:
    """Whether to stop timing: the cap on iterations or time is hit, or at least min_iters samples
    have a relative spread below rule.rel_spread."""
    n = len(samples_us)
    if n >= rule.max_iters:
        return True
    if n < rule.min_iters:
        return False
    if elapsed_s >= rule.max_time_s:
        return True
    return summarize(samples_us).rel_spread < rule.rel_spread


def next_chunk(n_done: int, rule: StopRule) -> int:
    """Iterations in the next chunk: chunk_iters, never past max_iters (and at least one)."""
    return max(1, min(rule.chunk_iters, rule.max_iters - n_done))


def ops_per_sample(time_us_per_op: float, rule: StopRule) -> int:
    """Calls per sample so that a sample lasts about rule.min_sample_us (1..max_ops_per_sample)."""
    if rule.min_sample_us <= 0 or time_us_per_op >= rule.min_sample_us:
        return 1
    wanted = math.ceil(rule.min_sample_us / max(time_us_per_op, 1e-3))
    return max(1, min(rule.max_ops_per_sample, wanted))


def _samples_us(op: Callable[[], object], align: Callable[[], None], n: int, per_sample: int,
                clock: Stopwatch) -> List[float]:
    marks = []
    for _ in range(n):
        align()  # ends with a device synchronize: the start mark is not queued behind old work
        start = clock.mark()
        for _ in range(per_sample):
            op()
        marks.append((start, clock.mark()))
    return [clock.elapsed_us(start, end) / per_sample for start, end in marks]


class RankAgreement:
    """The small collectives that keep every rank of the default group in step: `align` (a
    barrier, then a device synchronize) and `agreed_max` (values all-reduced with MAX)."""

    def __init__(self, device):
        self.device = device
        self.cuda = is_cuda(device)
        self._flag = torch.zeros(1, dtype=torch.float32, device=device)

    def align(self) -> None:
        dist.all_reduce(self._flag)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def agreed_max(self, values: List[float]) -> List[float]:
        """Each value's maximum over all ranks (identical on every rank)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()


def measure(op: Callable[[], object], device, rule: StopRule = StopRule()) -> Timing:
    """Time `op` (a blocking call of one collective, or of nothing on a rank with no part in this
    point) on every rank of the default process group; every rank must call this together.

    Returns the median, p10 and p90 in us per call over samples (a sample's time is the max over
    ranks), the number of calls timed and the calls per sample: identical on all ranks.
    """
    ranks = RankAgreement(device)
    clock = Stopwatch(device)

    def run_samples(n: int, per_sample: int) -> List[float]:
        return _samples_us(op, ranks.align, n, per_sample, clock)

    for _ in range(rule.warmup_iters):
        op()
    per_sample = 1
    if rule.min_sample_us > 0:
        # Calibrate on a short back-to-back run; every rank gets the same estimate, hence the same
        # number of calls per sample.
        calib = max(1, min(rule.warmup_iters, 3))
        estimate_us = ranks.agreed_max(run_samples(1, calib))[0]
        per_sample = ops_per_sample(estimate_us, rule)
    samples: List[float] = []
    t_start = time.perf_counter()
    while True:
        k = next_chunk(len(samples), rule)
        local = run_samples(k, per_sample)
        elapsed_us = (time.perf_counter() - t_start) * 1e6
        agreed = ranks.agreed_max(local + [elapsed_us])
        samples.extend(agreed[:-1])
        if should_stop(samples, agreed[-1] / 1e6, rule):
            break
    stats = summarize(samples)
    return Timing(time_us_median=stats.median, time_us_p10=stats.p10, time_us_p90=stats.p90,
                  iters=len(samples) * per_sample, ops_per_sample=per_sample)
