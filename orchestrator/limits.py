"""Bounds on work whose size is known before it starts (`limits.*`), and their checks.

A size the command line multiplies (micro-batches a schedule walks, samples the dynamic planner
splits, ranks and bytes a trace writes, points a profile measures, the largest message a
hardware profile sends, points of a sweep, processes the local launcher starts) is computed
from the config alone and checked here before any ledger entry, folder or file is made. Past
its bound the command is refused in one line (ConfigError, exit 2) naming the key that sets the
size, the size and the bound, and the `limits.<name>=<size>` that goes on: a user who means it
raises that limit. The defaults keep every run the docs show (a search at 65,536 GPUs, a trace
at 1,000,000 ranks by its representatives) well inside; the costs at the bounds are in
docs/config.md (limits).

Pure functions of config sections and layouts (no torch, no files).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from orchestrator.errors import ConfigError

GiB = 2**30
# Bytes a trace writes per traced rank, micro-batch and layer of its stage (+1 layer for the
# embedding, head and optimizer): fake_rank_<r>.jsonl and .log together. Measured 36-101 kB
# (tiny, tiny_moe; recompute full; 1 to 4 layers per stage): an estimate on the high side.
TRACE_BYTES_PER_LAYER_PASS = 100_000


@dataclass
class LimitsConfig:
    """Stated bounds on work known before it starts; raise one to go on past it."""

    # Micro-batches of one iteration: what search's schedules (every layout it may price),
    # train's layout (its prediction and its loop) and each trace configuration walk.
    max_micro_batches: int = 65536
    # Samples per data-parallel rank the dynamic micro-batching planner splits each iteration
    # (train.microbatching=dynamic, normal mode: its cost grows about as the square).
    max_dynamic_samples: int = 1024
    # Ranks a trace traces, over all its configurations (two files each).
    max_traced_ranks: int = 1024
    max_trace_GiB: float = 10.0  # what a trace writes, estimated before it starts
    max_profile_points: int = 256  # profile_model's (sequence length, TP degree) points
    max_message_GiB: float = 4.0  # profile_hardware's largest message (two buffers per rank)
    max_sweep_points: int = 256  # points of a `-m` sweep (each a run and its folder)
    max_local_ranks: int = 64  # processes launcher=local starts on this machine


def _number(value: float) -> str:
    """A size as a message shows it: 65,536; 12.5."""
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def check_limit(limits: LimitsConfig, name: str, size: float, key: str, what: str) -> None:
    """ConfigError when `size` is above limits.<name>: one line naming `key` (what sets the
    size), `what` it counts, the bound, and the override that goes on."""
    bound = getattr(limits, name)
    if size <= bound:
        return
    needed = size if isinstance(size, int) else math.ceil(size * 10) / 10
    raise ConfigError(f"{key}: {what} = {_number(size)}, above limits.{name}={_number(bound)} "
                      f"(work bounded before it starts); lower it, or go on with "
                      f"limits.{name}={needed}")


# ---------------------------------------------------------------- search, train
def search_micro_batches(search, model, world_size: int, max_cp: int) -> int:
    """The most micro-batches per iteration any layout of a search may have (an upper bound):
    the global batch over the smallest micro-batch size and the fewest data-parallel replicas
    (the world over the largest pp x tp x cp the search allows)."""
    tp_hi = search.tp or min(search.max_tp, model.heads, world_size)
    pp_hi = search.pp or min(search.max_pp, model.layers, world_size)
    dp_lo = max(1, -(-world_size // (tp_hi * pp_hi * max(1, max_cp))))
    least_mbs = min(search.micro_batch_sizes) if search.micro_batch_sizes else 1  # null: 1
    return -(-search.global_batch_size // (least_mbs * dp_lo))


def check_search(limits: LimitsConfig, search, model, world_size: int, max_cp: int) -> None:
    """ConfigError when a search's layouts may walk more micro-batches than the limit."""
    check_limit(limits, "max_micro_batches",
                search_micro_batches(search, model, world_size, max_cp),
                f"search.global_batch_size={search.global_batch_size}",
                "micro-batches per iteration (global batch / smallest micro-batch size / fewest "
                "data-parallel replicas)")


def check_train(limits: LimitsConfig, layout, key: str, dynamic: bool) -> None:
    """ConfigError when train's layout walks more micro-batches per iteration than the limit,
    or (`dynamic`: the dynamic planner in normal mode) splits more samples per data-parallel
    rank. `key`: the override that set the batch."""
    check_limit(limits, "max_micro_batches", layout.num_micro_batches, key,
                "micro-batches per iteration")
    if dynamic:
        check_limit(limits, "max_dynamic_samples",
                    layout.micro_batch_size * layout.num_micro_batches, key,
                    "samples per data-parallel rank for the dynamic planner each iteration "
                    "(or search.fast_mode=true: about linear)")


# ---------------------------------------------------------------- trace
def trace_layer_passes(layout, all_ranks: bool) -> int:
    """Layer passes a trace of `layout` records: per traced rank, micro-batches x (its stage's
    layers + 1), summed over the representatives (one per stage) or every rank."""
    per_replica = layout.num_micro_batches * (sum(layout.layers_per_stage) + layout.pp)
    return per_replica * (layout.world_size // layout.pp if all_ranks else 1)


def check_trace(limits: LimitsConfig, layouts: Iterable, all_ranks: bool) -> None:
    """ConfigError when a trace's configurations (their layouts) walk more micro-batches than
    the limit, trace more ranks, or would write more than limits.max_trace_GiB (estimated:
    TRACE_BYTES_PER_LAYER_PASS per layer pass)."""
    layouts = list(layouts)
    for lay in layouts:
        check_limit(limits, "max_micro_batches", lay.num_micro_batches,
                    f"trace.global_batch_size at [{lay.world_size}, {lay.pp}, {lay.tp}]",
                    "micro-batches per iteration")
    ranks = sum(lay.world_size if all_ranks else lay.pp for lay in layouts)
    key = "trace.all_ranks=true" if all_ranks else "trace.configs"
    check_limit(limits, "max_traced_ranks", ranks, key,
                "ranks to trace" + ("" if all_ranks else " (one per pipeline stage)"))
    passes = sum(trace_layer_passes(lay, all_ranks) for lay in layouts)
    n_bytes = passes * TRACE_BYTES_PER_LAYER_PASS
    check_limit(limits, "max_trace_GiB", n_bytes / GiB, key, "GiB of trace files (estimated)")


# ---------------------------------------------------------------- profiles, sweeps
def check_profile_points(limits: LimitsConfig, points: int, key: str) -> None:
    """ConfigError when profile_model would measure more (length, TP) points than the limit
    (`key`: what sets their number)."""
    check_limit(limits, "max_profile_points", points, key,
                "(sequence length, TP degree) points to profile")


def check_message_size(limits: LimitsConfig, max_size_bytes: Optional[int]) -> None:
    """ConfigError when profile_hardware's largest message is above limits.max_message_GiB."""
    if max_size_bytes is not None:
        check_limit(limits, "max_message_GiB", max_size_bytes / GiB,
                    f"profile_hardware.max_size_bytes={max_size_bytes}",
                    "GiB per message (two buffers of it per rank)")


def check_sweep_points(limits: LimitsConfig, points: int, keys: str) -> None:
    """ConfigError when a `-m` sweep (over `keys`) has more points than the limit."""
    check_limit(limits, "max_sweep_points", points, f"-m {keys}",
                "points in the sweep (each a run and its folder)")
