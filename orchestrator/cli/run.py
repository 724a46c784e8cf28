"""Running planned stages: each stage's launch, its wait, the ledger's record of how it ended,
and the one line a failure prints."""
from __future__ import annotations

import contextlib

import os
from datetime import datetime
from pathlib import Path
from typing import List, NoReturn, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf
from rich.markup import escape

from orchestrator.choices import Ranks
from orchestrator.cli.checks import selected_sources
from orchestrator.cli.interrupt import interrupted_by, interrupted_exit_code
from orchestrator.config import Config
from orchestrator.console import console, err_console
from orchestrator.errors import LaunchError
from orchestrator.launch import make_launcher, refresh_ledger
from orchestrator.pipeline import (
    check_launchable,
    decide,
    ledger_for,
    plan_stage,
    stages_for,
    validate_cluster,
)
from orchestrator.runtime.request import StageRequest
from orchestrator.stages import STAGES, StagePlan, disk_need_text, get_stage
from orchestrator.store import DISK_FULL, atomic_write, cluster_dir
from orchestrator.store.ledger import State


# ---------------------------------------------------------------- running stages
def _run_base(cfg: Config) -> Path:
    """This command's run folder (not made yet): profiles/<cluster>/runs/<time>_<stage>/, or a
    multirun point's own sweep folder."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.runtime.output_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "runs" / f"{stamp}_{cfg.stage.name}"


def _run_dir(base: Path, stage: str, n_stages: int) -> Path:
    """The folder of one launch (a sub-folder per stage for stage=all); not made yet."""
    return base / stage if n_stages > 1 else base


def _write_run_config(cfg: Config, base: Path, sources: dict) -> None:
    """The command's folder, made at its first launch once the ledger let it run, with the
    composed config (headed by where its cluster and model files came from: `sources`) and the
    overrides in it: a command that launches nothing (status, a rerun that skips everything, a
    run refused because another holds the stage) leaves no folder behind."""
    if not (base / "config.yaml").exists():
        text = "".join(f"# {group}: {source}\n" for group, source in sources.items())
        text += OmegaConf.to_yaml(OmegaConf.structured(cfg))
        overrides = "".join(f"- {o}\n" for o in HydraConfig.get().overrides.task)
        atomic_write(base / "overrides.yaml", lambda f: f.write(overrides))
        atomic_write(base / "config.yaml", lambda f: f.write(text))


def _check_inputs(plan: StagePlan, cfg: Config, produced_now: set) -> None:
    # An input an earlier stage of this command writes is checked by the stage when it runs.
    if plan.inputs and not any(i.producer in produced_now for i in plan.inputs):
        for note in get_stage(plan.stage).read_inputs(cfg, plan):
            console.print(f"note: {escape(note)}")


def _launch_line(plan: StagePlan, todo, launcher) -> str:
    where = f"{plan.world_size} rank(s)" if plan.ranks == Ranks.cluster else "1 process"
    parts = f" ({', '.join(todo)})" if todo else ""
    return (f"[bold]{escape(plan.key)}[/]: {len(todo) or 1} part(s) on {where} via "
            f"launcher={launcher.name}{escape(parts)}")


def run_stages(cfg: Config, plans: Optional[List[StagePlan]] = None) -> List[dict]:
    """Plan every named stage (or take `plans`, made by a caller such as stage=tune), then
    launch what is not done; returns one report row per stage."""
    validate_cluster(cfg)
    if os.environ.get("ORCHESTRATOR_FAST_MODE", "") not in ("", "0"):
        cfg.search.fast_mode = True  # in the config, so its hash tells fast results apart
    ledger = ledger_for(cfg)
    if plans is None:
        cache: dict = {}
        # every stage valid before any runs
        plans = [plan_stage(name, cfg, cache) for name in stages_for(cfg.stage.name)]
    for plan in plans:
        check_launchable(plan, cfg)
    launcher = make_launcher(cfg)
    refresh_ledger(ledger, cfg)  # a launch refuses keys of runs still going, so know which are
    run_base = _run_base(cfg)
    sources = selected_sources()
    rows, pending, produced_now, previous_job = [], [], set(), None
    for plan in plans:
        # Decided now: an earlier stage of this command may have just written its inputs.
        plan = get_stage(plan.stage).launch_plan(plan, produced_now)
        decision = decide(plan, ledger, force=cfg.force)
        if decision.done:
            console.print(f"[green]✓[/] {escape(plan.key)}: done (config {plan.config_hash}); "
                          f"skipping (force=true redoes it)")
            rows.append({"stage": plan.key, "state": "done (skipped)", "job_id": None, "log": "",
                         "outputs": [str(p) for p in plan.outputs]})
            continue
        if decision.stale_reason and not cfg.force:
            console.print(escape(f"{plan.key}: {decision.stale_reason}; running every part"))
        skipped = [s for s in plan.subparts if s not in decision.todo]
        if skipped:
            console.print(escape(f"{plan.key}: sub-parts done, skipping: {', '.join(skipped)}"))
        if decision.unfinished:
            console.print(escape(f"{plan.key}: {decision.unfinished}"))
        _check_inputs(plan, cfg, produced_now)
        request = StageRequest(plan=plan, config=cfg, todo=list(decision.todo),
                               ledger_dir=str(ledger.path.parent),
                               run_dir=str(_run_dir(run_base, plan.stage, len(plans))),
                               launcher=launcher.name, config_sources=sources)
        ledger.launch(plan.key, request.todo, queued=launcher.queued, config_hash=plan.config_hash,
                      launcher=launcher.name, run_dir=request.run_dir)  # may refuse: said first
        console.print(_launch_line(plan, request.todo, launcher))
        try:
            _write_run_config(cfg, run_base, sources)
            handle = launcher.submit(request, after=previous_job)
        except KeyboardInterrupt:
            _stop_interrupted(ledger, launcher, None, request, pending)
        except BaseException as e:
            _mark_ended(ledger, plan.key, State.failed, request.todo, f"not launched: {e}")
            raise
        # From here until its end is recorded, a Ctrl-C at any point stops this launch and
        # records it cancelled (one between two lines must not leave it `running`), except a
        # queued job the ledger already follows: that one runs on, as the user chose Slurm for.
        followed = False  # the ledger holds its job: a queued one then runs on without us
        job = None
        try:
            job = {"job_id": launcher.job_id(handle), "job_folder": launcher.job_folder(handle)}
            try:
                ledger.attach_job(plan.key, request.todo, **job)
                followed = True
            except Exception as e:  # e.g. a full disk: a launch nobody can follow must not run on
                launcher.stop(handle)
                reason = (f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename
                          else f"{type(e).__name__}: {e}")
                _mark_ended(ledger, plan.key, State.failed, request.todo,
                            f"stopped: its job could not be recorded ({reason})")
                raise
            produced_now.add(plan.stage)
            if launcher.queued:  # submit the whole chain first (afterok), then wait in order
                previous_job = job["job_id"]
                console.print(escape(f"  submitted Slurm job {previous_job}; "
                                     f"logs: {job['job_folder']}"))
                pending.append((handle, request))
                continue
            rows.append(_finish(ledger, launcher, handle, request))
        except KeyboardInterrupt:
            # a queued job the ledger already follows keeps running, even if the Ctrl-C came
            # before it joined `pending` (between recording it and printing its line), or
            # inside attach_job after its write (others already see the job id there)
            followed = followed or _ledger_follows(ledger, plan.key, job)
            if followed and launcher.queued and not any(h is handle for h, _ in pending):
                pending.append((handle, request))
            _stop_interrupted(ledger, launcher, handle, request, pending)
    for i, (handle, request) in enumerate(pending):
        if not cfg.wait:
            rows.append({"stage": request.ledger_key, "state": "submitted",
                         "job_id": launcher.job_id(handle), "log": launcher.job_folder(handle),
                         "outputs": []})
            continue
        try:
            rows.append(_finish(ledger, launcher, handle, request))
        except KeyboardInterrupt:  # the jobs not yet waited for run on
            _stop_interrupted(ledger, launcher, handle, request, pending[i:])
    return rows


def _ledger_follows(ledger, key: str, job: Optional[dict]) -> bool:
    """Whether the ledger records `job` (its id) for `key`: attach_job's write landed."""
    if job is None or job["job_id"] is None:
        return False
    entry = ledger.get(key)
    return entry is not None and entry.job_id == job["job_id"]


