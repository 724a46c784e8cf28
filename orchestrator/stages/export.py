"""export: our profiles and strategy in another tool's files (`stage=export export.path=<dir>`).

Galvatron's for now, the reverse of `stage=import`: hardware.json -> allreduce_bandwidth_*,
p2p_bandwidth_* (also the one-node file of a multi-node profile, so intra- and inter-node links
stay apart), sp_time_*, overlap_coefficient.json; model/<model>.json -> computation_profiling_*
and memory_profiling_* in Galvatron 2.4's layout; strategy/<model>.json's Galvatron form ->
galvatron_config_<model>_<N>nodes_<G>gpus_per_node_<M>GB_<dtype>.json. What exists is exported
(at least one of the three); `stage=import import.path=<dir>` reads the folder back. Runs in one
process, every time it is asked. The folder is the user's: a file there that export did not
write, or one changed since it wrote it, is kept as `<name>.orig-<time>` before it is replaced,
and the stage says which (store/user_folder.py; force=true changes nothing of this).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from orchestrator.choices import Ranks
from orchestrator.errors import ConfigError, ProfileError
from orchestrator.stages import Stage
from orchestrator.store import hardware_path, model_profile_path, read_profile, strategy_path
from orchestrator.store.schema import HardwareProfile, ModelProfile, StrategyProfile

FORMATS = ("galvatron",)


def _sources(cfg) -> Dict[str, Path]:
    """kind -> our file of that kind that exists for this cluster and model."""
    files = {"hardware": hardware_path(cfg.profiles_dir, cfg.cluster.name),
             "model": model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name),
             "strategy": strategy_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)}
    return {kind: path for kind, path in files.items() if path.exists()}


def strategy_file_name(model: str, nodes: int, gpus_per_node: int, memory_GiB: float,
                       dtype: str) -> str:
    """Galvatron's name for a strategy file (its search engine writes the same pattern)."""
    return (f"galvatron_config_{model}_{nodes}nodes_{gpus_per_node}gpus_per_node_"
            f"{memory_GiB:g}GB_{dtype}.json")


def galvatron_files(cfg, sources: Dict[str, Path]) -> Dict[str, object]:
    """File name -> JSON body of every Galvatron file our profiles and strategy make."""
    from orchestrator.interop.galvatron.hardware import to_galvatron
    from orchestrator.interop.galvatron.model import galvatron_model_files

    files: Dict[str, object] = {}
    if "hardware" in sources:
        hardware = read_profile(sources["hardware"], HardwareProfile, _rebuild("profile_hardware"),
                               config=cfg)
        files.update(to_galvatron(hardware.to_dict()))
    if "model" in sources:
        model = read_profile(sources["model"], ModelProfile, _rebuild("profile_model"),
                             config=cfg)
        files.update(galvatron_model_files(model))
    if "strategy" in sources:
        strategy = read_profile(sources["strategy"], StrategyProfile, _rebuild("search"))
        if strategy.exports.galvatron is None:
            raise ProfileError(f"{sources['strategy']} has no Galvatron form: "
                               f"{strategy.exports.galvatron_error}")
        c = cfg.cluster
        name = strategy_file_name(cfg.model.name, c.nodes, c.gpus_per_node or c.tasks_per_node,
                                  strategy.space.memory_GiB, str(cfg.model.dtype))
        files[name] = strategy.exports.galvatron
    return files


def run_export(ctx, run) -> dict:
    from rich.markup import escape

    from orchestrator.console import stage_console
    from orchestrator.store.user_folder import UserFolder

    cfg = run.cfg
    out = Path(cfg.export.path).expanduser()
    files = galvatron_files(cfg, _sources(cfg))  # every profile read before anything is written
    # The folder is the user's: a file there we did not write, or one edited since, is kept.
    with UserFolder(out) as folder:
        written: List[Path] = [folder.write_json(name, body) for name, body in files.items()]
    console = stage_console()
    console.print(f"wrote {len(written)} Galvatron files to {escape(str(out))}: "
                  + escape(", ".join(p.name for p in written)))
    for kept in folder.kept:
        console.print(f"[yellow]{escape(kept.describe())}[/]")
    return {"path": str(out), "files": [str(p) for p in written],
            "kept": [str(k.copy) for k in folder.kept]}


def _rebuild(stage: str) -> str:
    from orchestrator.commands import rerun_command

    return rerun_command(stage)


class Export(Stage):
    name = "export"
    hash_sections = ("cluster", "model", "export")
    torch_distributed = False
    always_runs = True  # the profiles exported may have changed since; exporting takes ms

    def plan(self, cfg):
        spec = cfg.export
        if not spec.path:
            raise ConfigError("stage=export needs export.path=<a folder to write into>")
        out = Path(spec.path).expanduser()
        if out.exists() and not out.is_dir():
            raise ConfigError(f"export.path={spec.path} is a file: export writes a folder of "
                              f"files; give a folder (new or existing)")
        if spec.format not in FORMATS:
            raise ConfigError(f"export.format={spec.format!r}; allowed: {', '.join(FORMATS)}")
        if cfg.model.experts:
            raise ConfigError(f"model={cfg.model.name} is a mixture-of-experts model; Galvatron's "
                              f"profile and strategy files describe dense transformers only")
        sources = _sources(cfg)
        if not sources:
            raise ConfigError(
                f"nothing to export for cluster={cfg.cluster.name} model={cfg.model.name} in "
                f"{cfg.profiles_dir}: no hardware.json, model/{cfg.model.name}.json or "
                f"strategy/{cfg.model.name}.json (profile, import or search first)")
        return self.make_plan(cfg, key=f"export/{cfg.model.name}", ranks=Ranks.one,
                              detail=tuple(sources))

    def run(self, ctx, run):
        return run_export(ctx, run)


STAGE = Export()
