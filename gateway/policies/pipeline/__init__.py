"""The pipeline baselines: a router picks the model (none, Avengers-Pro-style clusters, a BEST-Route-style
scorer), then a dispatcher picks the instance (round robin, shortest queue, random, power of two choices).
Every "<router>+<dispatcher>" pair is one registered policy."""

from gateway.policies.pipeline import avengers, best_route, policy

OPTIONS = {**policy.OPTIONS, **avengers.OPTIONS, **best_route.OPTIONS}
ENTRIES = (*policy.ENTRIES, *avengers.ENTRIES, *best_route.ENTRIES)

__all__ = ["ENTRIES", "OPTIONS"]
