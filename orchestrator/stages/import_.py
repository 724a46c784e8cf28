"""import: another tool's profiles into ours (`stage=import import.path=<dir>`).

Galvatron's files for now (orchestrator/interop/galvatron/): its hardware files
(allreduce_bandwidth_*, p2p_bandwidth_*, sp_time_*, overlap_coefficient.json) become
profiles/<cluster>/hardware.json for the shape `cluster.nodes` x `cluster.tasks_per_node`, its model
profiles (computation_profiling_*, memory_profiling_*) become profiles/<cluster>/model/<model>.json
for `model=`. Both carry `"source": "galvatron"` and an `imported` record: the files read, every
field that does not map and every assumption made (also printed once). `stage=search` then runs on
them as on our own profiles. `import.path` is searched recursively; the hardware files and the model
files may sit in different sub-folders (Galvatron keeps them apart), but each kind must come from
one folder. Runs in one process, every time it is asked (the files may have changed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from orchestrator.choices import Ranks, Source
from orchestrator.errors import ConfigError, ProfileError
from orchestrator.stages import Stage
from orchestrator.store import hardware_path, model_profile_path, write_profile
from orchestrator.store.schema import HardwareProfile, ImportRecord, ModelProfile, Provenance

FORMATS = ("galvatron",)
# File name prefixes of each kind of Galvatron file.
GALVATRON_FILES = {
    "hardware": ("allreduce_bandwidth_", "p2p_bandwidth_", "sp_time_", "overlap_coefficient"),
    "model": ("computation_profiling_", "memory_profiling_"),
    "strategy": ("galvatron_config_",),
}


def galvatron_folders(root: Path) -> Dict[str, List[Path]]:
    """Kind ("hardware" | "model" | "strategy") -> the folders under `root` (itself included)
    holding JSON files of that kind, sorted."""
    found: Dict[str, set] = {kind: set() for kind in GALVATRON_FILES}
    for path in root.rglob("*.json"):
        for kind, prefixes in GALVATRON_FILES.items():
            if path.name.startswith(prefixes):
                found[kind].add(path.parent)
    return {kind: sorted(dirs) for kind, dirs in found.items()}


def detect_format(root: Path) -> str:
    """The format of the files under `root` ("galvatron"); ConfigError when none is known."""
    folders = galvatron_folders(root)
    if folders["hardware"] or folders["model"]:
        return "galvatron"
    hint = (" (only Galvatron strategies: price one with "
            "`python -m orchestrator stage=search search.compare=<galvatron_config_*.json>`)"
            if folders["strategy"] else "")
    raise ConfigError(f"import.path={root} holds no profile files of a known format{hint}; "
                      f"Galvatron's are allreduce_bandwidth_*.json, p2p_bandwidth_*.json, "
                      f"sp_time_*.json, overlap_coefficient.json (hardware) and "
                      f"computation_profiling_*.json, memory_profiling_*.json (model)")


@dataclass(frozen=True)
class ImportPlan:
    format: str
    root: Path
    hardware_dir: Optional[Path]
    model_dirs: Tuple[Path, ...]  # candidates: the one matching the model is used


def _plan(cfg) -> ImportPlan:
    spec = cfg.import_
    if not spec.path:
        raise ConfigError("stage=import needs import.path=<a folder of profile files>, e.g. "
                          "Galvatron's hardware_configs/ or a model's configs/ folder")
    root = Path(spec.path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"import.path={spec.path}: no such folder")
    if spec.format not in ("auto",) + FORMATS:
        raise ConfigError(f"import.format={spec.format!r}; allowed: auto, {', '.join(FORMATS)}")
    fmt = detect_format(root) if spec.format == "auto" else spec.format
    folders = galvatron_folders(root)
    if len(folders["hardware"]) > 1:
        raise ConfigError(f"import.path={root} holds Galvatron hardware files in "
                          f"{len(folders['hardware'])} folders "
                          f"({', '.join(str(d) for d in folders['hardware'])}); point "
                          f"import.path at one of them")
    return ImportPlan(format=fmt, root=root,
                      hardware_dir=folders["hardware"][0] if folders["hardware"] else None,
                      model_dirs=tuple(folders["model"]))


def _record(plan: ImportPlan, imported) -> ImportRecord:
    def rel(path: Path) -> str:
        try:
            return str(Path(path).relative_to(plan.root))
        except ValueError:
            return str(path)

    return ImportRecord(format=plan.format, path=str(plan.root.resolve()),
                        files=[rel(f) for f in imported.files],
                        unmapped=list(imported.unmapped), assumptions=list(imported.assumptions))


def _import_model(cfg, plan: ImportPlan):
    """The model folder's import for `cfg.model`: the one folder whose files match it."""
    from orchestrator.interop.galvatron.model import import_model

    if cfg.model.experts:
        raise ConfigError(f"model={cfg.model.name} is a mixture-of-experts model; Galvatron's "
                          f"model profiles describe dense transformers only")
    matches, misses = [], []
    for folder in plan.model_dirs:
        try:
            matches.append(import_model(folder, cfg.model))
        except ProfileError as e:
            misses.append(str(e))
    if len(matches) > 1:
        where = ", ".join(str(m.files[0].parent) for m in matches)
        raise ConfigError(f"Galvatron model profiles for model={cfg.model.name} in several "
                          f"folders ({where}); point import.path at one of them")
    if not matches:
        raise ProfileError(misses[0] if len(misses) == 1 else
                           f"no Galvatron model profile under {plan.root} matches "
                           f"model={cfg.model.name}: " + "; ".join(misses))
    return matches[0]


