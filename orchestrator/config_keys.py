"""The schema read key by key: which dotted keys exist, the type each holds, whether a value from
the command line fits it (checked before Hydra composes), which keys name a folder or file, and
the user's spelling of `import.`.

The CLI, the site-file checks (site_files.py), the value rules (value_rules.py) and the override
rewriting (overrides.py) ask these, so that a mistake is one line naming the key (ConfigError,
exit 2) rather than Hydra's multi-line dump. The schema itself is orchestrator/config.py.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Dict, List, Optional

from orchestrator.config import Config
from orchestrator.errors import ConfigError

# Config values that become one folder or file name: profiles/<cluster.name>/,
# model/<model.name>.json, train/<model.name>/, conf/device/<device>.yaml.
PATH_NAME_KEYS = ("cluster.name", "model.name", "profile_model.device", "trace.device")
_PATH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_path_name(key: str, value: Any) -> None:
    """ConfigError unless `value` is safe as one folder or file name, so that it cannot leave
    the profiles folder: ASCII letters, digits, `_`, `-` and `.`, not starting with `.` or `-`,
    no `..` (None passes: an unset optional)."""
    if value is None:
        return
    text = str(value)
    if _PATH_NAME.fullmatch(text) and ".." not in text:
        return
    raise ConfigError(f"{key}={text!r}: it names a folder or file, so it may hold only letters, "
                      f"digits, '_', '-' and '.', and must not start with '.' or '-' nor contain "
                      f"'..'")


def check_path_names(cfg: Config) -> None:
    """check_path_name on every key of PATH_NAME_KEYS in `cfg`; an empty profiles_dir (e.g. a
    shell variable that was not set) would put every file in the current folder."""
    if not str(cfg.profiles_dir).strip():
        raise ConfigError("profiles_dir is empty: give the folder for profiles and runs "
                          "(profiles_dir=profiles is the default)")
    for key in PATH_NAME_KEYS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        check_path_name(key, value)


def _field_type(node: type, name: str) -> Optional[type]:
    """The type of dataclass `node`'s field `name`, Optional[X] and List[X] read as X; None when
    `node` is not a dataclass or has no such field."""
    if not dataclasses.is_dataclass(node):
        return None
    hint = typing.get_type_hints(node).get(name)
    while typing.get_origin(hint) in (typing.Union, list, List):  # Optional[X], List[X]
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def is_section(dotted_key: str) -> bool:
    """Whether `dotted_key` names a section of the config (a dataclass, e.g. "train"), not a
    typed leaf (e.g. "cluster.name")."""
    node: Optional[type] = Config
    for name in dotted_key.split("."):
        node = _field_type(node, name)
    return dataclasses.is_dataclass(node)


def choice_type(dotted_key: str, node: type = None) -> Optional[type]:
    """The Choice enum a config key (e.g. "search.schedules") holds, alone, optional or in a
    list; None for any other key. Lets the CLI refuse a bad choice in one line before Hydra."""
    from orchestrator.choices import Choice

    head, _, rest = dotted_key.partition(".")
    hint = _field_type(node or Config, head)
    if hint is None:
        return None
    if rest:
        return choice_type(rest, hint)
    return hint if isinstance(hint, type) and issubclass(hint, Choice) else None


# ---------------------------------------------------------------- the type of a command-line value
def _optional_inner(hint) -> tuple:
    """(X, True) for Optional[X], else (hint, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _schema_hint(dotted_key: str, node: type = Config):
    """The full type hint of `dotted_key` (Optional and List kept); Any inside a free-form Dict
    field, None for a key the schema does not have."""
    head, _, rest = dotted_key.partition(".")
    hint = typing.get_type_hints(node).get(head) if dataclasses.is_dataclass(node) else None
    if hint is None or not rest:
        return hint
    inner, _ = _optional_inner(hint)
    return Any if _is_free_form(inner) else _schema_hint(rest, inner)


def _type_words(hint) -> tuple:
    """How a message names a value of type `hint`: (singular, plural)."""
    from enum import Enum

    hint, _ = _optional_inner(hint)
    if typing.get_origin(hint) in (list, List):
        plural = _type_words((typing.get_args(hint) or (Any,))[0])[1]
        return f"a list of {plural}", f"lists of {plural}"
    if isinstance(hint, type) and issubclass(hint, Enum):
        names = ", ".join(hint.__members__)
        return f"one of {names}", f"items from {names}"
    if dataclasses.is_dataclass(hint):
        return "a mapping of its keys", "mappings"
    words = {bool: ("true or false", "booleans (true or false)"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), str: ("a string", "strings")}
    name = getattr(hint, "__name__", str(hint))
    return words.get(hint, (f"a {name}", f"{name} values"))


def _leaf_fits(hint, value) -> bool:
    """Whether OmegaConf's node of type `hint` (int, float, bool, str, an Enum) takes `value`:
    the check OmegaConf makes when Hydra assigns it."""
    from enum import Enum

    from omegaconf import nodes
    from omegaconf.errors import ValidationError

    kinds = {int: nodes.IntegerNode, float: nodes.FloatNode, bool: nodes.BooleanNode,
             str: nodes.StringNode}
    try:
        if isinstance(hint, type) and issubclass(hint, Enum):
            nodes.EnumNode(enum_type=hint, value=value)
        elif hint in kinds:
            kinds[hint](value=value)
    except ValidationError:
        return False
    return True


def _misfit(where: str, hint, value) -> Optional[tuple]:
    """(key with list indices, value, expected hint) of the first part of `value` that does not
    fit `hint`, walking lists and sections; None when every part fits."""
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: OmegaConf checks what it resolves to
    inner, optional = _optional_inner(hint)
    if inner is Any or inner is None or _is_free_form(inner):
        return None
    if value is None:
        return None if optional else (where, value, inner)
    if typing.get_origin(inner) in (list, List):
        if not isinstance(value, (list, tuple)):
            return (where, value, inner)
        item = (typing.get_args(inner) or (Any,))[0]
        return next((m for i, v in enumerate(value) if (m := _misfit(f"{where}[{i}]", item, v))),
                    None)
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            return (where, value, inner)
        hints = typing.get_type_hints(inner)
        return next((m for k, v in value.items()
                     if k in hints and (m := _misfit(f"{where}.{k}", hints[k], v))), None)
    return None if _leaf_fits(inner, value) else (where, value, inner)


def _shown(value) -> str:
    """A value as a message shows it: strings quoted, null, true/false."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def override_type_error(dotted_key: str, value: Any) -> Optional[str]:
    """None when `value` (as Hydra parsed it from the command line) fits the schema's type at
    `dotted_key`; else one line naming the key, down to the list item, and the type expected:
    "trace.configs[0][0]='a': expected an integer". OmegaConf decides, with the update Hydra
    makes when it composes, on the key's section (a top-level value: OmegaConf's node check)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    hint = _schema_hint(dotted_key)
    if (_optional_inner(hint)[0] is bool and isinstance(value, int)
            and not isinstance(value, bool) and value not in (0, 1)):
        # OmegaConf takes any integer as a boolean: `wait=2` is a slip, not true
        return user_spelling(f"{dotted_key}={value}: expected true or false")
    head, _, rest = dotted_key.partition(".")
    section = typing.get_type_hints(Config).get(head)
    cause = "does not fit the schema"
    if dataclasses.is_dataclass(section):
        try:
            node = OmegaConf.structured(section)
            if rest:
                OmegaConf.update(node, rest, value, merge=True)
            else:
                OmegaConf.merge(node, value)
            return None
        except (ConfigKeyError, ConfigAttributeError):
            return None  # an unknown key: refused as such before this check
        except OmegaConfBaseException as e:
            cause = str(e).strip().splitlines()[0]
    found = _misfit(dotted_key, hint, value)
    if found is None:
        return None if not dataclasses.is_dataclass(section) else user_spelling(
            f"{dotted_key}={_shown(value)}: {cause}")
    where, bad, expected = found
    brackets = ""  # `key=3,1` is a sweep of 3 and 1 to Hydra, not a list
    if (where == dotted_key and typing.get_origin(expected) in (list, List)
            and not isinstance(bad, (list, tuple))):
        brackets = f", in brackets: {where}=[...] (a,b without them is a sweep: -m)"
    return user_spelling(f"{where}={_shown(bad)}: expected {_type_words(expected)[0]}{brackets}")


