"""The label store: append-only, deduplicated, bounded, durable (SQLite).

One row per label (gateway/learning/labels.py). A label whose prompt, model, source and censoring are
already stored is not added again: the first one stays, so a repeated feedback or a prompt asked twice
counts once. A length is deduplicated apart from a censored one, so a lower bound never hides the
full length seen later. The store never deletes on its own except by `prune` (retention), and refuses
new rows once it holds `max_labels`: nothing accepted is ever pushed out silently.

Calls are blocking (SQLite): from the event loop, run them in a thread (gateway/learning/writer.py
does for answer lengths). One lock serialises them, so the store may be used from several threads.
No clock is read here: times are passed in.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.learning.export import ExportSummary, write_workload
from gateway.learning.labels import LENGTH, Label
from gateway.state.sqlite_file import file_errors, wal_connection

Added = Literal["stored", "exists", "full"]
MEMORY = ":memory:"
DAY_S = 86400.0

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS labels (
        prompt_hash TEXT NOT NULL,
        prompt TEXT,
        model TEXT NOT NULL,
        source TEXT NOT NULL CHECK (source IN ('file', 'feedback', 'judge', 'length')),
        value REAL NOT NULL,
        censored INTEGER NOT NULL CHECK (censored IN (0, 1)),
        key TEXT,
        created REAL NOT NULL,
        UNIQUE (prompt_hash, model, source, censored)
    )""",
    "CREATE INDEX IF NOT EXISTS labels_created ON labels (created)",
    # The row count, kept by triggers in the file itself: several gateway processes (`serve --workers`)
    # write one store, and max_labels bounds what all of them stored (counting the table would scan it).
    "CREATE TABLE IF NOT EXISTS label_count (id INTEGER PRIMARY KEY CHECK (id = 0), n INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO label_count (id, n) SELECT 0, COUNT(*) FROM labels",
    "CREATE TRIGGER IF NOT EXISTS labels_counted AFTER INSERT ON labels BEGIN UPDATE label_count SET n = n + 1; END",
    "CREATE TRIGGER IF NOT EXISTS labels_uncounted AFTER DELETE ON labels BEGIN UPDATE label_count SET n = n - 1; "
    "END",
)
_COUNT = "SELECT n FROM label_count"
_INSERT = """INSERT OR IGNORE INTO labels (prompt_hash, prompt, model, source, value, censored, key, created)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)"""
_COLUMNS = "prompt_hash, model, source, value, created, prompt, censored, key"
# A second process (the CLI's export while the gateway writes) may hold the write lock for a moment.
_LOCK_WAIT_S = 5.0


class LabelStoreError(Exception):
    """The label store cannot be opened, read or written; the message names the store and the cause."""


@dataclass(frozen=True, slots=True)
class LabelStats:
    """What a store holds: `routebalance labels stats`."""

    total: int
    max_labels: int
    by_source: Mapping[str, int]
    by_model: Mapping[str, Mapping[str, int]]  # model -> source -> labels
    lengths: int
    censored_lengths: int
    oldest: float | None  # epoch seconds of the oldest and newest label
    newest: float | None
    prompts_with_text: int = 0
    prompts: int = 0

    @property
    def censored_share(self) -> float | None:
        return self.censored_lengths / self.lengths if self.lengths else None


@dataclass(slots=True)
class _Open:
    """The connection, and the lock that keeps its calls from overlapping."""

    db: sqlite3.Connection
    lock: threading.RLock = field(default_factory=threading.RLock)


