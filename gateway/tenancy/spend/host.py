"""The spend ledger shared by one host's workers (`serve --workers N`, no Redis): holds and bookings in the SQLite file.

The embedded ledger (sqlite.py) keeps reservations in its process's memory, so
two workers could each grant a key its last dollar. Here a reservation is a
row of the file's `holds` table, taken in one `BEGIN IMMEDIATE` transaction
that drops the expired holds, adds up what is booked and what every
process holds, and inserts this hold only if the sum stays within the limit.
SQLite lets one writer at a time into an IMMEDIATE transaction, across
processes (a lock on the file), so the check and the hold cannot interleave
with another worker's. A settlement books the cost and deletes the hold in
one transaction: the money moves from held to booked at once, never counted
twice nor dropped.

A hold expires (`hold_ttl_s`, longer than a request may live), as in Redis:
a worker that dies mid-request does not lock its keys' money, and no
process needs to know which others are alive (a clean-up at start could not
tell a dead worker's holds from a live one's, and the supervisor restarts
workers at any time). Every process of the host reads one clock.

A settlement the file refuses (its lock held past the wait) is kept in
memory, its hold still counted in the file, and written first by the next
call: a reservation that cannot write it is refused (503), so what waits is
bounded by the reservations open when the file began refusing, and no request
is served unrecorded. Keys without a limit take no hold: only their bookings
are written.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from pathlib import Path

from gateway.config.sections import ApiKey
from gateway.core.budget import within_budget
from gateway.state.sqlite_file import wal_connection
from gateway.tenancy.spend.sqlite import (
    BOOK_UPSERT,
    SPEND_SCHEMA,
    Reservation,
    SpendStoreError,
    check_usd,
    period_start,
    store_errors,
)

log = logging.getLogger("routebalance.spend.host")

_HOLDS = """CREATE TABLE IF NOT EXISTS holds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    period TEXT NOT NULL,
    usd REAL NOT NULL,
    expires REAL NOT NULL
)"""
_HOLDS_INDEX = "CREATE INDEX IF NOT EXISTS holds_by_key ON holds (key, period)"
_COMMITTED = """SELECT COALESCE((SELECT usd FROM spend WHERE key = ?1 AND period = ?2), 0)
    + COALESCE((SELECT SUM(usd) FROM holds WHERE key = ?1 AND period = ?2 AND expires > ?3), 0)"""
# Calls run on the event loop: another worker's transaction (microseconds) is what they wait for.
_LOCK_WAIT_S = 0.25
# At start every worker sets up the file at once; switching to WAL needs it alone for a moment.
_OPEN_WAIT_S = 10.0


class HostSpendLedger:
    """request.KeyLedger over a SQLite file shared by the host's processes."""

    def __init__(self, path: str | os.PathLike[str], hold_ttl_s: float):
        self.path = Path(path)
        self.hold_ttl_s = hold_ttl_s
        with store_errors(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = wal_connection(self.path, (SPEND_SCHEMA, _HOLDS, _HOLDS_INDEX), _LOCK_WAIT_S, _OPEN_WAIT_S)
        self._local_ids = itertools.count(-1, -1)  # holds of keys without a limit, never in the file
        self._open: dict[int, Reservation] = {}
        # Settled, not yet written: (reservation, cost); its hold (if any) stays in the file until it is.
        self._unwritten: list[tuple[Reservation, float]] = []

    @property
    def unwritten(self) -> int:
        return len(self._unwritten)

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE: the write lock is taken first, so what is read inside stays true until COMMIT."""
        with store_errors(self.path):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # (SQLite may have rolled back already, on some errors)
                    self._db.execute("ROLLBACK")
                raise

    def _committed(self, key: str, period: str, now: float) -> float:
        return float(self._db.execute(_COMMITTED, (key, period, now)).fetchone()[0])

    async def refresh(self, key: ApiKey, now: float) -> None:
        """Nothing to read ahead: `remaining` reads the file."""

    def remaining(self, key: ApiKey, now: float) -> float | None:
        if key.spend_limit_usd is None:
            return None
        with store_errors(self.path):
            committed = self._committed(key.name, period_start(key.period, now), now)
        return max(0.0, key.spend_limit_usd - committed)

    async def acquire(self, key: ApiKey, amount_usd: float, now: float) -> Reservation | None:
        """Hold `amount_usd` of the key's spend, or None if every process's bookings and holds and this one
        would pass its limit; raises SpendStoreError when the file refuses."""
        check_usd(amount_usd, "amount_usd")
        self.flush()  # a booking that waits is written first (or this request is refused with it)
        period = period_start(key.period, now)
        limit = key.spend_limit_usd
        if limit is None:
            reservation = Reservation(next(self._local_ids), key.name, period, amount_usd)
            self._open[reservation.id] = reservation
            return reservation
        with self._transaction() as db:
            # Every key's expired holds, not only this one's: the table then stays about as long as the requests
            # in flight, whatever keys a dead worker held.
            db.execute("DELETE FROM holds WHERE expires <= ?", (now,))
            # The same tolerance as the max_tokens clamp, so a worst case clamped to the remaining spend fits.
            if not within_budget(self._committed(key.name, period, now) + amount_usd, limit):
                return None
            cursor = db.execute("INSERT INTO holds (key, period, usd, expires) VALUES (?, ?, ?, ?)",
                                (key.name, period, amount_usd, now + self.hold_ttl_s))
            hold_id = cursor.lastrowid
        assert hold_id is not None
        reservation = Reservation(hold_id, key.name, period, amount_usd)
        self._open[reservation.id] = reservation
        return reservation

    def settle(self, reservation: Reservation, cost_usd: float) -> None:
        """Book the real cost and delete the hold, in one transaction; once, however often called. Raises
        SpendStoreError when the file refuses (the booking is kept and written with the next call)."""
        check_usd(cost_usd, "cost_usd")
        if self._open.pop(reservation.id, None) is None:
            return
        self._unwritten.append((reservation, cost_usd))
        self.flush()

    def release(self, reservation: Reservation) -> None:
        """Free the hold of an attempt that cost nothing. If the file refuses, the hold expires on its own
        (money held a while, never spent), so this does not raise."""
        if self._open.pop(reservation.id, None) is None or reservation.id < 0:
            return
        try:
            with store_errors(self.path):
                self._db.execute("DELETE FROM holds WHERE id = ?", (reservation.id,))
        except SpendStoreError as e:
            log.warning("a hold of key %s was not freed (it expires within %g s): %s", reservation.key,
                        self.hold_ttl_s, e)

    def flush(self) -> None:
        """Write the bookings that wait, oldest first; raises SpendStoreError if the file still refuses."""
        while self._unwritten:
            reservation, cost = self._unwritten[0]
            with self._transaction() as db:
                db.execute(BOOK_UPSERT, (reservation.key, reservation.period, cost, 1))
                db.execute("DELETE FROM holds WHERE id = ?", (reservation.id,))
            self._unwritten.pop(0)

    async def aclose(self, timeout_s: float) -> None:
        """Write what waits, and close the file (each write waits at most the lock's wait)."""
        try:
            self.flush()
        except SpendStoreError as e:
            log.error("spend not yet written to %s is lost at exit: %s", self.path, e)
            for reservation, cost in self._unwritten:
                log.error("unwritten booking: key %s period %s cost %.10f USD", reservation.key,
                          reservation.period, cost)
        self._db.close()
