"""Planning: which stages and sub-parts must run, which are done (same config hash, outputs there).

Pure functions of the config and the ledger; nothing here launches anything.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import List

from omegaconf import DictConfig, OmegaConf

from orchestrator.config import SUBMISSION_ONLY_FIELDS, cluster_world_size
from orchestrator.errors import ConfigError
from orchestrator.stages import PIPELINE, StageSpec, get_stage
from orchestrator.store import cluster_dir, config_hash, file_sha256, read_json
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
    stale_reason: str = ""  # why earlier results are not reused, if they are not


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


def stage_hash(spec: StageSpec, cfg: DictConfig) -> str:
    """Hash of what decides whether the stage's results are still valid: its config sections
    (less `hash_exclude`) and the hashes of the stages that write its inputs."""
    section = {}
    for name in spec.hash_sections:
        node = OmegaConf.to_container(cfg[name], resolve=True)
        if name == "cluster":
            node = {k: v for k, v in node.items() if k not in SUBMISSION_ONLY_FIELDS}
        section[name] = node
    section = copy.deepcopy(section)
    # Known before the producers run, so a Slurm chain records the hash a later plan computes.
    section["inputs"] = {i.producer: stage_hash(get_stage(i.producer), cfg) for i in spec.inputs(cfg)}
    for dotted in spec.hash_exclude:
        head, _, leaf = dotted.rpartition(".")
        parent = section
        for part in head.split(".") if head else []:
            parent = parent.get(part, {})
        parent.pop(leaf, None)
    return config_hash(section)


def stale_outputs(spec: StageSpec, cfg: DictConfig, stage_hash_: str) -> str:
    """Why the stage's output files cannot be reused ("" if they can): missing, written under
    another config, or built from input files that have changed since (e.g. measured again)."""
    for path in spec.outputs(cfg):
        if not path.exists():
            return f"{path} missing"
        try:
            written = read_json(path)
        except ValueError:
            return f"{path} corrupt"
        if written.get("provenance", {}).get("config_hash") != stage_hash_:
            return f"{path} was written under another config"
        for input_path, recorded in (written.get("inputs") or {}).items():
            if Path(input_path).exists() and file_sha256(input_path) != recorded.get("sha256"):
                return f"{input_path} changed since {path} was written"
    return ""


def plan_stage(name: str, cfg: DictConfig, ledger: Ledger, force: bool = False) -> StagePlan:
    """What `stage=<name>` must run now; validates the stage's config first."""
    spec = get_stage(name)
    spec.validate(cfg)
    ranks = spec.ranks(cfg)
    if ranks == "cluster" and cfg.launcher.name == "local" and cfg.cluster.nodes != 1:
        raise ConfigError(f"launcher=local runs {name} on this machine only: cluster.nodes"
                          f"({cfg.cluster.nodes}) must be 1 (use launcher=slurm for "
                          f"{cfg.cluster.nodes} nodes)")
    key = spec.ledger_key(cfg)
    h = stage_hash(spec, cfg)
    subparts = list(spec.subparts(cfg))
    stale = stale_outputs(spec, cfg, h)
    if force or stale:
        todo = subparts
    else:
        todo = [s for s in subparts if not ledger.is_done(f"{key}/{s}", h)]
    done = not todo if subparts else (not force and not stale and ledger.is_done(key, h))
    return StagePlan(spec=spec, key=key, config_hash=h, subparts=subparts, todo=todo, done=done,
                     ranks=ranks, world_size=cluster_world_size(cfg.cluster) if ranks == "cluster" else 1,
                     stale_reason=stale)


def stages_for(stage: str) -> List[str]:
    """The stages `stage=<stage>` names, in run order."""
    return list(PIPELINE) if stage == "all" else [stage]


def ledger_for(cfg) -> Ledger:
    return Ledger(cluster_dir(cfg.profiles_dir, cfg.cluster.name))
