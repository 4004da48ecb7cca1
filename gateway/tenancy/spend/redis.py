"""The spend ledger shared by replicas: key spend and reservations held in Redis, checked atomically.

A reservation is one Lua script on the server: drop the key's expired holds,
add up what is booked and held by every replica, and add this hold only if
the sum stays within the limit. Two replicas can therefore never both take a
key's last dollar. A hold expires on its own (`hold_ttl_s`, longer than a
request may live) so a replica that dies does not lock its keys' money.

Settling and releasing are not awaited by the request: they go into an
ordered outbox that a writer task empties as soon as it can. Each settlement
books at most once (a per-reservation marker in the same script), so a write
retried after a timeout cannot spend twice; while Redis is away the outbox
keeps them (bounded: once full, keyed requests are refused rather than
served unrecorded).

Between calls the ledger keeps its best view of each key's committed spend:
the last value Redis returned plus what this replica changed since and has
not written yet. That view clamps max_tokens; the server's script decides.
While Redis is unreachable, keys with a limit are refused (`on_unavailable =
"refuse"`) or checked against that view (`"local"`: each replica then spends
up to the limit on what it last knew, so the fleet can overspend by what the
others spend during the outage).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config.sections import ApiKey
from gateway.core.budget import REL_TOL
from gateway.state.link import RedisLink, StateUnavailable
from gateway.tenancy.spend.sqlite import Booked, KeySpend, Reservation, SpendStoreError, check_usd, period_start

log = logging.getLogger("routebalance.state.spend")

# Shared by the scripts: drop the expired holds of one key and period, then add up booked and held.
# KEYS[1] booked (hash: usd, requests), KEYS[2] hold expiries (zset), KEYS[3] hold amounts (hash).
_COMMITTED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, member in ipairs(expired) do redis.call('HDEL', KEYS[3], member) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = 0
for _, amount in ipairs(redis.call('HVALS', KEYS[3])) do held = held + tonumber(amount) end
local booked = tonumber(redis.call('HGET', KEYS[1], 'usd') or '0')
"""
# ARGV: hold name, amount, limit ('' for none), hold ttl ms, relative tolerance of the limit.
# Returns {granted 0/1, committed after it (a string: Lua numbers would lose digits as integers)}.
_RESERVE = _COMMITTED + """
local amount = tonumber(ARGV[2])
if ARGV[3] ~= '' and booked + held + amount > tonumber(ARGV[3]) * (1 + tonumber(ARGV[5])) then
  return {0, string.format('%.17g', booked + held)}
end
local ttl = tonumber(ARGV[4])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return {1, string.format('%.17g', booked + held + amount)}
"""
_PEEK = _COMMITTED + """
return string.format('%.17g', booked + held)
"""
# KEYS[4] the settlement's marker. ARGV: hold name, cost, marker ttl s. Books once, frees the hold.
_SETTLE = """
if redis.call('SET', KEYS[4], '1', 'NX', 'EX', ARGV[3]) then
  redis.call('HINCRBYFLOAT', KEYS[1], 'usd', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'requests', 1)
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
# Long enough that no retry of a settlement comes later than this.
_MARKER_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class _Write:
    """A settlement (cost set) or a release (cost None) that Redis has not taken yet."""

    reservation: Reservation
    in_redis: bool  # the hold was taken there (not while Redis was away, nor for a key without a limit)
    cost_usd: float | None

    def delta(self) -> float:
        """How it changes the key's committed spend once written."""
        held = self.reservation.amount_usd if self.in_redis else 0.0
        return (self.cost_usd or 0.0) - held


