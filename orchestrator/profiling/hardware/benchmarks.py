"""The hardware benchmarks by name, in run order: the one list that the profile_hardware stage
runs, its config default and its validation read.

Each entry measures one section of hardware.json on every rank of a job together:
`bench(ctx, hw, on_point)` with ctx the rank (see collectives.RankInfo), hw the
profile_hardware config section and on_point(name, done, total) a progress callback. It returns
the section (identical on all ranks, or only on rank 0 for the inventory).

Torch-free at import; each benchmark imports what it runs. Their names and order are
choices.BENCHMARK_NAMES (what the config lists).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from orchestrator.choices import BENCHMARK_NAMES
from orchestrator.profiling.measure import OnPoint

Benchmark = Callable[[Any, Any, OnPoint], Optional[dict]]


def sweep_config(hw):
    """The collectives' SweepConfig (sizes, shapes, stop rule) from the profile_hardware section."""
    from orchestrator.profiling.hardware.collectives import SweepConfig
    from orchestrator.profiling.hardware.sampling import StopRule

    stop = StopRule(warmup_iters=hw.warmup_iters, min_iters=hw.min_iters, max_iters=hw.max_iters,
                    max_time_s=hw.max_time_s, rel_spread=hw.rel_spread)
    return SweepConfig(min_bytes=hw.min_size_bytes, max_bytes=hw.max_size_bytes,
                       step=hw.size_step, dtype=hw.dtype, max_tp=hw.max_tp,
                       max_group=hw.max_group, max_pp=hw.max_pp, stop=stop)


def inventory(ctx, hw, on_point: OnPoint) -> Optional[dict]:
    """{"ranks": [one record per rank]} on rank 0 (None elsewhere): node, device, CPU, memory."""
    from orchestrator.profiling.hardware.inventory import rank_inventory

    records = ctx.gather(rank_inventory(ctx))
    return {"ranks": records} if ctx.is_root else None


def _collective(name: str) -> Benchmark:
    def bench(ctx, hw, on_point: OnPoint) -> dict:
        from orchestrator.profiling.hardware import collectives

        return collectives.SWEEPS[name](ctx, sweep_config(hw), on_point=on_point)

    bench.__name__ = name
    bench.__doc__ = f"{{'points', 'fits'}} of {name} over message sizes (collectives.SWEEPS)."
    return bench


def overlap(ctx, hw, on_point: OnPoint) -> dict:
    """{"compute_slowdown", "comm_slowdown", "overlap_coe"} (see overlap.measure_overlap)."""
    from orchestrator.profiling.hardware.overlap import OverlapConfig, measure_overlap

    result = measure_overlap(ctx, OverlapConfig(dtype=hw.dtype))
    on_point("overlap", 1, 1)  # one measurement: its bar shows done, not 0/?
    return result


BENCHMARKS: Dict[str, Benchmark] = {
    **{name: _collective(name) for name in BENCHMARK_NAMES},  # in BENCHMARK_NAMES' order
    "inventory": inventory, "overlap": overlap}
