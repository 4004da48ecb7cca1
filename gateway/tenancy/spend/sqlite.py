"""The spend ledger: what each API key has spent this period, and what its requests in flight may still spend.

Before dispatch the server reserves a request's worst-case cost (``reserve``);
at the end it books the real cost (``settle``), or books nothing if the request
never went out (``release``). A reservation is granted only if the key's
booked spend plus everything already reserved plus this one stays within its
limit, so concurrent requests cannot overspend a key together.

Booked spend lives in a store (SQLite for one process, memory for tests);
reservations live in the ledger. The ledger is used from one event-loop thread,
so a reservation's check and hold cannot interleave with another's. Ledgers
shared by several processes cannot rely on that: they check and hold in one
atomic step, in the SQLite file of one host's workers (host.py) or on the
Redis server of several replicas (redis.py).

No clock is read here: every method takes ``now`` (epoch seconds); periods are
UTC days and months.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, Protocol

from gateway.config.sections import ApiKey
from gateway.core.budget import within_budget
from gateway.state.sqlite_file import file_errors, wal_connection

log = logging.getLogger("routebalance.spend")


class SpendStoreError(Exception):
    """The spend store cannot be opened, read or written; the message names the store and the cause."""


def store_errors(path) -> contextlib.AbstractContextManager[None]:
    """SQLite's and the file system's errors on the spend store at `path`, as SpendStoreError."""
    return file_errors(SpendStoreError, f"spend store {path}")


class Booked(NamedTuple):
    """Spend booked for one key in one period."""

    usd: float
    requests: int


NOTHING_BOOKED = Booked(0.0, 0)


def period_start(period: str, now: float) -> str:
    """The period ``now`` falls in, for a key whose limit resets each "day", "month" or never ("total").

    A day is named by its UTC date ("2026-11-23"), a month by its first day
    ("2026-11-01"); a limit that never resets has the single period "total".
    """
    if period == "total":
        return "total"
    if not math.isfinite(now):
        raise ValueError(f"now must be finite epoch seconds, got {now!r}")
    day = datetime.fromtimestamp(now, UTC).date()
    if period == "month":
        return day.replace(day=1).isoformat()
    if period == "day":
        return day.isoformat()
    raise ValueError(f"unknown period {period!r} (day, month or total)")


class SpendStore(Protocol):
    """Booked spend per (key name, period). Kept to two calls so another backend can take its place."""

    def booked(self, key: str, period: str) -> Booked:
        """What ``key`` has booked in ``period``; raises SpendStoreError."""
        ...

    def add(self, key: str, period: str, usd: float, requests: int) -> None:
        """Add to what ``key`` has booked in ``period``, durably; raises SpendStoreError."""
        ...

    def close(self) -> None: ...


class MemorySpendStore:
    """Spend kept in this process only (lost at exit): tests and throwaway gateways."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], Booked] = {}

    def booked(self, key: str, period: str) -> Booked:
        return self._rows.get((key, period), NOTHING_BOOKED)

    def add(self, key: str, period: str, usd: float, requests: int) -> None:
        old = self.booked(key, period)
        self._rows[key, period] = Booked(old.usd + usd, old.requests + requests)

    def close(self) -> None:
        pass


# Shared with host.py, which books into the same table.
SPEND_SCHEMA = """CREATE TABLE IF NOT EXISTS spend (
    key TEXT NOT NULL,
    period TEXT NOT NULL,
    usd REAL NOT NULL,
    requests INTEGER NOT NULL,
    PRIMARY KEY (key, period)
)"""
BOOK_UPSERT = """INSERT INTO spend (key, period, usd, requests) VALUES (?, ?, ?, ?)
ON CONFLICT (key, period) DO UPDATE SET usd = usd + excluded.usd, requests = requests + excluded.requests"""
# Calls run on the event loop: waiting for another writer's lock must stay short.
# Only a second process writing the same file takes that lock (readers never do in WAL mode).
_LOCK_WAIT_S = 0.1


class SqliteSpendStore:
    """Spend in a SQLite file, so a restart loses none.

    WAL with synchronous=NORMAL: a booking is one upsert committed without an
    fsync, so it costs microseconds on the event loop; a crash of the process
    loses nothing, a power cut may lose the last bookings.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        with store_errors(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Each statement is its own transaction, committed at once; the owner may open it on one thread and
            # use it on the event loop's.
            self._db = wal_connection(self.path, (SPEND_SCHEMA,), _LOCK_WAIT_S)

    def booked(self, key: str, period: str) -> Booked:
        with store_errors(self.path):
            row = self._db.execute("SELECT usd, requests FROM spend WHERE key = ? AND period = ?",
                                   (key, period)).fetchone()
        return Booked(*row) if row else NOTHING_BOOKED

    def add(self, key: str, period: str, usd: float, requests: int) -> None:
        with store_errors(self.path):
            self._db.execute(BOOK_UPSERT, (key, period, usd, requests))

    def close(self) -> None:
        self._db.close()


@dataclass(frozen=True, slots=True)
class Reservation:
    """A hold on a key's spend for one request in flight, until it is settled or released."""

    id: int
    key: str  # the key's name
    period: str  # the period it was made in; its cost is booked there even if settled after a rollover
    amount_usd: float


@dataclass(frozen=True, slots=True)
class KeySpend:
    """One key's spend this period (a row of `routebalance keys list`)."""

    name: str
    limit_usd: float | None
    period: str  # "day" | "month" | "total"
    period_start: str
    spent_usd: float
    requests: int
    remaining_usd: float | None  # None: no limit


