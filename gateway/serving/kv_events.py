"""The KV-cache events of instances that publish them: the exact half of the prefix index.

With `[scheduler] prefix_cache = "events"`, the gateway subscribes to each
instance whose config names an event endpoint (`kv_events`, where vLLM
publishes with `--kv-events-config`: a ZMQ PUB socket, batches as
`[topic, 8-byte sequence number, msgpack([ts, events, rank])]`, each event
an array tagged by its name (BlockStored, BlockRemoved, AllBlocksCleared),
or, since vllm-project/vllm#42892, a map tagged by its "type"; both are read).
Each event feeds the instance's `ReportedBlocks` (core/prefix.py), which
re-hashes the stored blocks' token ids into the gateway's own chain.

The approximate index (what the gateway sent) is always kept, and the
scheduler reads it in place of the reported one whenever the stream cannot
be trusted, which /health and `routebalance_kv_events_up` say:
- not connected yet, or pyzmq / msgpack missing (the `events` extra);
- a gap in the sequence numbers (batches were lost; vLLM's replay socket is
  not read): the reported index is cleared and rebuilt from what follows,
  trusted again after REWARM_S;
- a batch that cannot be read (the same);
- late: a batch stamped more than LATE_S before it was read;
- silent: the instance's own counters (vllm:prefix_cache_queries minus hits)
  say it computed new blocks since the last batch, and none came for
  SILENCE_S (a publisher that died, or an endpoint that is not it).
Each process (every `serve --workers` worker, every replica) subscribes on
its own: a PUB socket serves every subscriber, so all of them hold the same
exact index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config.store import ConfigStore
from gateway.core.pool_state import InstanceState, PoolState
from gateway.core.prefix import REPORTED_SLACK, ReportedBlocks

log = logging.getLogger(__name__)

EVENTS_EXTRA = "pip install 'routebalance-gateway[events]'"
LATE_S = 2.0  # a batch older than this when read: the index lags the instance
SILENCE_S = 5.0  # new blocks computed (its counters say) and no batch for this long: the stream is lost
REWARM_S = 10.0  # after a gap or an unreadable batch, the rebuilt index is trusted again after this long
CHECK_S = 0.5  # how often the subscriptions follow the config and the silence rule is checked
RECEIVE_HWM = 100_000  # batches queued in the socket before ZMQ drops (seen as a gap)


class StreamStatus:
    """One instance's stream, as /health reports it."""

    __slots__ = ("note", "seq", "read_at", "misses_at_read", "distrust_until", "lag_s")

    def __init__(self) -> None:
        self.note = "connecting"
        self.seq: int | None = None  # the last sequence number read
        self.read_at = -1.0  # loop time of the last batch
        self.misses_at_read = 0.0  # the instance's uncached prompt tokens then (from its counters)
        self.distrust_until = 0.0  # after a gap: rebuilding until then
        self.lag_s = 0.0


