"""Generic typed-config machinery: YAML -> dataclass tree, dotted CLI overrides, path-naming errors.

Works for any tree of `@dataclass` classes; the m6 schema itself lives in m6/config.py.
This module is the bottom of the import graph: stdlib and pyyaml only, nothing from m6.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import reprlib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

_NONE = type(None)


class ConfigError(ValueError):
    """A user-facing config error; the message names the dotted config path or the file."""


# PyYAML follows YAML 1.1, which reads `1e-3` (no dot) as a string; users mean a float.
_FLOAT_EXP = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


# The dumper needs the same resolver so a *string* like "1e-3" is quoted and reads back as a string.
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_EXP, list("-+.0123456789"))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _type_name(tp: Any) -> str:
    """Readable name of a type annotation, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is _NONE:
        return "None"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', origin)}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(path: str, tp: Any, value: Any) -> ConfigError:
    if typing.get_origin(tp) is Literal:
        expected = "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    else:
        expected = _type_name(tp)
    hint = ""
    if isinstance(value, list) and len(value) == 1 and "str" in expected.split(" | "):
        # YAML reads an unquoted [PAD] (a BERT special token) as a one-element list.
        hint = f"; YAML reads an unquoted [{value[0]}] as a list: quote it, \"[{value[0]}]\""
    return ConfigError(f"{path}: expected {expected}, got {_show(value)}{hint}")


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _unknown_key(key: str, parent: str, valid: Sequence[str]) -> ConfigError:
    msg = f"unknown config key {_join(parent, key)!r}"
    close = difflib.get_close_matches(key, list(valid), n=1)
    if close:
        return ConfigError(f"{msg}; did you mean {_join(parent, close[0])!r}?")
    where = f"under {parent!r}" if parent else "at top level"
    return ConfigError(f"{msg}; valid keys {where}: {', '.join(valid)}")


