"""RouteBalance (papers/routebalance.txt): Eq. 1 over every candidate instance, longest requests first,
each decision updating the chosen instance's state before the next (assign.py)."""

from gateway.policies.routebalance.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
