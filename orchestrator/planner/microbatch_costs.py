"""Per-micro-batch pricing for dynamic micro-batching: the cost model's own StageCosts
(cost_model.py) evaluated on many micro-batches at once, each of b sequences (rows) padded to
s tokens under a recompute mode (StageCosts.at: its terms as arrays over the micro-batches;
each sequence split over the CP ranks as the layout's own), so for m equal micro-batches the
plan's time and memory equal evaluate(simulate=True)'s. What does not depend on the micro-batch
(static memory, gradient sync, optimizer step) is the layout's own StageCosts'. Below: the
candidate micro-batches the partition chooses from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import (ConfigKey, CostOptions, StageCosts,
                                             check_layout_for_model)
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.schedule import in_flight_micro_batches


@dataclass(frozen=True)
class PricedMicroBatches:
    """K micro-batches priced on p stages; arrays [p, K] (us or bytes).

    fwd_us / bwd_us: per-stage forward / backward (recompute included) without pipeline sends
    (what simulate() takes); boundary_us: one send across boundary j -> j+1 (row p - 1: the
    interleaved wrap-around); stage_time_us: forward + backward with the stage's sends (the
    cost model's t_j); stored_bytes: activations one in-flight micro-batch keeps on the stage;
    extra_bytes: what it needs on top while it runs (the layer being recomputed, the LM head's
    activations on the last stage, the TP gathered activation); sync_window_us: the backward
    (recompute excluded) that hides the gradient sync when it is the stage's last."""

    fwd_us: np.ndarray
    bwd_us: np.ndarray
    boundary_us: np.ndarray
    stage_time_us: np.ndarray
    stored_bytes: np.ndarray
    extra_bytes: np.ndarray
    sync_window_us: np.ndarray

    def take(self, index) -> "PricedMicroBatches":
        """The micro-batches at `index` (columns), in that order."""
        return PricedMicroBatches(*(getattr(self, f)[:, index] for f in self.__dataclass_fields__))


class MicroBatchCosts:
    """Prices micro-batches of one (layout, model, hardware): built once, then price(b, s, mode)
    on arrays of any length. The layout's micro_batch_size and recompute are not used (each
    micro-batch brings its own)."""

    def __init__(self, layout: ParallelLayout, model: ModelCost, hardware: HardwareModel,
                 options: CostOptions = CostOptions()):
        check_layout_for_model(layout, model)
        self.layout, self.model, self.hardware, self.options = layout, model, hardware, options
        self.whole = whole = StageCosts(ConfigKey.of(layout), model, hardware, model.seq_len,
                                        options)
        self.stages = np.arange(layout.pp)
        self.n = np.array(layout.layers_per_stage, dtype=float)[:, None]  # a column [p, 1]
        j, n = self.stages, self.n[:, 0]
        self.static_bytes = whole.fixed_bytes(j, n)
        self.tail_bytes = whole.tail_bytes(j, n)
        self.sync_parts_us = whole.dp_sync_parts_us(j, n)
        self.optimizer_us = whole.optimizer_us(j, n)
        # a stage's most micro-batches in flight, however many the rank runs
        self.in_flight = in_flight_micro_batches(layout.schedule, layout.pp, 1 << 30,
                                                 layout.virtual_stages)

    def price(self, b, s, mode_code) -> PricedMicroBatches:
        """Price K micro-batches: b[k] sequences padded to s[k] tokens, recompute
        mode_code[k] (terms.MODE_CODES: 0 none, 1 selective, 2 full) on every layer of every
        stage."""
        costs = self.whole.at(b, s)
        code = np.asarray(mode_code)
        j, n = self.stages, self.n
        k = len(code)
        fwd = costs.stage_fwd_us(j, n, sends=False)
        bwd = costs.stage_bwd_us(j, n, code, n, sends=False)  # full: every layer
        stored, extra = costs.micro_batch_bytes(n, code)
        shape = (self.layout.pp, k)
        return PricedMicroBatches(
            fwd_us=fwd, bwd_us=bwd, boundary_us=costs.boundary_us,
            stage_time_us=fwd + bwd + costs.sends.fwd_us + costs.sends.bwd_us,
            stored_bytes=np.broadcast_to(stored, shape).astype(float),
            extra_bytes=np.broadcast_to(extra, shape).astype(float),
            sync_window_us=np.broadcast_to(costs.sync_window_us(j, n), shape))

    def alone_bytes(self, priced: PricedMicroBatches) -> np.ndarray:
        """[p, K]: a stage's memory (bytes) if every in-flight micro-batch were this one (or its
        tail after the backward, when larger)."""
        return self.static_bytes[:, None] + np.maximum(
            self.in_flight[:, None] * priced.stored_bytes + priced.extra_bytes,
            self.tail_bytes[:, None])

    def tail_us(self, sync_window_us: np.ndarray) -> np.ndarray:
        """Per stage: exposed gradient sync after the last backward (whose window is given, 0
        with no micro-batch) + optimizer step + the sync after it (ZeRO 1/2's parameter
        all-gather in the orchestrator engine) (us)."""
        return (self.whole.dp_exposed_us(self.stages, self.n[:, 0], sync_window_us,
                                         self.sync_parts_us)
                + self.optimizer_us)


