"""Pipeline-mode dispatchers: place a request on one of the instances its router left it.

Each dispatcher ranks a list of usable instance indices, chosen first, so the
shell can retry on the next one. `rank` only reads the view (the pipeline
applies the dead reckoning); `chose` tells the dispatcher which instance
actually got the request, for the one dispatcher that keeps turns.

Instances that tie on a dispatcher's keys are ordered at random, from a
generator seeded once: breaking ties by index would herd every tie (an idle
pool, a fresh start) onto the lowest-numbered instance of each model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gateway.core.view import PoolView


class Dispatcher(Protocol):
    name: str

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        """`usable` in preference order."""
        ...

    def chose(self, i: int) -> None:
        """Instance i got the request."""
        ...


def _ranked(usable: Sequence[int], rng: np.random.Generator, *keys: np.ndarray) -> list[int]:
    """`usable` sorted by `keys` (the first is the primary), ties in a random order."""
    if len(usable) < 2:
        return list(usable)
    tie = rng.random(len(usable))
    order = np.lexsort((tie, *reversed(keys)))  # lexsort's last key is the primary one
    return [usable[k] for k in order]


class RoundRobin:
    """Least recently chosen first: plain round robin over any fixed set of instances.

    A single turn counter taken modulo the list length would let requests for
    different models interleave and pin each model to one instance (A, B, A, B
    over two 2-instance models lands every A on the same replica); stamping
    each instance with the turn it was last chosen cycles every model's
    replicas independently, whatever the mix. Instances never chosen tie, and
    start in a seeded random order.
    """

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        self._turn = 0
        self._last: dict[int, int] = {}  # instance index -> turn it was last chosen
        self._rng = np.random.default_rng(seed)

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        return _ranked(usable, self._rng, np.array([self._last.get(i, -1) for i in usable]))

    def chose(self, i: int) -> None:
        self._last[i] = self._turn
        self._turn += 1


class ShortestQueue:
    """Fewest requests on the instance; ties to the emptiest relative to its slots, then at random."""

    name = "shortest_queue"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        idx = np.asarray(usable, dtype=np.int64)
        active = view.active[idx]
        return _ranked(usable, self._rng, active, active / view.max_num_seqs[idx])

    def chose(self, i: int) -> None:
        pass  # the queue lengths come from the view, which the pipeline updates


class PowerOfTwo:
    """Power of two choices: two instances drawn at random, the one with fewer requests first (ties: the
    emptier relative to its slots, then the first drawn), the other second, then the rest shortest first.

    The classic load balancer that needs no global scan (Mitzenmacher): nearly as even as shortest queue,
    without herding every simultaneous decision onto the one emptiest instance. One of ELDR's baselines.
    """

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        if len(usable) < 2:
            return list(usable)
        a, b = (usable[k] for k in self._rng.choice(len(usable), size=2, replace=False))
        pair = sorted((a, b), key=lambda i: (view.active[i], view.active[i] / view.max_num_seqs[i]))  # stable
        rest = [i for i in usable if i != a and i != b]
        idx = np.asarray(rest, dtype=np.int64)
        return pair + _ranked(rest, self._rng, view.active[idx], view.active[idx] / view.max_num_seqs[idx])

    def chose(self, i: int) -> None:
        pass


class Random:
    """A uniformly random order, from a generator seeded once so a run repeats for its seed."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def rank(self, usable: Sequence[int], view: PoolView) -> list[int]:
        return [usable[k] for k in self._rng.permutation(len(usable))]

    def chose(self, i: int) -> None:
        pass
