"""profile_model: compute time and memory of one block and of the "other" parts, per (seq, tp);
for a mixture-of-experts model also its FFN's parts (routing, experts, shared expert), sub-part
`moe`.

Writes profiles/<cluster.name>/model/<model.name>.json (schema: docs/profile-schema.md), and next
to it a PNG (time and activation memory against sequence length). Each (sequence length, TP
degree) point is a sub-part named `seq<S>_tp<T>`: it is merged into the file and marked done in
the ledger as soon as it finishes, so a rerun after a crash redoes only the missing points.

What runs is planned by profiling.model.plan (source measured or analytic, lengths, TP degrees);
each point is run by profiling.model.runner, on every rank (measured) or in this process
(analytic, ranks="one").
"""
from __future__ import annotations

import logging

from orchestrator.choices import ModelSource, Ranks
from orchestrator.models.config import ModelConfig
from orchestrator.profiling.model.plan import (MOE_PART, ProfilePlan, parse_point, plan_profile,
                                               point_name)
from orchestrator.stages import Stage
from orchestrator.store import model_profile_path, write_profile
from orchestrator.store.schema import ModelProfile
from orchestrator.store.schema.identity import model_summary

log = logging.getLogger("orchestrator.profile_model")


def _merge_point(profile: dict, point: dict) -> None:
    key = (point["seq_len"], point["tp"])
    profile["points"] = [p for p in profile["points"] if (p["seq_len"], p["tp"]) != key]
    profile["points"].append(point)
    profile["points"].sort(key=lambda p: (p["tp"], p["seq_len"]))


def _drop_unplanned(profile: dict, plan) -> None:
    """Drop points this plan never redoes that were made under other settings (e.g. another
    seq_lens list): they would stay in the fits for good. Planned ones stay until redone."""
    parts = profile.get("parts") or {}

    def keep(point):
        name = point_name(point["seq_len"], point["tp"])
        return (name in plan.subparts
                or parts.get(name, {}).get("config_hash") == plan.config_hash)

    profile["points"] = [p for p in profile["points"] if keep(p)]
    profile["parts"] = {n: parts[n] for n in parts
                        if n in plan.subparts or parts[n].get("config_hash") == plan.config_hash}
    if MOE_PART not in profile["parts"]:  # a MoE section this plan does not make or redo
        profile.pop("moe", None)


def _refresh_derived(profile: dict, model: ModelConfig, batch: int) -> None:
    from orchestrator.profiling.model.fit import fit_points
    from orchestrator.profiling.model.memory import memory_summary

    profile["fits"] = fit_points(profile["points"])
    profile["memory"] = memory_summary(profile["points"], model, batch)


def run_profile(ctx, run):
    from orchestrator.profiling.model import report as model_report
    from orchestrator.profiling.model.moe import moe_section
    from orchestrator.profiling.model.runner import point_runner

    cfg = run.cfg
    plan: ProfilePlan = run.plan.detail
    model = cfg.model
    batch = int(cfg.profile_model.micro_batch_size)
    (path,) = run.plan.outputs
    todo = [parse_point(n) for n in run.todo if n != MOE_PART]
    tps = list(dict.fromkeys(tp for _, tp in todo))
    runner = point_runner(ctx, cfg, plan, tps)
    profile = None
    if ctx.is_root:
        profile = run.resume_profile(path, "model", plan.source, identity="model",
                                     model=model_summary(model), micro_batch_size=batch,
                                     points=[], fits={}, memory={})
        _drop_unplanned(profile, run.plan)
        profile["method"] = runner.timing.method(plan)
    progress = _progress(ctx, plan, len(run.todo))
    try:
        for tp in tps:
            seqs = [s for s, t in todo if t == tp]
            with runner.for_tp(tp, max(seqs)):
                for seq in seqs:
                    name = point_name(seq, tp)
                    if progress:
                        progress.update(progress.task, description=f"{name} ({plan.source})")
                    with run.subpart(name):
                        record = runner.point(seq, tp)
                        if ctx.is_root:
                            _merge_point(profile, record)
                            _refresh_derived(profile, model, batch)
                            run.mark_part(profile, name)
                            write_profile(path, ModelProfile.from_dict(profile))
                            log.info("%s:%s", name,
                                     model_report.point_line(record, batch, markup=False))
                    if progress:
                        progress.console.print(model_report.point_line(record, batch))
                        progress.advance(progress.task)
        if MOE_PART in run.todo:
            if progress:
                progress.update(progress.task, description=f"{MOE_PART} ({plan.source})")
            with run.subpart(MOE_PART):
                records = runner.moe()
                if ctx.is_root:
                    profile["moe"] = moe_section(model, records)
                    run.mark_part(profile, MOE_PART)
                    write_profile(path, ModelProfile.from_dict(profile))
                    log.info("%s: %d cases", MOE_PART, len(records))
            if progress:
                progress.console.print(model_report.moe_line(profile.get("moe")))
                progress.advance(progress.task)
    finally:
        if progress:
            progress.stop()
    if not ctx.is_root:
        return None
    model_report.print_report(profile)
    png = None
    if cfg.profile_model.plot:
        png = model_report.plot_profile(profile, path.with_suffix(".png"))
    return {"path": str(path), "png": str(png) if png else None, "source": plan.source,
            "ran": list(run.todo), "points": len(profile["points"])}


def _progress(ctx, plan: ProfilePlan, total: int):
    if not ctx.is_root or total == 0:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from orchestrator.console import stage_console

    console = stage_console()
    console.print(f"profile_model: {plan.source} ({plan.reason}); seq {list(plan.seq_lens)}, "
                  f"tp {list(plan.tps)}" + (f", device sheet {plan.device}"
                                            if plan.source == "analytic" else "")
                  + (f"; MoE FFN parts: {len(plan.moe_cases)} cases" if plan.moe_cases else ""))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    progress.task = progress.add_task("points", total=total)
    progress.start()
    return progress


class ProfileModel(Stage):
    name = "profile_model"
    # dynamo: FakeTensorMode (analytic) and compile import it; DTensor: the TP points
    rank_imports = ("torch._dynamo", "torch.distributed.tensor",
                    "orchestrator.profiling.model.runner", "orchestrator.profiling.model.fit",
                    "orchestrator.profiling.model.memory")
    hash_sections = ("cluster", "model", "profile_model")
    hash_exclude = ("profile_model.plot",)

    def hash_extra(self, cfg) -> dict:
        """The block is timed compiled where train compiles it (train.compile): a profile timed
        eager is stale for a train that compiles, and back. Nothing when eager, so profiles made
        before train compiled (CPU ones, say) keep their hash."""
        from orchestrator.train.plan import train_compile, train_device

        return {"compiled": True} if train_compile(cfg, train_device(cfg)) else {}

    def plan(self, cfg):
        from orchestrator.limits import check_profile_points
        from orchestrator.train.plan import train_compile, train_device

        train_compile(cfg, train_device(cfg))  # a bad train.compile: refused before launch

        profile = plan_profile(cfg)
        check_profile_points(cfg.limits, len(profile.points()),
                             "profile_model's lengths x TP degrees (profile_model.max_tp)")
        return self.make_plan(
            cfg, key=f"profile_model/{cfg.model.name}",
            ranks=Ranks.one if profile.source == ModelSource.analytic else Ranks.cluster,
            subparts=profile.subparts(),
            outputs=[model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)],
            detail=profile)

    def run(self, ctx, run):
        return run_profile(ctx, run)


STAGE = ProfileModel()
