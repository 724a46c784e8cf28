"""Fits of compute time against sequence length, so the search can price lengths never profiled.

A block is quadratic in the sequence length s (projections and MLP grow with s, attention with s^2):
    time_us(s) = c0 + c1 s + c2 s^2
The "other" parts (embedding, LM head, loss) are linear: time_us(s) = c0 + c1 s.

The fit minimises the squared *relative* error (a 128-token point measured in microseconds weighs as
much as a 32k-token point measured in milliseconds) and keeps every coefficient >= 0: a negative
c2 fitted to noise would predict negative times far outside the profiled range (scipy's NNLS).

Over a short range of lengths the s^2 term of a block is small next to noise, and a free quadratic
can miss it (or invent it). Points carry their exact FLOPs, themselves c0 + c1 s + c2 s^2 (dense
layers linear, attention quadratic), so a second candidate is time = a + k * flops(s): one rate
for all the block's work, still a quadratic in s. Both are fitted on all but the longest length
and judged on how well they predict it (the use: pricing longer lengths); the FLOP model is kept
unless the free quadratic's error there is under half of its own. The chosen one is refitted on
all points; "block_models" in the fits says which ("quadratic" or "flops").
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from orchestrator.profiling.measure import nonneg_rel_lsq
from orchestrator.store.schema.model import HOST_DEVICE_PARTS

BLOCK_KEYS = ("block_fwd_us", "block_bwd_us")
QUADRATIC_MARGIN = 0.5  # the free quadratic must validate this much better than the FLOP model
EXACT_REL_ERR = 1e-9  # relative errors below this are round-off: both models are exact
OTHER_KEYS = ("other_fwd_us", "other_bwd_us")
OPTIM_KEYS = ("block_optim_us", "other_optim_us")
# An analytic profile's train gradient add per micro-batch (its points' bytes at the sheet's
# HBM bandwidth), which a measured profile times inside the backward (timing.MainGrads)
GRAD_ADD_KEYS = ("block_grad_add_us", "other_grad_add_us")
# A point's block forward + backward under each recompute mode, by mode (timed by
# profiling/model/timing.py time_recompute: a CPU, tp 1).
RECOMPUTE_KEYS = {"selective": "block_selective_us", "full": "block_full_us"}


def predict_poly(coeffs: Sequence[float], seq_len: float) -> float:
    """sum(c_i * seq_len^i): time in us (or bytes) at `seq_len` from [c0, c1, ...]."""
    return float(sum(c * float(seq_len) ** i for i, c in enumerate(coeffs)))


def fit_poly_nonneg(seq_lens: Sequence[float], values: Sequence[float],
                    degree: int) -> Tuple[List[float], List[float]]:
    """Non-negative polynomial fit minimising the squared relative error.

    Returns ([c0, ..., c_degree], relative residuals (pred - value) / value per point). With fewer
    distinct lengths than coefficients, the highest powers are dropped (set to 0).
    """
    s = np.asarray(seq_lens, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.size == 0:
        raise ValueError(f"need matching, non-empty seq_lens and values, got {s.size} and {v.size}")
    if np.any(v <= 0):
        raise ValueError(f"values must be > 0 for a relative fit, got {v.tolist()}")
    degree = min(degree, len(np.unique(s)) - 1)
    scale = float(s.max())  # powers of s/scale keep the system well conditioned
    x = s / scale
    best = nonneg_rel_lsq(np.stack([x ** i for i in range(degree + 1)], axis=1), v)
    coeffs = [float(c / scale ** i) for i, c in enumerate(best)]
    resid = [(predict_poly(coeffs, si) - vi) / vi for si, vi in zip(s, v)]
    return coeffs, [float(r) for r in resid]


def _flops_fit(seq_lens, values, flops) -> Tuple[List[float], List[float]]:
    """time = a + k * flops(s), a, k >= 0, as [c0, c1, c2] in s, and relative residuals."""
    s = np.asarray(seq_lens, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    f = np.asarray(flops, dtype=np.float64)
    fscale = float(f.max())
    if len(np.unique(f)) < 2:  # one length: proportional to the work
        a, k = 0.0, float(np.mean(v / f))
    else:
        (a, k), _ = fit_poly_nonneg(f / fscale, v, 1)  # linear in flops
        k /= fscale
    # flops(s) = f1 s + f2 s^2 exactly (no work without tokens): two lengths split it into
    # the dense and the attention part, where a free polynomial through two points is a line
    # (no s^2 term: selective recompute, the attention core, was priced at nothing).
    f1, f2 = _per_sequence_flops(s, f)
    coeffs = [max(c, 0.0) for c in (a, k * f1, k * f2)]
    resid = [(predict_poly(coeffs, si) - vi) / vi for si, vi in zip(s, v)]
    return coeffs, [float(r) for r in resid]


def fit_block(seq_lens: Sequence[float], values: Sequence[float],
              flops: Optional[Sequence[float]] = None) -> Tuple[List[float], List[float], str]:
    """A block's time fit: ([c0, c1, c2], relative residuals, "quadratic" | "flops").

    With FLOPs per point and 4+ lengths, the candidate that predicts the longest length from the
    others (the FLOP model unless the quadratic halves its error) is refitted on all points;
    without FLOPs, or with 3 lengths, the free quadratic; with fewer, the FLOP model (the
    quadratic is undetermined).
    """
    order = np.argsort(seq_lens)
    s = [float(seq_lens[i]) for i in order]
    v = [float(values[i]) for i in order]
    f = [float(flops[i]) for i in order] if flops is not None else None
    if f is None or any(x <= 0 for x in f):
        coeffs, resid = fit_poly_nonneg(s, v, 2)
        return coeffs + [0.0] * (3 - len(coeffs)), resid, "quadratic"
    distinct = len(set(s))
    if distinct < 4:
        if distinct < 3:
            c, r = _flops_fit(s, v, f)
            return c, r, "flops"
        c, r = fit_poly_nonneg(s, v, 2)
        return c + [0.0] * (3 - len(c)), r, "quadratic"
    last = s[-1]
    head = [i for i, x in enumerate(s) if x != last]
    tail = [i for i, x in enumerate(s) if x == last]
    sh, vh, fh = [s[i] for i in head], [v[i] for i in head], [f[i] for i in head]
    target = float(np.mean([v[i] for i in tail]))
    cq, _ = fit_poly_nonneg(sh, vh, 2)
    cf, _ = _flops_fit(sh, vh, fh)
    err_q = max(abs(predict_poly(cq, last) - target) / target, EXACT_REL_ERR)
    err_f = max(abs(predict_poly(cf, last) - target) / target, EXACT_REL_ERR)
    # The FLOP model has one parameter less and no free s^2 term to bend on noise: keep it
    # unless the free quadratic predicts clearly better (half the error; not on exact data).
    if err_q >= QUADRATIC_MARGIN * err_f:
        c, r = _flops_fit(s, v, f)
        return c, r, "flops"
    c, r = fit_poly_nonneg(s, v, 2)
    return c + [0.0] * (3 - len(c)), r, "quadratic"


def fit_points(points: Sequence[Mapping]) -> Dict[str, dict]:
    """The schema's "fits" section from profile points (any TP degrees, any order).

    Per TP degree (a string key): block_fwd_us / block_bwd_us as [c0, c1, c2] (quadratic, see
    fit_block; "block_models" says which candidate each is), other_fwd_us / other_bwd_us as
    [c0, c1] (linear), the largest relative error over all four fits ("max_rel_err"), the
    residuals per series ("rel_residuals", in the order of "seq_lens") and the source of the
    points fitted ("measured" or "analytic"), and "block_optim_us" / "other_optim_us" (the
    optimizer step of the part's parameters on one rank, us; the points' median) and
    GRAD_ADD_KEYS (analytic: train's gradient add per micro-batch) when the points have them.
    """
    by_tp: Dict[int, List[Mapping]] = {}
    for p in points:
        by_tp.setdefault(int(p["tp"]), []).append(p)
    fits = {}
    for tp in sorted(by_tp):
        pts = sorted(by_tp[tp], key=lambda p: p["seq_len"])
        seqs = [p["seq_len"] for p in pts]
        entry, worst, resid, models = {}, 0.0, {}, {}
        for key in BLOCK_KEYS + OTHER_KEYS:
            values = [p[key] for p in pts]
            if key in BLOCK_KEYS:
                part = key[:-len("_us")]  # block_fwd / block_bwd, as in the points' "flops"
                flops = ([p["flops"][part] for p in pts]
                         if all(part in p.get("flops", {}) for p in pts) else None)
                coeffs, r, models[key] = fit_block(seqs, values, flops)
            else:
                coeffs, r = fit_poly_nonneg(seqs, values, 1)
                coeffs += [0.0] * (2 - len(coeffs))
            entry[key] = coeffs
            resid[key] = r
            worst = max([worst] + [abs(x) for x in r])
        entry["max_rel_err"] = worst
        entry["seq_lens"] = seqs
        entry["rel_residuals"] = resid
        entry["block_models"] = models
        for key in OPTIM_KEYS + GRAD_ADD_KEYS:  # neither depends on the sequence length
            if all(key in p for p in pts):
                entry[key] = float(np.median([p[key] for p in pts]))
        recompute = fit_recompute(pts)
        if recompute is not None:
            entry["recompute_us"] = recompute
        host_device = fit_host_device(pts)
        if host_device is not None:  # a GPU's points: the host's and the device's times apart
            (entry["device_us"], entry["host_us"], entry["host_us_per_token"],
             entry["device_rel_residuals"], entry["device_models"]) = host_device
        sources = sorted({p.get("source", "measured") for p in pts})
        entry["source"] = sources[0] if len(sources) == 1 else "mixed"
        fits[str(tp)] = entry
    return fits


def fit_recompute(points: Sequence[Mapping]) -> Optional[Dict[str, List[float]]]:
    """What each recompute mode adds to a block's forward + backward, [c0, c1, c2] in s (a
    call's constant once, the rest per sequence), fitted as the forward (fit_block, its FLOPs):
    a point's extra is its time under the mode less its forward and backward (at least 1% of
    the forward: a selective extra within the noise is not negative work). None unless every
    point timed both modes."""
    if not points or not all(key in p for p in points for key in RECOMPUTE_KEYS.values()):
        return None
    seqs = [p["seq_len"] for p in points]
    flops = ([p["flops"]["block_fwd"] for p in points]
             if all("block_fwd" in p.get("flops", {}) for p in points) else None)
    out = {}
    for mode, key in RECOMPUTE_KEYS.items():
        extra = [max(p[key] - p["block_fwd_us"] - p["block_bwd_us"], 0.01 * p["block_fwd_us"])
                 for p in points]
        coeffs, _, _ = fit_block(seqs, extra, flops)
        out[mode] = coeffs
    return out


def _per_sequence_flops(seq_lens, flops_per_seq) -> Tuple[float, float]:
    """(f1, f2) with flops(s) = f1 s + f2 s^2 per sequence (a block has no work without
    tokens), least squares; one length: proportional to s."""
    s = np.asarray(seq_lens, dtype=np.float64)
    f = np.asarray(flops_per_seq, dtype=np.float64)
    if len(np.unique(s)) < 2:
        return float(np.mean(f / s)), 0.0
    scale = float(s.max())
    (f1, f2), *_ = np.linalg.lstsq(np.stack([s / scale, (s / scale) ** 2], axis=1), f,
                                   rcond=None)
    return float(f1 / scale), float(f2 / scale ** 2)


def _device_candidate(s, b, v, f, model: str) -> Tuple[List[float], List[float]]:
    """One form of fit_device: ([c0, c1(, c2)], relative residuals)."""
    if model == "flops":
        fscale = float(f.max())
        a, k = nonneg_rel_lsq(np.stack([np.ones_like(f), f / fscale], axis=1), v)
        f1, f2 = _per_sequence_flops(s, f / b)
        coeffs = [float(a), float(max(0.0, k / fscale * f1)), float(max(0.0, k / fscale * f2))]
    else:
        quadratic = model == "quadratic"
        tscale, sscale = float((b * s).max()), float(s.max())
        basis = [np.ones_like(s), b * s / tscale] + ([b * (s / sscale) ** 2] if quadratic else [])
        c = nonneg_rel_lsq(np.stack(basis, axis=1), v)
        coeffs = [float(c[0]), float(c[1]) / tscale] + ([float(c[2]) / sscale ** 2]
                                                         if quadratic else [])
    pred = [coeffs[0] + bi * (predict_poly(coeffs, si) - coeffs[0]) for si, bi in zip(s, b)]
    return coeffs, [float((p - vi) / vi) for p, vi in zip(pred, v)]


def fit_device(part: str, seqs: Sequence[float], batches: Sequence[float],
               values: Sequence[float],
               flops: Optional[Sequence[float]] = None) -> Tuple[List[float], List[float], str]:
    """A part's device time per call on `batches[i]` sequences of `seqs[i]` tokens, the time
    being c0 + b (c1 s + c2 s^2): ([c0, c1, c2] for a block, [c0, c1] for "other"), the
    relative residuals, and the form ("flops", "quadratic" or "linear"). c0 is the call's own
    device cost (what does not grow with its tokens), once per call. A block with the call's
    FLOPs (`flops`) is fitted both as time = a + k x flops and as a free quadratic in b s and
    b s^2; the FLOP model (one rate, no s^2 term to bend on noise) is kept unless the
    quadratic's worst residual is under QUADRATIC_MARGIN of its own. "other" is linear."""
    s, b, v = (np.asarray(x, dtype=np.float64) for x in (seqs, batches, values))
    if not part.startswith("block"):
        return (*_device_candidate(s, b, v, None, "linear"), "linear")
    cq, rq = _device_candidate(s, b, v, None, "quadratic")
    if flops is None:
        return cq, rq, "quadratic"
    cf, rf = _device_candidate(s, b, v, np.asarray(flops, dtype=np.float64), "flops")
    worst_q = max(max(abs(x) for x in rq), EXACT_REL_ERR)
    worst_f = max(max(abs(x) for x in rf), EXACT_REL_ERR)
    if worst_q >= QUADRATIC_MARGIN * worst_f:
        return cf, rf, "flops"
    return cq, rq, "quadratic"


