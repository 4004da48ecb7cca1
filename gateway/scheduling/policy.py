"""The one interface every routing policy implements.

A policy gets a batch of requests and a snapshot of the pool, and returns one
instance index per request. It does no I/O and reads no clock: the shell
builds the snapshot, so the live server and the simulator drive the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.api.parse import RoutingOptions


@dataclass(frozen=True, slots=True)
class RouteRequest:
    candidates: tuple[int, ...]  # indices into PoolView.instances this request may use
    prompt_text: str
    max_tokens: int | None
    routing: RoutingOptions


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the scheduler knows about the pool at one instant."""

    instances: tuple  # config.Instance, in config order
    in_flight: np.ndarray  # requests the gateway has dispatched and not seen finish
    available: np.ndarray  # bool: not marked down after a failure

    def usable(self, candidates: Sequence[int]) -> list[int]:
        """Candidates that are available, or all of them if none is (better to try than to refuse)."""
        up = [i for i in candidates if self.available[i]]
        return up or list(candidates)


class Policy(Protocol):
    name: str

    def assign(self, batch: Sequence[RouteRequest], view: PoolView) -> list[int]:
        """One instance index per request, each taken from that request's candidates."""
        ...
