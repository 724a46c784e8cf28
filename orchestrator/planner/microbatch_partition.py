"""The exact partition of a length-sorted batch into micro-batches (planner/dynamic.py's
"Partition"): a dynamic programme over split points per candidate bound on the slowest
micro-batch, thresholds refined until no gap between them can win."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from orchestrator.planner.microbatch_costs import (Candidates)


# ====================================================================== partition
def _min_sum(t_us: np.ndarray, taus: np.ndarray, groups: int):
    """For each bound tau: the least sum of t over partitions of [0, n) into runs with t <= tau
    whose count is a multiple of `groups` (dp[T, n + 1, groups], state = count mod groups).
    Returns (sums[T], dp)."""
    n = t_us.shape[0] - 1
    dp = np.full((len(taus), n + 1, groups), np.inf)
    dp[:, 0, 0] = 0.0
    by_end = t_us.T  # by_end[j, i] = t[i, j]: the runs ending at j, contiguous
    one_more = (np.arange(groups) - 1) % groups  # a run more: count mod groups + 1
    for j in range(1, n + 1):
        finite = np.flatnonzero(np.isfinite(by_end[j, :j]))
        if not len(finite):
            continue
        lo = finite[0]  # long runs do not fit memory: skip them
        t = by_end[j, lo:j]
        masked = np.where(t[None, :] <= taus[:, None], t[None, :], np.inf)
        best = (dp[:, lo:j, :] + masked[:, :, None]).min(axis=1)
        dp[:, j, :] = best[:, one_more]
    return dp[:, n, 0], dp


def _spread(first: int, last: int, count: int) -> List[int]:
    """Up to `count` indices evenly spread over [first, last], both ends included."""
    return sorted(set(np.linspace(first, last, max(1, min(count, last - first + 1)))
                      .round().astype(int).tolist()))


def _token_splits(sorted_padded: np.ndarray, count: int) -> np.ndarray:
    """At most 2 * (count + 1) split positions in [0, n]: cuts into runs of about equal tokens
    (long samples get positions of their own, short ones are grouped) and evenly spread ones."""
    prefix = np.concatenate([[0], np.cumsum(sorted_padded)])
    cuts = np.searchsorted(prefix, np.linspace(0, prefix[-1], count + 1), side="left")
    # And evenly by count, so runs of many short samples can still be split.
    return np.unique(np.concatenate([cuts, _spread(0, len(sorted_padded), count + 1)]))


def _open_intervals(sums: np.ndarray, taus: np.ndarray, fill_drain: float,
                    best: float) -> List[Tuple[float, int, int]]:
    """(lower bound, a, b) of each gap between evaluated thresholds a < b that could still beat
    `best`: sums only fall as tau grows, so inside (a, b) the objective is at least
    sums[b] + fill_drain * taus[a + 1]."""
    done = np.flatnonzero(~np.isnan(sums))
    gaps = []
    for a, b in zip(done, done[1:]):
        if b - a > 1:
            lower = sums[b] + fill_drain * taus[a + 1]
            if lower < best:
                gaps.append((float(lower), int(a), int(b)))
    return sorted(gaps)


def partition(cands: Candidates, fill_drain: float, groups: int = 1, batch: int = 16,
              fast: bool = False) -> Tuple[float, List[Tuple[int, int]]]:
    """Minimum of sum_i t_i + fill_drain * max_i t_i over partitions of the sorted batch into
    runs [i, j) (count a multiple of `groups`); returns (objective_us, runs), (inf, []) when no
    partition fits. The bound tau on the max is searched over the candidate times: `batch`
    spread thresholds first, then the gaps whose lower bound can still win, until none is left
    (exact). fast: the first `batch` thresholds only."""
    t = cands.t_us
    n = t.shape[0] - 1
    if n == 0:
        return 0.0, []
    finite = np.unique(t[np.isfinite(t)])
    # Every sample k sits in some run [i, j) with i <= k < j: the max is at least the fastest.
    later = np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1]  # later[i, j]: min over j' >= j
    floor = np.minimum.accumulate(later[:n, 1:], axis=0)[np.arange(n), np.arange(n)].max()
    taus = finite[finite >= floor] if fill_drain > 0 else finite[-1:]
    if not len(taus):
        return np.inf, []
    sums = np.full(len(taus), np.nan)
    best, best_k, best_dp = np.inf, -1, None
    pick = _spread(0, len(taus) - 1, batch)
    while pick:
        found, dp = _min_sum(t, taus[pick], groups)
        sums[pick] = found
        objective = found + fill_drain * taus[pick]
        k = int(np.argmin(objective))
        if objective[k] < best:
            best, best_k, best_dp = float(objective[k]), pick[k], dp[k]
        if fast:
            break
        gaps = _open_intervals(sums, taus, fill_drain, best)
        share = max(1, batch // max(1, len(gaps)))
        pick = sorted({x for _, a, b in gaps[:batch] for x in _spread(a + 1, b - 1, share)})
    if best_k < 0:
        return np.inf, []
    return best, _backtrack(t, taus[best_k], groups, best_dp)


def _backtrack(t_us: np.ndarray, tau: float, groups: int,
               dp: np.ndarray) -> List[Tuple[int, int]]:
    """The runs of the least-sum partition under bound tau (dp: _min_sum's for tau)."""
    masked = np.where(t_us <= tau, t_us, np.inf)
    runs, j, c = [], t_us.shape[0] - 1, 0
    while j > 0:
        prev = (c - 1) % groups
        i = int(np.argmin(dp[:j, prev] + masked[:j, j]))
        runs.append((i, j))
        j, c = i, prev
    return runs[::-1]
