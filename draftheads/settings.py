"""Typed settings from plain data: dataclasses built from YAML / JSON / ``key=value`` overrides.

Every command and every head keeps its defaults once, in a dataclass; this module only turns plain
data into those dataclasses (and back), with errors that name the file, key and value. An unknown key
is an error that names the closest valid one, so a typo never silently falls back to a default.
It depends on nothing else in the package, so any module may import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration file or override that cannot work; the message names file, key and value."""


# ---- building dataclasses from plain dicts, with errors that name what is wrong ----------------


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError naming ``where``.
    A float must be finite: no setting means inf or nan."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin in (tuple, list):
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):  # inf / nan would train to NaN or never stop
            raise ConfigError(f"{where}: expected a finite number, got {number}")
        return number
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    return value


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown key '{key}'{_closest(key, list(fields))}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err


def to_dict(obj: Any) -> Any:
    """Plain-data view of a (nested) config dataclass, for YAML/JSON."""
    if dataclasses.is_dataclass(obj):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        kind = getattr(type(obj), "kind", None)
        if isinstance(kind, str) and "kind" not in out:
            out = {"kind": kind, **out}
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


# ---- YAML + overrides ----------------------------------------------------------------------------


def parse_overrides(overrides: list[str]) -> dict:
    """``["train.max_steps=10", "head.kind=medusa"]`` -> nested dict (values parsed as YAML)."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. train.max_steps=100")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            mark = getattr(err, "problem", None) or "cannot be parsed"
            raise ConfigError(
                f"override '{item}': the value {raw!r} is not valid YAML ({mark}); "
                "quote it to pass it as a string"
            ) from None
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = value
    return nested


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge: ``update`` wins."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
