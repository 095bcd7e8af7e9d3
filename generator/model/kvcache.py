"""The paged KV cache's tensors: one pool of fixed-size blocks per layer, sized by a byte budget.

K/V memory is one pool of ``num_blocks`` blocks of :data:`BLOCK_SIZE` positions, sized by a
byte budget (``TOKENPIPE_KV_CACHE_MB``), as vLLM's PagedAttention. Which sequence holds which
blocks, and which blocks hold a reusable prefix, is the engine's bookkeeping
(:mod:`generator.engine.blocks`); here are only the tensors, written through flat slot indices
and read through block tables.

On CPU an idle generator's RSS holds only the blocks ever written, not the budget (:func:`_lazy_zeros`).
Block 0 is a scratch block: padding positions write there and block tables are padded with it,
so every read is of finite values (a masked NaN would still poison ``probs @ V``).

Layout per layer: ``[G, num_blocks, BLOCK_SIZE, hd]`` (G kv heads): gathering a batch's blocks
along dim 1 gives ``[G, B, T, hd]`` as a free view, the shape decode attention reads.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from tokenpipe.errors import TokenpipeError

__all__ = ["BLOCK_SIZE", "SCRATCH", "HandedOut", "KVCacheTooSmall", "PagedKVCache", "auto_budget_bytes",
           "bytes_per_position"]

BLOCK_SIZE = 16
SCRATCH = 0  # block id padding writes go to; never handed out
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


class HandedOut(Protocol):
    """The block bookkeeping over a pool (:class:`generator.engine.blocks.BlockPool`), as far as the pool's
    memory is concerned: blocks are handed out in order, so the next never-used id is the high-water mark."""

    @property
    def next_fresh(self) -> int: ...


class PagedKVCache:
    """The pool's tensors: per layer K and V ``[G, num_blocks, BLOCK_SIZE, hd]``."""

    def __init__(self, model: Any, budget_bytes: int, device: torch.device, dtype: torch.dtype, *,
                 min_positions: int) -> None:
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
        self.num_blocks = num_blocks
        self.blocks: HandedOut | None = None  # the engine's bookkeeping of this pool's blocks, where one keeps it
        shape = (2, self.kv_heads, num_blocks, BLOCK_SIZE, self.head_dim)
        self.kv = [_lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
                   for _ in range(self.layers)]  # [2, G, num_blocks, BLOCK_SIZE, hd] each
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]

    @property
    def touched_bytes(self) -> int:
        """Bytes of the pool ever written (what RSS holds on CPU): the blocks handed out so far, the scratch
        block included."""
        return (self.blocks.next_fresh if self.blocks is not None else 1) * self.block_bytes

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
