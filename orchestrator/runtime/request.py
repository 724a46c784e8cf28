"""A stage request: everything a rank needs to run a stage, typed.

The CLI builds it, a launcher carries it (a pickle file for mpiexec, submitit's own pickle under
Slurm), and every rank reads it. Launchers never look inside beyond `ranks` and `world_size`.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from orchestrator.choices import Backend, Ranks
from orchestrator.config import Config
from orchestrator.stages import StagePlan
from orchestrator.store import atomic_write

RESULT_NAME = "result.json"


def result_path(run_dir: str | Path) -> Path:
    """Where rank 0 of a launch writes its result (or its error) in the launch's run folder."""
    return Path(run_dir) / RESULT_NAME


@dataclass
class StageRequest:
    plan: StagePlan  # computed once by the CLI: key, sub-parts, ranks, inputs, outputs, hash
    config: Config  # the typed job config (OmegaConf.to_object of the composed config)
    todo: List[str]  # sub-parts to run, in order (empty for a stage without sub-parts)
    ledger_dir: str  # profiles/<cluster.name>
    run_dir: str  # logs and the result file of this launch
    launcher: str = "local"
    job_id: Optional[str] = None
    # group -> the file its choice came from (provenance): a site file's path or package:<file>
    config_sources: Dict[str, str] = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return self.plan.stage

    @property
    def ledger_key(self) -> str:
        return self.plan.key

    @property
    def config_hash(self) -> str:
        return self.plan.config_hash

    @property
    def world_size(self) -> int:
        """Ranks the stage needs; the runtime checks MPI agrees."""
        return self.plan.world_size

    @property
    def ranks(self) -> Ranks:
        return self.plan.ranks

    @property
    def backend(self) -> Backend:
        return self.config.cluster.backend

    @property
    def torch_distributed(self) -> bool:
        from orchestrator.stages import get_stage

        return get_stage(self.stage).torch_distributed

    @property
    def result_path(self) -> Path:
        return result_path(self.run_dir)

    def save(self, path: str | Path) -> Path:
        return atomic_write(path, lambda f: pickle.dump(self, f), binary=True)

    @classmethod
    def load(cls, path: str | Path) -> "StageRequest":
        with open(path, "rb") as f:
            request = pickle.load(f)
        if not isinstance(request, cls):
            raise TypeError(f"{path} holds a {type(request).__name__}, not a StageRequest")
        return request
