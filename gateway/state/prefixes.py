"""What every replica and worker sent where, shared through Redis: the approximate prefix index of the fleet.

The approximate index (core/prefix.py) is what a process sent each
instance. With several replicas or `serve --workers`, a conversation's turns
reach different processes, and each would know only its own turns; so each
process appends the prompts it sent (instance and chained block hashes) to
one Redis stream every `[state].sync_interval_s`, and records what the others
appended into its own index. The stream is capped (STREAM_ENTRIES, Redis
trims the oldest), each append holds at most the process's outbox
(core/pool_state.py OUTBOX_PROMPTS), and a read takes at most READ_ENTRIES
entries: a process that falls behind skips ahead rather than grow. A new
process starts from what the stream still holds, so it starts warm. When
Redis is away, each process routes on what it sent itself.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from gateway.config.store import ConfigStore
from gateway.core.pool_state import PoolState
from gateway.state.link import RedisLink, StateUnavailable

log = logging.getLogger(__name__)

STREAM_ENTRIES = 2000  # appends kept in Redis (each one process's prompts of one interval)
READ_ENTRIES = 500  # appends read at most per interval


class PrefixSync:
    def __init__(self, link: RedisLink, pool_state: PoolState, store: ConfigStore):
        self.link, self.pool_state, self.store = link, pool_state, store
        self.key = link.key("prefixes")
        self.last_id = "0-0"  # what the stream still holds, at start

    async def run(self) -> None:
        while True:
            if self.store.current.scheduler.prefix_cache != "off":
                await self.sync()
            await asyncio.sleep(self.store.current.state.sync_interval_s)

    async def sync(self) -> None:
        """Append what this process sent since the last sync; record what the others appended."""
        outbox = self.pool_state.sent_outbox
        sent = [[name, list(prefix)] for name, prefix in (outbox.popleft() for _ in range(len(outbox)))]
        client = self.link.client
        try:
            if sent:  # what cannot be appended is dropped: those prompts stay known to this process only
                await self.link.call("sharing the prompts sent", client.xadd(
                    self.key, {"r": self.link.replica, "p": orjson.dumps(sent)}, maxlen=STREAM_ENTRIES,
                    approximate=True))
            read = await self.link.call("reading the prompts the others sent",
                                        client.xread({self.key: self.last_id}, count=READ_ENTRIES))
        except StateUnavailable:
            return
        self.record(read)

    def record(self, read) -> None:
        max_blocks = self.store.current.scheduler.prefix_index_max_blocks
        for _stream, entries in read or ():
            for entry_id, fields in entries:
                self.last_id = _text(entry_id)
                if _text(fields.get(b"r", fields.get("r", b""))) == self.link.replica:
                    continue
                try:
                    prompts = orjson.loads(fields.get(b"p", fields.get("p", b"[]")))
                    for name, prefix in prompts:
                        self.pool_state.sent_prompt(str(name), tuple(int(h) for h in prefix), max_blocks,
                                                    by_peer=True)
                except (orjson.JSONDecodeError, ValueError, TypeError):
                    log.warning("a malformed entry in %s was skipped", self.key)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
