"""The KV pool's bookkeeping: which sequence holds which blocks, and the prefix cache over them.

A sequence holds a list of block ids (its block table); memory follows the positions held, and a
retiring sequence gives its blocks back without copying anything. The tensors the ids index are
:class:`generator.model.kvcache.PagedKVCache`'s.

Automatic prefix caching: a full block is keyed by a digest of (its parent block's key, its
token ids), so a key names a whole prefix. A new sequence reuses the longest chain of cached
blocks and prefills only the rest; a block whose last holder leaves stays cached (and
reusable) until the pool needs it, least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..model.kvcache import BLOCK_SIZE

__all__ = ["ROOT_KEY", "BlockPool", "prefix_keys"]

ROOT_KEY = b"tokenpipe-kv-root"  # the parent key of a first block


def prefix_keys(tokens: list[int], parent: bytes = ROOT_KEY, start: int = 0) -> list[bytes]:
    """Keys of the full blocks of ``tokens[start:]``, chained from ``parent``'s key."""
    keys = []
    for i in range(start, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = np.asarray(tokens[i: i + BLOCK_SIZE], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """Block ids, their holders, and the prefix cache over them. Pure bookkeeping, no tensors.

    A block is *used* (held by a sequence), *cached* (no holder, has a key: reusable until
    evicted, LRU), or *free* (no holder, no key). Fresh blocks are handed out in order after
    the freed ones, so the memory touched is the high-water mark of blocks in use.
    """

    def __init__(self, num_blocks: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self.refs = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, no holder; oldest first
        self.freed: list[int] = []
        # the next never-used block id (block 0 is the scratch block): the high-water mark of blocks touched
        self.next_fresh = 1
        self.used = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks a sequence could get now: free ones and cached ones nobody holds."""
        return self.capacity - self.used

    @property
    def cached(self) -> int:
        return len(self.evictable)

    def allocate(self) -> int:
        """A block for one holder; raises :class:`MemoryError` when every block is held."""
        if self.freed:
            block = self.freed.pop()
        elif self.next_fresh < self.num_blocks:
            block = self.next_fresh
            self.next_fresh += 1
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            key = self.key_of[block]
            if key is not None:
                del self.by_key[key]
                self.key_of[block] = None
        else:
            raise MemoryError("every KV block is held")
        self.refs[block] = 1
        self.used += 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one hold on each block. An unheld keyed block stays cached as the most recently
        used; of one chain the tail goes first (it is the least likely to be shared)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            self.used -= 1
            if self.key_of[block] is not None:
                self.evictable[block] = None
            else:
                self.freed.append(block)

    def match(self, keys: list[bytes]) -> list[int]:
        """Hold the longest run of cached blocks for ``keys`` (a sequence's leading full blocks)."""
        got = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
                self.used += 1
            self.refs[block] += 1
            got.append(block)
        return got

    def register(self, block: int, key: bytes) -> None:
        """``block`` is full with the prefix ``key`` names: later sequences may reuse it."""
        if not self.caching or self.key_of[block] is not None or key in self.by_key:
            return
        self.key_of[block] = key
        self.by_key[key] = block
