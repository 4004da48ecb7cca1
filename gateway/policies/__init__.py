"""Routing policies: one package each, listed by name in `registry.BUILTIN`.

A policy package's `__init__` exports `ENTRIES` (the PolicyEntry objects it
registers) and `OPTIONS` (its `[policies.<table>]` sections); its helpers live
inside it. `base` is the interface every policy implements.
"""
