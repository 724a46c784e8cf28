"""strategy/<model>.json: the search's answer, how it was found, and its exports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from orchestrator.layout import ParallelLayout
from orchestrator.choices import Source
from orchestrator.store.schema.header import Profile
from orchestrator.records import Record, doc


@dataclass(kw_only=True)
class StrategyInput(Record):
    sha256: str = doc("short digest of the profile's bytes when it was read")
    source: Optional[Source] = doc("the profile's source")


@dataclass(kw_only=True)
class SpaceSummary(Record):
    world_size: int = doc("devices")
    memory_GiB: float = doc("memory budget per device")
    global_batch_size: int = doc("sequences per iteration")
    seq_len: int = doc("tokens per sequence")
    fast_mode: bool = doc("one schedule, capped recompute refinement")
    reserve_fraction: Optional[float] = doc("search.reserve_fraction: share of the budget kept "
                                            "free", default=None)
    reserve_GiB: Optional[float] = doc("search.reserve_GiB: kept free on top of the fraction",
                                       default=None)
    reserve_total_GiB: Optional[float] = doc("kept free per device: reserve_fraction x "
                                             "memory_GiB + reserve_GiB", default=None)
    engine: Optional[str] = doc("search.engine: whose communication and memory were priced, "
                                "orchestrator (stage=train) or megatron (the Megatron export)",
                                default=None)
    max_cp: Optional[int] = doc("search.max_cp: the largest context-parallel degree searched",
                                default=None)


@dataclass(kw_only=True)
class Headroom(Record):
    """How much of the budget the best layout leaves (GiB per device, its largest stage)."""

    free_GiB: float = doc("memory_GiB - predicted peak, the reserve included in the peak")
    reserve_GiB: float = doc("the reserve kept free within the budget (space.reserve_total_GiB)")


@dataclass(kw_only=True)
class PredictionRecord(Record):
    """What the cost model predicts for a layout (us, bytes). breakdown_us sums to
    iteration_time_us and describes the slowest stage."""

    layout: ParallelLayout = doc("the layout predicted")
    iteration_time_us: float = doc("one training iteration")
    tokens_per_s: float = doc("global_batch_size x seq_len / iteration time")
    stage_fwd_us: List[float] = doc("per pipeline stage, one micro-batch forward")
    stage_bwd_us: List[float] = doc("per stage, backward (+recompute)")
    stage_time_us: List[float] = doc("per stage, forward + backward")
    breakdown_us: Dict[str, float] = doc("compute, tp_comm, pp_comm, bubble, dp_sync_exposed, "
                                         "recompute")
    memory_bytes: List[Dict[str, float]] = doc("per stage: params, grads, optim, activations, "
                                               "comm_buffers, reserve and total")
    peak_memory_bytes: float = doc("the largest stage total")
    feasible: bool = doc("fits the memory budget")
    reason: str = doc("why not, when infeasible")
    simulated_iteration_time_us: Optional[float] = doc("event-driven schedule makespan, null "
                                                       "unless simulated")


@dataclass(kw_only=True)
class Alternative(Record):
    layout: ParallelLayout = doc("a layout among the fastest")
    iteration_time_us: float = doc("its predicted iteration time")
    peak_memory_bytes: float = doc("its peak memory per device")


@dataclass(kw_only=True)
class Exports(Record):
    """The layout in other trainers' words. An approximation is listed, never hidden; a trainer
    that cannot express the layout at all has an error and no export."""

    megatron: Optional[List[str]] = doc("Megatron-LM arguments (also <model>.megatron.args)",
                                        default=None)
    megatron_approximations: List[str] = doc("what the arguments change, on the memory-safe "
                                             "side", default_factory=list)
    megatron_error: Optional[str] = doc("why there are no arguments", default=None)
    galvatron: Optional[Dict[str, Any]] = doc("Galvatron strategy (also "
                                              "<model>.galvatron.json)", default=None)
    galvatron_approximations: List[str] = doc("what the strategy changes", default_factory=list)
    galvatron_error: Optional[str] = doc("why there is no strategy", default=None)


@dataclass(kw_only=True)
class StrategyProfile(Profile):
    """profiles/<cluster.name>/strategy/<model.name>.json (written by search)."""

    KIND = "strategy"
    kind: str = doc("this file's kind", default="strategy")
    PRODUCER = "search"

    model: str = doc("model.name")
    inputs: Dict[str, StrategyInput] = doc("each profile read, by path relative to the "
                                           "cluster's profiles folder (hardware.json, "
                                           "model/<model>.json)")
    notes: List[str] = doc("what was extrapolated from the inputs (e.g. more nodes than "
                           "profiled)", default_factory=list)
    space: SpaceSummary = doc("what was searched")
    layout: ParallelLayout = doc("the best layout (ParallelLayout.to_dict())")
    describe: str = doc("the best layout in one line")
    best: ParallelLayout = doc("the same layout, as the search returned it")
    prediction: PredictionRecord = doc("the best layout's prediction")
    headroom: Optional[Headroom] = doc("what the best layout leaves of the budget",
                                       default=None)
    top: List[Alternative] = doc("the fastest layouts, best first")
    considered: int = doc("configurations evaluated")
    rejected: Dict[str, int] = doc("configurations refused, by reason")
    pruned: int = doc("configurations skipped by bounds")
    solved: int = doc("partition problems solved")
    elapsed_s: float = doc("search time")
    fast_mode: bool = doc("as space.fast_mode")
    exports: Exports = doc("Megatron and Galvatron forms", default_factory=Exports)
