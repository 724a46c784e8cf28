"""The order in which a pipeline stage runs its forwards and backwards: what the engine executes
(train/executor.py walks it; torch's Schedule1F1B / ScheduleInterleaved1F1B run the same order
for equal micro-batches), what the planner's simulation times and what the memory model
(workload/memory.py) walks to find a stage's peak."""
from __future__ import annotations

from typing import List, Optional, Tuple

from orchestrator.choices import Schedule


def interleave_group(pp: int, num_micro_batches: int, group: Optional[int] = None) -> int:
    """The interleaved schedule's micro-batches per round through a chunk (Megatron-LM's
    --microbatch-group-size-per-vp-stage N; None: pp, its default and the depth-first
    schedule); ValueError where Megatron refuses it (forward_backward_pipelining_with_
    interleaving): N outside [pp, m], or a last round of 1 to pp - 1 micro-batches."""
    m = num_micro_batches
    n = pp if group is None else group
    if not pp <= n <= max(m, pp):
        raise ValueError(f"interleaved schedule: micro-batch group {n} must lie in "
                         f"[pp({pp}), num_micro_batches({m})]")
    if 0 < m % n < pp:
        raise ValueError(f"interleaved schedule: num_micro_batches({m}) % group({n}) = "
                         f"{m % n}, a remainder below pp({pp}): a last round that short "
                         f"stalls the pipeline")
    return n


def stage_order(pp: int, stage: int, num_micro_batches: int,
                schedule: Schedule = Schedule["1f1b"],
                virtual_stages: int = 1, extra_warmup: int = 0,
                group: Optional[int] = None) -> List[Tuple[str, int, int]]:
    """The operations of `stage` in execution order: ("F" | "B", chunk, micro_batch).

    1F1B: min(p - stage - 1, m) warm-up forwards, then forward/backward pairs, then the
    remaining backwards. extra_warmup e (1F1B only; the dynamic planner's eager 1F1B): stage s
    runs min(e, p - s - 1) more warm-up forwards, so up to p - s + e micro-batches are in flight
    and a long micro-batch's backward waits less on the stages after it; e = p - 1 is the order
    of DynaPipe's cyclic schedule. The warm-up never grows along the pipeline, so every stage's
    next operation eventually has its input (no deadlock). Interleaved (Megatron,
    schedules.py: get_schedule_table, get_pp_rank_microbatches): micro-batches go in rounds of
    N = `group` (interleave_group; default p) through chunk 0, 1, ..., v-1 (backwards through
    v-1, ..., 0), the last round taking the rest, with (p - stage - 1) * 2 + (v - 1) * N warm-up
    forwards (all m v when that is more)."""
    m, v, p = num_micro_batches, virtual_stages, pp
    if extra_warmup < 0 or (extra_warmup and schedule != Schedule["1f1b"]):
        raise ValueError(f"extra_warmup must be >= 0, and 0 unless schedule=1f1b, got "
                         f"{extra_warmup} with {schedule}")
    if schedule == Schedule["1f1b"]:
        if v != 1:
            raise ValueError(f"1f1b has virtual_stages 1, got {v}")
        warmup = min(p - stage - 1 + min(extra_warmup, p - stage - 1), m)
        fwd = [("F", 0, i) for i in range(m)]
        bwd = [("B", 0, i) for i in range(m)]
    elif schedule == Schedule.interleaved:
        if group is None and m % p:
            raise ValueError(f"interleaved schedule: num_micro_batches({m}) % pp({p}) != 0")
        n = interleave_group(p, m, group)
        total = m * v
        warmup = min((p - stage - 1) * 2 + (v - 1) * n, total)
        table = [(chunk, mb) for first in range(0, m, n)
                 for chunk in range(v) for mb in range(first, min(first + n, m))]
        fwd = [("F", chunk, mb) for chunk, mb in table]
        bwd = [("B", v - 1 - chunk, mb) for chunk, mb in table]
    else:
        raise ValueError(f"schedule must be one of {tuple(Schedule)}, got {schedule!r}")
    order = fwd[:warmup]
    steady = len(fwd) - warmup
    for i in range(steady):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[steady:])
    return order
