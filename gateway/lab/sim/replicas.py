"""Several gateway replicas behind one balancer, sharing their in-flight accounting late (DESIGN.md,
"State and scale-out"; issue 16).

Live, each replica publishes its share of every instance's work (`PoolState.shares`: its requests
there and their pending prefill and decode tokens) and the instances it saw fail
(`PoolState.cooldowns`) to the shared state backend every `[state].sync_interval_s`, and at the same
tick reads the others' into its pool_state (`PoolState.others_read`), so its view and the TPOT heads'
features count the whole fleet's work. This module is that backend as the simulator sees it:

- a replica's tick comes every `interval_s`, the R replicas' ticks spread evenly over the period
  (replica k ticks at k/R of it), as replicas started at unrelated times would be;
- what a replica publishes at time t can be read from t + `delay_s` on (the write's and the read's
  round trips, the backend's replication: everything between one replica's pool_state and another's);
- at its tick a replica reads, of each other replica, the latest publication it can see, and keeps
  it until its next tick.

So at a decision the others' work a replica counts is `delay_s` old at least and about
`delay_s + interval_s` on average (up to `delay_s + 2 interval_s`: published just after the reader's
tick, read at the next one, used until the one after). `age` measures it per decision. The two limits
are the references: `interval_s = 0` reads the others' work as it is at every decision (one shared
pool_state, no delay: needs `delay_s = 0`), `interval_s = inf` never reads it (each replica sees only
its own dispatches, and the scrapes).

The balancer: a round robin over the replicas (`replica_of`). Pure bookkeeping, no clock: every
method takes `now`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gateway.core.pool_state import NO_SHARE, PoolState, Share


def replica_of(request: int, replicas: int) -> int:
    """The replica a round-robin balancer hands the request (in arrival order) to."""
    return request % replicas


def sharing_mode(replicas: int, interval_s: float) -> str:
    """"single" (one replica: nothing to share), "instant", "periodic" or "none" (see the module's doc)."""
    if replicas == 1:
        return "single"
    if interval_s == 0:
        return "instant"
    return "none" if math.isinf(interval_s) else "periodic"


@dataclass(frozen=True, slots=True)
class Published:
    """One replica's publication: its share of each instance's work, and until when it has each instance
    it saw fail cooling down."""

    at: float
    shares: dict[str, Share]
    cooling_until: dict[str, float]


class SharedState:
    """The shared state backend between `replicas` replicas (see the module's doc)."""

    def __init__(self, replicas: int, interval_s: float, delay_s: float):
        if replicas < 1 or interval_s < 0 or delay_s < 0 or math.isnan(interval_s) or math.isnan(delay_s):
            raise ValueError("replicas >= 1, a sync interval >= 0 and a delay >= 0")
        if interval_s == 0 and delay_s > 0:
            raise ValueError("a sync interval of 0 reads the others' work as it is: no delay with it")
        self.replicas, self.interval_s, self.delay_s = replicas, interval_s, delay_s
        self.mode = sharing_mode(replicas, interval_s)
        periodic = self.mode == "periodic"
        self.next_tick = [k * interval_s / replicas if periodic else math.inf for k in range(replicas)]
        self._posted: list[deque[Published]] = [deque() for _ in range(replicas)]
        # Per reader, per other replica: when what it counts of that replica was published (None: nothing yet).
        self._source: list[list[float | None]] = [[None] * replicas for _ in range(replicas)]

    @property
    def instant(self) -> bool:
        return self.mode == "instant"

    def publish(self, k: int, pool_state: PoolState, instances: tuple, now: float) -> None:
        """Replica k writes its share of each instance's work and its cooldowns."""
        cooling = {name: now + left for name, left in pool_state.cooldowns(now).items()}
        self._posted[k].append(Published(now, pool_state.shares(instances, now), cooling))

    def read(self, k: int, pool_state: PoolState, now: float) -> None:
        """Replica k reads the sum of the others' latest publications it can see into its pool_state."""
        shares: dict[str, Share] = {}
        cooldowns: dict[str, float] = {}
        for j in range(self.replicas):
            seen = None if j == k else self._visible(j, now)
            if seen is None:
                continue
            self._source[k][j] = seen.at
            for name, share in seen.shares.items():
                shares[name] = shares.get(name, NO_SHARE) + share
            for name, until in seen.cooling_until.items():
                if until > now:
                    cooldowns[name] = max(cooldowns.get(name, 0.0), until - now)
        pool_state.others_read(shares, cooldowns, now)

    def ticked(self, k: int) -> None:
        """Replica k's tick is done: the next one is a period later."""
        self.next_tick[k] += self.interval_s

    def age(self, k: int, now: float) -> float:
        """How old, on average over the other replicas, what replica k counts of their work is now
        (NaN before it has read anything)."""
        seen = [now - at for j, at in enumerate(self._source[k]) if j != k and at is not None]
        return sum(seen) / len(seen) if seen else math.nan

    def _visible(self, j: int, now: float) -> Published | None:
        """Replica j's latest publication that has reached a reader by `now` (older ones are dropped:
        time only moves on)."""
        posted = self._posted[j]
        while len(posted) > 1 and posted[1].at + self.delay_s <= now:
            posted.popleft()
        return posted[0] if posted and posted[0].at + self.delay_s <= now else None
