"""Where configs come from: the package's conf/ groups and the user's site folder layered over
them, in the order Hydra searches them.

The CLI asks these before Hydra starts (which names a group offers, where a choice came from);
`register_site_search_path` puts the site folder into Hydra's own search path, so `--help`, tab
completion, `--cfg` and `-m` see it too. The schema those files merge into is
orchestrator/config.py (its `register_configs` calls this module's registration).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from orchestrator.errors import ConfigError

# The Hydra config groups ship inside the package, so a wheel install finds them too.
CONF_DIR = Path(__file__).resolve().parent / "conf"

# The user's site folder: conf/<group>/<name>.yaml files layered over CONF_DIR's (a site file
# with the same name as a package file overrides it). This variable names it; else ./conf.
SITE_CONF_ENV = "ORCHESTRATOR_CONF"


def site_conf_dir() -> Optional[Path]:
    """The user's site config folder, absolute: $ORCHESTRATOR_CONF if set, else ./conf if it is
    a folder, else None. ConfigError if ORCHESTRATOR_CONF is set but is not a folder."""
    named = os.environ.get(SITE_CONF_ENV)
    if named:  # set and not empty
        path = Path(named).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{SITE_CONF_ENV}={named}: not a folder; point it at a folder of "
                              f"config groups (e.g. one holding cluster/<name>.yaml) or unset it "
                              f"to use ./conf")
        return path.resolve()
    local = Path.cwd() / "conf"
    return local.resolve() if local.is_dir() else None


def config_dirs() -> List[Path]:
    """The config folders in Hydra's search order: the site folder (when there is one), then
    the package's conf/. The first that holds `<group>/<name>.yaml` provides it."""
    site = site_conf_dir()
    return ([site] if site is not None else []) + [CONF_DIR]


def group_options(group: str, dirs: List[Path]) -> List[str]:
    """Names a command line can select in config `group` (`cluster=<name>`), over `dirs`."""
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def group_source(group: str, name: str, dirs: List[Path]) -> Optional[str]:
    """Where `group=name` comes from, for provenance: the file's absolute path, or
    `package:<group>/<name>.yaml` for the package's own; None when no folder of `dirs` (in
    search order) holds it."""
    for folder in dirs:
        path = folder / group / f"{name}.yaml"
        if path.is_file():
            if folder.resolve() == CONF_DIR:
                return f"package:{group}/{name}.yaml"
            return str(path.resolve())
    return None


def register_site_search_path() -> None:
    """Register the site folder's place in Hydra's search path (once per process)."""
    from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    global _site_search_path_registered
    if _site_search_path_registered:
        return

    class SiteSearchPath(SearchPathPlugin):
        """Puts the user's site folder (site_conf_dir: $ORCHESTRATOR_CONF or ./conf) right
        before the package's conf/ in Hydra's search path: `--help`, tab completion, `--cfg`
        and `-m` see its groups, and a site file named like a package file overrides it (the
        first folder that holds a file provides it). Other Hydra apps' paths are left alone."""

        def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
            try:
                site = site_conf_dir()
            except ConfigError:
                return  # main() has said so in one line before Hydra started
            package = next((e for e in search_path.get_path() if e.provider == "main" and
                            Path(e.path.removeprefix("file://")).resolve() == CONF_DIR), None)
            if site is None or package is None or site == CONF_DIR:
                return
            search_path.prepend("orchestrator-site", f"file://{site}",
                                anchor=SearchPathQuery(provider="main", path=package.path))

    Plugins.instance().register(SiteSearchPath)
    _site_search_path_registered = True


_site_search_path_registered = False
