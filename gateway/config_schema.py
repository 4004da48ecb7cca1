"""The config's schema machinery: frozen validated sections, and TOML data -> sections.

Each section is declared once, as a frozen dataclass (``@section``). A small
validator walks the dataclass type hints to turn parsed TOML into those
dataclasses, so a typo, a wrong type or a missing key is reported with its
full key path (``instances[3].pricee_input: unknown key``) instead of
surfacing later as an AttributeError deep in the server.

Value rules live next to the field (``option(ge=0)``); rules that involve more
than one field live in the section's ``_validate``. Both also run when a
section is built directly in code (tests, the simulator, per-request
overrides), so an invalid object cannot exist. A field marked
``metadata={"derived": True}`` is no key of the file: ``_validate`` fills it
from the others, and it is an init field only so that ``dataclasses.replace``
keeps it.

This module is a leaf: the config itself (gateway/config/sections.py) and every
policy's own table (``[policies.<name>]``, declared in the policy's module)
are built with it, so a policy never imports the config that lists it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

__all__ = ["ConfigError", "Section", "build_section", "option", "section", "set_normalised"]


class ConfigError(ValueError):
    """An invalid configuration.

    ``key`` is the full path of the offending key (``server.port``,
    ``instances[4].name``) or None when the problem is the file as a whole;
    ``reason`` is the message without the key; ``str(err)`` has both, prefixed
    by ``source`` (usually the file path) when known.
    """

    def __init__(self, reason: str, key: str | None = None, source: str | None = None):
        self.reason, self.key, self.source = reason, key, source
        super().__init__(": ".join([p for p in (source, key) if p] + [reason]))


# --------------------------------------------------------------------------
# Field rules


def option(default: Any = MISSING, *, factory: Any = MISSING, ge=None, gt=None, le=None,
           nonempty: bool = False) -> Any:
    """A dataclass field carrying simple value rules, checked in __post_init__."""
    rules = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    if nonempty:
        rules["nonempty"] = True
    return field(default=default, default_factory=factory, metadata=rules)


def _rule_violation(value: Any, rules: Mapping[str, Any]) -> str | None:
    if value is None:  # optional field left unset
        return None
    if rules.get("nonempty") and not value:
        return "must not be empty"
    if "ge" in rules and not value >= rules["ge"]:
        return f"must be >= {rules['ge']}, got {value!r}"
    if "gt" in rules and not value > rules["gt"]:
        return f"must be > {rules['gt']}, got {value!r}"
    if "le" in rules and not value <= rules["le"]:
        return f"must be <= {rules['le']}, got {value!r}"
    return None


class Section:
    """Mixin: checks the field rules, then the section's cross-field rules."""

    def __post_init__(self) -> None:
        instance: Any = self  # a Section is always mixed into a dataclass
        for f in fields(instance):
            if f.metadata:
                problem = _rule_violation(getattr(self, f.name), f.metadata)
                if problem:
                    raise ConfigError(problem, f.name)
        self._validate()

    def _validate(self) -> None:
        pass


def set_normalised(obj: Any, name: str, value: Any) -> None:
    # Normalising a frozen dataclass in __post_init__ is the documented way.
    object.__setattr__(obj, name, value)


section = dataclass(frozen=True, kw_only=True)


# --------------------------------------------------------------------------
# The validator: TOML data -> dataclasses, guided by the type hints


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _join(path: str, key: str) -> str:
    if not key:
        return path
    if not path:
        return key
    return path + key if key.startswith("[") else f"{path}.{key}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _frozen(value: Any) -> Any:
    """A TOML value made immutable: tables as read-only mappings, arrays as tuples."""
    if isinstance(value, dict):
        return types.MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:  # a value that whoever reads it checks (a lab table: gateway/lab/emulator/settings.py)
        return _frozen(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_section(tp, value, path)
    if origin in (typing.Union, types.UnionType):  # X | None; TOML has no null
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(f"expected one of {choices}, got {value!r}", path)
    if origin is tuple:
        assert len(args) == 2 and args[1] is Ellipsis, f"unsupported annotation {tp}"
        if not isinstance(value, list):
            raise ConfigError(f"expected array, got {_type_name(value)}", path)
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"expected table, got {_type_name(value)}", path)
        return types.MappingProxyType(
            {k: _convert(args[1], v, _join(path, k)) for k, v in value.items()})
    if tp is float:
        # ints are fine where a float is wanted (port = 8000.0 is not, hence no reverse)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"expected a finite number, got {value!r}", path)
            return float(value)
    elif tp in (int, str, bool):
        # bool is a subclass of int; `port = true` must not pass as 1
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
    else:
        raise TypeError(f"unsupported annotation {tp!r} at {path}")
    raise ConfigError(f"expected {tp.__name__}, got {_type_name(value)}", path)


def build_section(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"expected table, got {_type_name(data)}", path)
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls) if f.init and not f.metadata.get("derived")}
    for key in data:
        if key not in known:
            raise ConfigError("unknown key", _join(path, key))
    kwargs = {}
    for name, f in known.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError("missing required key", _join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError as err:  # keys raised by _validate are relative to this table
        raise ConfigError(err.reason, _join(path, err.key or ""), err.source) from None
