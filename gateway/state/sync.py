"""Each replica's share of the pool's work, and the cooldowns it has seen, exchanged through Redis.

Every `[state].sync_interval_s` a replica runs one script: it publishes its
own share of each instance's work (requests in flight, prompt tokens still
to compute, predicted answer tokens still to come) and the cooldowns its own
failures started, and reads back the other live replicas' shares and every
cooldown still running. A replica that stops publishing drops out after
`_ttl_s` (the server's clock decides, so replicas' clocks need not agree).

The shares read are added to this replica's dead reckoning (PoolState.others_read),
so its view counts the whole fleet's dispatches, as of at most one interval
plus a round trip ago. When Redis is away the replica keeps the last read for
KEEP_LAST_READ_S, then routes on its own view alone.
"""

from __future__ import annotations

import asyncio

import orjson

from gateway.config.store import ConfigStore
from gateway.core.pool_state import PoolState, Share
from gateway.state.link import RedisLink, StateUnavailable

# KEYS[1] live replicas (zset: replica -> expiry ms), KEYS[2] shares (hash: replica -> JSON),
# KEYS[3] cooldowns (hash: instance -> end ms). ARGV: replica, ttl ms, own shares JSON, own cooldowns JSON.
# Returns {the other live replicas' shares (JSON strings), {instance, ms left, ...}}.
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do redis.call('HDEL', KEYS[2], gone) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
for name, seconds in pairs(cjson.decode(ARGV[4])) do
  local ends = now + math.floor(seconds * 1000)
  if ends > tonumber(redis.call('HGET', KEYS[3], name) or '0') then redis.call('HSET', KEYS[3], name, ends) end
end
local others = {}
local shares = redis.call('HGETALL', KEYS[2])
for i = 1, #shares, 2 do
  if shares[i] ~= ARGV[1] then table.insert(others, shares[i + 1]) end
end
local cooling = {}
local ends = redis.call('HGETALL', KEYS[3])
for i = 1, #ends, 2 do
  local left = tonumber(ends[i + 1]) - now
  if left > 0 then
    table.insert(cooling, ends[i])
    table.insert(cooling, tostring(left))
  else
    redis.call('HDEL', KEYS[3], ends[i])
  end
end
return {others, cooling}
"""


# While Redis is away the last read is kept this long: in the simulator's staleness study (README,
# "How late may the replicas' view of each other be?") shares 8 s old cost 3.9% mean latency where
# requests queue, and no shares 20%; older, they mostly count requests that have finished.
KEEP_LAST_READ_S = 8.0


def _ttl_s(interval_s: float) -> float:
    """How long a replica's share outlives its last publication: a few missed syncs, at least a second."""
    return max(3 * interval_s, 1.0)


def encode_shares(shares: dict[str, Share]) -> bytes:
    return orjson.dumps({name: [s.requests, s.prefill_tokens, s.decode_tokens] for name, s in shares.items()})


def sum_shares(published: list[bytes | str]) -> dict[str, Share]:
    """The other replicas' shares, added up per instance; a malformed entry counts as nothing."""
    total: dict[str, Share] = {}
    for raw in published:
        try:
            entry = orjson.loads(raw)
            for name, (requests, prefill, decode) in entry.items():
                total[name] = total.get(name, Share()) + Share(float(requests), float(prefill), float(decode))
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
            continue
    return total


class ReplicaSync:
    def __init__(self, link: RedisLink, pool_state: PoolState, store: ConfigStore):
        self.link = link
        self.pool_state = pool_state
        self.store = store
        self._script = link.client.register_script(_SYNC)
        self._keys = [link.key("replicas"), link.key("shares"), link.key("cooldowns")]
        self.last_read: float | None = None  # loop time of the last read

    async def run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.store.current.state.sync_interval_s)

    async def sync(self) -> None:
        """Publish this replica's share and cooldowns, read the others'; on failure keep the last read
        while it may still be current."""
        loop = asyncio.get_running_loop()
        cfg, now = self.store.current, loop.time()
        ttl_s = _ttl_s(cfg.state.sync_interval_s)
        own = encode_shares(self.pool_state.shares(cfg.instances, now))
        cooling = orjson.dumps(self.pool_state.cooldowns(now))
        try:
            others, cooldowns = await self.link.call(
                "syncing the pool view",
                self._script(keys=self._keys, args=[self.link.replica, round(ttl_s * 1000), own, cooling]))
        except StateUnavailable:
            if self.last_read is not None and loop.time() - self.last_read > KEEP_LAST_READ_S:
                self.pool_state.others_read({}, {}, loop.time())
                self.last_read = None
            return
        now = loop.time()
        left = {_text(cooldowns[i]): float(cooldowns[i + 1]) / 1000 for i in range(0, len(cooldowns), 2)}
        self.pool_state.others_read(sum_shares(others), left, now)
        self.last_read = now


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