class RedisSpendLedger:
    def __init__(self, link: RedisLink, on_unavailable: str, hold_ttl_s: float, max_unwritten: int = 10_000):
        self.link = link
        self.on_unavailable = on_unavailable
        self.hold_ttl_ms = max(1, math.ceil(hold_ttl_s * 1000))
        self.max_unwritten = max_unwritten
        r = link.client
        self._reserve, self._peek = r.register_script(_RESERVE), r.register_script(_PEEK)
        self._settle, self._release = r.register_script(_SETTLE), r.register_script(_RELEASE)
        self._ids = itertools.count(1)
        self._open: dict[int, bool] = {}  # open reservation id -> its hold is in Redis
        # Key name -> (period, committed as Redis last returned it): one entry per key, the current period's.
        self._read: dict[str, tuple[str, float]] = {}
        # What this replica changed since that Redis does not have yet: holds taken while it was away,
        # and the deltas of the writes in the outbox.
        self._local: dict[tuple[str, str], float] = {}
        self.outbox: deque[_Write] = deque()
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()

    @property
    def unwritten(self) -> int:
        """Bookings and releases waiting for Redis."""
        return len(self.outbox)

    # ---- reading ---------------------------------------------------------------
    def _keys(self, name: str, period: str) -> list[str]:
        # One hash tag per key and period: the script's keys live in one slot of a Redis Cluster.
        tag = "{" + f"{name}|{period}" + "}"
        return [self.link.key("spend", tag), self.link.key("hold-expiry", tag), self.link.key("hold", tag)]

    def _last_read(self, name: str, period: str) -> float:
        read_period, committed = self._read.get(name, (period, 0.0))
        return committed if read_period == period else 0.0

    def _committed(self, name: str, period: str) -> float:
        return self._last_read(name, period) + self._local.get((name, period), 0.0)

    def _shift(self, where: tuple[str, str], usd: float) -> None:
        left = self._local.get(where, 0.0) + usd
        if abs(left) < 1e-15:  # drop the entry with its float drift
            self._local.pop(where, None)
        else:
            self._local[where] = left

    async def refresh(self, key: ApiKey, now: float) -> None:
        """Read the key's committed spend before a request plans with it (only keys with a limit)."""
        if key.spend_limit_usd is None:
            return
        period = period_start(key.period, now)
        try:
            committed = await self.link.call("reading spend", self._peek(keys=self._keys(key.name, period)))
        except StateUnavailable as e:
            if self.on_unavailable == "refuse":
                raise SpendStoreError(str(e)) from None
            return  # "local": plan with the last view
        self._read[key.name] = (period, float(committed))

    def remaining(self, key: ApiKey, now: float) -> float | None:
        if key.spend_limit_usd is None:
            return None
        return max(0.0, key.spend_limit_usd - self._committed(key.name, period_start(key.period, now)))

    async def report(self, keys: Iterable[ApiKey], now: float) -> list[KeySpend]:
        """Each key's booked spend this period, as Redis has it; raises SpendStoreError."""
        rows = []
        for key in keys:
            period = period_start(key.period, now)
            booked_key = self._keys(key.name, period)[0]
            try:
                usd, requests = await self.link.call("reading spend",
                                                     self.link.client.hmget(booked_key, "usd", "requests"))
            except StateUnavailable as e:
                raise SpendStoreError(str(e)) from None
            booked = Booked(float(usd or 0), int(requests or 0))
            remaining = None if key.spend_limit_usd is None else max(0.0, key.spend_limit_usd - booked.usd)
            rows.append(KeySpend(key.name, key.spend_limit_usd, key.period, period, booked.usd, booked.requests,
                                 remaining))
        return rows

    # ---- holding and booking ---------------------------------------------------
    async def acquire(self, key: ApiKey, amount_usd: float, now: float) -> Reservation | None:
        """Hold `amount_usd` of the key's spend (None: over its limit); raises SpendStoreError when the
        outbox is full, or Redis is away and limits are refused then."""
        check_usd(amount_usd, "amount_usd")
        if len(self.outbox) >= self.max_unwritten:
            raise SpendStoreError(f"{len(self.outbox)} spend writes wait for redis at {self.link.url}")
        period = period_start(key.period, now)
        reservation = Reservation(next(self._ids), key.name, period, amount_usd)
        limit = key.spend_limit_usd
        if limit is None:  # nothing to check: only its booking goes to Redis
            self._shift((key.name, period), amount_usd)
            self._open[reservation.id] = False
            return reservation
        name = f"{self.link.replica}:{reservation.id}"
        args = [name, repr(amount_usd), repr(limit), self.hold_ttl_ms, repr(REL_TOL)]
        call = asyncio.ensure_future(self.link.call(
            "reserving spend", self._reserve(keys=self._keys(key.name, period), args=args)))
        try:
            granted, committed = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The request went away while its hold was being taken: once taken, it is freed at once
            # rather than left to expire (holding the key's money for minutes).
            call.add_done_callback(lambda done: self._abandoned(done, reservation))
            raise
        except StateUnavailable as e:
            if self.on_unavailable == "refuse":
                raise SpendStoreError(str(e)) from None
            if self._committed(key.name, period) + amount_usd > limit * (1 + REL_TOL):
                return None
            self._shift((key.name, period), amount_usd)  # a hold Redis does not know
            self._open[reservation.id] = False
            return reservation
        self._read[key.name] = (period, float(committed))
        if not int(granted):
            return None
        self._open[reservation.id] = True
        return reservation

    def _abandoned(self, done: asyncio.Future, reservation: Reservation) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        granted, _ = done.result()
        if int(granted):
            self._open[reservation.id] = True
            self.release(reservation)

    def settle(self, reservation: Reservation, cost_usd: float) -> None:
        """Book the real cost and free the hold (written by the writer task; once, however often called)."""
        check_usd(cost_usd, "cost_usd")
        self._queue(reservation, cost_usd)

    def release(self, reservation: Reservation) -> None:
        """Free the hold of an attempt that cost nothing."""
        self._queue(reservation, None)

    def _queue(self, reservation: Reservation, cost_usd: float | None) -> None:
        in_redis = self._open.pop(reservation.id, None)
        if in_redis is None:
            return  # settled or released already
        write = _Write(reservation, in_redis, cost_usd)
        where = (reservation.key, reservation.period)
        if not in_redis:  # its hold was only ever counted here
            self._shift(where, -reservation.amount_usd)
        self._shift(where, write.delta())  # counted here until written
        self.outbox.append(write)
        self._wake.set()

    async def run(self, retry_s: float) -> None:
        """The writer: empty the outbox in order; while Redis is away, retry every `retry_s`."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except SpendStoreError:
                await asyncio.sleep(retry_s)
                self._wake.set()

    async def flush(self) -> None:
        """Write the outbox; raises SpendStoreError (keeping what is left) if Redis fails."""
        async with self._flushing:  # one writer: each write is taken off the outbox once
            await self._write_outbox()

    async def _write_outbox(self) -> None:
        while self.outbox:
            write = self.outbox[0]
            r = write.reservation
            spend, expiry, held = self._keys(r.key, r.period)
            name = f"{self.link.replica}:{r.id}"
            if write.cost_usd is None:
                call = self._release(keys=[expiry, held], args=[name])
            else:
                marker = self.link.key("settled", "{" + f"{r.key}|{r.period}" + "}", name)
                call = self._settle(keys=[spend, expiry, held, marker], args=[name, repr(write.cost_usd),
                                                                               _MARKER_TTL_S])
            try:
                await self.link.call("booking spend", call)
            except StateUnavailable as e:
                raise SpendStoreError(str(e)) from None
            self.outbox.popleft()
            self._shift((r.key, r.period), -write.delta())
            # Redis now has it: the last read lags until the next one; count it there meanwhile.
            if r.key in self._read and self._read[r.key][0] == r.period:
                self._read[r.key] = (r.period, self._read[r.key][1] + write.delta())

    async def aclose(self, timeout_s: float) -> None:
        """Write what is left, within `timeout_s`; what cannot be written is logged, one line per booking."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.flush()
        except (SpendStoreError, TimeoutError) as e:
            log.error("redis took not all spend before exit (%s); unwritten:", e)
            for w in self.outbox:
                if w.cost_usd is not None:
                    log.error("unwritten booking: key %s period %s cost %.10f USD", w.reservation.key,
                              w.reservation.period, w.cost_usd)
