"""The completions a client may still rate, shared by replicas and workers through Redis.

A feedback names a completion id; with several gateway processes (`serve --workers`, or replicas behind
a balancer) the process its connection reaches need not be the one that served the answer. So each
process, besides its own CompletionLog, publishes what it logs here, and a feedback for an id it does not
hold is looked up here.

Publishing never waits on Redis: entries go into a bounded outbox that a writer task empties in batches
(once full, the oldest waiting entry is dropped: that completion can then be rated only where it was
served). The server keeps at most `max_completions` ids and `max_text_chars` of prompt text, each for
`ttl_s` on its own clock, oldest dropped first, in one script per batch: a hash of entries, a sorted
set of their times and a hash of their text sizes, all under one hash tag (a Redis Cluster runs it too).
An id published twice becomes ambiguous and cannot be rated, as in the local log.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import orjson

from gateway.learning.completions import MAX_ID_CHARS, LoggedCompletion, Principal
from gateway.state.link import RedisLink, StateUnavailable

log = logging.getLogger("routebalance.learning.shared")

OUTBOX = 10_000  # entries waiting for the writer
BATCH = 200  # entries per script call

# KEYS: entries (hash id -> JSON), times (zset id -> ms), sizes (hash id -> prompt chars), text total (string).
# ARGV: ttl ms, max ids, max text chars, then (id, JSON, prompt chars) per entry.
_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget(id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  local size = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('DECRBY', KEYS[4], size)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[1]))) do forget(id) end
for i = 4, #ARGV, 3 do
  local id, entry, size = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if redis.call('HEXISTS', KEYS[1], id) == 1 then
    forget(id)
    redis.call('HSET', KEYS[1], id, '"ambiguous"')
    redis.call('ZADD', KEYS[2], now, id)
  else
    redis.call('HSET', KEYS[1], id, entry)
    redis.call('ZADD', KEYS[2], now, id)
    redis.call('HSET', KEYS[3], id, size)
    redis.call('INCRBY', KEYS[4], size)
  end
end
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[2])
      or tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[3]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  forget(oldest[1])
end
return redis.call('ZCARD', KEYS[2])
"""
# KEYS: entries, times. ARGV: ttl ms, id. The entry's JSON if it is there and not expired.
_GET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = redis.call('ZSCORE', KEYS[2], ARGV[2])
if not at or tonumber(at) <= now - tonumber(ARGV[1]) then return false end
return redis.call('HGET', KEYS[1], ARGV[2])
"""
# KEYS: entries. ARGV: id, rating. Sets the rating of an entry still there.
_RATE = """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry or entry == '"ambiguous"' then return 0 end
local decoded = cjson.decode(entry)
decoded['rating'] = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(decoded))
return 1
"""


def encode(entry: LoggedCompletion) -> bytes:
    return orjson.dumps({"key": entry.owner.key, "address": entry.owner.address, "model": entry.model,
                         "prompt_hash": entry.prompt_hash, "prompt": entry.prompt, "rating": entry.rating})


def decode(completion_id: str, raw: bytes | str) -> LoggedCompletion | None:
    """The entry, or None for an ambiguous id or a malformed entry (never rated)."""
    try:
        d = orjson.loads(raw)
        return LoggedCompletion(completion_id, Principal(d["key"], d["address"]), str(d["model"]),
                                str(d["prompt_hash"]), d["prompt"], 0.0,
                                None if d["rating"] is None else float(d["rating"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class CompletionOutbox:
    """Entries the local log took, waiting to be published where the other processes read them: bounded (once
    full, the oldest waiting entry is dropped and counted), emptied in batches by `run`, kept while the store
    refuses them. A store says how to write a batch (`write`) and how long to wait after a refusal."""

    RETRY_S = 1.0

    def __init__(self):
        self._outbox: deque[LoggedCompletion] = deque()
        self._waiting = asyncio.Event()
        self.dropped = 0  # entries the full outbox pushed out

    def publish(self, entry: LoggedCompletion) -> None:
        """Queue an entry the local log took (never waits; its id was checked there, CompletionLog.put)."""
        if len(self._outbox) >= OUTBOX:
            self._outbox.popleft()
            self.dropped += 1
        self._outbox.append(entry)
        self._waiting.set()

    async def run(self) -> None:
        """The writer: empty the outbox in batches while the store takes them; keep them while it does not."""
        while True:
            await self._waiting.wait()
            self._waiting.clear()
            while self._outbox:
                batch = [self._outbox[i] for i in range(min(BATCH, len(self._outbox)))]
                if not await self.write(batch):
                    await asyncio.sleep(self.RETRY_S)
                    continue
                for _ in batch:
                    self._outbox.popleft()

    async def write(self, batch: list[LoggedCompletion]) -> bool:
        """Publish `batch`; False if the store refused it (it is tried again)."""
        raise NotImplementedError


class SharedCompletions(CompletionOutbox):
    def __init__(self, link: RedisLink, ttl_s: float, max_completions: int, max_text_chars: int):
        super().__init__()
        self.link = link
        tag = "{completions}"
        self._keys = [link.key(tag, "entries"), link.key(tag, "times"), link.key(tag, "sizes"),
                      link.key(tag, "text")]
        self._put = link.client.register_script(_PUT)
        self._get = link.client.register_script(_GET)
        self._rate = link.client.register_script(_RATE)
        self.set_bounds(ttl_s, max_completions, max_text_chars)

    def set_bounds(self, ttl_s: float, max_completions: int, max_text_chars: int) -> None:
        self.ttl_ms, self.max_completions, self.max_text_chars = round(ttl_s * 1000), max_completions, max_text_chars

    async def write(self, batch: list[LoggedCompletion]) -> bool:
        args: list = [self.ttl_ms, self.max_completions, self.max_text_chars]
        for entry in batch:
            args += [entry.id, encode(entry), len(entry.prompt or "")]
        try:
            await self.link.call("publishing completions", self._put(keys=self._keys, args=args))
        except StateUnavailable:
            return False  # the link logs the outage
        return True

    async def lookup(self, completion_id: str) -> LoggedCompletion | None:
        """The entry another process published (None: unknown, expired, ambiguous, or Redis away)."""
        if len(completion_id) > MAX_ID_CHARS:
            return None
        try:
            raw = await self.link.call("looking up a completion",
                                       self._get(keys=self._keys[:2], args=[self.ttl_ms, completion_id]))
        except StateUnavailable:
            return None
        return None if raw is None else decode(completion_id, raw)

    async def rate(self, completion_id: str, score: float) -> None:
        """Record an accepted feedback's score, so another process sees a different one as a conflict."""
        try:
            await self.link.call("rating a completion", self._rate(keys=self._keys[:1], args=[completion_id, score]))
        except StateUnavailable:
            log.warning("the rating of %s was not shared (redis away)", completion_id)
