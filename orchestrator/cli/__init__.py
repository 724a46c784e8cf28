"""`python -m orchestrator stage=<name> [key=value ...]`: compose, validate, plan, launch, report.

Everything a user can get wrong is checked here, before anything is launched or submitted:
unknown stage or launcher, an impossible cluster layout, a stage's own config, missing inputs.
Such errors print one line and exit with the error's code (2 for config errors).
"""
from __future__ import annotations

import sys
from typing import List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.markup import escape

from orchestrator.cli.checks import check_closed_choices, check_site, selected_sources
from orchestrator.cli.interrupt import interrupted_by, interrupted_exit_code, stop_on_sigterm
from orchestrator.cli.run import _disk_need, _unrecorded_ends, run_stages
from orchestrator.cli.status import print_status
from orchestrator.commands import set_user_overrides
from orchestrator.conf_folders import CONF_DIR
from orchestrator.config import Config, register_configs
from orchestrator.config_keys import check_path_names
from orchestrator.console import console, err_console, print_error, report_error
from orchestrator.errors import ConfigError, InvalidLayout, OrchestratorError, file_error
from orchestrator.overrides import hydra_argv
from orchestrator.site_files import composed_error
from orchestrator.sweep import check_sweep_size, set_swept_keys
from orchestrator.value_rules import check_override_values, check_values

__all__ = ["check_closed_choices", "main", "report_error", "run_stages"]


# ---------------------------------------------------------------- entry points
def orchestrate(composed: DictConfig):
    """The Hydra task: one stage (or `all`, `status`, `init`) for one composed config."""
    try:
        cfg: Config = OmegaConf.to_object(composed)  # typed from here on, down to the ranks
    except OmegaConfBaseException as e:  # resolving it: `${oc.env:X}` unset, a `???` left
        return _failed(composed_error(e, selected_sources(), HydraConfig.get().overrides.task),
                       composed)
    set_user_overrides(HydraConfig.get().overrides.task)  # printed fix commands keep them
    _expand_home(cfg)
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


# Paths the user gives, read with `~` as the shell would have expanded it (export.path,
# import.path and search.compare already are): `profiles_dir='~/p'` made a folder named `~`
# in the current one, `train.data=~/corpus.txt` (the shell leaves `~` after a dotted key)
# named no file.
_HOME_PATHS = ("profiles_dir", "train.data", "train.load", "train.layout")


def _expand_home(cfg: Config) -> None:
    import os

    for key in _HOME_PATHS:
        *parents, leaf = key.split(".")
        section = cfg
        for name in parents:
            section = getattr(section, name)
        value = getattr(section, leaf)
        if isinstance(value, str) and value.startswith("~"):
            setattr(section, leaf, os.path.expanduser(value))
    # The ledger records run folders and logs under profiles_dir: relative, they named nothing
    # for a `stage=status profiles_dir=/shared/p` typed in another folder or on another login
    # node. A job's ranks get the absolute folder too, whatever their working directory.
    if cfg.profiles_dir.strip():  # an empty one is refused by the checks, not made `.`
        cfg.profiles_dir = os.path.abspath(cfg.profiles_dir)


# Hydra's modes, of which a command takes one (Hydra: a ValueError traceback, exit 1).
_MODES = {"--run": "--run", "-r": "--run", "--multirun": "-m", "-m": "-m", "--cfg": "--cfg",
          "-c": "--cfg", "--info": "--info", "-i": "--info", "--shell-completion": "-sc",
          "-sc": "-sc"}


def _check_one_mode(argv: List[str]) -> None:
    """ConfigError for `--cfg job -m ...` and the like: one line saying what each does."""
    modes = sorted({_MODES[a.split("=")[0]] for a in argv if a.split("=")[0] in _MODES})
    if len(modes) > 1:
        hint = (" (--cfg job prints one point's config: give it without -m and with one value "
                "per key)" if "--cfg" in modes and "-m" in modes else "")
        raise ConfigError(f"{' and '.join(modes)} cannot be combined: Hydra takes one of --run, "
                          f"-m, --cfg, --info and --shell-completion{hint}")


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
        _check_one_mode(argv)
        if not completing:
            check_sweep_size(argv)  # before a sweep's values are listed
            check_closed_choices(argv)
            check_override_values(argv)  # every point of a sweep, before the first runs
        check_site([] if completing else argv)
    except ConfigError as e:
        report_error(e)
    stop_on_sigterm()  # `kill <pid>` stops a run as a Ctrl-C does: cancelled, one line
    try:
        hydra_main()
    except KeyboardInterrupt:
        err_console.print(f"\ninterrupted ({interrupted_by()})")
        sys.exit(interrupted_exit_code())
