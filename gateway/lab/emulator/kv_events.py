"""vLLM's KV-cache events, published by an emulated instance that has `kv_events` set.

A vLLM server started with `--kv-events-config` publishes every change to its
prefix cache on a ZMQ PUB socket (vllm/distributed/kv_events.py,
`ZmqEventPublisher`); routers such as vllm-router's `kv_aware` policy, llm-d
and Dynamo keep an exact index of each server's cache from them. An emulated
instance publishes the same messages from its engine's cache, one batch per
tick of the emulator (vLLM: one per engine step that changed the cache).

Wire format, as vLLM sends it:

- one multipart message per batch: the topic (vLLM's default, empty), the
  batch's sequence number (8 bytes, big-endian, from 0), the msgpack payload;
- payload: `[ts, events, data_parallel_rank]` (`KVEventBatch`: wall-clock
  seconds, the events in order, rank 0);
- BlockStored (block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium): blocks that entered the cache, each the parent of the
  next; `parent_block_hash` is the block before the first (None: the first
  block of a prompt), `token_ids` the blocks' tokens end to end, `lora_id`
  None, medium "GPU";
- BlockRemoved (block_hashes, medium): one evicted block (vLLM sends one
  event per block);
- AllBlocksCleared: the cache was emptied (here: the instance went down).

Each event is encoded as `[emulator] kv_events_encoding` says: "map" (the
default), a map of its fields tagged by its "type", with the fields vLLM
added beside the map encoding (vllm-project/vllm#42892, #33304, #40984):
`lora_name` None, `extra_keys` one None per block, `group_idx` 0 and
`kv_cache_spec_kind` "full_attention", as vLLM 0.26 sends them; or "array",
the tag then the fields in order (vLLM's msgspec structs with
`array_like=True`, as releases before the map encoding sent them).

Block hashes go out as unsigned 64-bit integers, as vLLM's
`maybe_convert_block_hash` makes them (its default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the engine's hash
(gateway/core/prefix.py) modulo 2**64, so a reader that hashes the same
prompt compares `h % 2**64`. A reader that hashes the events' token ids
itself (this gateway, vllm-router) needs only that equal ids are equal
hashes.

Not emulated: the replay socket (vLLM's `replay_endpoint`, off by default;
the config has no key for it), and a tenant's `cache_salt` in `extra_keys`
(vLLM names it on a salted prompt's first block; here every block's is
None, so a reader that re-hashes token ids takes two tenants' equal prompts
for one).

pyzmq and msgpack are the `events` extra: imported only when an instance
publishes (`KvEventPublisher`), so a pool without `kv_events` needs neither.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

from gateway.config_schema import ConfigError
from gateway.serving.kv_events import EVENT_FIELDS

EVENTS_EXTRA = "pip install 'routebalance-gateway[events]'"
MEDIUM_GPU = "GPU"
TOPIC = b""  # KVEventsConfig.topic's default
DATA_PARALLEL_RANK = 0  # an emulated instance is one engine
SEND_HWM = 100_000  # ZmqEventPublisher's high-water mark: past it a slow subscriber loses batches
_U64 = (1 << 64) - 1
# What the map encoding carries beside the structs' fields (one cache group of full attention, no LoRA).
_MAP_ADDED = {"BlockStored": {"lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
              "BlockRemoved": {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}, "AllBlocksCleared": {}}


def external_hash(h: int) -> int:
    """A block hash as it goes on the wire (vLLM's hashes are unsigned 64-bit)."""
    return h & _U64


def as_map(event: list) -> dict:
    """An event of the array encoding in the map encoding."""
    tag, *values = event
    out = {"type": tag, **dict(zip(EVENT_FIELDS[tag], values, strict=True)), **_MAP_ADDED[tag]}
    if tag == "BlockStored":
        out["extra_keys"] = [None] * len(out["block_hashes"])
    return out


class BlockTable:
    """The parent and token ids of each full prompt block of the requests an instance is serving.

    A BlockStored event names a block's parent and carries its tokens, but the
    engine's cache knows blocks by hash alone. A block enters the cache while
    a request that holds it in its prompt runs, so the table keeps the blocks
    of the requests in the engine (waiting or running), counted per request,
    and drops a block when the last of them leaves: it holds at most the
    distinct blocks of the prompts in flight.
    """

    __slots__ = ("block_size", "_blocks")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[int, list] = {}  # hash -> [parent hash or None, token ids, requests holding it]

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, ids: Sequence[int], hashes: Sequence[int]) -> None:
        """A request with these prompt token ids and full-block hashes entered the engine."""
        blocks, size, parent = self._blocks, self.block_size, None
        for i, h in enumerate(hashes):
            entry = blocks.get(h)
            if entry is None:
                blocks[h] = [parent, ids[i * size:(i + 1) * size], 1]
            else:
                entry[2] += 1
            parent = h

    def drop(self, hashes: Iterable[int]) -> None:
        """The request with these block hashes left the engine."""
        blocks = self._blocks
        for h in hashes:
            entry = blocks[h]
            if entry[2] == 1:
                del blocks[h]
            else:
                entry[2] -= 1

    def events(self, stored: Sequence[int], removed: Sequence[int], cached) -> list[list]:
        """The events of one batch: `stored` and `removed` as the engine's cache recorded them (each in order),
        `cached` what it holds now (`in` is asked of it).

        The two lists lose how stores and evictions interleaved within the batch, so the events are ordered
        to leave a subscriber with the cache as it is now: evictions of blocks cached again since come first,
        then the stores (runs of blocks each the parent of the next, one BlockStored each, as vLLM sends one per
        request and step), then the other evictions."""
        again, gone = [], []
        for h in removed:
            (again if h in cached else gone).append(["BlockRemoved", [external_hash(h)], MEDIUM_GPU])
        out = again
        run: list | None = None  # the BlockStored being built
        last = None  # the hash that ends it
        for h in stored:
            parent, tokens, _ = self._blocks[h]
            if run is not None and parent == last:
                run[1].append(external_hash(h))
                run[3].extend(tokens)
            else:
                run = ["BlockStored", [external_hash(h)], None if parent is None else external_hash(parent),
                       list(tokens), self.block_size, None, MEDIUM_GPU]
                out.append(run)
            last = h
        out.extend(gone)
        return out


