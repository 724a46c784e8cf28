"""`python -m orchestrator stage=<name> [key=value ...]`: compose, validate, plan, launch, report.

Everything a user can get wrong is checked here, before anything is launched or submitted:
unknown stage or launcher, an impossible cluster layout, a stage's own config, missing inputs.
Such errors print one line and exit with the error's code (2 for config errors).
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import List, NoReturn, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.choices import Ranks
from orchestrator.conf_folders import (CONF_DIR, config_dirs, group_options, group_source,
                                       site_conf_dir)
from orchestrator.config import Config, register_configs
from orchestrator.config_keys import (PATH_NAME_KEYS, check_path_name, check_path_names,
                                      choice_type, override_type_error, schema_has_key,
                                      unknown_key_message)
from orchestrator.console import err_console, print_error, report_error
from orchestrator.commands import commands_that_launch, parse_overrides, set_user_overrides
from orchestrator.errors import (ConfigError, InvalidLayout, LaunchError, OrchestratorError,
                                 file_error)
from orchestrator.launch import make_launcher, refresh_ledger
from orchestrator.overrides import config_dir_args, hydra_argv, unknown_choice_message
from orchestrator.site_files import check_group_file, composed_error
from orchestrator.pipeline import (check_launchable, decide, ledger_for, plan_stage, stages_for,
                                   validate_cluster)
from orchestrator.runtime.request import StageRequest
from orchestrator.stages import STAGES, StagePlan, disk_need_text, get_stage
from orchestrator.store import DISK_FULL, atomic_write, cluster_dir, read_json
from orchestrator.store.ledger import State
from orchestrator.sweep import check_sweep_size, set_swept_keys
from orchestrator.value_rules import check_override_values, check_values

# Wide enough for the status table when output goes to a file or a pipe (rich would use 80).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)


# ---------------------------------------------------------------- the user's site folder
def check_site(argv: List[str]) -> None:
    """ConfigError for a site folder that cannot be used: $ORCHESTRATOR_CONF not a folder, a
    config.yaml there (it would replace the orchestrator's own: e.g. another Hydra app's
    ./conf), or a site file this command selects that the schema refuses (check_group_file).

    Hydra refuses such a file too, but in several lines and with exit code 1.
    """
    site = site_conf_dir()
    if site is None or site == CONF_DIR:
        return
    if (site / "config.yaml").exists():
        raise ConfigError(f"{site / 'config.yaml'}: a site folder holds config groups only "
                          f"(cluster/, model/, ...); this file would replace the orchestrator's "
                          f"own config.yaml. Move it, or set ORCHESTRATOR_CONF=<another folder>")
    for group, names in _selected_choices(argv).items():
        for name in names:
            path = site / group / f"{name}.yaml"
            if path.is_file():
                check_group_file(group, path)


def _override_values(o, options: Optional[List[str]] = None) -> list:
    """The values an override sets: its one value, or each value of a sweep. `glob(...)` picks
    among `options` (a config group's names, or a closed set such as the stages); on any other
    key it is refused, as Hydra would only fail later with a traceback."""
    if not o.is_sweep_override():
        return [o.value()]
    from hydra.core.override_parser.types import Glob

    if isinstance(o.value(), Glob):
        key = o.key_or_group
        if options is None:
            raise ConfigError(f"{key}=glob(...): glob picks among the names of a config group "
                              f"(cluster=glob(*)); list the values of {key} instead "
                              f"({key}=a,b)")
        return o.value().filter(options)
    return list(o.sweep_string_iterator())


def _selected_choices(argv: List[str]) -> dict:
    """group -> the names this command selects (`cluster=a,b` in a sweep: both), the package's
    defaults (conf/config.yaml) for groups the command line leaves alone."""
    import yaml

    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    chosen = {k: [v] for d in defaults if isinstance(d, dict) for k, v in d.items()
              if k.isidentifier()}
    for o in parse_overrides(tuple(argv)) or ():
        if o.key_or_group in chosen and not o.is_delete():
            values = _override_values(o, group_options(o.key_or_group, config_dirs()))
            chosen[o.key_or_group] = [str(v) for v in values]
    return chosen


def selected_sources() -> dict:
    """Where this command's cluster and model came from (provenance): a site file's path, or
    `package:<group>/<name>.yaml`, as Hydra's search path orders its folders."""
    hydra_cfg = HydraConfig.get()
    dirs = [Path(s.path) for s in hydra_cfg.runtime.config_sources if s.schema == "file"]
    sources = {group: group_source(group, str(hydra_cfg.runtime.choices.get(group)), dirs)
               for group in ("cluster", "model")}
    return {group: source for group, source in sources.items() if source is not None}


# ---------------------------------------------------------------- before Hydra: closed choices
def _group_names() -> List[str]:
    """Config groups a command line selects from (`cluster=dev`, `model=...`): the site's and
    the package's."""
    return sorted({p.name for d in config_dirs() for p in d.iterdir() if p.is_dir()})


def check_closed_choices(argv: List[str]) -> None:
    """Refuse an unknown key, group choice (stage, launcher, cluster, model: with the closest
    names) or enum value (schedule, dtype, source, ...), or a name that would leave the profiles
    folder (`cluster.name=../x`), or a value of the wrong type (`trace.configs=[[a,1,1]]`), with
    one line naming what is allowed (exit code 2).

    Hydra's own message for these spans several lines and exits 1, and for a key it suggests
    `+key`, which it then accepts silently; they are closed sets, so we check them first (every
    key and value of a sweep too).
    """
    overrides = parse_overrides(tuple(argv)) or ()  # a syntax error: Hydra reports it
    group_names = _group_names()
    extra_dirs = config_dir_args(argv)  # None: Hydra is told to look elsewhere; it decides
    groups = {} if extra_dirs is None else {  # the groups a Config field selects: their files
        g: group_options(g, config_dirs() + extra_dirs) for g in group_names if schema_has_key(g)}
    groups["stage"] = sorted(STAGES + ("all", "status"))
    for o in overrides:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or key in group_names:
            pass  # Hydra's own settings and group selections: Hydra knows them
        elif not schema_has_key(key):
            raise ConfigError(unknown_key_message(key))
        if o.is_delete():
            continue
        values = _override_values(o, groups.get(key) or (
            group_options(key, config_dirs()) if key in group_names else None))
        if key in groups:
            for value in values:
                name = "null" if value is None else str(value)
                if name not in groups[key]:
                    raise ConfigError(unknown_choice_message(key, name, groups[key]))
            continue
        if key in PATH_NAME_KEYS:  # before Hydra: a sweep makes its folder from cluster.name
            for value in values:
                check_path_name(key, value)
        _check_choice(key, values)
        if key not in group_names and key.split(".")[0].split("/")[0] != "hydra":
            _check_types(key, list(o.sweep_iterator()) if o.is_sweep_override() else values)


def _check_choice(key: str, values: list) -> None:
    """ConfigError if `key` holds a Choice enum and a value (or list item) is not one of it."""
    choice = choice_type(key)
    if choice is None:
        return
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            try:
                if item is not None:
                    choice.parse(item)
            except ValueError:
                allowed = ", ".join(choice.__members__)
                raise ConfigError(f"{key}={item!r}; allowed: {allowed}") from None


def _check_types(key: str, values: list) -> None:
    """ConfigError (one line, exit 2) if a value does not fit the schema's type for `key`: what
    Hydra would refuse at compose time with OmegaConf's multi-line dump and exit 1."""
    for value in values:
        error = override_type_error(key, value)
        if error:
            raise ConfigError(error)


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
        console.print(_launch_line(plan, request.todo, launcher))
        ledger.launch(plan.key, request.todo, queued=launcher.queued, config_hash=plan.config_hash,
                      launcher=launcher.name, run_dir=request.run_dir)
        try:
            _write_run_config(cfg, run_base, sources)
            handle = launcher.submit(request, after=previous_job)
        except KeyboardInterrupt:
            _stop_interrupted(ledger, launcher, None, request, pending)
        except BaseException as e:
            _mark_ended(ledger, plan.key, State.failed, request.todo, f"not launched: {e}")
            raise
        # From here until its end is recorded, a Ctrl-C at any point stops this launch and
        # records it cancelled: one between two lines must not leave it `running`.
        try:
            job = {"job_id": launcher.job_id(handle), "job_folder": launcher.job_folder(handle)}
            try:
                ledger.attach_job(plan.key, request.todo, **job)
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


def _stop_interrupted(ledger, launcher, handle, request: StageRequest, pending) -> NoReturn:
    """Ctrl-C during or after a launch (`handle` None: its submit): a batch job the ledger
    follows runs on without us (the user chose Slurm so it would); a local launch, or a job
    not yet followed, is stopped and recorded cancelled."""
    if pending:
        jobs = " ".join(launcher.job_id(h) for h, _ in pending)
        console.print(f"\nSlurm job(s) {jobs} keep running; `stage=status` re-attaches, "
                      f"`scancel {jobs}` stops them")
    if any(h is handle for h, _ in pending):
        raise SystemExit(130)
    if handle is not None:
        launcher.stop(handle)  # not yet followed by the ledger: it must not run on
    _interrupted(ledger, request)


def _interrupted(ledger, request: StageRequest) -> NoReturn:
    key = request.ledger_key
    ledger.mark_ended(key, State.cancelled, request.todo, "interrupted (Ctrl-C)")
    err_console.print(escape(f"\n{key}: interrupted (Ctrl-C); parts finished before are "
                             f"kept, rerun the same command to resume"))
    raise SystemExit(130)


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
    refresh_ledger(ledger, cfg)  # what it cannot refresh (read-only folder) is shown as recorded
    entries = ledger.entries()
    table = Table(title=f"{ledger.path}")
    for col in ("entry", "state", "job id", "config", "started", "took", "progress / log / error"):
        table.add_column(col)
    colours = {"done": "green", "failed": "red", "cancelled": "yellow", "running": "cyan",
               "pending": "white"}
    for key in sorted(entries, key=lambda k: (entries[k].started or 0, k)):
        e = entries[key]
        took = f"{e.took_s:.1f}s" if e.took_s is not None else ""
        started = time.strftime("%m-%d %H:%M:%S", time.localtime(e.started)) if e.started else ""
        table.add_row(escape(key), f"[{colours.get(e.state.value, 'white')}]{e.state_text()}[/]",
                      str(e.job_id or ""), str(e.config_hash or "")[:8],
                      started, took,
                      escape(str(e.error or (e.progress if e.state.value == "running" else "")
                                 or _relative(e.log_path) or "")))
    if entries:
        console.print(table)
        print_train_table(cfg)
        print_calibrations(cfg)
    else:
        console.print(escape(f"nothing has run for cluster {cfg.cluster.name!r} yet "
                             f"({ledger.path} does not exist); start with: "
                             f"{' or '.join(commands_that_launch('all', cfg))}"))
    return [dict(entry=k, **e.to_dict()) for k, e in entries.items()]


def print_train_table(cfg) -> None:
    """Every train summary of the cluster: predicted against measured, one row per layout."""
    from orchestrator.sweep import train_row
    from orchestrator.train.plan import train_dir

    rows = []
    for path in sorted(train_dir(cfg).parent.glob("*/*.json")):
        try:
            summary = read_json(path)
            if summary.get("kind") == "train":
                rows.append({"model": str(summary["model"]), **train_row(summary)})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not rows:
        return
    table = Table(title="train: predicted vs measured iteration time")
    columns = ("model", "layout", "iteration ms", "measured ms", "error %", "tokens/s",
               "model peak GiB", "measured peak GiB")
    for col in columns:
        table.add_column("predicted ms" if col == "iteration ms" else col,
                         justify="left" if col in ("model", "layout") else "right")
    for row in rows:
        table.add_row(*(escape(row[c]) for c in columns))
    console.print(table)


def print_calibrations(cfg) -> None:
    """One line per model stage=tune calibrated on this cluster: its factors, its runs, the
    pick, and whether the profiles still match it."""
    import dataclasses as dc

    from orchestrator.train.plan import current_calibration

    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "calibration"
    for path in sorted(folder.glob("*.json")):
        try:
            rec = read_json(path)
            model_cfg = dc.replace(cfg, model=dc.replace(cfg.model, name=path.stem))
            calibration, used, note = current_calibration(model_cfg)
            factors = ", ".join(f"{k} x{v:.2f}" for k, v in rec["factors"].items())
            state = ("stale: " + note if note else
                     "current" if used is not None else "unused")
            console.print(escape(f"calibration {path.stem}: {rec['runs']} runs of "
                                 f"{len(rec['candidates'])} ({factors}); "
                                 f"{rec.get('why_not') or 'fitted'}; pick "
                                 f"{rec.get('pick_describe') or 'none'}; {state}"),
                          highlight=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            console.print(escape(f"calibration {path}: unreadable ({e})"))


# ---------------------------------------------------------------- entry points
def orchestrate(composed: DictConfig):
    """The Hydra task: one stage (or `all`, `status`, `init`) for one composed config."""
    try:
        cfg: Config = OmegaConf.to_object(composed)  # typed from here on, down to the ranks
    except OmegaConfBaseException as e:  # resolving it: `${oc.env:X}` unset, a `???` left
        return _failed(composed_error(e, selected_sources(), HydraConfig.get().overrides.task),
                       composed)
    set_user_overrides(HydraConfig.get().overrides.task)  # printed fix commands keep them
    try:
        check_path_names(cfg)  # also what a cluster or model file names: before any folder
        check_values(cfg)  # every number in its range (value_rules.py), group files' too
        if cfg.stage.name == "status":
            return print_status(cfg)
        if cfg.stage.name == "init":  # on the login node; its check job goes through run_stages
            from orchestrator.cli.init import init_cluster

            return init_cluster(cfg, run_stages, console)
        if cfg.stage.name == "tune":  # launches train once per candidate, then fits
            from orchestrator.cli.tune import tune

            return tune(cfg, run_stages, console)
        return run_stages(cfg)
    except OrchestratorError as e:
        return _failed(e, cfg)
    except OSError as e:  # a file we must write: the profiles folder is read-only, full, ...
        return _failed(file_error(e, cfg.profiles_dir, _disk_need(e, cfg)), cfg)


def _failed(error: OrchestratorError, cfg: Config):
    """One line on stderr; in a sweep a row of its table (the sweep goes on), else the exit."""
    if _unrecorded_ends:
        error.args = ("; ".join([str(error), *_unrecorded_ends]),)
        _unrecorded_ends.clear()
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        if isinstance(error, InvalidLayout):  # a point that cannot run here: skipped, not failed
            err_console.print(f"[yellow]skipped:[/] {escape(str(error))}", soft_wrap=True)
            return [{"stage": cfg.stage.name, "state": "skipped", "error": str(error),
                     "exit_code": 0}]
        print_error(error)
        return [{"stage": cfg.stage.name, "state": "failed", "error": str(error),
                 "exit_code": error.exit_code}]
    report_error(error)


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig):
    return orchestrate(cfg)


def main(argv: Optional[List[str]] = None) -> None:
    try:  # `import.` and values holding '=' spelled for Hydra's grammar (overrides.hydra_argv)
        if argv is None:
            sys.argv[1:] = hydra_argv(sys.argv[1:])  # Hydra reads sys.argv itself
        argv = sys.argv[1:] if argv is None else hydra_argv(argv)
    except ConfigError as e:
        report_error(e)
    set_swept_keys(argv)
    # Tab completion's `query=bash` / `install=bash` are Hydra's words, not config keys.
    completing = any(a in ("-sc", "--shell-completion") for a in argv)
    try:
        if not completing:
            check_sweep_size(argv)  # before a sweep's values are listed
            check_closed_choices(argv)
            check_override_values(argv)  # every point of a sweep, before the first runs
        check_site([] if completing else argv)
    except ConfigError as e:
        report_error(e)
    try:
        hydra_main()
    except KeyboardInterrupt:
        err_console.print("\ninterrupted (Ctrl-C)")
        sys.exit(130)
