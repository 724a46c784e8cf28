"""`python -m orchestrator stage=<name> [key=value ...]`: compose, validate, plan, launch, report.

Everything a user can get wrong is checked here, before anything is launched or submitted:
unknown stage or launcher, an impossible cluster layout, a stage's own config, missing inputs.
Such errors print one line and exit with the error's code (2 for config errors).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from orchestrator.config import register_configs
from orchestrator.errors import ConfigError, LaunchError, OrchestratorError
from orchestrator.launch import make_launcher, refresh_ledger
from orchestrator.pipeline import StagePlan, ledger_for, plan_stage, stages_for, validate_cluster
from orchestrator.runtime.request import StageRequest
from orchestrator.stages import STAGES
from orchestrator.store import read_profile
from orchestrator.store.schema import PROFILE_KINDS
from orchestrator.store.ledger import Ledger

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Wide enough for the status table when output goes to a file or a pipe (rich would use 80).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)


# ---------------------------------------------------------------- before Hydra: closed choices
def check_group_choices(argv: List[str]) -> None:
    """Refuse an unknown stage or launcher with one line naming what is allowed (exit code 2).

    Hydra's own message for a missing group option spans many lines and exits 1; these two
    groups are closed sets, so we check them first.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-") and "=" in a]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except Exception:
        return  # let Hydra report syntax errors its own way
    allowed = {"stage": sorted(STAGES + ("all", "status")),
               "launcher": sorted(p.stem for p in (CONF_DIR / "launcher").glob("*.yaml"))}
    for o in overrides:
        group = o.key_or_group
        if group not in allowed or o.is_delete():
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            if str(value) not in allowed[group]:
                raise ConfigError(f"unknown {group} {value!r}; allowed: {', '.join(allowed[group])}")


# ---------------------------------------------------------------- running stages
def _run_dir(stage: str, n_stages: int) -> Path:
    base = Path(HydraConfig.get().runtime.output_dir)
    return base / stage if n_stages > 1 else base


def _check_inputs(plan: StagePlan, cfg, produced_now: set) -> None:
    for needed in plan.spec.inputs(cfg):
        if needed.producer not in produced_now:  # else an earlier stage of this command writes it
            read_profile(needed.path, PROFILE_KINDS[needed.kind], needed.rebuild(cfg))


def _request(plan: StagePlan, cfg, run_dir: Path) -> StageRequest:
    return StageRequest(
        stage=plan.spec.name, ledger_key=plan.key,
        config=OmegaConf.to_container(cfg, resolve=True), config_hash=plan.config_hash,
        todo=plan.todo, ledger_dir=str(ledger_for(cfg).path.parent), run_dir=str(run_dir),
        world_size=plan.world_size, backend=cfg.cluster.backend, launcher=cfg.launcher.name,
        extra={"ranks": plan.ranks, "torch_distributed": plan.spec.torch_distributed})


def _mark_launching(ledger: Ledger, plan: StagePlan, launcher_name: str, queued: bool,
                    request) -> None:
    """Before the launch: a job may finish (and rank 0 mark it done) before submit returns."""
    ledger.update(plan.key, state="pending" if queued else "running",
                  config_hash=plan.config_hash, launcher=launcher_name, job_id=None,
                  job_folder=None, log_path=request.run_dir, run_dir=request.run_dir,
                  started=time.time(), ended=None, error=None, todo=plan.todo)
    ledger.update_many([f"{plan.key}/{s}" for s in plan.todo], state="pending", job_id=None,
                       config_hash=plan.config_hash, log_path=request.run_dir)


def run_stages(cfg: DictConfig) -> List[dict]:
    """Plan every named stage, then launch what is not done; returns one report row per stage."""
    validate_cluster(cfg)
    if os.environ.get("ORCHESTRATOR_FAST_MODE", "") not in ("", "0"):
        cfg.search.fast_mode = True  # in the config, so its hash tells fast results apart
    names = stages_for(cfg.stage.name)
    ledger = ledger_for(cfg)
    for name in names:  # validate every stage before anything runs
        plan_stage(name, cfg, ledger, force=cfg.force)
    launcher = make_launcher(cfg)
    rows, pending, produced_now, previous_job = [], [], set(), None
    for name in names:
        # Planned again now: an earlier stage of this command may have just written its inputs.
        plan = plan_stage(name, cfg, ledger, force=cfg.force)
        if plan.done:
            console.print(f"[green]✓[/] {plan.key}: done (config {plan.config_hash}); "
                          f"skipping (force=true redoes it)")
            rows.append({"stage": plan.key, "state": "done (skipped)", "job_id": None, "log": ""})
            continue
        if plan.stale_reason and not cfg.force:
            console.print(f"{plan.key}: {plan.stale_reason}; running every part")
        skipped = [s for s in plan.subparts if s not in plan.todo]
        if skipped:
            console.print(f"{plan.key}: sub-parts done, skipping: {', '.join(skipped)}")
        _check_inputs(plan, cfg, produced_now)
        request = _request(plan, cfg, _run_dir(plan.spec.name, len(names)))
        where = f"{plan.world_size} rank(s)" if plan.ranks == "cluster" else "1 process"
        console.print(f"[bold]{plan.key}[/]: {len(plan.todo) or 1} part(s) on {where} via "
                      f"launcher={launcher.name}" + (f" ({', '.join(plan.todo)})" if plan.todo else ""))
        _mark_launching(ledger, plan, launcher.name, launcher.queued, request)
        try:
            handle = launcher.submit(request, after=previous_job)
        except BaseException as e:
            ledger.mark_ended(plan.key, "failed", plan.todo, f"not launched: {e}")
            raise
        job = {"job_id": launcher.job_id(handle), "job_folder": launcher.job_folder(handle)}
        ledger.update(plan.key, **job)  # ids only: never the state, which rank 0 may have set
        ledger.update_many([f"{plan.key}/{s}" for s in plan.todo], job_id=job["job_id"])
        produced_now.add(plan.spec.name)
        if launcher.queued:  # submit the whole chain first (afterok), then wait in order
            previous_job = job["job_id"]
            console.print(f"  submitted Slurm job {previous_job}; logs: {job['job_folder']}")
            pending.append((plan, handle, request))
            continue
        rows.append(_finish(ledger, launcher, plan, handle, request))
    for plan, handle, request in pending:
        if not cfg.wait:
            rows.append({"stage": plan.key, "state": "submitted",
                         "job_id": launcher.job_id(handle), "log": launcher.job_folder(handle)})
            continue
        rows.append(_finish(ledger, launcher, plan, handle, request))
    return rows