class KvEventPublisher:
    """vLLM's ZmqEventPublisher for one instance: a PUB socket bound at `endpoint`, batches numbered from 0,
    and the table of the blocks in flight that its BlockStored events describe (`blocks`).

    vLLM sends from a thread of its own; here a batch is a few list operations,
    one msgpack call and a send that never blocks (PUB drops past its
    high-water mark), so it goes out from the emulator's loop directly."""

    def __init__(self, endpoint: str, block_size: int, key: str, encoding: str = "map"):
        """`key`: the config key that asked for it (the error names it); `encoding`: "map" or "array"."""
        try:
            import msgpack
            import zmq
        except ImportError:
            raise ConfigError(f"publishing KV-cache events needs pyzmq and msgpack: {EVENTS_EXTRA}", key) from None
        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise OSError(e.errno, f"{key}: cannot publish KV-cache events at {endpoint!r} ({e.strerror})") from None
        self.endpoint = endpoint
        self.blocks = BlockTable(block_size)
        self._sock = sock
        self._pack = msgpack.Packer().pack
        self._seq = itertools.count()
        self._as_map = encoding == "map"

    def publish_changes(self, stored: Sequence[int], removed: Sequence[int], cached) -> None:
        """One batch of what entered (`stored`) and left (`removed`) the cache, if anything did (`cached`: the
        cache as it is now, BlockTable.events)."""
        if stored or removed:
            self.publish(self.blocks.events(stored, removed, cached))

    def publish(self, events: list[list]) -> None:
        """One batch; `events` in the array encoding (BlockTable.events), sent in the publisher's."""
        wire = [as_map(e) for e in events] if self._as_map else events
        payload = self._pack([time.time(), wire, DATA_PARALLEL_RANK])
        self._sock.send_multipart((TOPIC, next(self._seq).to_bytes(8, "big"), payload))

    def close(self) -> None:
        self._sock.close(linger=0)
