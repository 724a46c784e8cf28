"""Planning: which stages and sub-parts must run, which are done (same config hash, outputs there).

Pure functions of the config and the ledger; nothing here launches anything.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import List

from omegaconf import DictConfig, OmegaConf

from orchestrator.config import SUBMISSION_ONLY_FIELDS
from orchestrator.errors import ConfigError
from orchestrator.stages import PIPELINE, StageSpec, get_stage
from orchestrator.store import cluster_dir, config_hash
from orchestrator.store.ledger import Ledger


@dataclass
class StagePlan:
    spec: StageSpec
    key: str
    config_hash: str
    subparts: List[str]  # all of the stage's sub-parts for this config
    todo: List[str]  # those to run now
    done: bool  # nothing to run: every sub-part (or the stage) done under this hash
    ranks: str  # "cluster" or "one"
    world_size: int
    notes: List[str] = field(default_factory=list)


def world_size(cfg) -> int:
    return int(cfg.cluster.nodes) * int(cfg.cluster.tasks_per_node)


def validate_cluster(cfg) -> None:
    """Raise ConfigError for a cluster layout that cannot run, naming the numbers."""
    c = cfg.cluster
    if c.nodes < 1 or c.tasks_per_node < 1:
        raise ConfigError(f"cluster.nodes({c.nodes}) and cluster.tasks_per_node({c.tasks_per_node}) "
                          f"must both be >= 1")
    if c.backend not in ("gloo", "nccl"):
        raise ConfigError(f"cluster.backend={c.backend!r}; allowed: gloo (CPU), nccl (GPU)")
    if c.backend == "nccl" and c.gpus_per_node != c.tasks_per_node:
        raise ConfigError(f"cluster.backend=nccl runs one rank per GPU: cluster.tasks_per_node"
                          f"({c.tasks_per_node}) != cluster.gpus_per_node({c.gpus_per_node})")
    if cfg.launcher.name not in ("local", "slurm"):
        raise ConfigError(f"launcher={cfg.launcher.name!r}; allowed: local, slurm")


def _file_digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def stage_hash(spec: StageSpec, cfg: DictConfig) -> str:
    """Hash of the config sections that decide whether the stage's results are still valid."""
    section = {}
    for name in spec.hash_sections:
        node = OmegaConf.to_container(cfg[name], resolve=True)
        if name == "cluster":
            node = {k: v for k, v in node.items() if k not in SUBMISSION_ONLY_FIELDS}
        section[name] = node
    section = copy.deepcopy(section)
    # A stage whose inputs changed (a profile measured again) must run again.
    section["inputs"] = {str(i.path): _file_digest(i.path) for i in spec.inputs(cfg)
                         if i.path.exists()}
    for dotted in spec.hash_exclude:
        head, _, leaf = dotted.rpartition(".")
        parent = section
        for part in head.split(".") if head else []:
            parent = parent.get(part, {})
        parent.pop(leaf, None)
    return config_hash(section)


def plan_stage(name: str, cfg: DictConfig, ledger: Ledger, force: bool = False) -> StagePlan:
    """What `stage=<name>` must run now; validates the stage's config first."""
    spec = get_stage(name)
    spec.validate(cfg)
    key = spec.ledger_key(cfg)
    h = stage_hash(spec, cfg)
    subparts = list(spec.subparts(cfg))
    outputs_there = all(p.exists() for p in spec.outputs(cfg))
    notes = []
    if subparts:
        if force or not outputs_there:
            todo = subparts
            if not outputs_there and not force:
                notes.append("outputs missing: running every sub-part")
        else:
            todo = [s for s in subparts if not ledger.is_done(f"{key}/{s}", h)]
        done = not todo
    else:
        todo = []
        done = not force and outputs_there and ledger.is_done(key, h)
    ranks = spec.ranks(cfg)
    if ranks == "cluster" and cfg.launcher.name == "local" and cfg.cluster.nodes != 1:
        raise ConfigError(f"launcher=local runs {name} on this machine only: cluster.nodes"
                          f"({cfg.cluster.nodes}) must be 1 (use launcher=slurm for "
                          f"{cfg.cluster.nodes} nodes)")
    return StagePlan(spec=spec, key=key, config_hash=h, subparts=subparts, todo=todo, done=done,
                     ranks=ranks, world_size=world_size(cfg) if ranks == "cluster" else 1,
                     notes=notes)


def stages_for(stage: str) -> List[str]:
    """The stages `stage=<stage>` names, in run order."""
    return list(PIPELINE) if stage == "all" else [stage]


def ledger_for(cfg) -> Ledger:
    return Ledger(cluster_dir(cfg.profiles_dir, cfg.cluster.name))
