"""The completions a client may still rate: completion id -> who asked, which model answered, which prompt.

Kept in memory for a bounded time (`ttl_s`), for at most `max_completions` ids and `max_text_chars` of
prompt text, oldest forgotten first: a feedback for an id no longer here is answered 404 like an unknown
one. No clock is read here: `now` is passed in (a monotonic clock suits it), never decreasing.

An id is the `id` the client saw in the answer ("chatcmpl-..."), made by the instance. Should two answers
carry the same id (an upstream that does not make them unique), a feedback could not say which one it
rates, so the id is kept as ambiguous until it expires and cannot be rated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_ID_CHARS = 256  # longer ids are not a server's completion id; not worth the memory


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: its API key's name, or (anonymous) the client's address."""

    key: str | None
    address: str | None = None

    @classmethod
    def of(cls, key_name: str | None, address: str | None) -> Principal:
        return cls(key_name, None) if key_name is not None else cls(None, address)


@dataclass(slots=True)
class LoggedCompletion:
    id: str
    owner: Principal
    model: str  # the pool model that answered
    prompt_hash: str
    prompt: str | None  # None where the config keeps hashes only
    at: float  # when it was logged (the log's clock)
    rating: float | None = None  # the score its accepted feedback gave: a different one is a conflict
    ambiguous: bool = False  # its id was seen on two answers


class CompletionLog:
    def __init__(self, max_completions: int, ttl_s: float, max_text_chars: int):
        self._entries: OrderedDict[str, LoggedCompletion] = OrderedDict()  # oldest first
        self._text_chars = 0
        self.set_bounds(max_completions, ttl_s, max_text_chars)

    def set_bounds(self, max_completions: int, ttl_s: float, max_text_chars: int) -> None:
        """New bounds (a config reload); entries past them go at the next `put` or `get`."""
        if max_completions < 1 or not ttl_s > 0 or max_text_chars < 0:
            raise ValueError("max_completions must be >= 1, ttl_s > 0 and max_text_chars >= 0")
        self.max_completions, self.ttl_s, self.max_text_chars = max_completions, ttl_s, max_text_chars

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def text_chars(self) -> int:
        return self._text_chars

    def put(self, entry: LoggedCompletion) -> bool:
        """Log a completion at `entry.at`; False when it is not logged (no usable id, or an id already
        logged, which then becomes ambiguous)."""
        self._expire(entry.at)
        if not entry.id or len(entry.id) > MAX_ID_CHARS:
            return False
        seen = self._entries.get(entry.id)
        if seen is not None:
            seen.ambiguous = True
            self._drop_text(seen)
            return False
        if entry.prompt is not None and len(entry.prompt) > self.max_text_chars:
            entry.prompt = None  # larger than all the text the log may hold: its hash still labels it
        self._entries[entry.id] = entry
        self._text_chars += len(entry.prompt or "")
        while len(self._entries) > self.max_completions or self._text_chars > self.max_text_chars:
            self._forget_oldest()
        return True

    def get(self, completion_id: str, now: float) -> LoggedCompletion | None:
        """The completion logged under the id and not yet expired; None if unknown, expired or ambiguous."""
        self._expire(now)
        entry = self._entries.get(completion_id)
        return None if entry is None or entry.ambiguous else entry

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            within = len(self._entries) <= self.max_completions and self._text_chars <= self.max_text_chars
            if within and oldest.at > now - self.ttl_s:
                return
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._drop_text(entry)

    def _drop_text(self, entry: LoggedCompletion) -> None:
        self._text_chars -= len(entry.prompt or "")
        entry.prompt = None
