"""vLLM's automatic prefix caching over one engine's KV blocks.

A full block of a prompt is known by its chained hash (core/prefix.py). A
block held by running sequences is referenced (counted once however many
share it); when the last of them lets go it stays cached but free, and the
least recently freed goes first when a new block needs room. A request
takes its longest run of cached leading blocks at admission and prefills
only the rest. The engine (engine.py) owns the private blocks (a prompt's
partial last block, the answer's blocks, a block computed while an equal one
was already held); this class owns the shared ones.

With `record_events`, what enters and leaves the cache is kept for the
caller to publish as vLLM's KV-cache events (BlockStored, BlockRemoved).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    __slots__ = ("refs", "free", "queries", "hits", "record_events", "stored", "removed")

    def __init__(self, record_events: bool = False):
        self.refs: dict[int, int] = {}  # hash -> running sequences holding the block
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, held by none, least recently freed first
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)
        self.record_events = record_events
        self.stored: list[int] = []  # hashes that entered the cache since the caller last took them
        self.removed: list[int] = []  # hashes evicted since then

    @property
    def referenced(self) -> int:
        return len(self.refs)

    def __contains__(self, h: int) -> bool:
        return h in self.refs or h in self.free

    def match(self, prefix: Sequence[int], most: int) -> tuple[int, int]:
        """(leading blocks of `prefix` cached, at most `most`; how many of those are free, so that taking them
        uses room the engine counted as free)."""
        n = taken_free = 0
        for h in prefix[:most]:
            if h in self.refs:
                n += 1
            elif h in self.free:
                n += 1
                taken_free += 1
            else:
                break
        return n, taken_free

    def acquire(self, h: int) -> bool:
        """A running sequence holds block `h`; True if it was not cached before (the sequence computed it)."""
        count = self.refs.get(h)
        if count is not None:
            self.refs[h] = count + 1
            return False
        self.refs[h] = 1
        if h in self.free:
            del self.free[h]
            return False
        if self.record_events:
            self.stored.append(h)
        return True

    def release(self, held: Sequence[int]) -> None:
        """A sequence lets go of its blocks; those no one else holds become free, its first block the most
        recently freed (so a chain is evicted from its tail)."""
        for h in reversed(held):
            count = self.refs[h] - 1
            if count:
                self.refs[h] = count
            else:
                del self.refs[h]
                self.free[h] = None

    def evict(self, n: int) -> None:
        """Drop the `n` least recently freed blocks (a new block needs their room)."""
        for _ in range(min(n, len(self.free))):
            h = self.free.popitem(last=False)[0]
            if self.record_events:
                self.removed.append(h)

    def freed_by(self, held: Sequence[Sequence[int]]) -> int:
        """Blocks that would become free if the sequences holding `held` let go of them."""
        counts: dict[int, int] = {}
        for blocks in held:
            for h in blocks:
                counts[h] = counts.get(h, 0) + 1
        return sum(1 for h, c in counts.items() if self.refs.get(h) == c)

    def clear(self) -> None:
        """Forget every free block (vLLM's reset_prefix_cache; an instance that restarts)."""
        self.free.clear()
