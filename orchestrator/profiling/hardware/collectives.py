"""Collective benchmarks, run on every rank of a job with torch.distributed initialised.

Each benchmark sweeps message sizes for every group shape it covers, with all groups of a shape
running at once (as in training: every tensor-parallel group all-reduces in the same step), and
returns {"points": [...], "fits": [...]} as in docs/profile-schema.md, identical on all ranks.
Every rank must call the same benchmarks with the same arguments in the same order: process groups
are created collectively and every point is timed collectively.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from orchestrator.choices import Dtype
from orchestrator.dist_names import all_gather_single, reduce_scatter_single
from orchestrator.errors import ConfigError
from orchestrator.profiling.hardware.fit import fit_points
from orchestrator.profiling.hardware.groups import (check_node_of_rank, group_sizes, groups_for,
                                                    layouts_for, p2p_pairs_by_layout,
                                                    pp_neighbours, pp_sizes)
from orchestrator.profiling.hardware.sampling import StopRule, Timing, measure
from orchestrator.profiling.measure import (KiB, MiB, OnPoint, algbw_GBps, busbw_GBps,
                                            is_cuda)



class RankInfo(Protocol):
    """What the benchmarks need to know about the calling rank (the runtime's RankContext fits)."""

    rank: int
    world_size: int
    node_of_rank: Sequence[int]  # node id of every global rank
    device: Any  # torch.device: "cpu" (gloo) or "cuda:<i>" (nccl)


@dataclass(frozen=True)
class SweepConfig:
    """Message sizes and shapes to benchmark.

    Sizes run from min_bytes to max_bytes (None: 256 MiB on GPU, 64 MiB on CPU), multiplied by
    `step` each time. dtype None: bf16 on GPU, fp32 on CPU. max_tp caps the group sizes of
    reduce_scatter / all_gather / all2all (tensor/sequence-parallel collectives); max_group caps
    allreduce group sizes; max_pp caps the pipeline degrees of p2p. None: up to the world size.
    """

    min_bytes: int = 1 * KiB
    max_bytes: Optional[int] = None
    step: int = 2
    dtype: Optional[str] = None
    max_tp: Optional[int] = 8
    max_group: Optional[int] = None
    max_pp: Optional[int] = None
    stop: StopRule = field(default_factory=StopRule)

    def __post_init__(self) -> None:
        if self.step < 2:
            raise ConfigError(f"sweep step must be >= 2 (a multiplier), got {self.step}")
        if self.min_bytes < 1:
            raise ConfigError(f"sweep min_bytes must be >= 1, got {self.min_bytes}")
        if self.max_bytes is not None and self.max_bytes < self.min_bytes:
            raise ConfigError(f"sweep max_bytes ({self.max_bytes}) < min_bytes ({self.min_bytes})")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", Dtype.parse(self.dtype))  # frozen
            except ValueError as e:
                raise ConfigError(f"sweep dtype: {e}") from None


def default_max_bytes(device) -> int:
    """Largest message by default: 256 MiB on a GPU, 64 MiB on a CPU."""
    return 256 * MiB if is_cuda(device) else 64 * MiB


def default_dtype(device) -> Dtype:
    """Message dtype by default: bf16 on a GPU (what training sends), fp32 on a CPU."""
    return Dtype.bf16 if is_cuda(device) else Dtype.fp32


def message_sizes(min_bytes: int, max_bytes: int, step: int) -> List[int]:
    """min_bytes, min_bytes*step, ... up to and including max_bytes (bytes)."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step
    return sizes


def aligned_numel(size_bytes: int, elem_bytes: int, multiple: int) -> int:
    """Elements of a `size_bytes` message rounded down to a multiple of `multiple` (>= multiple),
    so that it splits evenly over a group."""
    numel = size_bytes // elem_bytes
    return max(multiple, numel - numel % multiple)


def make_point(op: str, group_size: int, layout: str, size_bytes: int, dtype: str,
               timing: Timing) -> Dict[str, Any]:
    """A schema point: the timing of `op` on `size_bytes` per rank, with algbw and busbw (GB/s)."""
    algbw = algbw_GBps(size_bytes, timing.time_us_median)
    return {"op": op, "group_size": group_size, "layout": layout, "size_bytes": size_bytes,
            "dtype": dtype, "time_us_median": timing.time_us_median,
            "time_us_p10": timing.time_us_p10, "time_us_p90": timing.time_us_p90,
            "algbw_GBps": algbw, "busbw_GBps": busbw_GBps(op, group_size, algbw),
            "iters": timing.iters}


class GroupCache:
    """Process groups by their ranks, created once. `dist.new_group` is collective over the whole
    world, so every rank asks for the same group lists in the same order."""

    def __init__(self) -> None:
        self._groups: Dict[Tuple[int, ...], Any] = {}

    def group_of(self, groups: Sequence[Sequence[int]], rank: int):
        """The process group of `rank` among `groups` (a partition of the world), creating all of
        them (in list order) on first use."""
        world = dist.get_world_size()
        mine = None
        for ranks in groups:
            key = tuple(ranks)
            if key not in self._groups:
                self._groups[key] = (dist.group.WORLD if len(key) == world
                                     else dist.new_group(list(key)))
            if rank in key:
                mine = self._groups[key]
        if mine is None:
            raise ConfigError(f"rank {rank} is in none of the groups {groups}")
        return mine


_default_cache: Tuple[Any, Optional[GroupCache]] = (None, None)


def default_group_cache() -> GroupCache:
    """The cache bound to the current default process group (a new one after re-initialisation)."""
    global _default_cache
    world = dist.group.WORLD
    if _default_cache[0] is not world or _default_cache[1] is None:
        _default_cache = (world, GroupCache())
    return _default_cache[1]


def _sweep_setup(ctx: RankInfo, sweep: SweepConfig) -> Tuple[List[int], Dtype, torch.dtype]:
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised: run the benchmarks inside a stage "
                          "(the runtime initialises gloo/nccl on every rank)")
    if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
        raise ConfigError(f"rank context (rank {ctx.rank} of {ctx.world_size}) disagrees with "
                          f"torch.distributed (rank {dist.get_rank()} of "
                          f"{dist.get_world_size()})")
    check_node_of_rank(ctx.node_of_rank, ctx.world_size)
    max_bytes = sweep.max_bytes if sweep.max_bytes is not None else default_max_bytes(ctx.device)
    dtype = sweep.dtype or default_dtype(ctx.device)
    return message_sizes(sweep.min_bytes, max_bytes, sweep.step), dtype, dtype.torch


def _buffers(count: int, numel: int, dtype: torch.dtype, device) -> List[torch.Tensor]:
    # Zeros: sums stay finite however many iterations run (ones would overflow to inf).
    return [torch.zeros(numel, dtype=dtype, device=device) for _ in range(count)]


def _collective_call(op: str, group, group_size: int, numel: int,
                     bufs: List[torch.Tensor]) -> Callable[[], None]:
    a, b = bufs[0], bufs[1]
    if op == "allreduce":
        t = a[:numel]
        return lambda: dist.all_reduce(t, group=group)
    if op == "reduce_scatter":
        fn, src, dst = reduce_scatter_single, a[:numel], b[:numel // group_size]
        return lambda: fn(dst, src, group=group)
    if op == "all_gather":
        fn, src, dst = all_gather_single, a[:numel // group_size], b[:numel]
        return lambda: fn(dst, src, group=group)
    if op == "all2all":
        src, dst = a[:numel], b[:numel]
        return lambda: dist.all_to_all_single(dst, src, group=group)
    raise ConfigError(f"no collective call for op {op!r}")


def bench_collective(op: str, ctx: RankInfo, sweep: SweepConfig,
                     shapes: Sequence[Tuple[int, str]],
                     on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """Sweep `op` ("allreduce", "reduce_scatter", "all_gather", "all2all") over message sizes for
    each (group size, layout) in `shapes`, all groups of a shape at once. Returns
    {"points", "fits"} (schema of docs/profile-schema.md), identical on all ranks."""
    sizes, dtype_name, dtype = _sweep_setup(ctx, sweep)
    cache = default_group_cache()
    elem = torch.empty((), dtype=dtype).element_size()
    bufs = _buffers(2, max((aligned_numel(size, elem, n) for n, _ in shapes for size in sizes),
                           default=0), dtype, ctx.device)
    total = len(shapes) * len(sizes)
    points: List[Dict[str, Any]] = []
    for group_size, layout in shapes:
        pg = cache.group_of(groups_for(layout, ctx.world_size, group_size), ctx.rank)
        for size in sizes:
            numel = aligned_numel(size, elem, group_size)
            timing = measure(_collective_call(op, pg, group_size, numel, bufs), ctx.device,
                             sweep.stop)
            points.append(make_point(op, group_size, layout, numel * elem, dtype_name, timing))
            if on_point is not None:
                on_point(op, len(points), total)
    return {"points": points, "fits": fit_points(points)}


def allreduce_shapes(world_size: int, max_group: Optional[int] = None) -> List[Tuple[int, str]]:
    """(group size, layout) pairs the allreduce benchmark covers: every size, both layouts."""
    return [(s, layout) for s in group_sizes(world_size, max_group)
            for layout in layouts_for(world_size, s)]


def tp_shapes(world_size: int, max_tp: Optional[int]) -> List[Tuple[int, str]]:
    """(group size, "consec") pairs for the tensor-parallel collectives, sizes 2..min(W, max_tp)."""
    return [(s, "consec") for s in group_sizes(world_size, max_tp)]


def bench_allreduce(ctx: RankInfo, sweep: SweepConfig = SweepConfig(), *,
                    on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """all_reduce (sum) for every group size and both layouts, all groups of a shape at once."""
    return bench_collective("allreduce", ctx, sweep,
                             allreduce_shapes(ctx.world_size, sweep.max_group), on_point)


def bench_reduce_scatter(ctx: RankInfo, sweep: SweepConfig = SweepConfig(), *,
                         on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """reduce_scatter over consecutive groups of 2..min(W, max_tp); size_bytes = input per rank."""
    return bench_collective("reduce_scatter", ctx, sweep,
                             tp_shapes(ctx.world_size, sweep.max_tp), on_point)


def bench_all_gather(ctx: RankInfo, sweep: SweepConfig = SweepConfig(), *,
                     on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """all_gather over consecutive groups of 2..min(W, max_tp); size_bytes = output per rank."""
    return bench_collective("all_gather", ctx, sweep,
                             tp_shapes(ctx.world_size, sweep.max_tp), on_point)


def bench_all2all(ctx: RankInfo, sweep: SweepConfig = SweepConfig(), *,
                  on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """all_to_all_single over consecutive groups of 2..min(W, max_tp); size_bytes = input per
    rank."""
    return bench_collective("all2all", ctx, sweep,
                             tp_shapes(ctx.world_size, sweep.max_tp), on_point)


def p2p_shapes(world_size: int, node_of_rank: Sequence[int],
               max_pp: Optional[int] = None) -> List[Tuple[int, str, List[Tuple[int, int]]]]:
    """(pp, layout, pairs) the p2p benchmark covers: each pipeline degree, intra- and inter-node
    pairs separately (a layout with no pair at that degree is skipped)."""
    return [(pp, layout, pairs) for pp in pp_sizes(world_size, max_pp)
            for layout, pairs in p2p_pairs_by_layout(world_size, pp, node_of_rank).items()]


def _p2p_call(peers: List[int], numel: int,
              bufs: List[torch.Tensor]) -> Callable[[], None]:
    if not peers:
        return lambda: None
    ops = []
    for i, peer in enumerate(peers):
        ops.append(dist.P2POp(dist.isend, bufs[2 * i][:numel], peer))
        ops.append(dist.P2POp(dist.irecv, bufs[2 * i + 1][:numel], peer))

    def call() -> None:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return call


def bench_p2p(ctx: RankInfo, sweep: SweepConfig = SweepConfig(), *,
              on_point: Optional[OnPoint] = None) -> Dict[str, list]:
    """Send/recv between neighbouring pipeline stages, for pp = 2, 4, ... dividing W.

    As in 1F1B's steady state, every rank of a pair sends one message to its peer and receives one
    from it at the same time, and all pairs of a (pp, layout) run at once; a rank between two
    stages takes part in both of its pairs. size_bytes = one message; busbw = algbw.
    """
    sizes, dtype_name, dtype = _sweep_setup(ctx, sweep)
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = p2p_shapes(ctx.world_size, ctx.node_of_rank, sweep.max_pp)
    bufs = _buffers(4, max((aligned_numel(size, elem, 1) for size in sizes), default=0), dtype,
                    ctx.device)
    total = len(shapes) * len(sizes)
    points: List[Dict[str, Any]] = []
    for pp, layout, pairs in shapes:
        prev_rank, next_rank = pp_neighbours(ctx.rank, ctx.world_size, pp)
        in_layout = set(pairs)
        peers = [peer for peer, pair in ((prev_rank, (prev_rank, ctx.rank)),
                                         (next_rank, (ctx.rank, next_rank)))
                 if peer is not None and pair in in_layout]
        for size in sizes:
            numel = aligned_numel(size, elem, 1)
            timing = measure(_p2p_call(peers, numel, bufs), ctx.device, sweep.stop)
            points.append(make_point("p2p", pp, layout, numel * elem, dtype_name, timing))
            if on_point is not None:
                on_point("p2p", len(points), total)
    return {"points": points, "fits": fit_points(points)}


# The sweeps by benchmark name (benchmarks.BENCHMARKS runs them with the stage's settings).
SWEEPS: Dict[str, Callable[..., Dict[str, list]]] = {
    "allreduce": bench_allreduce,
    "p2p": bench_p2p,
    "reduce_scatter": bench_reduce_scatter,
    "all_gather": bench_all_gather,
    "all2all": bench_all2all,
}
