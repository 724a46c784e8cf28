"""The base of every profile dataclass: `from_dict` validates field by field, `to_dict` writes
JSON-ready containers back in the same shape.

Fields are declared with `doc(...)` so the meaning travels with the type (the generated
docs/profile-schema.md prints both). A record with an `extras` field keeps the keys it does not
declare there (producers' notes that no reader uses); a record without one refuses unknown keys.
A field whose default is None is left out of `to_dict` while None (absent = unknown).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from enum import Enum
from typing import Any, ClassVar, Dict, Mapping, Tuple

from orchestrator.choices import Choice

EXTRAS = "extras"


class FieldError(ValueError):
    """A value that does not fit its field; `path` is where it is in the record
    (e.g. "benchmarks.allreduce.fits[3].alpha_us")."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path or '(the record)'}: {message}")
        self.path = path
        self.message = message


def doc(text: str, **kwargs) -> Any:
    """A dataclass field carrying its one-line meaning (units, conventions) in metadata."""
    return dataclasses.field(metadata={"doc": text}, **kwargs)


def show(value: Any) -> str:
    """A value as it reads in the JSON file, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _scalar(value: Any, tp: type, path: str) -> Any:
    ok = isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise FieldError(path, f"expected {_KIND_WORDS[tp]}, got {show(value)}")
    return value


def convert(value: Any, tp: Any, path: str) -> Any:
    """`value` read from JSON as type `tp` (scalars, Enums, records, Optional, List, Tuple[X, ...],
    Tuple[X, Y] (a list of one item per type), Dict); FieldError naming `path` when it does not
    fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return convert(value, next(a for a in args if a is not type(None)), path)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {show(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:  # Tuple[str, int]: by position
            if len(value) != len(args):
                raise FieldError(path, f"expected a list of {len(args)} items, got {show(value)}")
            return tuple(convert(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        items = [convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise FieldError(path, f"expected an object, got {show(value)}")
        return {_key(k, args[0], path): convert(v, args[1], join(path, k))
                for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp.parse(value) if issubclass(tp, Choice) else tp(value)
        except (ValueError, KeyError, TypeError):
            choices = [m.value for m in tp]
            raise FieldError(path, f"expected one of {choices}, got {show(value)}") from None
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_dict(value, path)
    if tp in _KIND_WORDS:
        return _scalar(value, tp, path)
    if hasattr(tp, "from_dict"):  # a domain object with its own checks (ParallelLayout)
        if not isinstance(value, Mapping):
            raise FieldError(path, f"expected an object, got {show(value)}")
        try:
            return tp.from_dict(value)
        except (ValueError, TypeError) as e:
            raise FieldError(path, str(e)) from None
    raise TypeError(f"schema: no reader for type {tp!r} at {path}")


def _key(key: str, tp: Any, path: str) -> Any:
    """A JSON object key as the dict's key type (ints are written as strings: "1", "2")."""
    if tp is int:
        try:
            return int(key)
        except ValueError:
            raise FieldError(join(path, key), "expected an integer key") from None
    return convert(key, tp, join(path, key))


def plain(value: Any) -> Any:
    """JSON-ready containers: records and domain objects via to_dict, Enums as their values."""
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Record:
    """Mixin of the schema dataclasses (declared `@dataclass(kw_only=True)`)."""

    _hints_cache: ClassVar[Dict[type, Dict[str, Any]]] = {}
    KEEP_NONE: ClassVar[bool] = False  # True: write null rather than leave a None field out

    @classmethod
    def hints(cls) -> Dict[str, Any]:
        """Field name -> resolved type."""
        if cls not in Record._hints_cache:
            Record._hints_cache[cls] = typing.get_type_hints(cls)
        return Record._hints_cache[cls]

    @classmethod
    def from_dict(cls, raw: Any, path: str = ""):
        """The record from a JSON object; FieldError naming the first field that does not fit."""
        if not isinstance(raw, Mapping):
            raise FieldError(path, f"expected an object, got {show(raw)}")
        hints, kwargs = cls.hints(), {}
        declared = [f for f in dataclasses.fields(cls) if f.name != EXTRAS]
        for f in declared:
            if f.name in raw:
                kwargs[f.name] = convert(raw[f.name], hints[f.name], join(path, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(join(path, f.name), "missing")
        unknown = {k: v for k, v in raw.items() if k not in {f.name for f in declared}}
        if EXTRAS in cls.__dataclass_fields__:
            kwargs[EXTRAS] = unknown
        elif unknown:
            raise FieldError(join(path, sorted(unknown)[0]),
                             f"unknown field; known: {[f.name for f in declared]}")
        record = cls(**kwargs)
        record.check(path)
        return record

    def check(self, path: str) -> None:
        """Checks across fields; raise FieldError. Nothing by default."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict in the file's shape (extras merged back at this level)."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == EXTRAS:
                out.update(plain(value))
            elif not (value is None and f.default is None and not self.KEEP_NONE):
                out[f.name] = plain(value)
        return out


def field_rows(cls: type) -> Tuple[Tuple[str, str, str, str], ...]:
    """(name, type as written, when absent, meaning) per field of a record, for the docs."""
    hints = cls.hints()
    return tuple((f.name, type_name(hints[f.name]), _absent(f, cls.KEEP_NONE),
                  f.metadata.get("doc", "")) for f in dataclasses.fields(cls))


def _absent(f: dataclasses.Field, keep_none: bool) -> str:
    """How the docs say what a missing key reads as."""
    if f.default is not dataclasses.MISSING:
        if f.default is None and not keep_none:
            return "left out"
        return f"`{json.dumps(plain(f.default))}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{json.dumps(plain(f.default_factory()))}`"
    return "required"


def type_name(tp: Any) -> str:
    """A type as a reader of the JSON sees it: `int`, `[float]`, `{int: TpFits}`,
    `"consec" | "strided"`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if origin is typing.Union:
        return type_name(next(a for a in args if a is not type(None))) + " or null"
    if origin in (list, tuple):
        return f"[{type_name(args[0])}]"
    if origin is dict:
        return f"{{{type_name(args[0])}: {type_name(args[1])}}}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return " | ".join(f'"{m.value}"' for m in tp)
    return getattr(tp, "__name__", str(tp))