class KvEventReader:
    def __init__(self, store: ConfigStore, pool_state: PoolState, on_lag: Callable[[str, float], None] | None = None,
                 wall: Callable[[], float] = time.time):
        self.store, self.pool_state = store, pool_state
        self.on_lag = on_lag
        self.wall = wall
        self.status: dict[str, StreamStatus] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}

    def health(self) -> dict[str, str]:
        return {name: s.note for name, s in self.status.items()}

    async def run(self) -> None:
        while not self._wanted():  # pyzmq and msgpack are imported only once a config asks for events
            await asyncio.sleep(CHECK_S)
        try:
            import msgpack
            import zmq.asyncio
        except ImportError:
            for name, _ in self._wanted():
                self._distrust(name, f"not read: pyzmq and msgpack missing ({EVENTS_EXTRA})")
            log.error("prefix_cache = \"events\" needs pyzmq and msgpack (%s); the approximate index stands in",
                      EVENTS_EXTRA)
            return
        ctx = zmq.asyncio.Context()
        try:
            while True:
                wanted = self._wanted()
                for key in [k for k in self._tasks if k not in wanted]:
                    self._tasks.pop(key).cancel()
                    self._distrust(key[0], "not subscribed")
                for key in wanted - self._tasks.keys():
                    self._tasks[key] = asyncio.create_task(self._follow(ctx, zmq, msgpack, *key))
                self._check_silence(asyncio.get_running_loop().time())
                await asyncio.sleep(CHECK_S)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            ctx.destroy(linger=0)

    def _wanted(self) -> set[tuple[str, str]]:
        cfg = self.store.current
        if cfg.scheduler.prefix_cache != "events":
            return set()
        return {(i.name, i.kv_events) for i in cfg.instances if i.kv_events is not None}

    async def _follow(self, ctx, zmq, msgpack, name: str, endpoint: str) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        status = self.status.setdefault(name, StreamStatus())
        loop = asyncio.get_running_loop()
        try:
            sock.connect(endpoint)
            status.note = "connected, no batch yet"
            while True:
                frames = await sock.recv_multipart()
                self.read(name, frames, msgpack.unpackb, loop.time())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad endpoint string, a socket error: say so, the approximate index serves
            log.error("KV-cache events of %s at %s: %s; the approximate index stands in", name, endpoint, e)
            self._distrust(name, f"not read: {e}")
        finally:
            sock.close(linger=0)

    def read(self, name: str, frames: list[bytes], unpack, now: float) -> None:
        """One batch from the instance's stream (`unpack`: msgpack's)."""
        state, status = self.pool_state.of(name), self.status.setdefault(name, StreamStatus())
        reported = self._reported(state)
        try:
            seq, ts, events = _batch(frames, unpack)
            if status.seq is not None and seq != status.seq + 1:
                raise _Gap(f"batches {status.seq + 1}-{seq - 1} lost")
            for event in events:
                _apply(reported, event)
        except (_Gap, ValueError, TypeError, IndexError, KeyError) as e:
            reported.cleared()  # it may now miss blocks or keep evicted ones: rebuilt from what follows
            status.distrust_until = now + REWARM_S
            self._distrust(name, f"rebuilding: {e}")
            status.seq = seq if isinstance(e, _Gap) else None
            return
        status.seq, status.read_at = seq, now
        status.misses_at_read = _misses(state)
        status.lag_s = max(self.wall() - ts, 0.0)
        if self.on_lag is not None:
            self.on_lag(name, status.lag_s)
        if status.lag_s > LATE_S:
            self._distrust(name, f"late: a batch read {status.lag_s:.1f} s after it was sent")
        elif now >= status.distrust_until:
            state.events_ok, status.note = True, "ok"

    def _reported(self, state: InstanceState) -> ReportedBlocks:
        if state.reported is None:
            sched = self.store.current.scheduler
            state.reported = ReportedBlocks(REPORTED_SLACK * state.bound(sched.prefix_index_max_blocks),
                                            sched.prefix_block_tokens)
        return state.reported

    def _check_silence(self, now: float) -> None:
        block = self.store.current.scheduler.prefix_block_tokens
        for name, status in self.status.items():
            state = self.pool_state.of(name)
            if (state.events_ok and now - status.read_at > SILENCE_S
                    and _misses(state) - status.misses_at_read >= 2 * block):
                self._distrust(name, f"silent: the instance computed new blocks and sent no event for {SILENCE_S:g} s")

    def _distrust(self, name: str, note: str) -> None:
        state = self.pool_state.of(name)
        if state.events_ok or self.status.get(name) is None or self.status[name].note != note:
            log.warning("KV-cache events of %s: %s; the approximate index stands in", name, note)
        state.events_ok = False
        self.status.setdefault(name, StreamStatus()).note = note


class _Gap(Exception):
    pass


def _batch(frames: list[bytes], unpack) -> tuple[int, float, list]:
    """(sequence number, timestamp, events) of one multipart message; ValueError if it is not vLLM's shape."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a batch of {len(frames)} frames, not [topic, sequence, payload]")
    seq = int.from_bytes(frames[1], "big")
    payload = unpack(frames[2])
    if isinstance(payload, dict):
        payload = [payload.get("ts"), payload.get("events")]
    if not isinstance(payload, list) or len(payload) < 2 or not isinstance(payload[1], list):
        raise ValueError("the payload is not [ts, events, rank]")
    return seq, float(payload[0]), payload[1]


# The fields of each event in the array encoding, after its tag: vLLM's structs' fields in declaration order (the
# emulator writes them in this order too; the reader needs the hashes, the parent, the tokens and the block size).
EVENT_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _apply(reported: ReportedBlocks, event: list | dict) -> None:
    if isinstance(event, dict):
        kind, fields = event.get("type"), event
    else:
        kind = event[0]
        fields = dict(zip(EVENT_FIELDS.get(kind, ()), event[1:], strict=False))
    if kind == "BlockStored":
        reported.stored(fields["block_hashes"], fields["parent_block_hash"], fields["token_ids"],
                        fields["block_size"])
    elif kind == "BlockRemoved":
        reported.removed(fields["block_hashes"])
    elif kind == "AllBlocksCleared":
        reported.cleared()
    else:
        raise ValueError(f"an event of unknown kind {kind!r}")


def _misses(state: InstanceState) -> float:
    """Prompt tokens the instance has computed rather than found cached, by its own counters (0: not scraped)."""
    snap = state.last
    return snap.prefix_queries - snap.prefix_hits if snap is not None else 0.0