def _print_lists(label: str, imported) -> None:
    from rich.markup import escape

    from orchestrator.console import stage_console

    console = stage_console()
    files = ", ".join(Path(f).name for f in imported.files)
    console.print(f"{label}: read {escape(files)}")
    for line in imported.unmapped:
        console.print(f"  not mapped: {escape(line)}")
    for line in imported.assumptions:
        console.print(f"  assumed: {escape(line)}")


def run_import(ctx, run) -> dict:
    cfg, plan = run.cfg, run.plan.detail
    prov = Provenance.from_dict(run.provenance())
    written: Dict[str, str] = {}
    if plan.hardware_dir is not None:
        from orchestrator.interop.galvatron.hardware import import_hardware

        c = cfg.cluster
        imported = import_hardware(plan.hardware_dir, cluster_name=c.name, nodes=c.nodes,
                                   gpus_per_node=c.gpus_per_node or c.tasks_per_node,
                                   dtype=str(cfg.model.dtype))
        profile = HardwareProfile.from_dict(
            {"kind": "hardware", "source": Source.galvatron.value, **imported.body}, "hardware")
        profile.provenance, profile.imported = prov, _record(plan, imported)
        path = hardware_path(cfg.profiles_dir, c.name)
        run.keep_aside_other(path, "hardware", Source.galvatron.value, "cluster",
                             profile.to_dict()["cluster"])
        write_profile(path, profile)
        _print_lists(f"hardware -> {path}", imported)
        written["hardware"] = str(path)
    if plan.model_dirs:
        imported = _import_model(cfg, plan)
        profile = ModelProfile.from_dict(
            {"kind": "model", "source": Source.galvatron.value, **imported.body}, "model")
        profile.provenance, profile.imported = prov, _record(plan, imported)
        path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
        run.keep_aside_other(path, "model", Source.galvatron.value, "model",
                             profile.to_dict()["model"])
        write_profile(path, profile)
        _print_lists(f"model -> {path}", imported)
        written["model"] = str(path)
    return {"format": plan.format, **written}


class Import(Stage):
    name = "import"
    hash_sections = ("cluster", "model", "import_")
    torch_distributed = False
    always_runs = True  # the files imported may have changed since; importing takes ms

    def plan(self, cfg):
        detail = _plan(cfg)
        outputs = ([hardware_path(cfg.profiles_dir, cfg.cluster.name)] if detail.hardware_dir
                   else [])
        if detail.model_dirs:
            outputs.append(model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name))
        return self.make_plan(cfg, key=f"import/{cfg.model.name}", ranks=Ranks.one,
                              outputs=outputs, detail=detail)

    def run(self, ctx, run):
        return run_import(ctx, run)


STAGE = Import()
