"""What each instance holds in its prefix cache, as the gateway knows it: pure, hashes in, cached tokens out.

vLLM's automatic prefix caching keys every full KV block by a hash chained
over the block's tokens and every token before it, so two prompts share a
cached block exactly when they share everything up to its end. The gateway
hashes a prompt's tokens the same way (`block_hashes`, in blocks of the
engines' size) and keeps, per instance, a bounded index of the hashes it
believes the instance holds (`PrefixIndex`): approximate, from what the
gateway itself sent where, or exact, from the instance's KV-cache events.
A request's cached prefix on an instance is its longest run of leading
blocks in that index.

The hash is Python's own tuple hash over ints, which (unlike the hash of a
str or bytes) is the same in every process, so the workers of one host and
the simulator's replicas agree on it. Collisions of 64-bit hashes are left
to chance, as vLLM leaves its own.

Both the index and the engine's cache (engine/prefix_cache.py) evict least
recently used, and a prompt's blocks are touched from its last to its first:
the first blocks of a chain are always the most recent, so a chain loses its
tail before its head, as in vLLM.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# The root every chain grows from when no salt is given (an arbitrary odd 63-bit constant).
_ROOT = 0x5851F42D4C957F2D
# Measured bytes per indexed block (an OrderedDict entry: key, links, the int), for the stated memory bound.
BYTES_PER_BLOCK = 104
# An index fed by events may hold this many times the instance's KV capacity: within one batch a store may come
# before the evictions that made its room, and a bound at the capacity itself would drop blocks still cached.
REPORTED_SLACK = 2


def chain_root(salt: str | None = None) -> int:
    """The hash a prompt's first block chains from: a tenant's salt (vLLM's `cache_salt`) gives a root of its own,
    so its blocks never equal another tenant's."""
    if salt is None:
        return _ROOT
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") >> 1


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> tuple[int, ...]:
    """The chained hash of each full block of `tokens` (a partial last block is never cached)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    toks = tokens if isinstance(tokens, list) else list(tokens)
    h = chain_root(salt)
    out = []
    for start in range(0, len(toks) - block_size + 1, block_size):
        h = hash((h, *toks[start:start + block_size]))
        out.append(h)
    return tuple(out)


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most leading blocks a prompt can take from the cache: vLLM always computes its last token, so a prompt of
    exactly k full blocks reuses at most k - 1 of them."""
    return max(prompt_tokens - 1, 0) // block_size


class PrefixIndex:
    """The block hashes one instance is believed to hold, at most `capacity` of them, least recently used out."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` are held (a read: nothing is touched)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[int]) -> list[int]:
        """The instance now holds these blocks (a prompt it was sent, or blocks it reported stored): each becomes
        the most recently used, its first block last. Returns the hashes evicted to stay within capacity."""
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def remove(self, hashes: Iterable[int]) -> None:
        """The instance dropped these blocks (its KV-cache events said so)."""
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()

    def resize(self, capacity: int) -> list[int]:
        """A new bound (the instance's KV capacity became known): the least recently used go first. Returns the
        hashes evicted."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        evicted = []
        while len(self._blocks) > capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted


class ReportedBlocks:
    """An instance's prefix index fed by its KV-cache events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared).

    vLLM names blocks by hashes of its own (seeded, and of its chosen
    algorithm), so the gateway cannot compute them; a BlockStored event
    carries each block's token ids and its parent's hash, from which the
    gateway computes its own chained hash (`block_hashes`' chain), and keeps
    the map from vLLM's hash to its own so that later events name blocks it
    knows. A block whose parent it never heard of (stored before it
    subscribed) cannot be chained and is left out; so is a block of another
    size. The map holds exactly the indexed blocks, so it shares the index's
    bound.
    """

    __slots__ = ("index", "block_size", "_ours", "_theirs", "unchained")

    def __init__(self, capacity: int, block_size: int):
        self.index = PrefixIndex(capacity)
        self.block_size = block_size
        self._ours: dict[int, int] = {}  # vLLM's hash -> the gateway's
        self._theirs: dict[int, int] = {}  # and back, to forget what the index evicts
        self.unchained = 0  # blocks left out: unknown parent, or another block size

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int) -> None:
        if block_size != self.block_size or len(token_ids) < len(hashes) * block_size:
            self.unchained += len(hashes)
            return
        if parent is None:
            h = _ROOT
        elif parent in self._ours:
            h = self._ours[parent]
        else:
            self.unchained += len(hashes)
            return
        ours = []
        for k, theirs in enumerate(hashes):
            h = hash((h, *token_ids[k * block_size:(k + 1) * block_size]))
            ours.append(h)
            self._ours[theirs] = h
            self._theirs[h] = theirs
        self._forget(self.index.record(ours))

    def removed(self, hashes: Iterable[int]) -> None:
        for theirs in hashes:
            ours = self._ours.pop(theirs, None)
            if ours is not None:
                self._theirs.pop(ours, None)
                self.index.remove((ours,))

    def cleared(self) -> None:
        self._ours.clear()
        self._theirs.clear()
        self.index.clear()

    def resize(self, capacity: int) -> None:
        self._forget(self.index.resize(capacity))

    def _forget(self, evicted: Iterable[int]) -> None:
        """The index let these (the gateway's hashes) go: so does the map."""
        for ours in evicted:
            theirs = self._theirs.pop(ours, None)
            if theirs is not None:
                self._ours.pop(theirs, None)
