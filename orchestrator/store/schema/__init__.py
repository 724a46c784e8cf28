"""Profile files as dataclasses: one record type per file kind, validated field by field.

`HardwareProfile`, `ModelProfile` and `StrategyProfile` are what producers build and readers get
from `orchestrator.store.read_profile`; JSON dicts stay at the file edge. docs/profile-schema.md
is generated from these classes (`python -m orchestrator.store.schema --markdown`).
"""
from orchestrator.store.schema.hardware import (AlphaBetaFit, BenchPoint, Benchmark,
                                                ClusterSummary, HardwareBenchmarks,
                                                HardwareProfile, Inventory, InventoryRank,
                                                LinkLayout, Op, Overlap)
from orchestrator.store.schema.header import SCHEMA_VERSION, Profile, Provenance, Source
from orchestrator.store.schema.model import (MemoryPart, ModelPoint, ModelProfile, ModelSummary,
                                             RecomputeMode, TpFits, TpMemory)
from orchestrator.store.schema.record import FieldError, Record
from orchestrator.store.schema.strategy import (Alternative, Exports, PredictionRecord,
                                                SpaceSummary, StrategyInput, StrategyProfile)

PROFILE_KINDS = {cls.KIND: cls for cls in (HardwareProfile, ModelProfile, StrategyProfile)}

__all__ = ["AlphaBetaFit", "Alternative", "BenchPoint", "Benchmark", "ClusterSummary", "Exports",
           "FieldError", "HardwareBenchmarks", "HardwareProfile", "Inventory", "InventoryRank",
           "LinkLayout", "MemoryPart", "ModelPoint", "ModelProfile", "ModelSummary", "Op",
           "Overlap", "PROFILE_KINDS", "PredictionRecord", "Profile", "Provenance",
           "RecomputeMode", "Record", "SCHEMA_VERSION", "Source", "SpaceSummary",
           "StrategyInput", "StrategyProfile", "TpFits", "TpMemory"]
