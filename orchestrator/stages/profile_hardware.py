"""profile_hardware: inventory, collectives, p2p and overlap, in one job, resumable per benchmark.

Writes profiles/<cluster.name>/hardware.json (schema: docs/profile-schema.md). Each benchmark is
a sub-part: it is merged into the file and marked done in the ledger as soon as it finishes, so a
rank killed in the middle of one loses only that one. With `profile_hardware.source=analytic` the
profile comes from the cluster's published link figures (`cluster.links`), in this process.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from orchestrator.config import cluster_world_size
from orchestrator.errors import ConfigError
from orchestrator.choices import Backend, HardwareSource, Ranks
from orchestrator.profiling.hardware.benchmarks import BENCHMARKS
from orchestrator.stages import Stage
from orchestrator.store import PNG_DPI, cluster_dir, hardware_path, write_profile
from orchestrator.store.schema import HardwareProfile


def _cluster_summary(cfg) -> dict:
    c = cfg.cluster
    return {"name": c.name, "nodes": c.nodes, "tasks_per_node": c.tasks_per_node,
            "world_size": cluster_world_size(c), "backend": c.backend,
            "gpus_per_node": c.gpus_per_node}


def link_sheet(cfg):
    from orchestrator.profiling.hardware.analytic import LinkSheet

    gpus = cfg.cluster.gpus_per_node or cfg.cluster.tasks_per_node
    return LinkSheet(gpus_per_node=gpus, **dataclasses.asdict(cfg.cluster.links))


def _progress(ctx, names):
    """A rich progress bar on rank 0 (a no-op elsewhere): one task per benchmark."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not ctx.is_root:
        return None, lambda *a: None
    from orchestrator.console import stage_console

    progress = Progress(TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stage_console())
    tasks = {n: progress.add_task(n, total=None) for n in names}

    def on_point(name, done, total):
        progress.update(tasks[name], completed=done, total=total)

    return progress, on_point


def _finish_outputs(profile: dict, cfg, path: Path) -> dict:
    """Table, PNG and exports next to hardware.json (rank 0, at the end)."""
    from orchestrator.console import stage_console
    from orchestrator.profiling.hardware.report import plot_busbw, print_report

    outputs = {"path": str(path)}
    print_report(profile, console=stage_console())
    hw = cfg.profile_hardware
    if hw.plot and any(b.get("points") for b in profile["benchmarks"].values() if isinstance(b, dict)):
        outputs["plot"] = str(plot_busbw(profile, path.with_name("hardware.png")))
    if hw.export == "galvatron":
        from orchestrator.interop.galvatron.hardware import write_galvatron_dir

        files = write_galvatron_dir(profile, cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "galvatron")
        outputs["galvatron"] = [str(f) for f in files]
    return outputs


def run_profile(ctx, run):
    cfg = run.cfg
    (path,) = run.plan.outputs
    if cfg.profile_hardware.source == "analytic":
        return _run_analytic(ctx, run, path)
    profile = None
    if ctx.is_root:
        profile = run.resume_profile(path, "hardware", "measured", identity="cluster",
                                     cluster=_cluster_summary(cfg), inventory=None, benchmarks={})
    progress, on_point = _progress(ctx, [n for n in run.todo if n != "inventory"])
    if progress is not None:
        progress.start()
    try:
        for name in run.todo:
            with run.subpart(name):
                section = BENCHMARKS[name](ctx, cfg.profile_hardware, on_point)
                if ctx.is_root:
                    if name == "inventory":
                        profile["inventory"] = section
                    else:
                        profile["benchmarks"][name] = section
                    run.mark_part(profile, name)
                    write_profile(path, HardwareProfile.from_dict(profile))
    finally:
        if progress is not None:
            progress.stop()
    if not ctx.is_root:
        return None
    outputs = _finish_outputs(profile, cfg, path)
    return {**outputs, "ran": list(run.todo),
            "nodes": sorted({r["node"] for r in (profile.get("inventory") or {}).get("ranks", [])})}


def _run_analytic(ctx, run, path: Path) -> dict:
    """The whole profile from published figures (no measurement): marked source=analytic."""
    from orchestrator.profiling.hardware.analytic import analytic_hardware

    cfg = run.cfg
    world = cluster_world_size(cfg.cluster)
    with run.subpart("analytic"):
        profile = analytic_hardware(cfg.cluster.name, world, link_sheet(cfg),
                                    max_tp=cfg.profile_hardware.max_tp)
        record = profile.to_dict()
        run.mark_part(record, "analytic")
        profile = HardwareProfile.from_dict(record)
        run.keep_aside_other(path, "hardware", "analytic", "cluster", record["cluster"])
        write_profile(path, profile)
    return _finish_outputs(profile.to_dict(), cfg, path)


