"""Planning: which stages and sub-parts must run, which are done (same config hash, outputs there).

Pure functions of the config and the ledger; nothing here launches anything. A stage is planned
once (`plan_stage`: the stage's own plan plus its config hash); what to run of it now
(`decide`) is asked again right before its launch, because an earlier stage of the same command
may just have written its inputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from orchestrator.choices import Backend, LauncherName, Ranks
from orchestrator.config import SUBMISSION_ONLY_FIELDS, Config
from orchestrator.errors import ConfigError
from orchestrator.stages import (PIPELINE, Stage, StagePlan, check_ranks_reachable,
                                 get_stage)
from orchestrator.store import cluster_dir, config_hash, file_sha256, read_json
from orchestrator.store.ledger import Ledger, LedgerEntry, State
from orchestrator.sweep import labelled, point_label


@dataclass(frozen=True)
class Decision:
    """What of a planned stage runs now."""

    todo: Tuple[str, ...]  # sub-parts to run now, in order
    done: bool  # nothing to run: the stage (and every sub-part) done under this hash
    stale_reason: str = ""  # why earlier results are not reused, if they are not
    # Why a stage whose sub-parts are all done runs again (with none): it did not finish.
    unfinished: str = ""


def validate_cluster(cfg: Config) -> None:
    """Raise ConfigError for a cluster layout that cannot run, naming the numbers."""
    c = cfg.cluster
    if c.nodes < 1 or c.tasks_per_node < 1:
        raise ConfigError(f"cluster.nodes({c.nodes}) and cluster.tasks_per_node"
                          f"({c.tasks_per_node}) must both be >= 1")
    if c.backend == Backend.nccl and c.gpus_per_node != c.tasks_per_node:
        raise ConfigError(f"cluster.backend=nccl runs one rank per GPU: cluster.tasks_per_node"
                          f"({c.tasks_per_node}) != cluster.gpus_per_node({c.gpus_per_node})")


def check_launchable(plan: StagePlan, cfg: Config) -> None:
    """Raise ConfigError when this launcher cannot start the plan's ranks."""
    check_ranks_reachable(plan.stage, plan.ranks, cfg)
    if plan.ranks == Ranks.cluster and cfg.launcher.name == LauncherName.local:
        from orchestrator.limits import check_limit  # each rank a process on this machine

        check_limit(cfg.limits, "max_local_ranks", plan.world_size,
                    f"cluster.tasks_per_node={cfg.cluster.tasks_per_node}",
                    "ranks launcher=local starts on this machine")
        if cfg.cluster.backend == Backend.nccl:  # one rank per GPU of this machine
            import torch

            gpus = torch.cuda.device_count()
            if gpus < plan.world_size:
                raise ConfigError(
                    f"cluster={cfg.cluster.name} is an nccl cluster (one rank per GPU) and "
                    f"launcher=local starts its {plan.world_size} ranks on this machine, which "
                    f"has {gpus} GPU(s): use launcher=slurm, or a gloo cluster here "
                    f"(cluster=local)")


def _drop(section: dict, dotted: str) -> None:
    head, _, leaf = dotted.rpartition(".")
    for part in head.split(".") if head else []:
        section = section.get(part, {})
    section.pop(leaf, None)


def stage_hash(stage: Stage, cfg: Config, input_hashes: Dict[str, str]) -> str:
    """Hash of what decides whether the stage's results are still valid: its config sections
    (less `hash_exclude`) and the hashes of the stages that write its inputs."""
    section = {}
    for name in stage.hash_sections:
        node = dataclasses.asdict(getattr(cfg, name))
        if name == "cluster":
            node = {k: v for k, v in node.items() if k not in SUBMISSION_ONLY_FIELDS}
        section[name] = node
    section.update(stage.hash_extra(cfg))
    # Known before the producers run, so a Slurm chain records the hash a later plan computes.
    section["inputs"] = dict(input_hashes)
    for dotted in stage.hash_exclude:
        _drop(section, dotted)
    return config_hash(section)


def _sweep_point(plan: StagePlan, label: str) -> StagePlan:
    """The plan of one sweep point: its own ledger key and output files (see orchestrator.sweep)."""
    if not label:
        return plan
    return dataclasses.replace(plan, key=f"{plan.key}@{label}",
                               former_key=plan.former_key and f"{plan.former_key}@{label}",
                               outputs=tuple(labelled(p, label) for p in plan.outputs))


def plan_stage(name: str, cfg: Config, plans: Optional[Dict[str, StagePlan]] = None) -> StagePlan:
    """The stage's plan with its config hash; validates the stage's config first. `plans`
    caches the plans of this command (a producer's hash is part of its consumers')."""
    plans = {} if plans is None else plans
    if name not in plans:
        stage = get_stage(name)
        plan = _sweep_point(stage.plan(cfg), point_label(cfg, stage.sweep_section))
        inputs = {i.producer: plan_stage(i.producer, cfg, plans).config_hash for i in plan.inputs}
        plans[name] = dataclasses.replace(plan, config_hash=stage_hash(stage, cfg, inputs))
    return plans[name]


def stale_outputs(plan: StagePlan, folder: Path) -> str:
    """Why the stage's output files cannot be reused ("" if they can): missing, corrupt, written
    under another config (a stage without sub-parts; with them, staleness is per sub-part:
    `decide`), or built from input files that have changed since (e.g. measured again). Input
    keys are paths relative to the cluster's profiles `folder`; other keys (older files) are
    stale."""
    expected = {str(i.path.relative_to(folder)) for i in plan.inputs}
    for path in plan.outputs:
        if not path.exists():
            return f"{path} missing"
        try:
            written = read_json(path)
        except ValueError:
            return f"{path} corrupt"
        if not plan.subparts and written.get("provenance", {}).get("config_hash") != plan.config_hash:
            return f"{path} was written under another config"
        inputs = written.get("inputs") or {}
        if plan.inputs and set(inputs) != expected:
            return f"{path} names its inputs by other paths ({', '.join(sorted(inputs))})"
        for key, recorded in inputs.items():
            if (folder / key).exists() and file_sha256(folder / key) != recorded.get("sha256"):
                return f"{folder / key} changed since {path} was written"
    return ""


