"""Dynamic plans of a mixture-of-experts model whose expert-parallel groups span data-parallel
ranks: every MoE layer's forward exchanges tokens (all-to-all) with the other ranks of its
EP (and ETP) group, and full recompute exchanges them again in the backward. So the dp ranks of
one group run as many micro-batches, full recompute at the same positions and the same pipeline
warm-up (the same collectives in the same order), though each micro-batch keeps its own
samples, size and length.

lockstep_groups() says which dp ranks run together; align() brings one plan's micro-batches to
that (micro-batches split where a rank has fewer, merged where it cannot split enough, full
recompute where any rank of the group has it, the least warm-up).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from orchestrator.choices import Recompute, Schedule
from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout
from orchestrator.planner.terms import MODE_CODES

Rows = Tuple[Tuple[int, ...], ...]  # a micro-batch's packed rows (() : one sample per row)


def lockstep_groups(layout: ParallelLayout, moe: bool) -> List[Tuple[int, ...]]:
    """The dp ranks that must run their micro-batches in lockstep (a MoE model's expert groups,
    etp x ep consecutive ranks of a stage, joining the dp ranks whose tp x cp ranks they
    cover), each group ascending; only groups of more than one dp rank."""
    if not moe or layout.ep * layout.etp == 1:
        return []
    per_dp, per_group = layout.tp * layout.cp, layout.etp * layout.ep
    parent = list(range(layout.dp))

    def root(d: int) -> int:
        while parent[d] != d:
            d = parent[d]
        return d
    first_of_group = {}
    for rank in range(per_dp * layout.dp):
        d, g = rank // per_dp, rank // per_group
        other = first_of_group.setdefault(g, d)
        parent[root(d)] = root(other)
    groups = {}
    for d in range(layout.dp):
        groups.setdefault(root(d), []).append(d)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def _rows(mb, rows: Rows) -> int:
    """A micro-batch's rows (sequences as the engine runs them)."""
    return len(rows) or mb.size


def _split(mb, rows: Rows):
    """Two micro-batches of about half the rows each (same length and recompute)."""
    half = _rows(mb, rows) // 2
    if rows:
        parts = (rows[:half], rows[half:])
        return [(type(mb)(tuple(s for row in part for s in row), mb.padded_len, mb.recompute),
                 part) for part in parts]
    return [(type(mb)(mb.samples[:half], mb.padded_len, mb.recompute), ()),
            (type(mb)(mb.samples[half:], mb.padded_len, mb.recompute), ())]


def _merge(a, rows_a: Rows, b, rows_b: Rows):
    """One micro-batch of both, padded to the longer, the stronger recompute: rows kept
    packed when either is packed (each padded sample its own row otherwise)."""
    mode = max(a.recompute, b.recompute, key=MODE_CODES.__getitem__)
    merged = type(a)(a.samples + b.samples, max(a.padded_len, b.padded_len), mode)
    if rows_a or rows_b:
        rows = ((rows_a or tuple((s,) for s in a.samples))
                + (rows_b or tuple((s,) for s in b.samples)))
        return merged, rows
    return merged, ()


def _to_count(mbs: List, rows: List[Rows], count: int) -> None:
    """Split the micro-batch of the most rows (merge the two of the fewest, neighbours in
    execution order) until there are `count`, in place."""
    while len(mbs) < count:
        i = max(range(len(mbs)), key=lambda k: _rows(mbs[k], rows[k]))
        (a, ra), (b, rb) = _split(mbs[i], rows[i])
        mbs[i:i + 1], rows[i:i + 1] = [a, b], [ra, rb]
    while len(mbs) > count:
        i = min(range(len(mbs) - 1),
                key=lambda k: _rows(mbs[k], rows[k]) + _rows(mbs[k + 1], rows[k + 1]))
        mb, r = _merge(mbs[i], rows[i], mbs[i + 1], rows[i + 1])
        mbs[i:i + 2], rows[i:i + 2] = [mb], [r]


def align(layout: ParallelLayout, groups: Sequence[Tuple[int, ...]], micro_batches, packed_rows,
          extra_warmup) -> Tuple[List[List], List[List[Rows]], List[int], List[int]]:
    """(micro_batches, packed_rows, extra_warmup, changed ranks) per dp rank with every group
    in lockstep: as many micro-batches as its rank with the most (fewer where a rank has fewer
    rows than that: its least, a multiple of pp under interleaving), full recompute at every
    position where a rank of the group has it, the group's least eager 1F1B warm-up.
    ConfigError when a group cannot run the micro-batches the schedule needs; a group with an
    empty rank is left as it is."""
    mbs = [list(x) for x in micro_batches]
    rows = [list(x) if x else [()] * len(mbs[r]) for r, x in enumerate(packed_rows)]
    extra = list(extra_warmup) if extra_warmup else [0] * len(mbs)
    changed = set()
    step = layout.pp if layout.schedule == Schedule.interleaved else 1
    for group in groups:
        count = max(len(mbs[r]) for r in group)
        most = min(sum(_rows(mb, rw) for mb, rw in zip(mbs[r], rows[r])) for r in group)
        count = min(count, most // step * step)
        if any(not mbs[r] for r in group):
            continue  # a rank with no sample: the iteration is skipped (train's empty_ranks)
        if count < 1:
            raise ConfigError(f"dp ranks {list(group)} share expert-parallel groups and must "
                              f"run as many micro-batches, but one has too few samples "
                              f"({most} rows; the schedule needs a multiple of {step}): use "
                              f"train.microbatching=fixed or more samples per rank")
        for r in group:
            if len(mbs[r]) != count:
                _to_count(mbs[r], rows[r], count)
                changed.add(r)
        full = {i for r in group for i, mb in enumerate(mbs[r]) if mb.recompute == Recompute.full}
        warmup = min(extra[r] for r in group)
        for r in group:
            for i in full:
                if mbs[r][i].recompute != Recompute.full:
                    mb = mbs[r][i]
                    mbs[r][i] = type(mb)(mb.samples, mb.padded_len, Recompute.full)
                    changed.add(r)
            if extra[r] != warmup:
                extra[r] = warmup
                changed.add(r)
    return mbs, rows, extra, sorted(changed)
