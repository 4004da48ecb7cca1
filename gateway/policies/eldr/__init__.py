"""ELDR (papers/eldr-expert-locality-routing.txt): balanced k-means centroids over prompt embeddings, one
per instance (centroids.py), and the tau-band rule (policy.py)."""

from gateway.policies.eldr.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
