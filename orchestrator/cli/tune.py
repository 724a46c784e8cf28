"""tune: predict, verify, learn. After search, train the best predicted layouts (and the best of
each other family, as controls) for a few steps each, fit the cluster's calibration to what they
measured, and make the measured fastest the layout stage=train trains.

Runs from the command line like stage=all: each candidate is one `stage=train` launch of its own
(a Slurm job under launcher=slurm, one after the other under the local launcher), with its own
ledger key (`train/<model>@tune=<layout tag>`), summary (`train/<model>/<tag>@tune.json`) and
layout file (`tune/<model>/<tag>.layout.json`): a rerun skips the candidates already measured.
A candidate that fails (out of memory, a crash) is recorded with its reason and left out.
Writes calibration/<model>.json (planner/calibration.py: factors, every candidate predicted
before and after against measured, the pick), the pick as strategy/<model>.layout.json, and a
plot beside the strategy.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from orchestrator.choices import Microbatching, Source
from orchestrator.errors import ConfigError, InfeasibleError, OrchestratorError
from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.pipeline import decide, ledger_for, plan_stage
from orchestrator.stages.search_config import check_work, search_space, validate
from orchestrator.store import (calibration_path, cluster_dir, file_sha256, hardware_path,
                                model_profile_path, provenance, strategy_path, write_json,
                                write_profile)
from orchestrator.store.ledger import RunInProgress

FAMILIES = ("pure dp", "tp-heavy", "pp-heavy")
MOE_FAMILIES = ("no ep", "ep-heavy")  # a mixture-of-experts model's controls besides


@dataclass(frozen=True)
class Candidate:
    role: str  # "top 1", ..., or a family
    layout: ParallelLayout
    predicted_ms: float  # search's prediction, the cost model as profiled


def _divisors_desc(n: int, bound: int) -> List[int]:
    return [d for d in range(min(n, bound), 0, -1) if n % d == 0]


def choose_candidates(cfg, model_cost, hardware) -> Tuple[List[Candidate], int, List[str]]:
    """The `tune.top_k` best distinct layouts of the search (the cost model as profiled), then
    (tune.controls) the best pure-dp layout (pp = tp = 1), the best with the largest tp and the
    best with the largest pp that fit, and for a mixture-of-experts model the best without
    expert parallelism and the best with the largest ep, each once; (candidates, seq_len,
    notes)."""
    from orchestrator.planner import search
    from orchestrator.planner.calibration import Calibration
    from orchestrator.planner.search import InfeasibleError as PlannerInfeasible
    from orchestrator.train.plan import layout_tag

    t, space = cfg.tune, search_space(cfg)
    # As profiled, not as an earlier tune calibrated: the same profiles give the same
    # candidates, so a rerun resumes rather than chasing its own fit.
    space = dataclasses.replace(space, options=dataclasses.replace(space.options,
                                                                   calibration=Calibration()))
    notes: List[str] = []
    seen: Dict[str, str] = {}
    out: List[Candidate] = []

    def add(role: str, layout: ParallelLayout, pred_us: float) -> None:
        tag = layout_tag(layout)
        if tag in seen:
            notes.append(f"{role} is {seen[tag]} already ({layout.describe()})")
            return
        seen[tag] = role
        out.append(Candidate(role, layout, pred_us / 1e3))

    result = search(model_cost, hardware, dataclasses.replace(space, top_k=max(50, 4 * t.top_k)))
    for layout, pred in result.top:
        if sum(c.role.startswith("top") for c in out) == t.top_k:
            break
        if layout_tag(layout) not in seen:
            add(f"top {len(out) + 1}", layout, pred.iteration_time_us)
    if not t.controls:
        return out, space.seq_len, notes
    world = space.world_size
    fixed = {"pure dp": [(1, 1, None)],
             "tp-heavy": [(None, tp, None) for tp in _divisors_desc(world, space.max_tp)
                          if tp > 1],
             "pp-heavy": [(pp, None, None) for pp in _divisors_desc(world, min(space.max_pp,
                                                                              model_cost.layers))
                          if pp > 1]}
    families = FAMILIES
    if model_cost.moe is not None:  # the dispatcher's price (ep_comm) needs runs with and without
        families += MOE_FAMILIES
        fixed["no ep"] = [(None, None, 1)]
        fixed["ep-heavy"] = [(None, None, ep) for ep in _divisors_desc(world, space.max_ep)
                             if ep > 1]
    for family in families:
        for pp, tp, ep in fixed[family]:
            try:
                best = search(model_cost, hardware,
                              dataclasses.replace(space, pp=pp, tp=tp, ep=ep, top_k=1))
            except (PlannerInfeasible, LayoutError, ValueError):
                continue  # e.g. tp not dividing the heads, or out of memory: the next degree
            add(family, best.best, best.prediction.iteration_time_us)
            break
        else:
            notes.append(f"no {family} layout fits")
    return out, space.seq_len, notes


def _candidate_config(cfg, layout_file: Path):
    """The config of one candidate's train launch: its layout file, tune's steps, no plots,
    no checkpoint (a rerun of a measured candidate is skipped, not resumed; on a GPU each was
    the whole model's states, ~15 GB for llama2_7b cut to 4 layers)."""
    c = copy.deepcopy(cfg)
    c.stage.name = "train"
    t = c.train
    for name in ("pp", "tp", "cp", "cp_comm", "cp_a2a", "ep", "etp", "zero", "sequence_parallel",
                 "micro_batch_size", "num_micro_batches", "global_batch_size", "schedule",
                 "virtual_stages", "recompute", "layers_per_stage", "seq_len"):
        setattr(t, name, None)
    t.layout = str(layout_file.resolve())
    t.steps = cfg.tune.steps
    t.timing_warmup_steps = cfg.tune.timing_warmup_steps
    t.keep_checkpoints = 0
    t.plot = False
    return c


def _check(cfg) -> None:
    t = cfg.tune
    if t.top_k < 1:
        raise ConfigError(f"tune.top_k({t.top_k}) must be >= 1")
    if t.steps <= t.timing_warmup_steps:
        raise ConfigError(f"tune.steps({t.steps}) must be more than tune.timing_warmup_steps"
                          f"({t.timing_warmup_steps}): no step would be timed")
    if t.min_runs < 2:
        raise ConfigError(f"tune.min_runs({t.min_runs}) must be >= 2")
    if not t.controls and t.top_k < t.min_runs:  # runs that could never be fitted
        raise ConfigError(f"tune.top_k({t.top_k}) candidates with tune.controls=false: fewer than "
                          f"the tune.min_runs({t.min_runs}) runs the fit needs; raise tune.top_k "
                          f"or set tune.controls=true")
    if cfg.train.microbatching != Microbatching.fixed:
        raise ConfigError("stage=tune measures fixed-length layouts; leave train.microbatching "
                          "at fixed")


def _run_candidate(cfg, cand: Candidate, seq_len: int, work: Path, run_stages,
                   console) -> Tuple[Optional[Path], Optional[str]]:
    """Train one candidate: (its summary, None) or (None, why it failed)."""
    from orchestrator.sweep import labelled
    from orchestrator.train.plan import layout_tag

    tag = layout_tag(cand.layout)
    layout_file = work / f"{tag}.layout.json"
    write_json(layout_file, {"model": cfg.model.name, "seq_len": seq_len,
                             "layout": cand.layout.to_dict(), "source": f"tune: {cand.role}"})
    c = _candidate_config(cfg, layout_file)
    console.print(f"[bold]tune[/]: {cand.role}: {cand.layout.describe()} "
                  f"(predicted {cand.predicted_ms:.1f} ms)", highlight=False)
    try:
        plan = plan_stage("train", c, {})
        plan = dataclasses.replace(plan, key=f"train/{cfg.model.name}@tune={tag}",
                                   former_key=None, detail="tune",
                                   outputs=tuple(labelled(p, "tune") for p in plan.outputs))
        summary = plan.outputs[0]
        if not decide(plan, ledger_for(c), force=cfg.force).done:
            # A candidate writes no checkpoint; one an older version left would be resumed:
            # time a fresh run.
            shutil.rmtree(summary.with_suffix(".ckpt"), ignore_errors=True)
        run_stages(c, [plan])
    except RunInProgress:
        # Another command runs this candidate (a second tune on the profiles folder) or holds
        # the ledger: not a failure of the layout. Left out, the two tunes would each time
        # part of the candidates while the other's ranks share the CPUs, and each write its
        # own pick over the other's: refused (exit 5), as a second run of a stage is.
        raise
    except OrchestratorError as e:
        console.print(f"[yellow]tune[/]: {cand.role} failed, left out: {e}", highlight=False)
        return None, str(e)
    return summary, None


def _price(cfg, model_cost, hardware, seq_len: int):
    """price(layout, calibration) -> the parts train measures, from the cost model as profiled
    (contention included) under that calibration."""
    from orchestrator.planner.prediction import run_parts_ms
    from orchestrator.train.plan import engine_options

    base = engine_options(cfg, engine="orchestrator")  # what train runs, no reserve

    def price(layout, calibration):
        return run_parts_ms(layout, model_cost, hardware, seq_len,
                            dataclasses.replace(base, calibration=calibration))
    return price


def tune(cfg, run_stages: Callable, console) -> List[dict]:
    """stage=tune: candidates, one train launch each, the fit, the pick; one report row."""
    from orchestrator.planner.calibration import Calibration, Observation, fit_calibration
    from orchestrator.store import read_json
    from orchestrator.store.schema import (CalibrationProfile, Provenance, StrategyInput,
                                           TunedCandidate)
    from orchestrator.train.plan import layout_file, planner_profiles
    from orchestrator.train.report import measured_run_parts

    started = time.time()
    _check(cfg)
    check_work(cfg, validate(cfg))  # the searches that choose the candidates
    model_cost, hardware = planner_profiles(cfg)
    candidates, seq_len, notes = choose_candidates(cfg, model_cost, hardware)
    for note in notes:
        console.print(f"tune: {note}", highlight=False)
    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name)
    work = folder / "tune" / cfg.model.name
    ran: List[Tuple[Candidate, Optional[Path], Optional[str]]] = []
    for cand in candidates:
        summary, why = _run_candidate(cfg, cand, seq_len, work, run_stages, console)
        ran.append((cand, summary, why))

    price = _price(cfg, model_cost, hardware, seq_len)
    observations, measured = [], {}
    for cand, summary, why in ran:
        if summary is not None:
            measured[cand.role] = read_json(summary)
            observations.append(Observation(cand.role, cand.layout,
                                            measured_run_parts(measured[cand.role]["measured"])))
    fit = fit_calibration(observations, price, min_runs=cfg.tune.min_runs)
    cal = fit.calibration
    parts = {o.name: o.parts_ms for o in observations}
    records = []
    for cand, summary, why in ran:
        s = measured.get(cand.role)
        record = TunedCandidate(role=cand.role, layout=cand.layout,
                                describe=cand.layout.describe(),
                                state="measured" if s else "failed", reason=why,
                                summary=str(summary.relative_to(folder)) if s else None,
                                predicted_ms=price(cand.layout, Calibration()),
                                calibrated_ms=price(cand.layout, cal))
        if s:
            record.measured_ms = dict(parts[cand.role])
            record.peak_memory_MiB = max(s["measured"]["peak_memory_MiB"])
            if s.get("predicted"):
                record.predicted_memory_MiB = s["predicted"]["peak_memory_MiB"]
        records.append(record)
    done = [r for r in records if r.state == "measured"]
    pick = min(done, key=lambda r: r.measured_ms["iteration"]) if done else None

    def mean_error(key: str) -> Optional[float]:
        errs = [abs(getattr(r, key)["iteration"] / r.measured_ms["iteration"] - 1) for r in done]
        return statistics.mean(errs) if errs else None

    plan = plan_stage("tune", cfg, {})
    hw_file = hardware_path(cfg.profiles_dir, cfg.cluster.name)
    mp_file = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    profile = CalibrationProfile(
        source=Source.measured,
        provenance=Provenance.from_dict(provenance(
            dataclasses.asdict(cfg), plan.config_hash, job_id=None, hosts=[socket.gethostname()],
            started=started, ended=time.time())),
        model=cfg.model.name,
        inputs={str(p.relative_to(folder)): StrategyInput(sha256=file_sha256(p), source=None)
                for p in (hw_file, mp_file)},
        seq_len=seq_len, steps=cfg.tune.steps,
        timing_warmup_steps=cfg.tune.timing_warmup_steps, runs=len(done),
        factors=cal.factors, why_not=fit.why_not or None, at_bound=cal.at_bound(),
        mean_error_before=mean_error("predicted_ms"), mean_error_after=mean_error("calibrated_ms"),
        candidates=records, pick=pick.layout if pick else None,
        pick_describe=pick.describe if pick else None)
    out = calibration_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    if pick is None and _fitted(cfg):
        # Every candidate failed (a train setting refusing them all, a crash): no run to learn
        # from, so the calibration an earlier tune fitted to these profiles stays in use.
        _report(profile, dataclasses.replace(fit, why_not="no run to fit: the calibration "
                                             "fitted before stays in use"), console)
        reasons = "; ".join(sorted({f"{r.role}: {r.reason}" for r in records})[:3])
        raise InfeasibleError(f"tune: every candidate failed ({len(records)}): {reasons}; the "
                              f"calibration fitted before is kept: {out}")
    if not _same_fit(out, profile):  # a rerun that measured nothing new leaves it (and so
        write_profile(out, profile)  # the searches and traces priced from it) as it was
    if pick is not None:  # what stage=train trains next
        write_json(layout_file(cfg), {"model": cfg.model.name, "seq_len": seq_len,
                                      "layout": pick.layout.to_dict(),
                                      "source": f"tune: measured fastest of {len(done)}"})
    _report(profile, fit, console)
    plot = None
    if cfg.tune.plot and done:
        from orchestrator.planner.report import plot_tune

        plot = plot_tune(profile, strategy_path(cfg.profiles_dir, cfg.cluster.name,
                                                cfg.model.name).with_suffix(".tune.png"))
    if pick is None:
        raise InfeasibleError(f"tune: every candidate failed ({len(records)}); see {out}")
    return [{"stage": f"tune/{cfg.model.name}", "state": "done", "job_id": None,
             "log": "", "outputs": [str(out)] + ([str(plot)] if plot else []),
             "result": {"pick": pick.describe, "measured_ms": pick.measured_ms["iteration"],
                        "calibration": cal.describe()}}]


