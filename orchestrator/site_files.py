"""A site's group file (conf/cluster/<name>.yaml, conf/model/<name>.yaml, in ./conf or
$ORCHESTRATOR_CONF) read as Hydra will read it, every mistake said in one line naming the file,
the line and the key (exit code 2), where Hydra would print 15 to 150 lines and exit 1.

The ways a file can be wrong, in the order they are asked: it cannot be read (no permission, not
UTF-8 text); it is not YAML (syntax, a tab, a duplicate key, an unknown alias); it holds what a
config cannot (a YAML set, binary, an explicit `!!timestamp`, an ordered map, a custom or Python
tag, a key that is not a name such as `1:` or `true:`, an alias that holds itself), or is not a
mapping of keys at all, or its `defaults:` is not a list; an interpolation `${...}` that does not
parse or names no key or resolver; the schema's refusals where its keys land (its group, or its
`# @package`): an unknown key, a wrong type, a name that cannot be a folder name. What only
resolving finds once Hydra has composed (an unset `${oc.env:X}`) is composed_error's, named the
same way.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Tuple

from orchestrator.errors import ConfigError

YAML_TAG = "tag:yaml.org,2002:"
# What a config holds, as plain YAML writes it (OmegaConf's primitives). Any other tag makes a
# Python object OmegaConf refuses (a set, a date) or one no schema field expects (bytes).
HELD_SCALARS = ("str", "int", "float", "bool", "null")


def _line(node) -> int:
    return node.start_mark.line + 1


def _where(path: Path, line: Optional[int]) -> str:
    """`<path>: line <n>:` (or `<path>:` when the line is not known)."""
    return f"{path}: line {line}:" if line else f"{path}:"


def _tag(node) -> str:
    """`str`, `map`, `set`, ... for YAML's own tags; any other as written (`!foo`)."""
    return node.tag.removeprefix(YAML_TAG)


