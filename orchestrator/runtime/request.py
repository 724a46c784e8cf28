"""A stage request: everything a rank needs to run a stage, as plain data.

The CLI builds it, a launcher carries it (a JSON file for mpiexec, a pickle for submitit), and
every rank reads it. Launchers never look inside.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from orchestrator.store import read_json, write_json


@dataclass
class StageRequest:
    stage: str
    ledger_key: str  # e.g. profile_hardware, profile_model/tiny
    config: dict  # the resolved job config (OmegaConf container)
    config_hash: str
    todo: List[str]  # sub-parts to run, in order (empty for a stage without sub-parts)
    ledger_dir: str  # profiles/<cluster.name>
    run_dir: str  # logs and the result file of this launch
    world_size: int  # ranks the stage needs; the runtime checks MPI agrees
    backend: str = "gloo"
    launcher: str = "local"
    job_id: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @property
    def result_path(self) -> Path:
        return Path(self.run_dir) / "result.json"

    def save(self, path: str | Path) -> Path:
        return write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> "StageRequest":
        return cls(**read_json(path))
