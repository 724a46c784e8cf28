"""Variable-length samples for `stage=train` (train.microbatching = dynamic | padded | packed):
each iteration's sample lengths on every data-parallel rank, its plan (planner/dynamic.py, one
step ahead on a background thread so the ranks never wait for it), and the micro-batches'
tensors.

Every rank plans every dp rank's samples from the same deterministic lengths, so all ranks hold
the same plan without exchanging it, and the global count of real (non-padded) tokens that the
loss is averaged over is known everywhere.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Microbatching
from orchestrator.layout import ParallelLayout
from orchestrator.planner.dynamic import (ExecutionPlan, MicroBatchCosts, packed_plan,
                                          padded_plan, plan_iteration)

GiB = float(1 << 30)


@dataclass(frozen=True)
class Iteration:
    """One step's samples and plan: lengths[r] (tokens) of dp rank r's samples, in data order;
    total_tokens, the real targets of the whole global batch (skipped samples excluded)."""

    step: int
    lengths: Tuple[np.ndarray, ...]
    plan: ExecutionPlan
    total_tokens: int

    @property
    def total_rows(self) -> int:
        """The rows (sequences as the model sees them: a packed row is one) of the whole
        global batch, over every dp rank: a mixture-of-experts model's balance loss is a mean
        over them."""
        plan = self.plan
        return sum(len(rows) or mb.size for r, rank in enumerate(plan.micro_batches)
                   for mb, rows in zip(rank, _rows(plan, r)))

    def record(self) -> Dict[str, Any]:
        """What the run summary keeps of the plan (predicted_ms; measured_ms is added later):
        per dp rank its micro-batches as [sequences, padded_len, recompute, packed rows] and its
        extra warm-up."""
        plan = self.plan
        micro_batches = [[[mb.size, mb.padded_len, mb.recompute, len(rows)]
                          for mb, rows in zip(rank, _rows(plan, r))]
                         for r, rank in enumerate(plan.micro_batches)]
        return {"step": self.step, "kind": plan.kind, "mode": plan.mode,
                "planning_ms": plan.planning_ms,
                "predicted_ms": plan.iteration_time_us / 1e3,
                "predicted_peak_MiB": max(plan.stage_peak_memory_bytes) / 2**20,
                "real_tokens": self.total_tokens,
                # A packed micro-batch computes rows x padded_len tokens, a padded one
                # sequences x padded_len.
                "padded_tokens": sum((rows or size) * padded for rank in micro_batches
                                     for size, padded, _, rows in rank),
                "micro_batches": micro_batches,
                # eager 1F1B's extra warm-up forwards per dp rank (0: plain 1F1B)
                "extra_warmup": [plan.extra_warmup_of(r) for r in range(len(micro_batches))],
                "skipped": [list(x) for x in plan.skipped]}


def _rows(plan: ExecutionPlan, rank: int) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """The packed rows of each of dp rank `rank`'s micro-batches (() for a padded one)."""
    rows = plan.packed_rows[rank] if plan.packed_rows else ()
    return tuple(rows) + ((),) * (len(plan.micro_batches[rank]) - len(rows))


