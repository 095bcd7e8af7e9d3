"""The paged KV cache: one pool of fixed-size blocks, per-sequence block tables, prefix reuse.

K/V memory is one pool of ``num_blocks`` blocks of :data:`BLOCK_SIZE` positions, sized by a
byte budget (``TOKENPIPE_KV_CACHE_MB``), as vLLM's PagedAttention. A sequence holds a list of
block ids (its block table); memory follows the positions held, and a retiring sequence gives
its blocks back without copying anything.

Automatic prefix caching: a full block is keyed by a digest of (its parent block's key, its
token ids), so a key names a whole prefix. A new sequence reuses the longest chain of cached
blocks and prefills only the rest; a block whose last holder leaves stays cached (and
reusable) until the pool needs it, least recently used first.

On CPU an idle generator's RSS holds only the blocks ever written, not the budget (:func:`_lazy_zeros`).
Block 0 is a scratch block: padding positions write there and block tables are padded with it,
so every read is of finite values (a masked NaN would still poison ``probs @ V``).

Layout per layer: ``[G, num_blocks, BLOCK_SIZE, hd]`` (G kv heads): gathering a batch's blocks
along dim 1 gives ``[G, B, T, hd]`` as a free view, the shape decode attention reads.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from tokenpipe.errors import TokenpipeError
from tokenpipe.metrics import GeneratorMetrics

if TYPE_CHECKING:
    from .engineproc import PoolCounters

__all__ = ["BLOCK_SIZE", "ROOT_KEY", "SCRATCH", "BlockPool", "PagedKVCache", "KVCacheTooSmall", "KVCacheMeter",
           "auto_budget_bytes", "bytes_per_position", "prefix_keys"]

BLOCK_SIZE = 16
SCRATCH = 0  # block id padding writes go to; never handed out
ROOT_KEY = b"tokenpipe-kv-root"  # the parent key of a first block
_CPU_SHARE = 0.25  # of MemAvailable, when no budget is set
_CUDA_SHARE = 0.6  # of free device memory after the model is loaded


class KVCacheTooSmall(TokenpipeError):
    """The budget cannot hold one sequence of the longest allowed length."""

    code = "config_error"


def bytes_per_position(model: Any, dtype: torch.dtype) -> int:
    """K and V bytes one position takes over all layers."""
    cfg = model.config
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * hd * item


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2


def auto_budget_bytes(device: torch.device, ceiling: int) -> int:
    """The default budget: a share of available RAM (CPU) or of free device memory (CUDA),
    at most ``ceiling`` bytes (what ``max_batch`` sequences of ``max_seq_len`` could hold)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = int(free * _CUDA_SHARE)
    else:
        share = int(_mem_available() * _CPU_SHARE)
    return min(share, ceiling)


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


