"""The completions a client may still rate, shared by one host's workers through a SQLite file.

`serve --workers` without Redis: the kernel gives a feedback's connection to any worker, not necessarily
the one that served the answer. So each worker, besides its own CompletionLog, writes what it logs to a
SQLite file beside the state file (`beside`), and a feedback for an id it does not hold is looked up
there: the same protocol and bounds as the Redis log of replicas (shared_completions.py). A file of its
own, not the state file: trimming the table to its bounds scans it, and spend reservations must not wait
behind that.

Publishing never waits on the file: entries go into a bounded outbox that a writer task empties in
batches, each one transaction in a thread on a connection of its own (once full, the oldest waiting
entry is dropped: that completion can then be rated only where it was served). Looking up and rating
are single-row statements on the event loop. The table keeps at most `max_completions` ids and
`max_text_chars` of prompt text, each for `ttl_s` of the host's wall clock (every worker reads the same
one), oldest dropped first. An id published twice becomes ambiguous and cannot be rated, as in the local log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from pathlib import Path

from gateway.learning.completions import MAX_ID_CHARS, LoggedCompletion
from gateway.learning.shared_completions import CompletionOutbox, decode, encode
from gateway.state.sqlite_file import wal_connection

log = logging.getLogger("routebalance.learning.host")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS completions (
        id TEXT PRIMARY KEY,
        entry TEXT NOT NULL,
        at REAL NOT NULL,
        chars INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS completions_by_time ON completions (at)",
)
_AMBIGUOUS = '"ambiguous"'  # an entry that decodes to no completion (shared_completions.decode)
_PUT = f"""INSERT INTO completions (id, entry, at, chars) VALUES (?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET entry = '{_AMBIGUOUS}', at = excluded.at, chars = 0"""
_LOCK_WAIT_S = 0.25  # on the event loop: another worker's transaction is short
_OPEN_WAIT_S = 10.0  # every worker sets the file up at once at start


def beside(state_path: str | os.PathLike[str]) -> Path:
    """The file of the host's shared completions, next to its state file."""
    state = Path(state_path)
    return state.with_name(f"{state.stem}-completions.db")


def _connect(path: Path) -> sqlite3.Connection:
    # The writer's connection is used by one thread at a time, each in turn; a completion lost to a power cut
    # costs a feedback, not money.
    return wal_connection(path, _SCHEMA, _LOCK_WAIT_S, _OPEN_WAIT_S)


class HostCompletions(CompletionOutbox):
    def __init__(self, path: str | os.PathLike[str], ttl_s: float, max_completions: int, max_text_chars: int):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _connect(self.path)  # the event loop's
        self._writer = _connect(self.path)  # the writer's, in a thread
        self.set_bounds(ttl_s, max_completions, max_text_chars)

    def set_bounds(self, ttl_s: float, max_completions: int, max_text_chars: int) -> None:
        self.ttl_s, self.max_completions, self.max_text_chars = ttl_s, max_completions, max_text_chars

    async def write(self, batch: list[LoggedCompletion]) -> bool:
        try:
            await asyncio.to_thread(self.put, batch, time.time())
        except sqlite3.Error as e:
            log.warning("completions not yet shared through %s (retried): %s", self.path, e)
            return False
        return True

    def put(self, batch: list[LoggedCompletion], now: float) -> None:
        """Write `batch` and trim the table to its bounds, oldest first, in one transaction (the writer's)."""
        db = self._writer
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM completions WHERE at <= ?", (now - self.ttl_s,))
            db.executemany(_PUT, [(e.id, encode(e).decode(), now, len(e.prompt or "")) for e in batch])
            count, chars = db.execute("SELECT COUNT(*), COALESCE(SUM(chars), 0) FROM completions").fetchone()
            drop = []
            oldest = db.execute("SELECT id, chars FROM completions ORDER BY at, rowid")
            for completion_id, size in oldest:  # read only as far as the bounds need
                if count <= self.max_completions and chars <= self.max_text_chars:
                    break
                drop.append((completion_id,))
                count, chars = count - 1, chars - size
            oldest.close()
            db.executemany("DELETE FROM completions WHERE id = ?", drop)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    async def lookup(self, completion_id: str) -> LoggedCompletion | None:
        """The entry another worker published (None: unknown, expired, ambiguous, or the file refused)."""
        if len(completion_id) > MAX_ID_CHARS:
            return None
        try:
            row = self._db.execute("SELECT entry FROM completions WHERE id = ? AND at > ?",
                                   (completion_id, time.time() - self.ttl_s)).fetchone()
        except sqlite3.Error as e:
            log.warning("looking up completion %s in %s failed: %s", completion_id, self.path, e)
            return None
        return None if row is None else decode(completion_id, row[0])

    async def rate(self, completion_id: str, score: float) -> None:
        """Record an accepted feedback's score, so another worker sees a different one as a conflict."""
        try:
            self._db.execute(f"UPDATE completions SET entry = json_set(entry, '$.rating', ?) "
                             f"WHERE id = ? AND entry != '{_AMBIGUOUS}'", (score, completion_id))
        except sqlite3.Error as e:
            log.warning("the rating of %s was not shared through %s: %s", completion_id, self.path, e)
