"""Round robin over each request's available candidates: the baseline dispatcher."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.scheduling.policy import PoolView, RouteRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0  # one counter for the pool: a tier's instances take turns as the requests come

    def assign(self, batch: Sequence[RouteRequest], view: PoolView) -> list[int]:
        chosen = []
        for req in batch:
            usable = view.usable(req.candidates)
            chosen.append(usable[self._turn % len(usable)])
            self._turn += 1
        return chosen