# ====================================================================== candidate runs
def padded_length(length, multiple: int, max_seq_len: int):
    """Length rounded up to `multiple`, never above max_seq_len (ints or numpy arrays)."""
    return np.minimum(-(-np.asarray(length) // multiple) * multiple, max_seq_len)


def pack_rows(lengths: Sequence[int], row_len: int) -> List[Tuple[int, ...]]:
    """Samples in the order given concatenated into rows of at most row_len tokens; a sample
    longer than what is left of a row starts a new row (no splitting). Returns each row's
    sample positions."""
    rows, row, used = [], [], 0
    for index, length in enumerate(lengths):
        if row and used + length > row_len:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(tuple(row))
    return rows


def row_counts(lengths: np.ndarray, row_len_by_end: np.ndarray,
               bounds: np.ndarray) -> np.ndarray:
    """[g, g] for the g ascending split positions `bounds` (in [0, n]): counts[a, c] =
    len(pack_rows(lengths[bounds[a]:bounds[c]], row_len_by_end[c])) for a < c (0 elsewhere;
    row_len_by_end[0] is unused). Exact, for every run at once: a row starting at sample k
    ends where the prefix sums pass its length, and the rows of [i, j) are the jumps from i
    that stay below j, counted by pointer doubling (O(g^2 log n))."""
    n = len(lengths)
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    # jump[c, k]: end of the row starting at k under row_len_by_end[c] (one sample at least).
    jump = np.searchsorted(prefix, prefix[None, :] + np.asarray(row_len_by_end)[:, None],
                           side="right") - 1
    jump = np.minimum(np.maximum(jump, np.arange(n + 1) + 1), n)
    levels = [jump]
    for _ in range(max(1, n.bit_length()) - 1):
        levels.append(np.take_along_axis(levels[-1], levels[-1], axis=1))
    g = len(bounds)
    cur = np.broadcast_to(bounds[None, :], (g, g)).copy()
    count = np.ones((g, g), dtype=np.int64)
    for level in range(len(levels) - 1, -1, -1):
        nxt = np.take_along_axis(levels[level], cur, axis=1)
        move = nxt < bounds[:, None]
        cur = np.where(move, nxt, cur)
        count += move.astype(np.int64) << level
    return np.where(bounds[:, None] < bounds[None, :], count.T, 0)


@dataclass(frozen=True)
class Candidates:
    """Every run [bounds[a], bounds[c]) of a sorted batch of n between split positions `bounds`
    (default all of 0..n), as the fastest micro-batch that fits: t_us[a, c] the bottleneck
    stage's forward + backward (inf: none fits or c <= a), mode[a, c] its recompute code,
    row_len[a, c] its rows' length (tokens) and rows[a, c] their count (as many as samples:
    one sample per row, padded; fewer: samples packed into rows)."""

    t_us: np.ndarray
    mode: np.ndarray
    row_len: np.ndarray
    rows: np.ndarray
    bounds: np.ndarray


def fastest_fitting(costs: MicroBatchCosts, b: np.ndarray, s: np.ndarray,
                    budget: float) -> Tuple[np.ndarray, np.ndarray]:
    """(t_us[K], mode[K]): each micro-batch's (b[k] rows of s[k] tokens) bottleneck time under
    the fastest recompute whose alone_bytes fit `budget` on every stage (inf, 0: none fits).
    Recompute only adds time, so modes are tried in order, each priced only where the
    previous did not fit."""
    t_us, mode = np.full(len(b), np.inf), np.zeros(len(b), dtype=np.int64)
    todo = np.arange(len(b))
    for code in range(3):
        if not len(todo):
            break
        priced = costs.price(b[todo], s[todo], np.full(len(todo), code))
        fits = (costs.alone_bytes(priced) <= budget).all(axis=0)
        t_us[todo[fits]] = priced.stage_time_us.max(axis=0)[fits]
        mode[todo[fits]] = code
        todo = todo[~fits]
    return t_us, mode


def price_candidates(costs: MicroBatchCosts, sorted_lengths: np.ndarray,
                     sorted_padded: np.ndarray, budget: float, max_seq_len: int,
                     bounds: Optional[np.ndarray] = None, pack: bool = True) -> Candidates:
    """Every run between split positions `bounds` (default 0..n) of the ascending lengths
    (sorted_padded: each rounded up), priced as its samples packed by pack_rows into rows of
    the run's padded length (at worst one sample per row: padded) or into rows of
    max_seq_len, whichever is faster; each row is priced as one sequence of its length
    (attention over the whole row: the model's packed rows keep each sample to itself with a
    dense block-diagonal causal mask, models/gpt.packed_rows, so they compute the whole row's
    scores, as priced). `pack` False: one sample per row, padded (layouts that cannot pack,
    dynamic.packs)."""
    n = len(sorted_padded)
    bounds = np.arange(n + 1) if bounds is None else np.asarray(bounds)
    g = len(bounds)
    a, c = np.triu_indices(g, k=1)
    own_len = sorted_padded[bounds[c] - 1]
    own_caps = np.concatenate([[0], sorted_padded[bounds[1:] - 1]])
    own_rows = (row_counts(sorted_lengths, own_caps, bounds)[a, c] if pack
                else bounds[c] - bounds[a])
    long_rows = row_counts(sorted_lengths, np.full(g, max_seq_len), bounds)[a, c]
    # Many runs share (rows, length): price each pair once.
    pairs, inverse = np.unique(own_rows * (max_seq_len + 1) + own_len, return_inverse=True)
    t_own, mode_own = fastest_fitting(costs, pairs // (max_seq_len + 1),
                                      pairs % (max_seq_len + 1), budget)
    t_long, mode_long = fastest_fitting(costs, np.arange(1, n + 1), np.full(n, max_seq_len),
                                        budget)
    t_own, mode_own = t_own[inverse], mode_own[inverse]
    t_long, mode_long = t_long[long_rows - 1], mode_long[long_rows - 1]
    use_long = (t_long < t_own) & pack
    out = [np.zeros((g, g), dtype=dtype) for dtype in (float, np.int64, np.int64, np.int64)]
    out[0][:] = np.inf
    for array, values in zip(out, (np.where(use_long, t_long, t_own),
                                   np.where(use_long, mode_long, mode_own),
                                   np.where(use_long, max_seq_len, own_len),
                                   np.where(use_long, long_rows, own_rows))):
        array[a, c] = values
    return Candidates(*out, bounds=bounds)
