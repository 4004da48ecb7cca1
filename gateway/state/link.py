"""The replicas' link to Redis: one client, its timeouts, and whether the server answers.

Every call goes through `call`, which bounds it in time and records the
outcome, so the spend ledger and the pool sync agree on one `reachable` flag
(read by /health/ready and the routebalance_state_backend_up metric).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

log = logging.getLogger("routebalance.state")


class StateUnavailable(Exception):
    """Redis did not answer in time, refused, or failed the call."""


class RedisLink:
    def __init__(self, url: str, prefix: str, timeout_s: float):
        # The client's own timeouts bound connecting and each socket read; `call` bounds the whole call.
        # A dropped connection (Redis restarted) is retried at once on a new one, a few times within the
        # timeout: every script is safe to run twice (a hold or a share is named, a settlement marked).
        # At most 64 connections; a call that finds them all busy waits for one (within the timeout)
        # rather than failing at once, as the default pool would under a burst.
        retry = Retry(ExponentialBackoff(cap=timeout_s / 4, base=0.005), retries=3)
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=64, timeout=timeout_s, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            health_check_interval=30, retry=retry)
        self.client = aioredis.Redis(connection_pool=pool)
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.replica = uuid.uuid4().hex[:12]  # this process, in hold and share names
        self.reachable = True
        self._said_down = False

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def call(self, what: str, awaitable: Awaitable):
        """Await one Redis call within the timeout; StateUnavailable if it fails."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the caller's own cancellation
            # when the call ends at that moment, and a cancelled background loop would then run on.
            async with asyncio.timeout(self.timeout_s):
                result = await awaitable
        except (RedisError, OSError, TimeoutError) as e:
            self._down(what, e)
            raise StateUnavailable(f"redis at {self.url}: {what} failed: {e.__class__.__name__}: {e}") from None
        if not self.reachable:
            log.warning("redis at %s answers again", self.url)
        self.reachable, self._said_down = True, False
        return result

    def _down(self, what: str, e: BaseException) -> None:
        self.reachable = False
        if not self._said_down:  # once per outage, not once per call
            self._said_down = True
            log.error("redis at %s is unreachable (%s: %s: %s); serving on this replica's local view",
                      self.url, what, e.__class__.__name__, e)

    async def close(self) -> None:
        await self.client.aclose(close_connection_pool=True)
