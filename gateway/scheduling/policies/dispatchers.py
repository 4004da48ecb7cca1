"""Pipeline-mode dispatchers: place a request on one of the instances its router left it.

Each dispatcher ranks a list of usable instance indices, chosen first, so the
shell can retry on the next one. `rank` only reads the view (the pipeline
applies the dead reckoning); `chose` tells the dispatcher which instance
actually got the request, for the one dispatcher that keeps turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gateway.scheduling.view import PoolView


class Dispatcher(Protocol):
    name: str

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        """`usable` in preference order."""
        ...

    def chose(self, i: int) -> None:
        """Instance i got the request."""
        ...


class RoundRobin:
    """Least recently chosen first: plain round robin over any fixed set of instances.

    A single turn counter taken modulo the list length would let requests for
    different models interleave and pin each model to one instance (A, B, A, B
    over two 2-instance models lands every A on the same replica); stamping
    each instance with the turn it was last chosen cycles every model's
    replicas independently, whatever the mix.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0
        self._last: dict[int, int] = {}  # instance index -> turn it was last chosen

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        return sorted(usable, key=lambda i: (self._last.get(i, -1), i))

    def chose(self, i: int) -> None:
        self._last[i] = self._turn
        self._turn += 1


class ShortestQueue:
    """Fewest requests on the instance; ties to the emptiest relative to its slots, then the lowest index."""

    name = "shortest_queue"

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        active = view.active
        return sorted(usable, key=lambda i: (active[i], active[i] / view.max_num_seqs[i], i))

    def chose(self, i: int) -> None:
        pass  # the queue lengths come from the view, which the pipeline updates


class Random:
    """A uniformly random order, from a generator seeded once so a run repeats for its seed."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        return [usable[k] for k in self._rng.permutation(len(usable))]

    def chose(self, i: int) -> None:
        pass
