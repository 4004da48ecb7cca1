"""Routing policies, one module each, found by name in `registry`."""