class _Held(NamedTuple):
    usd: float
    reservations: int


_NOTHING_HELD = _Held(0.0, 0)


class SpendLedger:
    """Spend limits per key: reservations before dispatch, bookings after.

    A booking the store refuses stays in memory (it still counts against the
    key) and is written with the next one; ``flush`` retries it, e.g. before
    closing the store.
    """

    def __init__(self, store: SpendStore):
        self.store = store
        self._ids = itertools.count(1)
        self._open: dict[int, Reservation] = {}
        # (key name, period) -> sum and number of its open reservations; an entry goes when
        # its last reservation does, which also drops the float drift of the running sum.
        self._held: dict[tuple[str, str], _Held] = {}
        self._unwritten: dict[tuple[str, str], Booked] = {}  # settled, not yet taken by the store

    @property
    def unwritten(self) -> int:
        """Keys and periods with bookings the store has not taken yet."""
        return len(self._unwritten)

    def booked(self, key_name: str, period: str) -> Booked:
        """What ``key_name`` has booked in ``period`` (a ``period_start`` value); raises SpendStoreError."""
        stored = self.store.booked(key_name, period)
        unwritten = self._unwritten.get((key_name, period), NOTHING_BOOKED)
        return Booked(stored.usd + unwritten.usd, stored.requests + unwritten.requests)

    def spent(self, key_name: str, period: str) -> float:
        return self.booked(key_name, period).usd

    def remaining(self, key: ApiKey, now: float) -> float | None:
        """What ``key`` may still reserve this period; None when it has no limit."""
        if key.spend_limit_usd is None:
            return None
        period = period_start(key.period, now)
        return max(0.0, key.spend_limit_usd - self._committed(key.name, period))

    def reserve(self, key: ApiKey, amount_usd: float, now: float) -> Reservation | None:
        """Hold ``amount_usd`` of ``key``'s spend, or None if that would take it over its limit."""
        check_usd(amount_usd, "amount_usd")
        period = period_start(key.period, now)
        limit = key.spend_limit_usd
        # The same tolerance as the max_tokens clamp, so a worst case clamped to the remaining spend fits.
        if limit is not None and not within_budget(self._committed(key.name, period) + amount_usd, limit):
            return None
        reservation = Reservation(next(self._ids), key.name, period, amount_usd)
        self._open[reservation.id] = reservation
        held = self._held.get((key.name, period), _NOTHING_HELD)
        self._held[key.name, period] = _Held(held.usd + amount_usd, held.reservations + 1)
        return reservation

    async def acquire(self, key: ApiKey, amount_usd: float, now: float) -> Reservation | None:
        """`reserve`, in the shape a shared ledger needs (which must ask its server)."""
        return self.reserve(key, amount_usd, now)

    async def refresh(self, key: ApiKey, now: float) -> None:
        """Nothing to read before a request: this process holds the whole ledger."""

    def settle(self, reservation: Reservation, cost_usd: float) -> None:
        """Book the request's real cost (above or below what was reserved) and free the hold.

        Settling again, or after a release, books nothing. Raises SpendStoreError
        when the store refuses the booking, which then stays in memory (see the class).
        """
        check_usd(cost_usd, "cost_usd")
        if not self._close(reservation):
            return
        where = (reservation.key, reservation.period)
        unwritten = self._unwritten.get(where, NOTHING_BOOKED)
        self._unwritten[where] = Booked(unwritten.usd + cost_usd, unwritten.requests + 1)
        self.flush()

    def release(self, reservation: Reservation) -> None:
        """Free the hold of a request refused before dispatch: no cost and no request are booked."""
        self._close(reservation)

    def flush(self) -> None:
        """Write the bookings the store has not taken yet; raises SpendStoreError if it still refuses."""
        for (key, period), booked in list(self._unwritten.items()):
            self.store.add(key, period, booked.usd, booked.requests)
            del self._unwritten[key, period]

    async def aclose(self, timeout_s: float) -> None:
        """Write what the store has not taken, and close it."""
        try:
            self.flush()
        except SpendStoreError as e:
            log.error("spend not yet written to the ledger is lost at exit: %s", e)
            for (key, period), booked in self._unwritten.items():
                log.error("unwritten booking: key %s period %s cost %.10f USD (%d requests)", key, period,
                          booked.usd, booked.requests)
        self.store.close()

    def report(self, keys: Iterable[ApiKey], now: float) -> list[KeySpend]:
        """Each key's spend in its current period."""
        rows = []
        for key in keys:
            period = period_start(key.period, now)
            booked = self.booked(key.name, period)
            rows.append(KeySpend(key.name, key.spend_limit_usd, key.period, period, booked.usd, booked.requests,
                                 self.remaining(key, now)))
        return rows

    def _committed(self, key_name: str, period: str) -> float:
        """Booked plus held: what no new reservation may push past the limit."""
        return self.spent(key_name, period) + self._held.get((key_name, period), _NOTHING_HELD).usd

    def _close(self, reservation: Reservation) -> bool:
        """Drop an open reservation's hold; False if it was closed already."""
        if self._open.pop(reservation.id, None) is None:
            return False
        where = (reservation.key, reservation.period)
        held = self._held[where]
        if held.reservations == 1:
            del self._held[where]
        else:
            self._held[where] = _Held(held.usd - reservation.amount_usd, held.reservations - 1)
        return True


def check_usd(value: float, what: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number of USD >= 0, got {value!r}")
