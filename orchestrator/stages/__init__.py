"""The stages: one module each, each exposing `SPEC: StageSpec`.

A stage's `run(ctx, run)` executes on every rank it asked for and never knows which launcher
started it. The rest of the spec tells the pipeline what the stage reads and writes, which config
sections decide whether earlier results are still valid, and its sub-parts (each a ledger entry).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Tuple

from orchestrator.errors import ConfigError

# `stage=all` runs these in order, skipping what is done.
PIPELINE = ("profile_hardware", "profile_model", "search")
# Stages a user can name (plus `all` and `status`, which the CLI handles itself).
STAGES = PIPELINE + ("noop",)


@dataclass(frozen=True)
class StageInput:
    path: Path
    kind: str  # the profile kind the file must hold
    producer: str  # the stage that writes it

    def rebuild(self, cfg) -> str:
        """The command that writes this input, for error messages."""
        cmd = f"python -m orchestrator stage={self.producer} cluster={cfg.cluster.name}"
        return cmd + (f" model={cfg.model.name}" if self.producer == "profile_model" else "")


def _no_inputs(cfg) -> List[StageInput]:
    return []


def _no_subparts(cfg) -> List[str]:
    return []


def _valid(cfg) -> None:
    return None


@dataclass(frozen=True)
class StageSpec:
    name: str
    run: Callable  # run(ctx: RankContext, run: StageRun) -> dict summary (rank 0)
    ledger_key: Callable  # cfg -> str, e.g. "profile_model/tiny"
    outputs: Callable  # cfg -> list[Path]
    hash_sections: Tuple[str, ...]  # top-level config sections that decide validity
    hash_exclude: Tuple[str, ...] = ()  # dotted keys in them that do not (e.g. which sub-parts)
    ranks: Callable = lambda cfg: "cluster"  # "cluster": every rank of the cluster; "one"
    subparts: Callable = _no_subparts  # cfg -> sub-part names in run order
    inputs: Callable = _no_inputs  # cfg -> list[StageInput]
    validate: Callable = _valid  # cfg -> None, raises ConfigError before launch
    # False: the ranks get MPI only (no torch import, no process group): a cheaper start.
    torch_distributed: bool = True


def get_stage(name: str) -> StageSpec:
    """The spec of stage `name`; ConfigError naming the allowed stages if there is none."""
    if name not in STAGES:
        raise ConfigError(f"unknown stage {name!r}; allowed: {', '.join(STAGES + ('all', 'status'))}")
    return importlib.import_module(f"orchestrator.stages.{name}").SPEC