class PagedKVCache:
    """The pool's tensors: per layer K and V ``[G, num_blocks, BLOCK_SIZE, hd]``."""

    def __init__(self, model: Any, budget_bytes: int, device: torch.device, dtype: torch.dtype, *,
                 min_positions: int, caching: bool = True) -> None:
        cfg = model.config
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.block_bytes = bytes_per_position(model, dtype) * BLOCK_SIZE
        num_blocks = budget_bytes // self.block_bytes
        need = -(-min_positions // BLOCK_SIZE) + 1
        if num_blocks < need:
            raise KVCacheTooSmall(
                f"a KV cache of {budget_bytes / 2**20:.0f} MiB holds {max(num_blocks - 1, 0) * BLOCK_SIZE} positions; "
                f"one sequence of {min_positions} needs {need * self.block_bytes / 2**20:.0f} MiB "
                "(raise TOKENPIPE_KV_CACHE_MB or lower TOKENPIPE_MAX_SEQ_LEN)")
        self.pool = BlockPool(num_blocks, caching=caching)
        shape = (2, self.kv_heads, num_blocks, BLOCK_SIZE, self.head_dim)
        self.kv = [_lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
                   for _ in range(self.layers)]  # [2, G, num_blocks, BLOCK_SIZE, hd] each
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def touched_bytes(self) -> int:
        """Bytes of the pool ever written (what RSS holds on CPU)."""
        return self.pool.next_fresh * self.block_bytes

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """Store ``k, v [G, M, hd]`` at the flat cache positions ``slots [M]`` (block * BLOCK_SIZE + offset).

        One ``index_copy_`` over the layer seen as ``[2G, num_blocks * BLOCK_SIZE, hd]``: two
        advanced-index assignments (blocks, offsets) cost 27 against 6 µs a layer at one row."""
        self.kv[layer].view(2 * self.kv_heads, -1, self.head_dim).index_copy_(1, slots, torch.cat((k, v)))

    def gather_k(self, layer: int, tables: Tensor) -> Tensor:
        """``tables [B, n]`` of block ids -> K ``[G, B, n * BLOCK_SIZE, hd]``."""
        B, n = tables.shape
        return self.k[layer].index_select(1, tables.reshape(-1)).view(self.kv_heads, B, n * BLOCK_SIZE, self.head_dim)

    def value_bags(self, tables: Tensor, group: int) -> tuple[Tensor, Tensor]:
        """For ``embedding_bag`` over one layer's V viewed as rows ``[G * num_blocks * BLOCK_SIZE, hd]``:
        the row of every (kv head g, row b, query head r of g's group, position t), and the start
        of each (g, b, r) bag. The same for every layer of a step: built once."""
        B, n = tables.shape
        T = n * BLOCK_SIZE
        offset = torch.arange(BLOCK_SIZE, device=tables.device)
        rows = (tables[:, :, None] * BLOCK_SIZE + offset).view(1, B, 1, T)  # [1, B, 1, T]
        head = torch.arange(self.kv_heads, device=tables.device).view(-1, 1, 1, 1) * (self.num_blocks * BLOCK_SIZE)
        index = (rows + head).expand(self.kv_heads, B, group, T).reshape(-1)
        starts = torch.arange(0, index.numel(), T, device=tables.device)
        return index, starts

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """``tables [B, n]`` of block ids -> K, V ``[G, B, n * BLOCK_SIZE, hd]``, in one gather."""
        B, n = tables.shape
        kv = self.kv[layer].index_select(2, tables.reshape(-1))  # [2, G, B * n, BLOCK_SIZE, hd]
        kv = kv.view(2, self.kv_heads, B, n * BLOCK_SIZE, self.head_dim)
        return kv[0], kv[1]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zeroed CPU tensor whose pages are mapped on first write, 4 KiB at a time.

    Not ``np.zeros`` (calloc): numpy advises huge pages for arrays over 4 MiB, and the pool is
    180 separate slabs for SmolLM2 (layer x K/V x kv head), so the first block written faulted in a
    2 MiB page in each: 360 MiB of RSS (fp32) for a 64-token prompt whose K/V is 3 MiB. With
    ``MADV_NOHUGEPAGE`` a block costs its own pages only, also where THP is ``always``."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero until written
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps buf alive


class KVCacheMeter:
    """Moves a pool's state into the generator's Prometheus metrics (its counters by how much
    the pool's totals grew since the last look): a :class:`BlockPool`, or the counters an
    engine-core process reports of its own."""

    def __init__(self, metrics: GeneratorMetrics) -> None:
        self.metrics = metrics
        self._seen = (0, 0, 0)

    def update(self, pool: BlockPool | PoolCounters, preemptions: int) -> None:
        m = self.metrics
        cached = pool.cached
        m.labels(m.kv_cache).set(pool.used / max(pool.capacity, 1))
        for state, count in (("used", pool.used), ("cached", cached), ("free", pool.capacity - pool.used - cached)):
            m.kv_blocks.labels(model_name=m.model, state=state).set(count)
        now = (pool.query_tokens, pool.hit_tokens, preemptions)
        for counter, new, old in zip((m.prefix_queries, m.prefix_hits, m.preemptions), now, self._seen, strict=True):
            if new > old:
                m.labels(counter).inc(new - old)
        self._seen = now