def fit_host_device(points: Sequence[Mapping]):
    """(device_us, host_us, host_us_per_token, rel_residuals, device_models) of one TP degree's
    points from their "host_device" samples (a GPU's: per micro-batch size, each part's device
    time alone and the host's time to issue it), or None when no point has them (a CPU,
    analytic points). device_us: per part, fit_device over every length and micro-batch size;
    host_us and host_us_per_token: per part, fit_host over the samples' tokens."""
    samples = [(p["seq_len"], h) for p in points for h in p.get("host_device", ())]
    if not samples:
        return None
    device, host, per_token, resid, models = {}, {}, {}, {}, {}
    for part in HOST_DEVICE_PARTS:
        have = [(s, h) for s, h in samples if h.get(f"{part}_device_us", 0) > 0]
        if not have:
            return None
        flops = ([h["flops"][part] for _, h in have]
                 if all(part in h.get("flops", {}) for _, h in have) else None)
        device[part], resid[part], models[part] = fit_device(
            part, [s for s, _ in have], [h["micro_batch_size"] for _, h in have],
            [h[f"{part}_device_us"] for _, h in have], flops)
        host[part], per_token[part] = fit_host(
            [s * h["micro_batch_size"] for s, h in have], [h[f"{part}_host_us"] for _, h in have])
    return device, host, per_token, resid, models


