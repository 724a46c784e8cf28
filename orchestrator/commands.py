"""Commands printed to the user (in errors and hints): copy-pasteable, and they do the fix.

A printed command must keep what the user gave on the command line (`profiles_dir`, `cluster`,
`model`, a model or cluster field, `launcher`) or it acts on other files than the ones the
message is about. The CLI records the user's overrides once (`set_user_overrides`); every
message builds its command with `rerun_command`, which keeps the overrides that matter to the
stage named and quotes each argument for a POSIX shell (`[...]` is a glob in bash).
"""
from __future__ import annotations

import shlex
from functools import lru_cache
from typing import Iterable, List, Optional, Sequence, Tuple

# Config sections every stage's command keeps (they say which files and which hardware).
_SHARED = ("profiles_dir", "cluster", "model", "launcher", "hydra")
# Top-level keys that never belong in a fix command (the message adds them when it means them).
_DROPPED = ("stage", "force", "wait")

_user_overrides: List[str] = []


def set_user_overrides(overrides: Iterable[str]) -> None:
    """Record the overrides of this command (Hydra's `hydra.overrides.task`), once, in the CLI,
    as the user spells them (`import.path`, which the schema calls `import_.path`)."""
    from orchestrator.config_keys import user_spelling
    from orchestrator.overrides import typed_form

    _user_overrides[:] = [typed_form(user_spelling(str(o))) for o in overrides]


def user_overrides() -> List[str]:
    return list(_user_overrides)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _kept(override: str, stage: str) -> bool:
    """Does `override` matter to a command running `stage`?"""
    key = _key(override)
    top = key.split(".", 1)[0].split("/", 1)[0]
    if top in _DROPPED:
        return False
    return top in _SHARED or top == stage


@lru_cache(maxsize=4)
def parse_overrides(argv: Tuple[str, ...]) -> Optional[list]:
    """The overrides of a command line as Hydra parses them (key, value, sweep), before Hydra
    composes anything; None on a syntax error (Hydra reports those its own way)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-") and "=" in a or a.startswith("~")]
    try:
        return OverridesParser.create().parse_overrides(args)
    except Exception:
        return None


def rerun_command(stage: str, *extra: str, overrides: Optional[Sequence[str]] = None) -> str:
    """`python -m orchestrator stage=<stage> <the user's overrides that matter to it> <extra>`,
    each argument shell-quoted. `extra` overrides win over the user's for the same key."""
    given = user_overrides() if overrides is None else list(overrides)
    extra_keys = {_key(e) for e in extra}
    kept = [o for o in given if _kept(o, stage) and _key(o) not in extra_keys]
    args = [f"stage={stage}", *kept, *extra]
    return "python -m orchestrator " + " ".join(shlex.quote(a) for a in args)


def commands_that_launch(stage: str, cfg) -> List[str]:
    """The command that runs `stage` with this command's overrides; where the local launcher
    cannot start the cluster's nodes (`cfg`: the Config), two instead: on Slurm with them
    (launcher=slurm), and here on one node (cluster.nodes=1)."""
    from orchestrator.config import local_cannot_reach

    if local_cannot_reach(cfg.launcher.name, cfg.cluster.nodes):
        return [rerun_command(stage, "launcher=slurm"), rerun_command(stage, "cluster.nodes=1")]
    return [rerun_command(stage)]