def _check_bounds(hw) -> None:
    """Sizes and iteration counts the sampler would refuse only after the ranks start."""
    lower = {"min_size_bytes": 1, "warmup_iters": 0, "min_iters": 1, "max_tp": 1}
    for key, least in lower.items():
        if getattr(hw, key) < least:
            raise ConfigError(f"profile_hardware.{key}({getattr(hw, key)}) must be >= {least}")
    if hw.max_size_bytes is not None and hw.max_size_bytes < hw.min_size_bytes:
        raise ConfigError(f"profile_hardware.max_size_bytes({hw.max_size_bytes}) must be >= "
                          f"profile_hardware.min_size_bytes({hw.min_size_bytes})")
    if hw.max_iters < hw.min_iters:
        raise ConfigError(f"profile_hardware.max_iters({hw.max_iters}) must be >= "
                          f"profile_hardware.min_iters({hw.min_iters})")
    if hw.max_time_s <= 0:
        raise ConfigError(f"profile_hardware.max_time_s({hw.max_time_s}) must be > 0")
    if hw.rel_spread < 0:  # 0 is allowed: never stop early (every point runs max_time_s)
        raise ConfigError(f"profile_hardware.rel_spread({hw.rel_spread}) must be >= 0")


def validate(cfg) -> None:
    """Refuse what cannot be measured on this cluster, before anything is launched."""
    from orchestrator.profiling.hardware.groups import check_group_size, check_pp

    hw = cfg.profile_hardware
    unknown = [b for b in hw.benchmarks if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"profile_hardware.benchmarks: unknown {unknown}; allowed: {list(BENCHMARKS)}")
    if hw.size_step < 2:
        raise ConfigError(f"profile_hardware.size_step({hw.size_step}) must be >= 2")
    _check_bounds(hw)
    world = cluster_world_size(cfg.cluster)
    try:
        if hw.max_group is not None:
            check_group_size(world, hw.max_group)
        if hw.max_pp is not None:
            check_pp(world, hw.max_pp)
    except ConfigError as e:
        raise ConfigError(f"profile_hardware: {e}") from None
    if hw.source == "analytic":
        link_sheet(cfg)  # its own checks (positive figures, overlap_coe >= 1)


def stand_in_bytes(cfg) -> int:
    """About how many bytes hardware.json and (with plot) hardware.png take: those of a
    stand-in profile of the same shape, the analytic one from cluster.links at the message
    sizes, group sizes and benchmarks configured (its inventory and provenance left out: small
    beside the points). ConfigError where no analytic profile exists (one rank)."""
    import io

    from orchestrator.profiling.hardware.analytic import analytic_benchmarks

    hw, world = cfg.profile_hardware, cluster_world_size(cfg.cluster)
    sizes, names = None, None  # analytic: its own sizes, every section
    if hw.source != HardwareSource.analytic:
        from orchestrator.profiling.hardware.collectives import default_max_bytes, message_sizes

        device = "cuda" if cfg.cluster.backend == Backend.nccl else "cpu"
        sizes = message_sizes(hw.min_size_bytes, hw.max_size_bytes or default_max_bytes(device),
                              hw.size_step)
        names = set(hw.benchmarks)
    benchmarks = analytic_benchmarks(world, link_sheet(cfg), max_tp=hw.max_tp,
                                     max_pp=None if names is None else hw.max_pp, sizes=sizes)
    record = {"kind": "hardware", "source": str(hw.source), "cluster": _cluster_summary(cfg),
              "benchmarks": {k: v for k, v in benchmarks.items() if names is None or k in names}}
    n_bytes = len(json.dumps(record, indent=1, default=str))
    if hw.plot and any(b.get("points") for b in record["benchmarks"].values()):
        import matplotlib.pyplot as plt

        from orchestrator.profiling.hardware.report import build_busbw_figure

        fig = build_busbw_figure(record)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=PNG_DPI)
        plt.close(fig)
        n_bytes += png.tell()
    return n_bytes


class ProfileHardware(Stage):
    name = "profile_hardware"
    rank_imports = ("scipy.optimize", "orchestrator.profiling.hardware.collectives")  # the fits
    hash_sections = ("cluster", "profile_hardware")
    hash_exclude = ("profile_hardware.benchmarks", "profile_hardware.export",
                    "profile_hardware.plot")

    def plan(self, cfg):
        from orchestrator.limits import check_message_size

        validate(cfg)
        check_message_size(cfg.limits, cfg.profile_hardware.max_size_bytes)
        analytic = cfg.profile_hardware.source == HardwareSource.analytic
        subparts = (["analytic"] if analytic
                    else [b for b in BENCHMARKS if b in cfg.profile_hardware.benchmarks])
        # Fewer than all named: `benchmarks=[all2all]` redoes all2all (README: redo one part).
        selection = subparts if len(subparts) < len(BENCHMARKS) and not analytic else ()
        return self.make_plan(cfg, key="profile_hardware",
                              ranks=Ranks.one if analytic else Ranks.cluster, subparts=subparts,
                              selection=selection,
                              outputs=[hardware_path(cfg.profiles_dir, cfg.cluster.name)])

    def run(self, ctx, run):
        return run_profile(ctx, run)

    def disk_bytes(self, cfg) -> Optional[int]:
        return stand_in_bytes(cfg)


STAGE = ProfileHardware()