def _same_fit(path: Path, profile) -> bool:
    """Whether the calibration at `path` says what `profile` says, its provenance (when and by
    which command it was written) aside."""
    from orchestrator.store import read_json

    try:
        old = read_json(path)
    except (OSError, ValueError):
        return False
    new = json.loads(json.dumps(profile.to_dict()))  # as it would read back (tuples: lists)
    return ({k: v for k, v in old.items() if k != "provenance"}
            == {k: v for k, v in new.items() if k != "provenance"})


def _fitted(cfg) -> bool:
    """Whether the cluster's calibration of this model is one fitted to the profiles on disk."""
    from orchestrator.train.plan import current_calibration

    calibration, used, _ = current_calibration(cfg)
    return used is not None and calibration.runs > 0


def bound_warning(cal) -> str:
    """What tune says of a Calibration's factors its fit pushed to their bounds, and what to
    run instead."""
    from orchestrator.commands import rerun_command
    from orchestrator.planner.calibration import FACTOR_BOUNDS, FACTOR_PROFILE

    names = cal.at_bound()
    stages = [s for s in ("profile_hardware", "profile_model")
              if any(FACTOR_PROFILE[name] == s for name in names)]
    lo, hi = FACTOR_BOUNDS
    return (f"{', '.join(f'{n} x{cal.factors[n]:.2f}' for n in names)} at the fit's bound "
            f"({lo:g} to {hi:g}): the profiles are that far off these runs, more than any "
            f"trait of a cluster (a profile of another machine, or measured while the host was "
            f"busy?), and the factor hides it. Measure again, then tune: "
            + "; ".join(rerun_command(s, "force=true") for s in stages))


