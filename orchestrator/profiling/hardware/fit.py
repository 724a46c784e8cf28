"""Alpha-beta fit of collective times:

    time_us(size_bytes) = alpha_us + size_bytes / (algbw_GBps * 1e3)

The fit minimises the squared *relative* error, so a 1 KiB point measured in tens of microseconds
weighs as much as a 256 MiB point measured in tens of milliseconds (an absolute least-squares fit
would ignore every small size). Both parameters are kept non-negative (scipy's NNLS).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from orchestrator.bandwidth import half_allreduce_line  # noqa: F401 (re-exported)
from orchestrator.profiling.measure import nonneg_rel_lsq

# Slowest and fastest bandwidth a fit may return (GB/s): a flat curve (time not growing with size,
# e.g. a sweep of latency-bound sizes only) has no measurable bandwidth; report a huge but finite
# one so JSON stays valid and predictions stay latency-only.
MAX_ALGBW_GBps = 1e9


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted line: latency alpha_us (us), algorithm bandwidth algbw_GBps (GB/s), and the largest
    relative error |pred - measured| / measured over the points it was fitted on."""

    alpha_us: float
    algbw_GBps: float
    max_rel_err: float

    def time_us(self, size_bytes: float) -> float:
        return predict_time_us(self.alpha_us, self.algbw_GBps, size_bytes)


def predict_time_us(alpha_us: float, algbw_GBps: float, size_bytes: float) -> float:
    """Time in us of moving `size_bytes` under the alpha-beta model."""
    return alpha_us + size_bytes / (algbw_GBps * 1e3)


def predict_fit_time_us(fit: Mapping, size_bytes: float) -> float:
    """Time in us predicted by a schema fit record ({"alpha_us", "algbw_GBps", ...})."""
    return predict_time_us(fit["alpha_us"], fit["algbw_GBps"], size_bytes)


def fit_alpha_beta(size_bytes: Sequence[float], time_us: Sequence[float]) -> AlphaBeta:
    """Fit time_us = alpha_us + size_bytes / (algbw_GBps * 1e3) to measured points.

    Returns alpha_us (us, >= 0), algbw_GBps (GB/s, > 0; capped at MAX_ALGBW_GBps when times do not
    grow with size) and max_rel_err over the points. Needs at least one point with positive time;
    with a single size, alpha_us is 0.
    """
    s = np.asarray(size_bytes, dtype=np.float64)
    t = np.asarray(time_us, dtype=np.float64)
    if s.shape != t.shape or s.ndim != 1 or len(s) == 0:
        raise ValueError(f"need matching 1-D sizes and times, got {s.shape} and {t.shape}")
    if np.any(t <= 0) or np.any(s < 0):
        raise ValueError("times must be positive and sizes non-negative to fit alpha-beta")
    if len(np.unique(s)) == 1 and s[0] > 0:
        # One size cannot separate latency from bandwidth: take the time as all transfer.
        alpha, beta = 0.0, float(nonneg_rel_lsq(s[:, None], t)[0])
    else:
        alpha, beta = nonneg_rel_lsq(np.stack([np.ones_like(s), s], axis=1), t)  # us, us per byte
    beta = max(beta, 1.0 / (MAX_ALGBW_GBps * 1e3))
    algbw = 1.0 / (beta * 1e3)
    pred = alpha + s * beta
    max_rel_err = float(np.max(np.abs(pred - t) / t))
    return AlphaBeta(alpha_us=float(alpha), algbw_GBps=float(algbw), max_rel_err=max_rel_err)


def fit_points(points: Iterable[Mapping]) -> list:
    """Schema fit records, one per (op, group_size, layout) found in schema `points`, in first-seen
    order: {"op", "group_size", "layout", "alpha_us", "algbw_GBps", "max_rel_err"}."""
    series: dict = {}
    for p in points:
        key = (p["op"], p["group_size"], p["layout"])
        series.setdefault(key, ([], []))
        series[key][0].append(p["size_bytes"])
        series[key][1].append(p["time_us_median"])
    fits = []
    for (op, group_size, layout), (sizes, times) in series.items():
        ab = fit_alpha_beta(sizes, times)
        fits.append({"op": op, "group_size": group_size, "layout": layout,
                     "alpha_us": ab.alpha_us, "algbw_GBps": ab.algbw_GBps,
                     "max_rel_err": ab.max_rel_err})
    return fits


def held_out_rel_err(size_bytes: Sequence[float], time_us: Sequence[float]) -> float:
    """Largest relative error predicting every other point (odd indices, sorted by size) from a fit
    on the rest: a check that the model interpolates, not just that it fits."""
    order = np.argsort(np.asarray(size_bytes, dtype=np.float64))
    s = np.asarray(size_bytes, dtype=np.float64)[order]
    t = np.asarray(time_us, dtype=np.float64)[order]
    if len(s) < 3:
        raise ValueError("need at least 3 points to hold some out")
    train = np.arange(len(s)) % 2 == 0
    ab = fit_alpha_beta(s[train], t[train])
    pred = ab.alpha_us + s[~train] / (ab.algbw_GBps * 1e3)
    return float(np.max(np.abs(pred - t[~train]) / t[~train]))
