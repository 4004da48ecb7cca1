"""Batch formation: which waiting requests the scheduler takes next, and when.

Two modes (config [batching].mode):
- "window", the paper's rule: the share of instances with requests waiting
  in their vLLM queue picks a (size, window) pair; a batch closes when it
  holds `size` requests or `window` after its first request arrived.
- "eager": the scheduler fires as soon as it is free and takes what arrived
  while it was busy (up to the largest rule size), so no request waits for a
  window at light load and batches still grow with load.

The queue is bounded: past `max_queue` a request is refused (HTTP 429) rather
than left to wait without end. Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchLimit:
    size: int
    window_s: float


def batch_limit(rules: Sequence, busy_share: float) -> BatchLimit:
    """The first rule whose `below` exceeds the share of instances with waiting requests."""
    for rule in rules:
        if busy_share < rule.below:
            return BatchLimit(rule.size, rule.window_ms / 1000)
    last = rules[-1]
    return BatchLimit(last.size, last.window_ms / 1000)


def busy_share(waiting: Sequence[float]) -> float:
    """Share of instances with at least one request waiting in their own queue."""
    return sum(1 for w in waiting if w > 0) / len(waiting) if len(waiting) else 0.0


class BatchQueue(Generic[T]):
    """Requests waiting for the scheduler, oldest first, with their arrival times."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._items: deque[tuple[float, T]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T, now: float) -> bool:
        """Queue `item`; False (and nothing queued) if the queue is full."""
        if len(self._items) >= self.max_queue:
            return False
        self._items.append((now, item))
        return True

    def remove(self, item: T) -> None:
        """Forget a request whose client went away before it was scheduled."""
        for entry in self._items:
            if entry[1] is item:
                self._items.remove(entry)
                return

    def ready(self, limit: BatchLimit, now: float) -> bool:
        """Window rule: a batch closes when full or when its first request has waited the window.

        Judged against `closes_at` itself, so a caller that sleeps until then finds it
        ready (arrival + window - arrival can round below the window)."""
        closes = self.closes_at(limit)
        return len(self._items) >= limit.size or (closes is not None and now >= closes)

    def closes_at(self, limit: BatchLimit) -> float | None:
        """When the current batch's window ends (None if the queue is empty)."""
        return self._items[0][0] + limit.window_s if self._items else None

    def take(self, size: int, order: Callable[[list[T]], Sequence[T]] | None = None) -> list[tuple[float, T]]:
        """Up to `size` requests with their arrival times: the oldest, or the first in `order`.

        `order` ranks the waiting requests (a policy's `order` hook, e.g. earliest
        deadline first); any it leaves out rank after those it names, in arrival
        order, so a batch is never empty while requests wait. Those not taken stay
        queued in arrival order, so a window still runs from the oldest request."""
        if order is None:
            return [self._items.popleft() for _ in range(min(size, len(self._items)))]
        arrived = {id(item): at for at, item in self._items}
        ranked = [item for item in dict.fromkeys(order([item for _, item in self._items])) if id(item) in arrived]
        named = {id(item) for item in ranked}
        ranked += [item for _, item in self._items if id(item) not in named]
        chosen = ranked[:size]
        taken = {id(item) for item in chosen}
        self._items = deque(entry for entry in self._items if id(entry[1]) not in taken)
        return [(arrived[id(item)], item) for item in chosen]