# A host line must explain this share of the samples' variance to be kept (else the median):
# issuing a block's kernels does not depend on its tokens, and a line through the noise of
# such samples (the H200's block forward: R^2 0.30, backward 0.41) is none.
HOST_LINE_MIN_R2 = 0.5


def fit_host(tokens: Sequence[float], host_us: Sequence[float]) -> Tuple[float, float]:
    """(c0, c1): the host's time to issue a call of `tokens` tokens, c0 + c1 x tokens (us).
    A least-squares line where its slope is positive and it explains HOST_LINE_MIN_R2 of the
    samples' variance (the eager loss issues its ops once per chunk of tokens), else the
    samples' median and 0."""
    x, y = np.asarray(tokens, dtype=np.float64), np.asarray(host_us, dtype=np.float64)
    median = (float(np.median(y)), 0.0)
    if len(np.unique(x)) < 2 or np.ptp(y) == 0:
        return median
    c1, c0 = np.polyfit(x, y, 1)
    explained = 1.0 - np.sum((y - c0 - c1 * x) ** 2) / np.sum((y - y.mean()) ** 2)
    if c1 <= 0 or c0 < 0 or explained < HOST_LINE_MIN_R2:
        return median
    return float(c0), float(c1)


def fit_activation_bytes(seq_lens: Sequence[float], act_bytes: Sequence[float]) -> List[float]:
    """Exact-interpolation fit of activation bytes per micro-batch: [c0, c1, c2] in s (bytes).

    Saved activations are a polynomial of degree <= 2 in s for a fixed kernel choice (linear with
    flash attention, quadratic where attention scores are kept), so an ordinary least-squares fit
    through the measured points reproduces them and extends to other lengths.
    """
    s = np.asarray(seq_lens, dtype=np.float64)
    b = np.asarray(act_bytes, dtype=np.float64)
    degree = min(2, len(np.unique(s)) - 1)
    if degree < 1:  # one length: proportional to s
        return [0.0, float(b[0] / s[0]), 0.0]
    scale = float(s.max())
    coeffs = np.polynomial.polynomial.polyfit(s / scale, b, degree)
    out = [float(c / scale ** i) for i, c in enumerate(coeffs)]
    return out + [0.0] * (3 - len(out))


def fit_tokens(tokens: Sequence[float], values: Sequence[float]) -> Tuple[List[float],
                                                                         List[float]]:
    """A MoE part's time against the tokens it processes, c0 + c1 x (us): the launch and
    weight-read cost, and the cost per token. Non-negative, relative error (as the block's
    fits). Returns ([c0, c1], relative residuals per point)."""
    coeffs, resid = fit_poly_nonneg(tokens, values, 1)
    return coeffs + [0.0] * (2 - len(coeffs)), resid


def fit_token_bytes(tokens: Sequence[float], act_bytes: Sequence[float]) -> List[float]:
    """Activation bytes against tokens, [c0, c1] (least squares: saved tensors are exactly
    linear in the tokens of a MoE part); one token count: proportional."""
    x = np.asarray(tokens, dtype=np.float64)
    b = np.asarray(act_bytes, dtype=np.float64)
    if len(np.unique(x)) < 2:
        return [0.0, float(b[0] / x[0])]
    scale = float(x.max())
    c0, c1 = np.polynomial.polynomial.polyfit(x / scale, b, 1)
    return [round(float(c0), 6), round(float(c1 / scale), 6)]  # exact bytes, less round-off
