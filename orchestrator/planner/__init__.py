"""The planner: cost model, pipeline schedules and the exact layout search (pure functions over
plain data: the JSON profiles loaded as dicts, ParallelLayout, SearchSpace)."""
from orchestrator.planner.options import CostOptions
from orchestrator.planner.prediction import Prediction, evaluate
from orchestrator.planner.exports import galvatron_strategy, megatron_args
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.schedule import ScheduleResult, simulate
from orchestrator.planner.search import InfeasibleError, SearchResult, SearchSpace, search

__all__ = [
    "CostOptions", "HardwareModel", "InfeasibleError", "ModelCost", "Prediction",
    "ScheduleResult", "SearchResult", "SearchSpace", "evaluate",
    "galvatron_strategy", "megatron_args", "search", "simulate",
]