def _convert(tp: Any, value: Any, path: str, coerce: bool = True) -> Any:
    """Check `value` against annotation `tp` and return it converted (int -> float, list -> tuple)."""
    if tp in (list, tuple, dict):  # bare generics: elements are unchecked
        origin, args = tp, ()
    else:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if tp is _NONE:
        if value is None:
            return None
    elif _is_section(tp):
        return value if isinstance(value, tp) else from_dict(tp, value, path)
    elif origin is Literal:
        # Compare types too: True == 1 == 1.0 must not satisfy Literal[1] or Literal[True].
        if any(type(value) is type(a) and value == a for a in args):
            return value
    elif origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        arms = [a for a in args if a is not _NONE]
        if len(arms) == 1 and isinstance(value, (dict, list, tuple)):
            # Optional section/container: an error from inside it names a deeper, more precise path.
            return _convert(arms[0], value, path, coerce)
        # An exact match beats a coercion, so `float | int` keeps 3 as an int.
        for strict in (True, False) if coerce else (True,):
            for arm in arms:
                try:
                    return _convert(arm, value, path, coerce=not strict)
                except ConfigError:
                    pass
    elif tp is bool:
        if type(value) is bool:
            return value
    elif tp is int:
        if type(value) is int:  # bool is a subclass of int, never a count
            return value
    elif tp is float:
        if type(value) is float:
            return value
        if coerce and type(value) is int:
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            elem = args[0] if args else Any
            return [_convert(elem, v, f"{path}[{i}]", coerce) for i, v in enumerate(value)]
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            if not args or (len(args) == 2 and args[1] is Ellipsis):
                elem = args[0] if args else Any
                return tuple(_convert(elem, v, f"{path}[{i}]", coerce) for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(_convert(a, v, f"{path}[{i}]", coerce) for i, (a, v) in enumerate(zip(args, value)))
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, val_tp = args or (Any, Any)
            return {
                _convert(key_tp, k, f"{path} (key {k!r})", coerce): _convert(val_tp, v, _join(path, str(k)), coerce)
                for k, v in value.items()
            }
    else:
        raise TypeError(f"{path}: unsupported annotation {tp!r} in config schema")
    raise _type_error(path, tp, value)


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build an instance of dataclass `cls` from a plain dict, type-checking every key against the schema."""
    if not isinstance(data, dict):
        where = path or "config"
        raise ConfigError(f"{where}: expected a mapping (config section), got {_show(data)}")
    fields = _init_fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(str(key), path, list(fields))
    hints = typing.get_type_hints(cls)
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(path, name)}: required key is missing")
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Turn a dataclass tree back into plain dicts/lists that yaml.safe_dump can write."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


_INDEX = re.compile(r"\[(\d+)\]")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split a CLI override `a.b.c=VALUE` into its key path and its YAML-parsed value. A list
    element is a numeric key: `data.sources.0.path=x` or `data.sources[0].path=x`."""
    key, sep, raw = text.partition("=")
    keys = [k.strip() for k in _INDEX.sub(r".\1", key).split(".")]
    if not sep or not all(keys):
        raise ConfigError(f"bad override {text!r}: expected the form key=value, e.g. model.moe.num_experts=64")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {text!r}: value is not valid YAML ({e})") from e
    return keys, value


def _child_type(tp: Any, key: str, path: str) -> Any:
    """Annotation of `key` inside a value of type `tp`, used to check override paths against the schema."""
    if typing.get_origin(tp) in (Union, types.UnionType):  # look inside an optional section
        arms = [a for a in typing.get_args(tp) if a is not _NONE]
        tp = arms[0] if len(arms) == 1 else tp
    if _is_section(tp):
        fields = _init_fields(tp)
        if key not in fields:
            raise _unknown_key(key, path, list(fields))
        return typing.get_type_hints(tp)[key]
    if tp is dict or typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        return args[1] if args else Any
    if tp is list or typing.get_origin(tp) is list:
        if not key.isdigit():
            raise ConfigError(f"{path} is a list: index it with a number, e.g. {path}.0 or {path}[0]; got {key!r}")
        args = typing.get_args(tp)
        return args[0] if args else Any
    if tp is Any:
        return Any
    raise ConfigError(f"{path}: is a {_type_name(tp)} value, not a section; cannot set {_join(path, key)!r}")


def apply_overrides(data: dict, overrides: Sequence[str], cls: type) -> dict:
    """Return a copy of the raw config dict with dotted overrides applied, key paths checked against `cls`."""
    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        tp, path = cls, ""
        for key in keys:  # check the whole path against the schema, even where the YAML lacks the section
            tp, path = _child_type(tp, key, path), _join(path, key)
        node, path, section = data, "", cls
        for key, child in zip(keys[:-1], keys[1:]):
            absent = isinstance(node, dict) and key not in node
            key = _slot(node, key, path)
            path = _join(path, str(key))
            if absent and child.isdigit():  # indexing a list the YAML leaves at its default
                node[key] = _default_of(section, key)
            if node[key] is None:  # absent or null: the override creates the section or list
                node[key] = [] if child.isdigit() else {}
            elif not isinstance(node[key], (dict, list)):
                raise ConfigError(f"{path}: expected a mapping (config section), got {_show(node[key])}")
            node, section = node[key], _child_type(section, str(key), path)
        node[_slot(node, keys[-1], path)] = value
    return data


def _unwrap(tp: Any) -> Any:
    """The one non-None arm of an Optional annotation, else ``tp``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not _NONE]
        return arms[0] if len(arms) == 1 else tp
    return tp


def _default_of(section: Any, key: str) -> Any:
    """The schema default of field ``key`` of dataclass ``section`` as plain data, or None."""
    section = _unwrap(section)
    if not _is_section(section):
        return None
    f = _init_fields(section).get(key)
    if f is None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
        return None
    return to_dict(f.default_factory() if f.default is dataclasses.MISSING else copy.deepcopy(f.default))


def _slot(node: dict | list, key: str, path: str) -> str | int:
    """Where ``key`` goes in ``node``: a dict key as is (created as None when absent); a list index
    as an int, where one past the end appends an element (so `sources.1.path=...` adds a source)."""
    if isinstance(node, dict):
        node.setdefault(key, None)
        return key
    index = int(key)
    if index > len(node):
        raise ConfigError(f"{_join(path, key)}: {path} has {len(node)} element(s), so the index must be at most "
                          f"{len(node)} (which adds one)")
    if index == len(node):
        node.append(None)
    return index


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "save the config as UTF-8") from e
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        raise ConfigError(describe_yaml_error(path, text, e)) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config sections, got {type(data).__name__}")
    return data


_SNIPPET_LINES = 6  # the most lines of a YAML error's snippet (the first, "...", the last ones)


def describe_yaml_error(path: Path, text: str, error: yaml.MarkedYAMLError) -> str:
    """``PATH:LINE: invalid YAML: ...`` naming where the mistake starts, then the lines from there
    to where the parser gave up, with carets.

    The parser's problem mark is where it noticed, often a line after the typo: a key without its
    ':' is read as a value running on into the next line, and the ':' there is the problem. So the
    message starts at the construct the problem belongs to: the parser's context mark (an unclosed
    bracket or quote), or, for "mapping values are not allowed here", the value that ran on."""
    problem = error.problem_mark
    if problem is None:
        return f"{path}: invalid YAML: {error.problem}"
    start, why = error.context_mark, error.context
    if start is None and error.problem and error.problem.startswith("mapping values are not allowed"):
        start = _last_scalar_start(text)
        why = "in a value"
    if start is None or (start.line, start.column) >= (problem.line, problem.column):
        start, why = problem, None
    where = f"line {problem.line + 1}, column {problem.column + 1}"
    message = f"{path}:{start.line + 1}: invalid YAML: {error.problem} at {where}"
    if why:
        message += f", {why} that starts at line {start.line + 1}, column {start.column + 1}"
        if why == "in a value":
            message += (f" (a ':' missing after a key, or line {problem.line + 1} indented differently from "
                        f"the line above?)")
    lines = text.splitlines() or [""]
    shown = list(range(start.line, min(problem.line, len(lines) - 1) + 1)) or [min(problem.line, len(lines) - 1)]
    if len(shown) > _SNIPPET_LINES:
        shown = shown[:1] + [None] + shown[-(_SNIPPET_LINES - 2):]
    width = len(str(problem.line + 1))
    snippet = []
    for number in shown:
        if number is None:
            snippet.append(f"  {'':>{width}} | ...")
            continue
        snippet.append(f"  {number + 1:>{width}} | {lines[number].expandtabs(1)}")  # a tab: one column, as marks count
        carets = [mark.column for mark in {start, problem} if mark.line == number]
        if carets:
            marks = "".join("^" if i in carets else " " for i in range(max(carets) + 1))
            snippet.append(f"  {'':>{width}} | {marks}")
    return message + "\n" + "\n".join(snippet)


def _last_scalar_start(text: str):
    """The start mark of the last scalar the scanner read before its error (None if none)."""
    start = None
    try:
        for token in yaml.scan(text, Loader=_Loader):
            if isinstance(token, yaml.ScalarToken):
                start = token.start_mark
    except yaml.YAMLError:
        pass
    return start


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML file (or nothing), apply CLI overrides, build the typed tree, and run its validate()."""
    data = {} if path is None else _read_yaml(Path(path))
    obj = from_dict(cls, apply_overrides(data, overrides, cls))
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def dumps_yaml(obj: Any) -> str:
    """A config tree as YAML text (what dump_yaml writes)."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False)


def dump_yaml(obj: Any, path: str | os.PathLike) -> None:
    """Write a config tree as YAML, atomically, so a crash never leaves a half-written resolved config."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory, so os.replace is atomic
    try:
        with open(tmp, "w") as f:
            f.write(dumps_yaml(obj))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