def _stop_interrupted(ledger, launcher, handle, request: StageRequest, pending) -> NoReturn:
    """Ctrl-C during or after a launch (`handle` None: its submit): a batch job the ledger
    follows runs on without us (the user chose Slurm so it would); a local launch, or a job
    not yet followed, is stopped and recorded cancelled."""
    jobs = " ".join(launcher.job_id(h) for h, _ in pending)
    if pending:
        console.print(f"\nSlurm job(s) {jobs} keep running; `stage=status` re-attaches, "
                      f"`scancel {jobs}` stops them")
    if any(h is handle for h, _ in pending):
        raise SystemExit(interrupted_exit_code())
    if handle is not None:
        launcher.stop(handle)  # not yet followed by the ledger: it must not run on
    _interrupted(ledger, request, jobs)


def _interrupted(ledger, request: StageRequest, running_jobs: str = "") -> NoReturn:
    """Record the stage cancelled and exit; `running_jobs`: the Slurm jobs of this command that
    run on (a rerun is refused while they hold their stages, so the line says when to rerun)."""
    key = request.ledger_key
    ledger.mark_ended(key, State.cancelled, request.todo, f"interrupted ({interrupted_by()})")
    entry = ledger.get(key)  # done stays done: rank 0 may have finished as the interrupt came
    done = entry is not None and entry.state == State.done
    with contextlib.suppress(OSError):  # a SIGHUP's terminal may be gone; the ledger says it
        err_console.print(escape("\n" + interrupted_line(key, running_jobs, done)))
    raise SystemExit(interrupted_exit_code())


