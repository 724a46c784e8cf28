"""What measured runs teach the cost model: the contention term and per-cluster calibration.

Contention. A rank's compute time depends on how many ranks of its node compute at the same
time: CPU ranks share cores (4 single-thread ranks on 2 cores run at half speed when all are
busy), GPU ranks share a host and a power budget. profile_model times a block with every rank
of the job busy at once (`Concurrency.profiled_busy`); a pipeline keeps every rank busy only in
its steady phase. `contention_factor` walks the phases of the schedule (slots of one
micro-batch chunk: stage j busy in slots j .. j + m v - 1) and scales the profiled compute by
the mean slowdown of the slots a stage computes in, relative to the profile's. A slowdown is
f(n) = max(1, n x threads / cpus) for n busy ranks on a host (its ranks spread evenly over the
stages). On GPUs (cpus unknown) the factor is 1 and calibration learns what is left.

Calibration. Per cluster and model, factors on the terms of the cost model: compute, recompute,
a TP collective's latency and its time per byte, pipeline sends, data-parallel sync, the
optimizer step. Fitted by robust least squares (scipy) to the iteration time, per-stage
compute, exposed gradient sync and optimizer step of the runs `stage=tune` measured, with a
prior that keeps a factor the runs cannot tell apart at 1, the stronger the fewer runs the
factor moves. `Calibration()` is the identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

FACTORS = ("compute", "recompute", "tp_latency", "tp_bandwidth", "p2p", "dp_sync",
           "optimizer", "ep_comm")
FACTOR_BOUNDS = (0.1, 10.0)  # a factor outside is a model that is wrong, not a cluster's trait
PRIOR_WEIGHT = 0.15  # weight of log(factor) among the residuals: a factor no run pins stays 1
MIN_RUNS = 2  # fewer successful runs fit nothing
# Robust least squares: a residual beyond F_SCALE (a 2% miss) counts less than its square, so
# one run the model cannot explain (a regime no other run shares) does not drag every factor.
LOSS, F_SCALE = "soft_l1", 0.02


@dataclass(frozen=True)
class Concurrency:
    """How the model profile's times were taken: `profiled_busy` ranks of a node computing at
    once, each with `threads` intra-op threads, on `cpus` usable CPUs (None: a GPU, or not
    recorded)."""

    profiled_busy: int
    threads: int = 1
    cpus: Optional[int] = None

    @classmethod
    def from_method(cls, method: Optional[Mapping[str, Any]]) -> Optional["Concurrency"]:
        """From a model profile's `method.concurrency` (None for profiles without it)."""
        raw = (method or {}).get("concurrency")
        if not isinstance(raw, Mapping) or not raw.get("ranks_busy"):
            return None
        cpus = raw.get("cpus")
        return cls(profiled_busy=int(raw["ranks_busy"]), threads=int(raw.get("threads") or 1),
                   cpus=int(cpus) if cpus else None)

    def slowdown(self, busy_ranks: float) -> float:
        """Time of a computation with `busy_ranks` ranks of its node computing at once, over its
        time alone."""
        if not self.cpus:
            return 1.0
        return max(1.0, busy_ranks * self.threads / self.cpus)


def busy_stages(pp: int, chunks: int) -> List[int]:
    """Per slot of the pipeline (chunks + pp - 1 of them, a slot one micro-batch chunk), how many
    stages compute: stage j is busy in slots j .. j + chunks - 1."""
    slots = chunks + pp - 1
    return [sum(1 for j in range(pp) if j <= s < j + chunks) for s in range(slots)]


def contention_factor(concurrency: Optional[Concurrency], pp: int, num_micro_batches: int,
                      virtual_stages: int) -> float:
    """Compute time of this schedule over the profile's: the mean, over the stages and the slots
    each computes in, of slowdown(busy ranks) / slowdown(profiled_busy), a host's ranks (as
    many as profiled) spread evenly over the stages. 1 without a concurrency record, on GPUs,
    and for one stage."""
    if concurrency is None or not concurrency.cpus:
        return 1.0
    chunks = num_micro_batches * max(1, virtual_stages)
    counts = busy_stages(pp, chunks)
    base = concurrency.slowdown(concurrency.profiled_busy)
    total = 0.0
    for j in range(pp):
        mine = counts[j:j + chunks]
        busy = (concurrency.profiled_busy * c / pp for c in mine)
        total += sum(concurrency.slowdown(n) for n in busy) / len(mine)
    return total / pp / base


