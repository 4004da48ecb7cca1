"""Routing policies. Each is a small class implementing scheduling.policy.Policy."""

from gateway.scheduling.policies.round_robin import RoundRobin

POLICIES = {RoundRobin.name: RoundRobin}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
