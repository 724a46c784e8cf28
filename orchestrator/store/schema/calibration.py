"""calibration/<model>.json: the layouts stage=tune ran, predicted against measured, the
per-cluster factors fitted to them, and the measured best."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from orchestrator.layout import ParallelLayout
from orchestrator.store.schema.header import Profile
from orchestrator.records import Record, doc
from orchestrator.store.schema.strategy import StrategyInput


@dataclass(kw_only=True)
class TunedCandidate(Record):
    """One layout stage=tune trained."""

    role: str = doc('why it ran: "top <k>" of the prediction, or the best of a family '
                    '("pure dp", "tp-heavy", "pp-heavy")')
    layout: ParallelLayout = doc("the layout trained")
    describe: str = doc("the layout in one line")
    state: str = doc('"measured" or "failed" (then excluded from the fit and the pick)')
    reason: Optional[str] = doc("why it failed (OOM, a crash, ...), with its log", default=None)
    summary: Optional[str] = doc("its train summary, relative to the cluster's profiles folder",
                                 default=None)
    measured_ms: Dict[str, float] = doc("what train measured, by part: iteration, compute/<stage>, "
                                        "dp_sync_exposed, optimizer", default_factory=dict)
    predicted_ms: Dict[str, float] = doc("the same parts from the cost model as profiled",
                                         default_factory=dict)
    calibrated_ms: Dict[str, float] = doc("the same parts after calibration",
                                          default_factory=dict)
    peak_memory_MiB: Optional[float] = doc("measured peak memory of its largest rank",
                                           default=None)
    predicted_memory_MiB: Optional[float] = doc("the planner's peak memory", default=None)


@dataclass(kw_only=True)
class CalibrationProfile(Profile):
    """profiles/<cluster.name>/calibration/<model.name>.json (written by stage=tune)."""

    KIND = "calibration"
    kind: str = doc("this file's kind", default="calibration")
    PRODUCER = "tune"

    model: str = doc("model.name")
    inputs: Dict[str, StrategyInput] = doc("the profiles the predictions came from, by path "
                                           "relative to the cluster's profiles folder: the "
                                           "calibration is stale once one changes")
    seq_len: int = doc("tokens per sequence of the runs")
    steps: int = doc("train steps per candidate")
    timing_warmup_steps: int = doc("steps left out of each candidate's measured time")
    runs: int = doc("candidates measured (the fit's data)")
    factors: Dict[str, float] = doc("multiplier per cost-model term (compute, recompute, "
                                    "tp_latency, tp_bandwidth, p2p, dp_sync, optimizer, "
                                    "ep_comm); all 1 when not fitted")
    why_not: Optional[str] = doc("why the factors were not fitted (too few runs)",
                                 default=None)
    at_bound: List[str] = doc("factors the fit pushed to its bounds (0.1 or 10): profiles "
                              "that far off the runs are to be measured again",
                              default_factory=list)
    mean_error_before: Optional[float] = doc("mean |iteration error| over the runs, as "
                                             "profiled", default=None)
    mean_error_after: Optional[float] = doc("the same, calibrated (in-sample)", default=None)
    candidates: List[TunedCandidate] = doc("every layout run, in run order")
    pick: Optional[ParallelLayout] = doc("the measured fastest candidate: what stage=train "
                                         "trains next (strategy/<model>.layout.json)",
                                         default=None)
    pick_describe: Optional[str] = doc("the pick in one line", default=None)