@dataclass(frozen=True)
class Calibration:
    """Multipliers on the cost model's terms, fitted per cluster (1.0: as profiled); `runs`:
    how many measured runs they come from (0: not calibrated)."""

    compute: float = 1.0
    recompute: float = 1.0  # on top of compute: a rerun forward is not always a forward's time
    tp_latency: float = 1.0  # a TP collective's fixed cost (a call: alpha)
    tp_bandwidth: float = 1.0  # its time per byte (beta)
    p2p: float = 1.0
    dp_sync: float = 1.0
    optimizer: float = 1.0
    ep_comm: float = 1.0  # the MoE token dispatcher's all-to-alls and ETP collectives
    runs: int = 0

    @property
    def factors(self) -> Dict[str, float]:
        return {name: getattr(self, name) for name in FACTORS}

    @classmethod
    def of(cls, factors: Mapping[str, float], runs: int) -> "Calibration":
        return cls(**{name: float(factors.get(name, 1.0)) for name in FACTORS}, runs=int(runs))

    def at_bound(self) -> List[str]:
        """The factors a fit pushed to FACTOR_BOUNDS (within 1%): the profiles are that far
        off the runs, which no trait of a cluster explains (a profile of another machine, or
        measured on a loaded host), so the factor hides the error rather than mends it."""
        lo, hi = (math.log(b) for b in FACTOR_BOUNDS)
        return [name for name, value in self.factors.items()
                if min(abs(math.log(value) - lo), abs(math.log(value) - hi)) < 0.01]

    def describe(self) -> str:
        if not self.runs:
            return "not calibrated"
        moved = ", ".join(f"{name} x{value:.2f}" for name, value in self.factors.items()
                          if abs(value - 1.0) >= 0.005)
        bound = self.at_bound()
        warn = f"; {', '.join(bound)} at the bound: profiles to measure again" if bound else ""
        return f"calibrated from {self.runs} runs ({moved or 'every factor 1.00'}{warn})"


# The profile whose prices each factor scales: what to measure again when a fit pushes the
# factor to its bound (Calibration.at_bound).
FACTOR_PROFILE = {"compute": "profile_model", "recompute": "profile_model",
                  "optimizer": "profile_model", "tp_latency": "profile_hardware",
                  "tp_bandwidth": "profile_hardware", "p2p": "profile_hardware",
                  "dp_sync": "profile_hardware", "ep_comm": "profile_hardware"}


PART_WEIGHTS = {"iteration": 1.0, "compute": 0.5, "dp_sync_exposed": 0.5, "optimizer": 0.5}


def part_weight(part: str) -> float:
    """A part's weight among the residuals: `compute/1` weighs as `compute`."""
    return PART_WEIGHTS[part.split("/", 1)[0]]


@dataclass(frozen=True)
class Observation:
    """One measured run: its layout (anything `price` takes) and what train measured (ms) by
    part: "iteration", "compute/<stage>" (the stage's forward/backward work, TP collectives
    in, pipeline sends out), "dp_sync_exposed", "optimizer" (the first stage's)."""

    name: str
    layout: Any
    parts_ms: Mapping[str, float]

    @property
    def iteration_ms(self) -> float:
        return self.parts_ms["iteration"]


@dataclass
class FitResult:
    calibration: Calibration
    after: Dict[str, float] = field(default_factory=dict)  # run -> iteration error, calibrated
    before: Dict[str, float] = field(default_factory=dict)  # run -> iteration error, as profiled
    why_not: str = ""  # why the model stays uncalibrated ("" when fitted)


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def fit_calibration(runs: Sequence[Observation],
                    price: Callable[[Any, Calibration], Mapping[str, float]],
                    min_runs: int = MIN_RUNS, prior_weight: float = PRIOR_WEIGHT) -> FitResult:
    """Least-squares factors (in log space, bounded by FACTOR_BOUNDS) that make `price` (the
    cost model under a Calibration: the parts of Observation, ms) agree with the measured
    runs. A residual per run and part: (predicted - measured) / the run's measured iteration,
    times the part's weight (PART_WEIGHTS: the iteration counts double), under a soft-L1 loss
    (LOSS, F_SCALE); plus, per factor, prior_weight x (1 + 2 / the runs it moves) x
    log(factor). Fewer than `min_runs` runs: the identity, with why."""
    import numpy as np
    from scipy.optimize import least_squares

    identity = Calibration()

    def iteration_errors(cal: Calibration) -> Dict[str, float]:
        return {r.name: relative_error(price(r.layout, cal)["iteration"], r.iteration_ms)
                for r in runs}

    before = iteration_errors(identity)
    if len(runs) < min_runs:
        return FitResult(identity, before, before,
                         f"{len(runs)} successful run(s), at least {min_runs} needed to fit: the "
                         f"cost model stays uncalibrated")

    def calibration_of(x) -> Calibration:
        return Calibration.of(dict(zip(FACTORS, np.exp(x))), len(runs))

    # A factor's prior weighs more the fewer runs it moves (by >= 1% when doubled): what one
    # run alone exercises is not learnt from that run alone.
    base = [price(r.layout, identity)["iteration"] for r in runs]
    support = []
    for k in range(len(FACTORS)):
        doubled = calibration_of(np.eye(len(FACTORS))[k] * math.log(2.0))
        support.append(sum(abs(price(r.layout, doubled)["iteration"] / b - 1) >= 0.01
                           for r, b in zip(runs, base)))
    prior = prior_weight * (1.0 + 2.0 / np.maximum(np.asarray(support, dtype=float), 0.1))

    def residuals(x):
        cal = calibration_of(x)
        out = []
        for r in runs:
            priced = price(r.layout, cal)
            out += [part_weight(part) * (priced[part] - measured) / r.iteration_ms
                    for part, measured in r.parts_ms.items() if part in priced]
        out += list(prior * np.asarray(x))
        return np.asarray(out)

    lo, hi = (math.log(b) for b in FACTOR_BOUNDS)
    fit = least_squares(residuals, np.zeros(len(FACTORS)), bounds=(lo, hi), diff_step=1e-3,
                        loss=LOSS, f_scale=F_SCALE)
    cal = calibration_of(fit.x)
    return FitResult(cal, iteration_errors(cal), before)