def parts_made(plan: StagePlan) -> Tuple[Dict[str, dict], Tuple[str, ...]]:
    """Sub-part name -> what it was made under (`parts` of the output file), and the parts the
    file says a run has yet to make (`unfinished`: a stopped run's); ({}, ()) if unreadable."""
    try:
        written = read_json(plan.outputs[0]) if plan.outputs else {}
        return dict(written.get("parts") or {}), tuple(written.get("unfinished") or ())
    except (OSError, ValueError, AttributeError):
        return {}, ()


def _part_current(plan: StagePlan, ledger: Ledger, name: str, made: Optional[dict]) -> bool:
    """Done under this hash in the ledger and in the file; for a named selection, also made by
    that same selection (so naming a part redoes it, and rerunning that command resumes)."""
    if made is None or made.get("config_hash") != plan.config_hash:
        return False
    if plan.selection and tuple(made.get("selection") or ()) != plan.selection:
        return False
    return ledger.is_done(f"{plan.key}/{name}", plan.config_hash)


def decide(plan: StagePlan, ledger: Ledger, force: bool = False) -> Decision:
    """What of `plan` must run now, from the ledger and the output files.

    A stage is done only when it is done in the ledger: rank 0 marks it so after its last
    write (a report, a plot: after every sub-part), so a stage that failed there (a full disk)
    runs again, with no sub-part to redo, and `stage=status` and the rerun agree."""
    if get_stage(plan.stage).always_runs:
        return Decision(todo=plan.subparts, done=False)
    stale = stale_outputs(plan, ledger.path.parent)
    left: Tuple[str, ...] = ()  # what the output file says a stopped run had yet to make
    if force or stale:
        todo = plan.subparts
    else:
        made, left = parts_made(plan)
        todo = tuple(s for s in plan.subparts if s in left
                     or not _part_current(plan, ledger, s, made.get(s)))
    done = (not force and not stale and not todo and not left
            and (ledger.is_done(plan.key, plan.config_hash)
                 or (plan.former_key is not None and ledger.get(plan.key) is None
                     and ledger.is_done(plan.former_key, plan.config_hash))))
    unfinished = ""
    if plan.subparts and not todo and not done:
        entry = ledger.get(plan.key)
        unfinished = (f"every part is done, the stage is not "
                      f"({entry.state if entry else 'not in the ledger'}); finishing it"
                      if not left else
                      f"every planned part is done; the file still lists "
                      f"{', '.join(left)} as unfinished; finishing it")
    return Decision(todo=tuple(todo), done=done, stale_reason=stale, unfinished=unfinished)


def stages_for(stage: str) -> List[str]:
    """The stages `stage=<stage>` names, in run order."""
    return list(PIPELINE) if stage == "all" else [stage]


def ledger_for(cfg: Config) -> Ledger:
    """The cluster's ledger; a corrupt one is rebuilt from the output files (`rebuild_entries`)."""
    return Ledger(cluster_dir(cfg.profiles_dir, cfg.cluster.name), rebuild=rebuild_entries)


def _train_key(path: Path) -> str:
    """The ledger key of a train summary: `train/<model>/<stem>` (a layout's, a sweep point's
    `<tag>@<label>`), `train/<model>@tune=<tag>` for stage=tune's candidates."""
    tag, _, label = path.stem.partition("@")
    if label == "tune":
        return f"train/{path.parent.name}@tune={tag}"
    return f"train/{path.parent.name}/{path.stem}"


# Output files of a cluster folder: (glob, kind, the ledger key of a file's path).
_OUTPUTS = (("hardware.json", "hardware", lambda path: "profile_hardware"),
            ("model/*.json", "model", lambda path: f"profile_model/{path.stem}"),
            ("strategy/*.json", "strategy", lambda path: f"search/{path.stem}"),
            ("train/*/*.json", "train", _train_key))


def rebuild_entries(folder: Path) -> Tuple[Dict[str, LedgerEntry], List[str]]:
    """Ledger entries rebuilt from the provenance of the output files in a cluster folder:
    each file's stage key and each of its `parts`, done under the hash they were made under;
    and the files read (relative to `folder`). Unreadable files are left to be redone."""
    entries: Dict[str, LedgerEntry] = {}
    files: List[str] = []
    for pattern, kind, key_of in _OUTPUTS:
        for path in sorted(folder.glob(pattern)):
            try:
                written = read_json(path)
                prov = written["provenance"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not isinstance(written, dict) or written.get("kind") != kind:
                continue  # e.g. strategy/<m>.layout.json
            key = key_of(path)
            left = written.get("unfinished") or []  # a stopped run's: not done
            entries[key] = LedgerEntry(state=State.cancelled if left else State.done,
                                       config_hash=prov.get("config_hash"),
                                       job_id=prov.get("job_id"), started=prov.get("started"),
                                       ended=prov.get("ended"))
            for name, made in (written.get("parts") or {}).items():
                if name in left:
                    continue
                entries[f"{key}/{name}"] = LedgerEntry(
                    state=State.done, config_hash=made.get("config_hash"),
                    job_id=made.get("job_id"), ended=made.get("ended"))
            files.append(str(path.relative_to(folder)))
    return entries, files
