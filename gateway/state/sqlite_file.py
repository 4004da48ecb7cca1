"""A connection to one of the gateway's SQLite files (spend, labels, the host's shared completions), set up
alike: write-ahead logging, so readers never wait for the writer; commits without fsync (a power cut may
lose the last ones); transactions begun and ended by the caller (isolation_level=None); usable from the
thread that did not open it (check_same_thread=False: each owner's calls never overlap)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator


def wal_connection(path: str | os.PathLike[str], schema: Iterable[str], wait_s: float,
                   open_wait_s: float | None = None) -> sqlite3.Connection:
    """Open `path` and create what `schema` creates. A call waits at most `wait_s` for another connection's
    lock; with `open_wait_s`, the set-up may wait that long instead (every worker of a host sets a shared file
    up at once, and switching to WAL needs it alone for a moment). Closed again if the set-up fails."""
    db = sqlite3.connect(path, timeout=wait_s if open_wait_s is None else open_wait_s, isolation_level=None,
                         check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        for statement in schema:
            db.execute(statement)
        if open_wait_s is not None:
            db.execute(f"PRAGMA busy_timeout={round(wait_s * 1000)}")
    except sqlite3.Error:
        db.close()
        raise
    return db


@contextlib.contextmanager
def file_errors(raise_as: type[Exception], what: str) -> Iterator[None]:
    """SQLite's and the file system's errors on one of these files, as `raise_as` naming `what` and the cause."""
    try:
        yield
    except (OSError, sqlite3.Error) as err:
        raise raise_as(f"{what}: {err}") from err
