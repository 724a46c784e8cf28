"""The command line before Hydra reads it: group choices that name no file, and values Hydra's
override grammar cannot take as typed.

Hydra refuses both, but in many lines (its "Could not find 'model/tinny'" with every option on a
line of its own, or a grammar error "mismatched input '='") and with exit code 1. The CLI asks
these first, so a mistake is one line and exit code 2 (docs/runs.md), as for a misspelled key.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Hydra's options that change where configs come from: with them the CLI cannot know every
# group's names (a config dir is added; a primary config or search path replaced).
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
_OTHER_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn")


def config_dir_args(argv: Sequence[str]) -> Optional[List[Path]]:
    """The folders Hydra's `--config-dir`/`-cd` add to its search path (`--config-dir=X` or
    `--config-dir X`), or None when the command line chooses configs in a way the CLI does not
    follow (`--config-path`, `--config-name`, `hydra.searchpath=...`): Hydra then decides."""
    dirs = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _OTHER_CONFIG_FLAGS or flag.lstrip("+~") == "hydra.searchpath":
            return None
        if flag in _CONFIG_DIR_FLAGS:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            dirs.append(Path(value).expanduser())
    return dirs


def unknown_choice_message(group: str, name: str, allowed: Sequence[str]) -> str:
    """'unknown <group> <name>; did you mean <closest>? allowed: <every name>', one line; for a
    group of files (cluster, model) also where a new one goes."""
    close = difflib.get_close_matches(name, allowed, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    line = f"unknown {group} {name!r}; {hint}allowed: {', '.join(allowed)}"
    if group in ("cluster", "model"):
        line += f" (a new one is a file conf/{group}/<name>.yaml: docs/config.md)"
    return line

