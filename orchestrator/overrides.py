"""The command line before Hydra reads it: group choices that name no file, and values Hydra's
override grammar cannot take as typed.

Hydra refuses both, but in many lines (its "Could not find 'model/tinny'" with every option on a
line of its own, or a grammar error "mismatched input '='") and with exit code 1. The CLI asks
these first, so a mistake is one line and exit code 2 (docs/runs.md), as for a misspelled key.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import List, Optional, Sequence

from orchestrator.errors import ConfigError

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



# ---------------------------------------------------------------- values holding '='
# Hydra's override grammar ends a key at the first '=' and then refuses a second one unquoted
# ("mismatched input '='"), yet srun's and mpiexec's flags hold one (`cluster.mpi_flag=
# --mpi=pmix`, as docs/config.md and the example site write them). A value, each value of a sweep
# or each item of a flat list that holds '=' and nothing else of the grammar is quoted for the
# user; Hydra's grammar stays as it is for every argument it already takes.
_KEY = re.compile(r"[+~]{0,2}[\w./@-]+")
_PLAIN_ITEM = re.compile(r"[^\[\]{}(),'\"\\$]*")  # no grammar but '=': quoting keeps it as typed


def _parses(arg: str) -> bool:
    """Does Hydra's override grammar take `arg`?"""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides([arg])
    except Exception:  # its OverrideParseException, or any error of a value it cannot read
        return False
    return True


def quote_equals(arg: str) -> str:
    """`key=--mpi=pmix` as Hydra's grammar takes it, `key='--mpi=pmix'`; also each value of a
    sweep (`key=a=1,a=2`) and each item of a flat list (`key=[--cpu-bind=cores,-v]`). Any other
    argument is returned as it is: a flag, one Hydra already parses, one whose value holds
    other grammar (quotes, braces, nested lists, `${...}`): check_equals_quoted says how to quote
    those."""
    key, eq, value = arg.partition("=")
    if arg.startswith("-") or not eq or "=" not in value or not _KEY.fullmatch(key):
        return arg
    if _parses(arg):
        return arg
    listed = value.startswith("[") and value.endswith("]")
    items = (value[1:-1] if listed else value).split(",")
    if not all(_PLAIN_ITEM.fullmatch(item) for item in items):
        return arg
    quoted = ",".join(f"'{item}'" if "=" in item else item for item in items)
    rewritten = f"{key}=[{quoted}]" if listed else f"{key}={quoted}"
    return rewritten if _parses(rewritten) else arg


_QUOTED_ITEM = re.compile(r"'([^'\\]*=[^'\\]*)'")  # an item quote_equals quoted


# A value Hydra's lexer refuses though it holds none of the grammar: a path starting with `~`
# (`train.data=~/corpus.txt`: the shell expands `~` only after `name=` with no dot), or
# holding a letter outside ASCII (`profiles_dir=/data/données`). Hydra's answer is a
# LexerNoViableAltException in 5 lines and exit code 1; quoted, it is the value as typed.
_PLAIN_VALUE = re.compile(r"[^\[\]{}(),'\"\\$=]+")


def quote_plain(arg: str) -> str:
    """`key=~/x` as Hydra's grammar takes it, `key='~/x'`, when Hydra's lexer refuses the value
    but it holds no grammar (no quotes, brackets, braces, commas, `$` or `=`); any other
    argument as it is."""
    key, eq, value = arg.partition("=")
    if (arg.startswith("-") or not eq or not _KEY.fullmatch(key) or key[:1] == "~"
            or not _PLAIN_VALUE.fullmatch(value) or _parses(arg)):
        return arg
    quoted = f"{key}='{value}'"
    return quoted if _parses(quoted) else arg


def typed_form(arg: str) -> str:
    """The inverse of quote_equals and free_form_spelling: `key='--mpi=pmix'` as the user may
    type it, `key=--mpi=pmix`, when quote_equals makes exactly `arg` of that; else `arg`. A printed fix
    command shows what the user typed, not the quotes added for Hydra."""
    if arg.startswith("++") and free_form_spelling(arg[2:]) == arg:
        arg = arg[2:]
    key, eq, value = arg.partition("=")
    if len(value) > 1 and value[0] == value[-1] == "'" and quote_plain(key + eq + value[1:-1]) == arg:
        return key + eq + value[1:-1]
    plain = key + eq + _QUOTED_ITEM.sub(r"\1", value)
    return plain if plain != arg and quote_equals(plain) == arg else arg


def check_equals_quoted(argv: Sequence[str]) -> None:
    """ConfigError (one line, exit 2) for an argument Hydra's grammar refuses because its value
    holds an unquoted '=' that quote_equals could not place; other grammar errors are Hydra's
    to report."""
    import shlex

    for arg in argv:
        key, eq, value = arg.partition("=")
        if arg.startswith("-") or not eq or "=" not in value or _parses(arg):
            continue
        # Hydra's double quotes inside the shell's single quotes: pasted, the shell passes them on.
        example = (f'{key}=["a=b",c]' if value.startswith("[") else
                   f'{key}={{a: "b=c"}}' if value.startswith("{") else f'{key}="{value}"')
        raise ConfigError(f"{arg}: Hydra's override grammar ends the key at the first '=' and "
                          f"refuses another unquoted one; quote the value, or each item that "
                          f"holds '=', so that the shell passes the quotes on, e.g. "
                          f"{shlex.quote(example)}")


# Hydra's options whose value is the next argument (`--config-dir /a=b`): a path, not an override.
_VALUED_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                 "--experimental-rerun", "--package", "-p", "--cfg", "-c", "--info", "-i")


def free_form_spelling(arg: str) -> str:
    """`cluster.sbatch_args.<flag>=v` as Hydra takes it, `++cluster.sbatch_args.<flag>=v`
    (added, or replaced where a cluster file sets it): Hydra refuses a key its config lacks
    without `+`, and a free-form key is one the user names (docs/config.md); any other argument
    unchanged."""
    from orchestrator.config_keys import inside_free_form

    key, eq, _ = arg.partition("=")
    return f"++{arg}" if eq and key[:1] not in "+~" and inside_free_form(key) else arg


def hydra_argv(argv: Sequence[str]) -> List[str]:
    """The command line as Hydra is to read it: each override as the schema spells it
    (`import.` -> `import_.`, config.schema_spelling) with its '=' values quoted
    (quote_equals); ConfigError for a value holding '=' that cannot be quoted for the user.
    Options and their values (`--config-dir /a=b`) pass unchanged."""
    from orchestrator.config_keys import schema_spelling

    rewritten, overrides = [], []
    for i, arg in enumerate(argv):
        if arg.startswith("-") or (i and argv[i - 1] in _VALUED_FLAGS):
            rewritten.append(arg)
            continue
        rewritten.append(quote_plain(quote_equals(free_form_spelling(schema_spelling(arg)))))
        overrides.append(rewritten[-1])
    check_equals_quoted(overrides)
    return rewritten
