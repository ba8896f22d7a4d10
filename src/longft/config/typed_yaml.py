"""A YAML mapping into nested frozen dataclasses, checked against their type annotations (Literal,
Optional, tuples, bool/int/float/str): every problem is collected with its dotted key, so a params
file with several mistakes is reported in one go. `load_yaml` reads the text itself, refusing a key
given twice in one mapping (PyYAML keeps the last silently). Used by config/params.py.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Literal

import yaml

from longft.errors import UserError


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "list"
    return getattr(tp, "__name__", str(tp))


def coerce(value, tp, key: str, problems: list[str]):
    """Check `value` against annotation `tp`; return the converted value or record a problem."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X], or X | Literal[...]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], key, problems)
        for alternative in inner:  # the first that takes the value as it is
            tried: list[str] = []
            out = coerce(value, alternative, key, tried)
            if not tried:
                return out
        problems.append(f"{key}: expected {type_name(tp)}, got {value!r}")
        return None
    if origin is Literal:
        if isinstance(value, bool) and "on" in args:  # YAML 1.1 reads on/off as booleans
            value = "on" if value else "off"
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        problems.append(f"{key}: {value!r} is not one of {type_name(tp)}")
        return None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key}: expected a list, got {value!r}")
            return None
        elem = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, elem, f"{key}[{i}]", problems) for i, v in enumerate(value))
        if len(value) != len(args):
            problems.append(f"{key}: expected a list of {len(args)} values, got {len(value)}")
            return None
        return tuple(coerce(v, a, f"{key}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if math.isfinite(number):
                return number
            # .nan/.inf pass every `<= 0` range check (nan compares false) and only show up as a
            # nan loss or a hang later; no knob means anything with them.
            problems.append(f"{key}: must be a finite number, got {value!r}; set a number")
            return None
    elif tp is str:
        if isinstance(value, str):
            return value
    problems.append(f"{key}: expected {type_name(tp)}, got {value!r}")
    return None


def build_dataclass(cls, raw, prefix: str, problems: list[str]):
    """An instance of dataclass `cls` from mapping `raw`; unknown keys and wrong types are appended
    to `problems` (all of them, not just the first), missing keys take the field defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'params'}: expected a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            problems.append(f"{where}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = build_dataclass(tp, raw[f.name], key, problems)
        else:
            before = len(problems)
            v = coerce(raw[f.name], tp, key, problems)
            if len(problems) == before:
                kwargs[f.name] = v
    return cls(**kwargs)


class DuplicateKeyError(UserError, ValueError):
    """A mapping that names one key twice; `problem` names the key and both lines (params.load
    turns it into a ConfigError)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            seen.setdefault(key, line)
            if first is not None:
                raise DuplicateKeyError(
                    f"key {key!r} is given twice (lines {first} and {line}); only the last would "
                    f"count, so delete one of them")
        return super().construct_mapping(node, deep)


def load_yaml(text: str):
    """Parse YAML text like yaml.safe_load, but raise DuplicateKeyError on a repeated key."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