class LabelStore:
    """Labels in a SQLite file (`path`), or in memory (`LabelStore.in_memory()`, for tests: the same SQL).

    WAL with synchronous=NORMAL, as the spend store: a committed label survives the process crashing;
    a power cut may lose the last commits.
    """

    def __init__(self, path: str | os.PathLike[str], max_labels: int):
        if max_labels < 1:
            raise ValueError(f"max_labels must be at least 1, got {max_labels!r}")
        self.path = str(path)
        self.max_labels = max_labels
        with self._errors():
            if self.path != MEMORY:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            # Transactions are opened explicitly (one per batch of labels).
            self._open = _Open(wal_connection(self.path, _SCHEMA, _LOCK_WAIT_S))

    @classmethod
    def in_memory(cls, max_labels: int = 1_000_000) -> LabelStore:
        return cls(MEMORY, max_labels)

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return file_errors(LabelStoreError, f"label store {self.path}")

    @property
    def rows(self) -> int:
        o = self._open
        with o.lock, self._errors():
            return int(o.db.execute(_COUNT).fetchone()[0])

    # ---- writing ---------------------------------------------------------------------------
    def add(self, label: Label) -> Added:
        """Store one label durably: "stored", "exists" (the first label for its prompt, model and
        source stays) or "full" (max_labels reached: nothing was written). Raises LabelStoreError."""
        return self._insert([label])[0]

    def add_many(self, labels: Sequence[Label]) -> Counter[Added]:
        """Store labels in one transaction; how many had each outcome."""
        return Counter(self._insert(labels))

    def _insert(self, labels: Sequence[Label]) -> list[Added]:
        o = self._open
        outcomes: list[Added] = []
        with o.lock, self._errors():
            o.db.execute("BEGIN IMMEDIATE")  # the write lock: no other process adds between the count and the insert
            try:
                rows = int(o.db.execute(_COUNT).fetchone()[0])
                for label in labels:
                    if rows >= self.max_labels:
                        outcomes.append("full")
                        continue
                    cursor = o.db.execute(_INSERT, (label.prompt_hash, label.prompt, label.model, label.source,
                                                    label.value, int(label.censored), label.key, label.created))
                    stored = cursor.rowcount == 1
                    rows += stored
                    outcomes.append("stored" if stored else "exists")
                o.db.execute("COMMIT")
            except BaseException:
                o.db.execute("ROLLBACK")
                raise
        return outcomes

    def prune(self, now: float, retention_days: float) -> int:
        """Delete the labels from traffic (feedback, judge, length) older than `retention_days` before `now`;
        a user's own file labels are theirs to keep. Returns how many went."""
        o = self._open
        with o.lock, self._errors():
            cursor = o.db.execute("DELETE FROM labels WHERE source != 'file' AND created < ?",
                                  (now - retention_days * DAY_S,))
            return cursor.rowcount

    # ---- reading ---------------------------------------------------------------------------
    def stats(self) -> LabelStats:
        o = self._open
        by_model: dict[str, dict[str, int]] = {}
        by_source: Counter[str] = Counter()
        with o.lock, self._errors():
            for model, source, n in o.db.execute(
                    "SELECT model, source, COUNT(*) FROM labels GROUP BY model, source ORDER BY model, source"):
                by_model.setdefault(model, {})[source] = n
                by_source[source] += n
            censored = o.db.execute("SELECT COUNT(*) FROM labels WHERE censored = 1").fetchone()[0]
            oldest, newest = o.db.execute("SELECT MIN(created), MAX(created) FROM labels").fetchone()
            prompts, with_text = o.db.execute(
                "SELECT COUNT(DISTINCT prompt_hash), COUNT(DISTINCT CASE WHEN prompt IS NOT NULL THEN prompt_hash END)"
                " FROM labels").fetchone()
        return LabelStats(total=sum(by_source.values()), max_labels=self.max_labels, by_source=dict(by_source),
                          by_model=by_model, lengths=by_source[LENGTH], censored_lengths=censored, oldest=oldest,
                          newest=newest, prompts_with_text=with_text, prompts=prompts)

    def quality_models(self) -> list[str]:
        """Models with at least one quality label (any source but length), by name."""
        o = self._open
        with o.lock, self._errors():
            return [m for (m,) in o.db.execute(
                "SELECT DISTINCT model FROM labels WHERE source != 'length' ORDER BY model")]

    def labels(self) -> Iterator[Label]:
        """Every label, grouped by prompt (ordered by prompt hash), read in one snapshot. The store's lock
        is held until the iteration ends: consume it whole, and from one thread."""
        o = self._open
        with o.lock, self._errors():
            o.db.execute("BEGIN")  # one read snapshot, whatever another process writes meanwhile
            try:
                for h, model, source, value, created, prompt, censored, key in o.db.execute(
                        f"SELECT {_COLUMNS} FROM labels ORDER BY prompt_hash, model, source"):
                    yield Label(h, model, source, value, created, prompt, bool(censored), key)
            finally:
                o.db.execute("COMMIT")

    def export(self, out: str | os.PathLike[str], weights: Mapping[str, float], count_tokens: Callable[[str], int],
               models: Iterable[str] | None = None) -> ExportSummary:
        """Write a workload file for `routebalance train` (gateway/learning/export.py says what goes in)."""
        chosen = list(models) if models is not None else self.quality_models()
        return write_workload(self.labels(), out, chosen, weights, count_tokens)

    def close(self) -> None:
        with self._open.lock:
            self._open.db.close()
