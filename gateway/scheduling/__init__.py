"""Scheduling: the policy interface, the instance view, and the policies."""
