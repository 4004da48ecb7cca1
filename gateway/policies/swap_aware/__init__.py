"""Swap-aware first come, first served: the naive FCFS baseline as a careful operator of GPUs shared by
several models would configure it (policy.py)."""

from gateway.policies.swap_aware.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