def _compose(text: str):
    """The YAML node tree of `text` as OmegaConf's loader resolves it (the loader Hydra reads
    group files with: no implicit dates), None for an empty document; yaml.YAMLError else."""
    from omegaconf._utils import get_yaml_loader

    loader = get_yaml_loader()(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _nodes(node, key: str = "", seen: Optional[set] = None,
           above: frozenset = frozenset()) -> Iterator[Tuple[object, str, str]]:
    """(node, dotted key, role) for `node` and every node under it, each once (an alias shares
    its anchor's node): role "value", "key" (a mapping's key) or "cycle" (an alias that holds
    itself, `a: &a [*a]`, which no config can hold)."""
    import yaml

    seen = set() if seen is None else seen
    if id(node) in above:
        yield node, key, "cycle"
        return
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node, key, "value"
    above = above | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            yield key_node, key, "key"
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            yield from _nodes(value_node, f"{key}.{name}" if key else str(name), seen, above)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _nodes(item, f"{key}[{i}]", seen, above)


def node_problem(node, key: str, role: str) -> Optional[str]:
    """What a config cannot take in one YAML node (`key`: where it is, "" at the top; `role`
    as _nodes gives it), or None: a key that is not a name, an alias that holds itself, a tag
    other than a mapping, a list or a HELD_SCALARS value, an interpolation that does not
    parse."""
    import yaml
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar_parser import parse

    tag, at = _tag(node), f"{key}: " if key else ""
    written = f"!!{tag}" if node.tag.startswith(YAML_TAG) else tag
    if role == "cycle":
        return f"{at}an alias that holds itself (&a [*a]): no config can hold it"
    if role == "key":
        if tag in ("str", "merge"):  # `<<: *base` merges a mapping in, as YAML means it
            return None
        value = node.value if isinstance(node, yaml.ScalarNode) else "..."
        return (f"{at}the key {value!r} is a YAML {written}, not a name: quote it "
                f"('{value}': ...) or rename it")
    if ((isinstance(node, yaml.MappingNode) and tag == "map")
            or (isinstance(node, yaml.SequenceNode) and tag == "seq")):
        return None
    if isinstance(node, yaml.ScalarNode) and tag in HELD_SCALARS:
        if tag == "str" and "${" in node.value:
            try:
                parse(node.value)
            except GrammarParseError as e:
                return (f"{at}{node.value!r} is not a valid interpolation "
                        f"({str(e).splitlines()[0]}); a literal '${{' is written '\\${{'")
        return None
    return (f"{at}a YAML {written} value, which a config cannot hold: write text (quoted, to "
            f"keep it as written), a number, true/false, null, a list or a mapping")


def _yaml_error(path: Path, error) -> str:
    """One line for a YAML error: the file, the line of the problem, what it is."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{_where(path, mark.line + 1 if mark is not None else None)} not valid YAML: {problem}"


def read_group_file(path: Path, group: str = ""):
    """(the file's YAML node tree, its DictConfig, its text); tree and config None for an empty
    file. ConfigError, one line naming the file, the line and the key (`<group>.<key>`, or where
    its `# @package` puts it), for a file that cannot be read, is not YAML, holds what a config
    cannot (node_problem), is not a mapping, or whose `defaults:` is not a list."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        text = path.read_text(encoding="utf-8")  # as Hydra opens it
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        root = _compose(text)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    if root is None:
        return None, None, text
    if not isinstance(root, yaml.MappingNode) or _tag(root) != "map":
        what = ("a list" if isinstance(root, yaml.SequenceNode) else
                f"the single value {root.value!r}" if isinstance(root, yaml.ScalarNode) else
                f"a YAML !!{_tag(root)}")
        raise ConfigError(f"{_where(path, _line(root))} holds {what}, not keys (key: value, "
                          f"one a line)")
    for key_node, value_node in root.value:
        if key_node.value == "defaults" and not isinstance(value_node, yaml.SequenceNode):
            raise ConfigError(f"{_where(path, _line(value_node))} defaults: Hydra's defaults "
                              f"list is a list (defaults: [...]); or leave it out")
    for node, key, role in _nodes(root, package_of(text, group)):
        problem = node_problem(node, key, role)
        if problem:
            raise ConfigError(f"{_where(path, _line(node))} {problem}")
    try:  # what the tree does not show: a duplicate key is found as the mapping is built
        return root, OmegaConf.create(text), text
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e.full_key}: {str(e).splitlines()[0]}") from None


def _find(root, dotted_key: str):
    """The YAML node of `dotted_key` (`links.nic_Gbps`) in a file's node tree, else None."""
    import yaml

    node = root
    for name in dotted_key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        node = next((v for k, v in node.value if k.value == name), None)
        if node is None:
            return None
    return node


def line_of(root, dotted_key: str) -> Optional[int]:
    """The line of `dotted_key` in a file's YAML node tree (1-based), else None."""
    node = _find(root, dotted_key)
    return _line(node) if node is not None and node is not root else None


def package_of(text: str, group: str) -> str:
    """Where Hydra places a group file's keys (its `# @package` header, as a dotted key): the
    group itself by default ("cluster"), "" for `_global_` (the top of the config)."""
    import re

    header = re.match(r"(?:\s*#[^\n]*\n|\s*\n)*?\s*#\s*@package\s+(\S+)", text)
    if header is None:
        return group
    parts = [group if p == "_group_" else p for p in header.group(1).split(".")]
    return ".".join(parts[1:] if parts[0] == "_global_" else parts)


def check_group_file(group: str, path: Path) -> None:
    """ConfigError, one line naming `path`, the line and the key, when a group file (e.g. a
    site's conf/cluster/mysite.yaml) cannot be read as YAML a config holds (read_group_file),
    or does not fit the schema where its keys land (the `group` section, or its `# @package`):
    an unknown key, a wrong type, an interpolation naming no key or resolver, a name that
    cannot be a folder name."""
    from omegaconf import OmegaConf
    from omegaconf.errors import (ConfigKeyError, InterpolationKeyError,
                                  OmegaConfBaseException, UnsupportedInterpolationType)

    from orchestrator.config import Config
    from orchestrator.config_keys import (PATH_NAME_KEYS, _field_type, check_path_name,
                                          override_type_error, unknown_key_message)

    root, node, text = read_group_file(path, group)
    target = package_of(text, group)
    _check_named(group, path, target, root)
    if node is None:
        return
    section = Config
    for name in target.split(".") if target else ():
        section = _field_type(section, name)
    if not dataclasses.is_dataclass(section):
        return  # a free-form or unknown place: Hydra says what it makes of it
    node.pop("defaults", None)
    prefix = f"{target}." if target else ""

    def refuse(key: str, line: str) -> ConfigError:
        return ConfigError(f"{_where(path, line_of(root, key))} {line}")

    try:
        merged = OmegaConf.merge(OmegaConf.structured(section), node)
    except ConfigKeyError as e:
        key = str(e.full_key)
        raise refuse(key, unknown_key_message(f"{prefix}{key}")) from None
    except OmegaConfBaseException as e:  # a wrong type: worded as on the command line
        key = str(e.full_key)
        line = (override_type_error(f"{prefix}{key}", OmegaConf.select(node, key))
                or f"{prefix}{key}: {str(e).splitlines()[0]}")
        raise refuse(key, line) from None
    if "${" in text:
        try:
            _resolve(merged, target)
        except (InterpolationKeyError, UnsupportedInterpolationType) as e:
            key = str(e.full_key).removeprefix(prefix)
            what = "names no key" if isinstance(e, InterpolationKeyError) else "names no resolver"
            raise refuse(key, f"{prefix}{key}: {getattr(_find(root, key), 'value', '')!r} "
                              f"{what} ({str(e).splitlines()[0]})") from None
        except OmegaConfBaseException:
            pass  # `${hydra:...}` (set once Hydra runs), an unset variable: composed_error
    for key in PATH_NAME_KEYS:
        if key.startswith(prefix):
            leaf = key.removeprefix(prefix)
            try:
                check_path_name(key, OmegaConf.select(merged, leaf,
                                                      throw_on_resolution_failure=False))
            except ConfigError as e:
                raise refuse(leaf, str(e)) from None


# Groups whose `name` is a folder under the profiles folder (profiles/<cluster.name>/,
# model/<model.name>.json, train/<model.name>/).
NAMED_GROUPS = ("cluster", "model")
# A model's shape: no default fits another model (the schema's are tiny's).
MODEL_SHAPE = ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "seq_len")


