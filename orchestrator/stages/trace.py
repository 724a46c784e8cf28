"""trace: the workload of one training iteration per rank at a fake world size, for a batch of
configurations, in this process (orchestrator/trace).

`trace.configs=[[WS,PP,TP],...]` (or trace.world_size/pp/tp for one; `[WS,PP,TP,CP,EP(,ETP)]`
for a mixture-of-experts model): each valid configuration is a sub-part; invalid ones are
skipped with their reason (in index.json too). Writes
profiles/<cluster>/trace/SIM_<model>_Config<i>_WS.._PP.._TP.._DP.._nMICROB.._MICROB_SIZE.._
GLOBAL_BATCH../ (fake_rank_<r>.jsonl / .log per traced rank, summary.json, and with
trace.export=simai the SimAI workload) and profiles/<cluster>/trace/index.json. A configuration
that fails is reported, the others run, and the stage fails at the end naming it; a rerun
traces only the configurations not done.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from orchestrator.choices import CpComm, Ranks
from orchestrator.errors import ConfigError
from orchestrator.limits import check_trace
from orchestrator.models.config import is_moe
from orchestrator.stages import Stage
from orchestrator.store import cluster_dir
from orchestrator.trace.configs import (Skipped, TraceSettings, TraceSpec, parse_configs,
                                        plan_configs)

EXPORTS = ("simai",)


@dataclass(frozen=True)
class TracePlan:
    specs: Tuple[TraceSpec, ...]
    skipped: Tuple[Skipped, ...]


def trace_dir(cfg) -> Path:
    return cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "trace"


def _configs(cfg) -> List[Tuple[int, ...]]:
    t = cfg.trace
    single = (t.world_size, t.pp, t.tp)
    if t.configs:
        if any(v is not None for v in single):
            raise ConfigError("give trace.configs=[[WS,PP,TP(,CP(,EP(,ETP)))],...] or "
                              "trace.world_size/pp/tp, not both")
        try:
            return parse_configs([list(c) for c in t.configs])
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    if any(v is None for v in single):
        raise ConfigError("stage=trace needs trace.configs='[[8192,16,8],...]' ([WORLD_SIZE, "
                          "PP, TP] or [WORLD_SIZE, PP, TP, CP] each) or trace.world_size=.. "
                          "trace.pp=.. trace.tp=..")
    return [tuple(int(v) for v in single)]


def settings(cfg) -> TraceSettings:
    t = cfg.trace
    if t.export is not None and t.export not in EXPORTS:
        raise ConfigError(f"trace.export={t.export!r}; allowed: {', '.join(EXPORTS)}")
    for name in ("global_batch_size", "micro_batch_size", "virtual_stages"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trace.{name}({getattr(t, name)}) must be >= 1")
    for name in ("cp", "ep", "etp"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trace.{name}({getattr(t, name)}) must be >= 1")
    if t.cp_comm == CpComm["a2a+p2p"] and t.export == "simai":
        raise ConfigError("trace.export=simai with trace.cp_comm=a2a+p2p: SimAI has one group "
                          "that can stand for CP (its EP group), the hierarchical flavour needs "
                          "two; trace without the export (the trace's files hold every message)")
    if t.zero not in (0, 1, 2):
        raise ConfigError(f"trace.zero={t.zero}: trace follows train's ZeRO 0/1/2 (ZeRO-3's "
                          f"FSDP gathers are not traced yet)")
    return TraceSettings(
        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len or cfg.model.seq_len, sequence_parallel=t.sequence_parallel,
        schedule=t.schedule, virtual_stages=t.virtual_stages, zero=t.zero, recompute=t.recompute,
        layers_per_stage=tuple(t.layers_per_stage) if t.layers_per_stage else None,
        cp=t.cp, cp_comm=t.cp_comm, cp_a2a=t.cp_a2a, ep=t.ep, etp=t.etp)


def pricing_inputs(cfg) -> dict:
    """Trace.hash_extra: the cost model's options the trace prices with, and the sha256 of each
    profile file it reads (None where there is none: the device sheet, no calibration)."""
    from orchestrator.store import file_sha256, model_profile_path
    from orchestrator.trace.timing import planner_options
    from orchestrator.train.plan import OVERLAP_KNOBS, current_calibration

    options = planner_options(cfg)
    model_path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    _, calibration_path, _ = current_calibration(cfg)
    return {"pricing": {
        "engine": str(options.engine), "moe_imbalance": options.moe_imbalance,
        "dtype": str(options.dtype), "device": str(options.device),
        **{knob: getattr(options, knob, None) for knob in OVERLAP_KNOBS},
        "model_profile": file_sha256(model_path) if model_path.exists() else None,
        "calibration": file_sha256(calibration_path) if calibration_path else None}}


def check_model(cfg) -> None:
    """The model's mixture-of-experts fields (top_k in 1..experts, capacity_factor > 0, ...)
    and what trace follows of train for a MoE model (ZeRO 0-2), before any configuration: a
    ConfigError naming the numbers."""
    from orchestrator.models.config import validate_moe

    try:
        validate_moe(cfg.model)
    except ValueError as e:
        raise ConfigError(f"model={cfg.model.name}: {e}") from None
    t = cfg.trace
    if not is_moe(cfg.model) and (t.ep > 1 or t.etp > 1):
        raise ConfigError(f"trace.ep({t.ep}) / trace.etp({t.etp}) need a mixture-of-experts "
                          f"model; model={cfg.model.name} is dense (model.experts 0)")


def _simai_skips(specs, skipped, export, moe: bool):
    """With trace.export=simai, the configurations SimAI's workload cannot express move to the
    skipped ones with the reason (trace/simai.unexportable)."""
    if export != "simai":
        return list(specs), list(skipped)
    from orchestrator.trace.simai import unexportable

    keep = []
    for spec in specs:
        reason = unexportable(spec.layout, moe)
        if reason is None:
            keep.append(spec)
        else:
            skipped.append(Skipped(spec.index, tuple(spec.config()), reason))
    return keep, sorted(skipped, key=lambda s: s.index)


def run_trace(ctx, run) -> dict:
    from orchestrator.console import stage_console
    from orchestrator.trace.output import read_index, write_index
    from orchestrator.trace.run import trace_configuration
    from orchestrator.trace.timing import make_pricer, planner_options

    cfg, plan = run.cfg, run.plan.detail
    console = stage_console()
    out = trace_dir(cfg)
    index_path = out / "index.json"
    model_name = cfg.model.name
    index = read_index(index_path)
    entries = index["configurations"]
    for s in plan.skipped:
        console.print(f"[yellow]skipped[/] config {s.index} {list(s.config)}: {s.reason}")
        entries[f"config{s.index}_{'_'.join(map(str, s.config))}"] = {
            "config": list(s.config), "index": s.index, "state": "skipped", "reason": s.reason}
    todo = set(run.todo)
    specs = [s for s in plan.specs if s.subpart() in todo]
    pricer = make_pricer(cfg, {s.layout.tp for s in specs})
    console.print(f"trace: {len(specs)} configuration(s) to trace, "
                  f"{len(plan.specs) - len(specs)} done before; {pricer.note}")
    done, failed = [], []
    captures: dict = {}  # a chunk shape met in one configuration is not traced again
    # What the Megatron arguments say is overlapped: the options search prices and exports with
    overlap = planner_options(cfg).megatron_overlap()
    for spec in plan.specs:
        name = spec.dir_name(model_name)
        if spec not in specs:
            entries[name] = {"config": spec.config(),
                             "index": spec.index, "state": "done", "path": str(out / name)}
            continue
        try:
            with run.subpart(spec.subpart()):
                summary = trace_configuration(
                    spec, cfg.model, pricer, out / name, all_ranks=cfg.trace.all_ranks,
                    bucket_MiB=cfg.trace.bucket_MiB, export=cfg.trace.export,
                    captures=captures, overlap=overlap)
                done.append(summary)
                entries[name] = {"config": summary["config"], "index": spec.index,
                                 "state": "done", "path": str(out / name),
                                 "ranks_traced": summary["ranks_traced"],
                                 "seconds": summary["seconds"]}
                run.mark_part(index, spec.subpart())
                write_index(index_path, index)  # inside the sub-part: done only once written
        except Exception as e:  # reported; the other configurations still run
            failed.append(f"{spec.subpart()}: {type(e).__name__}: {e}")
            entries[name] = {"config": spec.config(),
                             "index": spec.index, "state": "failed",
                             "error": f"{type(e).__name__}: {e}"}
            console.print(f"[red]failed[/] {name}: {type(e).__name__}: {e}")
            continue
        console.print(f"traced {name}: {summary['ranks_traced']} of {summary['ranks_total']} "
                      f"ranks in {summary['seconds']:.1f} s (every rank: ~"
                      f"{summary['seconds_all_ranks_estimate']:.0f} s)")
    write_index(index_path, index)
    if failed:
        raise RuntimeError(f"{len(failed)} configuration(s) failed (the others are written; "
                           f"rerun the command to retry them): " + "; ".join(failed))
    return {"path": str(out), "index": str(index_path), "traced": len(done),
            "skipped": [f"{list(s.config)}: {s.reason}" for s in plan.skipped],
            "seconds": round(sum(s["seconds"] for s in done), 2)}


class Trace(Stage):
    name = "trace"
    hash_sections = ("cluster", "model", "trace")
    # Which configurations are listed does not change a configuration's trace: adding one to
    # the list traces only it.
    hash_exclude = ("trace.configs", "trace.world_size", "trace.pp", "trace.tp",
                    "trace.all_ranks")
    sweep_section = "trace"
    torch_distributed = False  # one process; the tracer makes its own fake process group

    def hash_extra(self, cfg) -> dict:
        """What prices the trace's compute beside the trace section (trace/timing.make_pricer):
        the planner's options (search.engine and its overlap knobs, search.moe_imbalance, train's
        dtype and device) and the contents of the model profile and the calibration it reads.
        A model measured again or a new calibration (stage=tune) retraces every configuration,
        as it makes the search's strategy stale."""
        return pricing_inputs(cfg)

    def plan(self, cfg):
        from orchestrator.trace.timing import model_profile

        check_model(cfg)
        model_profile(cfg)  # a profile it cannot use is refused before anything runs
        specs, skipped = plan_configs(_configs(cfg), settings(cfg), cfg.model)
        specs, skipped = _simai_skips(specs, skipped, cfg.trace.export, is_moe(cfg.model))
        if not specs:
            raise ConfigError("no configuration can be traced: " + "; ".join(
                f"{list(s.config)}: {s.reason}" for s in skipped))
        check_trace(cfg.limits, [s.layout for s in specs], cfg.trace.all_ranks)
        return self.make_plan(cfg, key=f"trace/{cfg.model.name}", ranks=Ranks.one,
                              subparts=[s.subpart() for s in specs],
                              outputs=[trace_dir(cfg) / "index.json"],
                              detail=TracePlan(tuple(specs), tuple(skipped)))

    def run(self, ctx, run):
        return run_trace(ctx, run)

    def disk_bytes(self, cfg):
        from orchestrator.limits import TRACE_BYTES_PER_LAYER_PASS, trace_layer_passes

        specs, _ = plan_configs(_configs(cfg), settings(cfg), cfg.model)
        return TRACE_BYTES_PER_LAYER_PASS * sum(trace_layer_passes(s.layout, cfg.trace.all_ranks)
                                                for s in specs)


STAGE = Trace()
