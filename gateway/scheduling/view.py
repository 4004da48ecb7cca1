"""The gateway's own live accounting of the pool, and snapshots of it for policies."""

from __future__ import annotations

import numpy as np

from gateway.scheduling.policy import PoolView

DOWN_FOR_S = 2.0  # after a connect failure, skip the instance this long before trying it again


class PoolState:
    """Mutable per-instance counters, keyed by instance name so they survive config reloads."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.down_until: dict[str, float] = {}

    def started(self, name: str) -> None:
        self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def finished(self, name: str) -> None:
        self.in_flight[name] = max(0, self.in_flight.get(name, 0) - 1)

    def mark_down(self, name: str, now: float) -> None:
        self.down_until[name] = now + DOWN_FOR_S

    def mark_up(self, name: str) -> None:
        self.down_until.pop(name, None)

    def snapshot(self, instances: tuple, now: float) -> PoolView:
        in_flight = np.fromiter((self.in_flight.get(i.name, 0) for i in instances), dtype=np.int64, count=len(instances))
        available = np.fromiter((self.down_until.get(i.name, 0.0) <= now for i in instances), dtype=bool, count=len(instances))
        return PoolView(instances, in_flight, available)
