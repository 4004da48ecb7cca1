"""QLM (papers/qlm-queue-management.txt) and EDF: request groups in per-instance virtual queues, a request
completion time estimator (rct.py), a plan generator (plan.py), request pulling and eviction (policy.py)."""

from gateway.policies.qlm.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
