"""Requests per minute per API key: a sliding window of the last minute's requests.

Each key keeps the times of at most its limit's worth of requests (a deque
bounded by ``requests_per_minute``), so memory is bounded by the configured
limits, whatever the traffic. Where names come from the traffic (client
addresses), ``max_names`` bounds how many are tracked: the one idle longest
is forgotten first. No clock is read here: ``now`` is passed in
(a monotonic clock suits it: only differences matter).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

WINDOW_S = 60.0


class RateLimiter:
    def __init__(self, max_names: int | None = None) -> None:
        if max_names is not None and max_names < 1:
            raise ValueError(f"max_names must be at least 1, got {max_names!r}")
        self._recent: dict[str, deque[float]] = {}  # key name -> times of its requests in the window, oldest first
        self.max_names = max_names  # with it, _recent is kept least recently used first

    def allow(self, name: str, per_minute: int, now: float) -> float | None:
        """None if ``name`` may send a request now (it is counted); else the seconds until it may."""
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, got {per_minute!r}")
        recent = self._recent.get(name)
        if self.max_names is not None:
            if recent is not None:
                self._recent[name] = self._recent.pop(name)  # now the most recently used
            elif len(self._recent) >= self.max_names:
                del self._recent[next(iter(self._recent))]
        if recent is None or recent.maxlen != per_minute:
            # New key, or its limit changed on a reload: keep its latest requests, up to the new limit.
            recent = self._recent[name] = deque(recent or (), maxlen=per_minute)
        while recent and recent[0] <= now - WINDOW_S:
            recent.popleft()
        if len(recent) == per_minute:
            return recent[0] + WINDOW_S - now
        recent.append(now)
        return None

    def retain(self, names: Iterable[str]) -> None:
        """Forget keys not in ``names`` (after a reload removed them)."""
        keep = set(names)
        for name in [n for n in self._recent if n not in keep]:
            del self._recent[name]
