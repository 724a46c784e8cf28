"""Profile files as dataclasses: one record type per file kind, validated field by field.

`HardwareProfile`, `ModelProfile` and `StrategyProfile` are what producers build and readers get
from `orchestrator.store.read_profile`; JSON dicts stay at the file edge. docs/profile-schema.md
is generated from these classes (`python -m orchestrator.store.schema --markdown`).
"""
from orchestrator.choices import LinkLayout, Op, Recompute, Source
from orchestrator.store.schema.calibration import CalibrationProfile, TunedCandidate
from orchestrator.store.schema.hardware import (AlphaBetaFit, BenchPoint, Benchmark,
                                                ClusterSummary, HardwareBenchmarks,
                                                HardwareProfile, Inventory, InventoryRank, Overlap)
from orchestrator.store.schema.header import (SCHEMA_VERSION, ImportRecord, PartMade, Profile,
                                              Provenance)
from orchestrator.store.schema.model import (MemoryPart, ModelPoint, ModelProfile, ModelSummary,
                                             MoePoint, MoeSection, TokenFit, TpFits, TpMemory)
from orchestrator.records import FieldError, Record
from orchestrator.store.schema.strategy import (Alternative, Exports, PredictionRecord,
                                                SpaceSummary, StrategyInput, StrategyProfile)

__all__ = ["AlphaBetaFit", "Alternative", "BenchPoint", "Benchmark", "CalibrationProfile",
           "ClusterSummary", "Exports",
           "FieldError", "HardwareBenchmarks", "HardwareProfile", "ImportRecord", "Inventory",
           "InventoryRank",
           "LinkLayout", "MemoryPart", "ModelPoint", "ModelProfile", "ModelSummary", "MoePoint",
           "MoeSection", "Op",
           "Overlap", "PartMade", "PredictionRecord", "Profile", "Provenance",
           "Recompute", "Record", "SCHEMA_VERSION", "Source", "SpaceSummary",
           "StrategyInput", "StrategyProfile", "TokenFit", "TpFits", "TpMemory", "TunedCandidate"]