class IterationPlanner:
    """Plans iteration `step` for every dp rank: the lengths come from the data (seed, step,
    sample index), the plan from the dynamic planner or one of its baselines."""

    def __init__(self, kind: Microbatching, layout: ParallelLayout, data, distribution,
                 model_cost, hardware, budget_bytes: float, max_seq_len: int,
                 fast_mode: Optional[bool]):
        self.kind = Microbatching.parse(kind)
        self.layout, self.data, self.distribution = layout, data, distribution
        self.model, self.hardware = model_cost, hardware
        self.budget_bytes, self.max_seq_len = budget_bytes, max_seq_len
        self.fast_mode = fast_mode
        self.samples_per_rank = layout.micro_batch_size * layout.num_micro_batches
        self.costs = MicroBatchCosts(layout, model_cost, hardware)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")

    def lengths(self, step: int) -> Tuple[np.ndarray, ...]:
        n = self.samples_per_rank
        return tuple(self.data.sample_lengths(step, r * n, n, self.distribution)
                     for r in range(self.layout.dp))

    def plan(self, step: int) -> Iteration:
        lengths = self.lengths(step)
        args = ([x.tolist() for x in lengths], self.layout, self.model, self.hardware,
                self.budget_bytes)
        kwargs = dict(max_seq_len=self.max_seq_len, costs=self.costs)
        if self.kind == Microbatching.dynamic:
            plan = plan_iteration(*args, fast_mode=self.fast_mode, on_bad="skip", **kwargs)
        elif self.kind == Microbatching.padded:
            plan = padded_plan(*args, **kwargs)
        else:
            plan = packed_plan(*args, **kwargs)
        skipped = {(rank, index) for rank, index, _, _ in plan.skipped}
        total = sum(int(n) for r, x in enumerate(lengths) for i, n in enumerate(x)
                    if (r, i) not in skipped)
        return Iteration(step, lengths, plan, total)

    def submit(self, step: int) -> Future:
        """Plan `step` on the background thread (numpy releases the GIL for its loops)."""
        return self._pool.submit(self.plan, step)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def rank_inputs(iteration: Iteration, data, dp_rank: int, samples_per_rank: int) -> List[Any]:
    """dp rank `dp_rank`'s micro-batches as the engine runs them (MicroBatchInput: tokens and
    targets with padding ignored), in the plan's order. A packed micro-batch's rows hold their
    samples back to back, with the segments that keep each sample's attention and positions
    its own (data.packed_segments); every pipeline stage builds the same from the plan."""
    from orchestrator.train.data import micro_batch_tensors, packed_segments, packed_tensors
    from orchestrator.train.executor import MicroBatchInput

    plan = iteration.plan
    lengths = iteration.lengths[dp_rank]
    first = dp_rank * samples_per_rank
    index = sorted({s for mb in plan.micro_batches[dp_rank] for s in mb.samples})
    cut = data.varlen_windows(iteration.step, [first + s for s in index],
                              [int(lengths[s]) for s in index])
    windows = dict(zip(index, cut))
    out = []
    for mb, rows in zip(plan.micro_batches[dp_rank], _rows(plan, dp_rank)):
        segments = None
        if rows:
            tokens, targets = packed_tensors(windows, rows, mb.padded_len)
            segments = packed_segments([[len(windows[s]) - 1 for s in row] for row in rows],
                                       mb.padded_len)
        else:
            tokens, targets = micro_batch_tensors(windows, mb)
        out.append(MicroBatchInput(tokens, targets, mb.recompute, segments=segments))
    return out


def empty_ranks(plan: ExecutionPlan) -> List[int]:
    """dp ranks the plan gives no micro-batch (every sample skipped)."""
    return [r for r, mbs in enumerate(plan.micro_batches) if not mbs]


def budget_bytes(budget_GiB: float, reserve_fraction: float, reserve_GiB: float) -> float:
    """What the planner may fill per device: the budget minus the search's reserve rule."""
    from orchestrator.planner.cost_model import memory_reserve_GiB

    return (budget_GiB - memory_reserve_GiB(budget_GiB, reserve_fraction, reserve_GiB)) * GiB


def summarize(records: Sequence[Dict[str, Any]], timed_from: int) -> Dict[str, Any]:
    """Medians over the timed iterations (step > timed_from, else all): predicted and measured
    iteration time (ms), their relative error, planning time; skipped samples over the run."""
    import statistics

    timed = [r for r in records if r["step"] > timed_from and "measured_ms" in r] or \
        [r for r in records if "measured_ms" in r]

    def median(key):
        return statistics.median(r[key] for r in timed) if timed else None
    errors = [(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in timed
              if r["measured_ms"] > 0]
    return {"iterations": len(records), "timed": len(timed),
            "predicted_ms": median("predicted_ms"), "measured_ms": median("measured_ms"),
            "error": statistics.median(errors) if errors else None,
            "planning_ms": median("planning_ms"),
            "real_tokens": sum(r["real_tokens"] for r in records),
            "padded_tokens": sum(r["padded_tokens"] for r in records),
            "skipped_samples": sum(len(r["skipped"]) for r in records)}


def with_fast_mode(kind: Microbatching, fast: bool) -> Optional[bool]:
    """search.fast_mode=true forces fast mode; false leaves ORCHESTRATOR_FAST_MODE to decide."""
    return True if fast and kind == Microbatching.dynamic else None