def _finish(ledger, launcher, plan, handle, request) -> dict:
    """Wait for one launch, record how it ended, and raise if it did not finish."""
    def on_state(state):
        console.print(f"  job {launcher.job_id(handle)}: {state}")
        if state == "RUNNING":
            ledger.update(plan.key, state="running")

    try:
        outcome = launcher.wait(handle, request, on_state=on_state,
                                on_output=lambda text: console.out(text, end=""))
    except KeyboardInterrupt:
        if launcher.job_folder(handle):  # a batch job runs on without us
            console.print(f"\njob {launcher.job_id(handle)} keeps running; `stage=status` "
                          f"re-attaches, `scancel {launcher.job_id(handle)}` stops it")
            raise SystemExit(130)
        ledger.mark_ended(plan.key, "cancelled", plan.todo, "interrupted (Ctrl-C)")
        raise SystemExit(130)
    except BaseException as e:  # an in-process stage raised: an error to act on, or a bug
        ledger.mark_ended(plan.key, "failed", plan.todo, f"{type(e).__name__}: {e}")
        raise
    ledger.mark_ended(plan.key, outcome.state, plan.todo, outcome.message)
    if outcome.state != "done":
        error = LaunchError(f"{plan.key} {outcome.state}: {outcome.message}. Parts finished before "
                            f"are kept; rerun the same command to resume.")
        error.exit_code = outcome.exit_code or LaunchError.exit_code
        raise error
    console.print(f"[green]✓[/] {plan.key}: done" + _summary_text(outcome.result))
    return {"stage": plan.key, "state": "done", "job_id": outcome.job_id, "log": outcome.log_path,
            "result": outcome.result}


def _summary_text(result) -> str:
    if isinstance(result, dict) and result.get("path"):
        return f" -> {result['path']}"
    return ""


# ---------------------------------------------------------------- status
def _relative(path) -> str:
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_status(cfg) -> List[dict]:
    """The ledger as a table, after re-attaching to Slurm jobs still pending or running."""
    ledger = ledger_for(cfg)
    refresh_ledger(ledger, cfg)
    entries = ledger.entries()
    table = Table(title=f"{ledger.path}")
    for col in ("entry", "state", "job id", "config", "started", "took", "log / error"):
        table.add_column(col)
    colours = {"done": "green", "failed": "red", "cancelled": "yellow", "running": "cyan",
               "pending": "white"}
    for key in sorted(entries, key=lambda k: (entries[k].get("started") or 0, k)):
        e = entries[key]
        started, ended = e.get("started"), e.get("ended")
        took = f"{ended - started:.1f}s" if started and ended else ""
        state = e.get("state", "?")
        table.add_row(key, f"[{colours.get(state, 'white')}]{state}[/]", str(e.get("job_id") or ""),
                      str(e.get("config_hash") or "")[:8],
                      time.strftime("%m-%d %H:%M:%S", time.localtime(started)) if started else "",
                      took, str(e.get("error") or _relative(e.get("log_path")) or ""))
    if entries:
        console.print(table)
    else:
        console.print(f"nothing has run for cluster {cfg.cluster.name!r} yet ({ledger.path} "
                      f"does not exist); start with: python -m orchestrator stage=all")
    return [dict(entry=k, **v) for k, v in entries.items()]


# ---------------------------------------------------------------- entry points
def orchestrate(cfg: DictConfig):
    """The Hydra task: one stage (or `all`, or `status`) for one composed config."""
    try:
        if cfg.stage.name == "status":
            return print_status(cfg)
        return run_stages(cfg)
    except OrchestratorError as e:
        err_console.print(f"[red]error:[/] {e}", soft_wrap=True)
        sys.exit(e.exit_code)


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig):
    return orchestrate(cfg)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_group_choices(argv)
    except ConfigError as e:
        err_console.print(f"[red]error:[/] {e}", soft_wrap=True)
        sys.exit(e.exit_code)
    hydra_main()