def interrupted_line(key: str, running_jobs: str = "", done: bool = False) -> str:
    """What the user reads when the stage `key` was interrupted (_interrupted); `done`: it
    finished all the same (the command still stops: what follows it does not run)."""
    when = (f" once Slurm job(s) {running_jobs} have ended (`stage=status` shows them), or after "
            f"`scancel {running_jobs}`" if running_jobs else "")
    if done:
        return (f"{key}: done as the interrupt ({interrupted_by()}) came; the command stops "
                f"here: rerun it{when} for what follows (a rerun skips what is done)")
    return (f"{key}: interrupted ({interrupted_by()}); parts finished before are kept, rerun the "
            f"same command to resume{when}")


def _finish(ledger, launcher, handle, request: StageRequest) -> dict:
    """Wait for one launch, record how it ended, and raise if it did not finish (a Ctrl-C
    propagates to the caller, which knows whether the launch runs on without us)."""
    key = request.ledger_key

    def on_state(state):
        console.print(f"  job {launcher.job_id(handle)}: {state}")
        if state == "RUNNING":
            ledger.transition(key, State.running, from_states=(State.pending,))

    try:
        with ledger.heartbeat(key):  # a CLI on another login node sees this run alive
            outcome = launcher.wait(handle, request, on_state=on_state,
                                    on_output=lambda text: console.out(text, end=""))
    except KeyboardInterrupt:  # not a failure: the caller decides
        raise
    except BaseException as e:  # an in-process stage raised: an error to act on, or a bug
        _mark_ended(ledger, key, State.failed, request.todo, f"{type(e).__name__}: {e}")
        raise
    _mark_ended(ledger, key, outcome.state, request.todo, outcome.message)
    if outcome.state != "done":
        error = LaunchError(f"{key} {outcome.state}: {outcome.message}. Parts finished before "
                            f"are kept; rerun the same command to resume.")
        error.exit_code = outcome.exit_code or LaunchError.exit_code
        raise error
    console.print("[green]✓[/] " + escape(f"{key}: done" + _summary_text(outcome.result)))
    return {"stage": key, "state": "done", "job_id": outcome.job_id, "log": outcome.log_path,
            "result": outcome.result, "outputs": [str(p) for p in request.plan.outputs]}


# Ends of launches the ledger could not record (a full disk, even with its reserve spent): the
# error line says so rather than a second error hiding the first.
_unrecorded_ends: List[str] = []


def _mark_ended(ledger, key: str, state, todo, message: str) -> None:
    """ledger.mark_ended; when the ledger cannot be written, a note for the error line."""
    try:
        ledger.mark_ended(key, state, todo, message)
    except OSError as e:
        _unrecorded_ends.append(f"the ledger {ledger.path} could not record that {key} "
                                f"{state} ({e.strerror or e}): `stage=status` marks it failed "
                                f"once there is room")


def _disk_need(error: OSError, cfg: Config) -> str:
    """On a full disk, what this command's stages write (`disk_need_text`); else ''."""
    if error.errno not in DISK_FULL or cfg.stage.name not in STAGES + ("all",):
        return ""
    return disk_need_text(stages_for(cfg.stage.name), cfg)


def _summary_text(result) -> str:
    if isinstance(result, dict) and result.get("path"):
        return f" -> {result['path']}"
    return ""