def _report(profile, fit, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"tune: {profile.runs} of {len(profile.candidates)} layouts measured "
                        f"({profile.steps} steps, {profile.timing_warmup_steps} untimed)")
    for col in ("role", "layout", "predicted ms", "calibrated ms", "measured ms", "error",
                "calibrated error"):
        table.add_column(col, justify="left" if col in ("role", "layout") else "right")
    for r in profile.candidates:
        meas = r.measured_ms.get("iteration")
        pred, calib = r.predicted_ms["iteration"], r.calibrated_ms["iteration"]
        table.add_row(r.role, escape(r.describe), f"{pred:.1f}", f"{calib:.1f}",
                      f"{meas:.1f}" if meas else "failed (below)",
                      f"{pred / meas - 1:+.1%}" if meas else "",
                      f"{calib / meas - 1:+.1%}" if meas else "")
    console.print(table)
    for r in profile.candidates:  # whole: a reason names the layout first, its cause after
        if not r.measured_ms.get("iteration"):
            console.print(escape(f"tune: {r.role} failed: {r.reason or 'no reason recorded'}"),
                          highlight=False)
    if fit.why_not:
        console.print(f"tune: {fit.why_not}", highlight=False)
    else:
        console.print(f"tune: cost model {fit.calibration.describe()}; mean |error| "
                      f"{profile.mean_error_before:.1%} -> {profile.mean_error_after:.1%} on "
                      f"these runs", highlight=False)
        if profile.at_bound:
            console.print(f"[yellow]tune: {bound_warning(fit.calibration)}[/yellow]",
                          highlight=False)
    if profile.pick_describe:
        console.print(f"tune: pick (measured fastest): {profile.pick_describe}; stage=train "
                      f"trains it, the next search prices with the calibration",
                      highlight=False)
