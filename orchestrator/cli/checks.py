"""What the command line asks, checked before Hydra composes it: the user's site folder and
the closed choices (a group option or a key's enum), each refused with one line."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from hydra.core.hydra_config import HydraConfig

from orchestrator.commands import parse_overrides
from orchestrator.conf_folders import (
    CONF_DIR,
    config_dirs,
    group_options,
    group_source,
    site_conf_dir,
)
from orchestrator.config_keys import (
    PATH_NAME_KEYS,
    check_path_name,
    choice_type,
    override_type_error,
    schema_has_key,
    unknown_key_message,
)
from orchestrator.errors import ConfigError
from orchestrator.overrides import config_dir_args, unknown_choice_message
from orchestrator.site_files import check_group_file
from orchestrator.stages import STAGES


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
        _check_prefix(o, key, group_names)
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


def _check_prefix(o, key: str, group_names) -> None:
    """ConfigError for a `+` or `~` Hydra would refuse in several lines, exit 1: `+key=v` for a
    key the config already holds (`+model.hidden=64`, `+model=tiny`), `~key` for a typed key
    (`~cluster.name`: a dataclass field cannot be deleted). `++` and free-form keys pass."""
    from orchestrator.config_keys import inside_free_form, is_section

    if key == "hydra" or key.startswith(("hydra.", "hydra/")) or inside_free_form(key):
        return
    typed = o.input_line.split("=", 1)[0] if o.input_line else key
    if o.is_add() and not o.is_force_add() and (key in group_names or schema_has_key(key)):
        what = "chosen" if key in group_names else "in the config"
        raise ConfigError(f"{typed}: {key} is already {what}; write {key}=... without the '+' "
                          f"(or '++' to add or replace)")
    if o.is_delete() and key == "stage":  # Hydra drops the choice: the default, stage=all, ran
        raise ConfigError(f"{typed}: a command runs the stage it names (stage=<name>); without "
                          f"one it runs stage=all")
    if o.is_delete() and key not in group_names and not is_section(key):
        raise ConfigError(f"{typed}: {key} is a typed key and cannot be deleted; set it "
                          f"({key}=...), or leave it out for its default")


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
