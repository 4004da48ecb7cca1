"""The policy registry: every routing policy by name, and the config tables they own.

A policy package declares `ENTRIES` (PolicyEntry) and `OPTIONS` (table name ->
its config section class, read from `[policies.<table>]`) in its `__init__`;
a built-in package is named once in BUILTIN below, and that line is all that
adding one changes outside its package. Code outside the package (a plug-in, a
test) calls `register` and `register_options` directly. The config, the CLI
and the API take their lists of valid names from here, so nothing else tests
a policy's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from gateway.core.policy import Policy, PolicyContext, PolicyEntry

# The built-in policy packages under gateway/policies/, in the order `routebalance policies` lists them.
BUILTIN = ("routebalance", "pipeline", "swap_aware", "qlm", "qos", "eldr", "prefix")

_entries: dict[str, PolicyEntry] = {}
_tables: dict[str, type] = {}


def register(entry: PolicyEntry) -> None:
    """Add a policy; a name is registered once."""
    if entry.name in _entries:
        raise ValueError(f"policy {entry.name!r} is already registered")
    _entries[entry.name] = entry


def register_options(table: str, options: type) -> None:
    """Declare `[policies.<table>]`, checked by the config section class `options`."""
    if _tables.get(table, options) is not options:
        raise ValueError(f"policy table {table!r} is already registered")
    _tables[table] = options


def unregister(name: str) -> None:
    """Forget a policy and a table of the same name (tests that register their own clean up with this)."""
    _entries.pop(name, None)
    _tables.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_entries)


def entry(name: str) -> PolicyEntry:
    """The policy called `name`; ValueError listing the known ones if there is none."""
    found = _entries.get(name)
    if found is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(_entries)})")
    return found


def hashes_prompts(name: str, prefix_cache: str) -> bool:
    """Do requests routed by policy `name` carry their prompt's blocks to the scheduler? Where it reads the prefix
    index and [scheduler] prefix_cache looks at prefixes; the gateway and the simulator ask the same."""
    return prefix_cache != "off" and entry(name).reads_prefixes


def tables() -> Mapping[str, type]:
    return dict(_tables)


def options_class(table: str) -> type:
    """The section class of `[policies.<table>]`; KeyError if no policy declared it."""
    return _tables[table]


def table() -> str:
    """The registered policies as a Markdown table (`routebalance policies`; the README carries it)."""
    rows = ["| policy | what it does | needs the estimators |", "|---|---|---|"]
    rows += [f"| `{e.name}` | {e.summary} | {'yes' if e.needs_estimates else 'no'} |" for e in _entries.values()]
    return "\n".join(rows)


def build(name: str, config, estimators=None) -> Policy:
    """A new policy object for this config; ValueError if it cannot run (e.g. needs estimators that are not built)."""
    return entry(name).build(PolicyContext(config, estimators))


def install(package: str) -> None:
    """Register the tables and the policies of the package gateway.policies.<package>."""
    module = importlib.import_module(f"gateway.policies.{package}")
    for name, options in module.OPTIONS.items():
        register_options(name, options)
    for policy in module.ENTRIES:
        register(policy)


for _package in BUILTIN:
    install(_package)
