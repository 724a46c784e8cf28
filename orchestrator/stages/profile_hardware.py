"""profile_hardware: inventory, collectives, p2p and overlap, in one job, resumable per benchmark.

Writes profiles/<cluster.name>/hardware.json (schema: docs/profile-schema.md). Each benchmark is
a sub-part: it is merged into the file and marked done in the ledger as soon as it finishes, so a
rank killed in the middle of one loses only that one.
"""
from __future__ import annotations

from orchestrator.errors import ConfigError
from orchestrator.profiling.inventory import rank_inventory
from orchestrator.stages import StageSpec
from orchestrator.store import hardware_path, write_json

BENCHMARKS = ("inventory", "allreduce", "p2p", "reduce_scatter", "all_gather", "all2all", "overlap")


def _cluster_summary(cfg) -> dict:
    c = cfg.cluster
    return {"name": c.name, "nodes": c.nodes, "tasks_per_node": c.tasks_per_node,
            "world_size": c.nodes * c.tasks_per_node, "backend": c.backend,
            "gpus_per_node": c.gpus_per_node}


def _measure(name: str, ctx, cfg, progress=None):
    """Run benchmark `name` on every rank; returns its section of hardware.json (rank 0)."""
    if name == "inventory":
        records = ctx.gather(rank_inventory(ctx))
        return {"ranks": records} if ctx.is_root else None
    from orchestrator.profiling import collectives, overlap

    hw = cfg.profile_hardware
    if name == "overlap":
        return overlap.measure_overlap(ctx, hw)
    return collectives.run_benchmark(name, ctx, hw, on_point=progress)


def run(ctx, run):
    cfg = run.cfg
    path = hardware_path(cfg.profiles_dir, cfg.cluster.name)
    profile = None
    if ctx.is_root:
        profile = run.resume_profile(path, "hardware", "measured",
                                     cluster=_cluster_summary(cfg), inventory=None, benchmarks={})
    for name in run.todo:
        with run.subpart(name):
            section = _measure(name, ctx, cfg)
            if ctx.is_root:
                if name == "inventory":
                    profile["inventory"] = section
                else:
                    profile["benchmarks"][name] = section
                profile["provenance"] = run.provenance()
                write_json(path, profile)
    if not ctx.is_root:
        return None
    return {"path": str(path), "ran": list(run.todo),
            "hosts": sorted({r["node"] for r in (profile.get("inventory") or {}).get("ranks", [])})}


def validate(cfg) -> None:
    hw = cfg.profile_hardware
    unknown = [b for b in hw.benchmarks if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"profile_hardware.benchmarks: unknown {unknown}; allowed: {list(BENCHMARKS)}")
    if hw.source not in ("measured", "analytic"):
        raise ConfigError(f"profile_hardware.source={hw.source!r}; allowed: measured, analytic")


SPEC = StageSpec(
    name="profile_hardware",
    run=run,
    ledger_key=lambda cfg: "profile_hardware",
    outputs=lambda cfg: [hardware_path(cfg.profiles_dir, cfg.cluster.name)],
    hash_sections=("cluster", "profile_hardware"),
    hash_exclude=("profile_hardware.benchmarks", "profile_hardware.export", "profile_hardware.plot"),
    subparts=lambda cfg: [b for b in BENCHMARKS if b in cfg.profile_hardware.benchmarks],
    validate=validate,
)