def _is_free_form(hint) -> bool:
    """A Dict field: any key below it is the user's (e.g. cluster.sbatch_args.<flag>)."""
    return hint in (dict, Dict) or typing.get_origin(hint) in (dict, Dict)


def schema_has_key(dotted_key: str, node: type = Config) -> bool:
    """Whether `dotted_key` (e.g. "search.max_tp") names a field of the schema, or a key inside
    one of its free-form Dict fields."""
    head, _, rest = dotted_key.partition(".")
    hint = _field_type(node, head)
    if hint is None:
        return False
    if not rest or _is_free_form(hint):
        return True
    return schema_has_key(rest, hint)


def inside_free_form(dotted_key: str, node: type = Config) -> bool:
    """Whether `dotted_key` lies below a free-form Dict field (cluster.sbatch_args.<flag>): a
    key the schema cannot list, which Hydra takes only with `+` or `++` in front."""
    head, _, rest = dotted_key.partition(".")
    hint = _field_type(node, head)
    if hint is None or not rest:
        return False
    return _is_free_form(hint) or inside_free_form(rest, hint)


def schema_keys(node: type = Config, prefix: str = "") -> List[str]:
    """Every dotted key of the schema (sections and fields), e.g. "search", "search.max_tp"."""
    keys = []
    for f in dataclasses.fields(node):
        key = prefix + f.name
        keys.append(key)
        hint = _field_type(node, f.name)
        if dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, key + ".")
    return keys


def unknown_key_message(dotted_key: str) -> str:
    """'unknown key <key>; did you mean <closest known key>?' (or where to list the keys)."""
    import difflib

    close = difflib.get_close_matches(dotted_key, schema_keys(), n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]}?" if close
            else "`python -m orchestrator --cfg job` lists the keys")
    return user_spelling(f"unknown key {dotted_key}; {hint}")


# `import` is a Python keyword, so no dataclass field can be called that: the command line's
# `import.<key>` is the schema's `import_.<key>`. These two convert between the spellings.
def schema_spelling(override: str) -> str:
    """An override as the schema spells it (`import.path=x` -> `import_.path=x`; also with
    `+`, `++` or `~` in front)."""
    return re.sub(r"^([+~]{0,2})import\.", r"\1import_.", override)


def user_spelling(text: str) -> str:
    """An override or a message as the user spells it (`import_.` -> `import.`)."""
    return re.sub(r"(?<![\w.])import_\.", "import.", text)