def _check_named(group: str, path: Path, target: str, root) -> None:
    """ConfigError when a cluster or model file sets no `name:` of its own: it would take the
    schema's default (`local`, `tiny`) or its `defaults:` parent's, and its profiles would
    replace that cluster's or model's own (profile_model kept tiny.json aside and wrote this
    model's shape there)."""
    import yaml

    if group not in NAMED_GROUPS or target != group:
        return
    keys = {getattr(k, "value", None) for k, _ in root.value} if isinstance(
        root, yaml.MappingNode) else set()
    missing = [k for k in MODEL_SHAPE if k not in keys]
    if group == "model" and "name" in keys and "defaults" not in keys and missing:
        raise ConfigError(f"{path}: sets no {', '.join(missing)}; a model file gives its whole "
                          f"shape ({', '.join(MODEL_SHAPE)}), else it takes tiny's (or put "
                          f"`defaults: [<model>, _self_]` first to start from another model)")
    if "name" in keys:
        return
    from orchestrator.config import Config

    default = getattr(getattr(Config(), group), "name")
    raise ConfigError(f"{path}: sets no name; add `name: {path.stem}` (the file's name): "
                      f"profiles land in folders named by it, and without it this {group} "
                      f"would be named {default!r} and replace that {group}'s profiles")


def _resolve(merged, target: str) -> None:
    """Resolve the interpolations of a group file's keys (`merged`, placed at `target`) against
    the schema's defaults for every other section, with Hydra's resolvers registered:
    `${model.seq_len}` resolves, `${model.nope}` raises InterpolationKeyError, `${nope:x}`
    UnsupportedInterpolationType."""
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    from orchestrator.config import Config

    setup_globals()  # `${now:...}`, `${hydra:...}`: registered as Hydra does before composing
    placed = merged
    for name in reversed(target.split(".") if target else ()):
        placed = {name: placed}
    whole = OmegaConf.merge(OmegaConf.structured(Config), placed)
    OmegaConf.to_container(OmegaConf.select(whole, target) if target else whole, resolve=True)


def composed_error(error, sources: Dict[str, str], overridden: Sequence[str]) -> ConfigError:
    """One line for what OmegaConf raises on the composed config (an unset `${oc.env:X}`, a
    `???` left for the command line): the key and what is wrong, headed by the site file and
    line it came from (`sources`: group -> file, selected_sources) unless the command line set
    the key (`overridden`: its overrides)."""
    key = str(getattr(error, "full_key", "") or "")
    line = f"{key}: {str(error).splitlines()[0]}" if key else str(error).splitlines()[0]
    group, _, leaf = key.partition(".")
    source = sources.get(group, "package:")
    if source.startswith("package:") or key in {o.split("=", 1)[0].lstrip("+~") for o in
                                                overridden}:
        return ConfigError(line)
    path = Path(source)
    try:
        root = _compose(path.read_text(encoding="utf-8"))
    except Exception:  # the file read before: a change since is not worth a second error
        root = None
    return ConfigError(f"{_where(path, line_of(root, leaf) if root else None)} {line}")
