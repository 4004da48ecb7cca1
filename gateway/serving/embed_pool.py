"""Which embed instance takes the next embeddings request: the one with the fewest outstanding requests.

An embedding costs the same wherever it runs and has no answer length to predict, so nothing of Eq. 1 or
the estimators applies: load alone decides, counted by this replica (the requests it has out on each
instance). Ties go round robin, so a lone client's requests still spread; an instance that failed is
tried last until its cooldown ends. Both maps hold only the config's embed instances, and only while a
request is out on one or its cooldown runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from gateway.config.sections import Instance


class EmbedPool:
    def __init__(self) -> None:
        self._running: dict[str, int] = {}  # instance name -> requests out on it now
        self._cooling: dict[str, float] = {}  # instance name -> loop time its cooldown ends
        self._turn = 0

    def order(self, instances: Sequence[Instance], now: float) -> list[Instance]:
        """The instances to try, best first: not cooling down, then the fewest outstanding, ties in turn."""
        self._cooling = {name: until for name, until in self._cooling.items() if until > now}
        self._turn += 1
        n = len(instances)
        turned = [instances[(self._turn + k) % n] for k in range(n)]
        return sorted(turned, key=lambda i: (i.name in self._cooling, self._running.get(i.name, 0)))

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        """One request out on `name` for the duration of the block."""
        self._running[name] = self._running.get(name, 0) + 1
        try:
            yield
        finally:
            left = self._running[name] - 1
            if left:
                self._running[name] = left
            else:
                del self._running[name]

    def failed(self, name: str, until: float) -> None:
        self._cooling[name] = until

    def answered(self, name: str) -> None:
        self._cooling.pop(name, None)
