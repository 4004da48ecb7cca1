"""The policy registry: every routing policy by name, and the config tables they own.

A policy module declares `ENTRIES` (PolicyEntry) and `OPTIONS` (table name ->
its config section class, read from `[policies.<table>]`); a built-in module
is listed once in BUILTIN below. Code outside the package (a plug-in, a
test) calls `register` and `register_options` directly. The config, the CLI
and the API take their lists of valid names from here, so nothing else tests
a policy's name.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.scheduling.policies import avengers, best_route, eldr, pipeline, qlm, qos, routebalance
from gateway.scheduling.policies.base import Policy, PolicyContext, PolicyEntry

BUILTIN = (routebalance, pipeline, avengers, best_route, qlm, qos, eldr)

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


for _module in BUILTIN:
    for _table, _options in _module.OPTIONS.items():
        register_options(_table, _options)
    for _entry in _module.ENTRIES:
        register(_entry)
