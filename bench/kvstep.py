"""The raw forward steps over a paged KV cache, for benchmarks that time a step, not the engine.

Each row owns a contiguous run of blocks (a fixed block table), so a step costs what the engine's
does at the same batch and context: the writes through slot indices, the gather through tables.
"""

from __future__ import annotations

import torch
from torch import Tensor

from generator.forward import decode_step, prefill
from generator.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from generator.models import LoadedModel

__all__ = ["RawSteps"]


class RawSteps:
    """``rows`` sequences of up to ``max_len`` positions in a pool of exactly that size."""

    def __init__(self, lm: LoadedModel, rows: int, max_len: int) -> None:
        self.lm = lm
        per_row = -(-max_len // BLOCK_SIZE)
        self.cache = PagedKVCache(lm.model, (rows * per_row + 1) * BLOCK_SIZE * bytes_per_position(lm.model, lm.dtype),
                                  lm.device, lm.dtype, min_positions=max_len)
        self.tables = (1 + torch.arange(rows * per_row).view(rows, per_row)).to(lm.device)  # [rows, per_row]

    def _slots(self, positions: Tensor) -> Tensor:
        rows = torch.arange(positions.shape[0], device=positions.device).view(-1, *([1] * (positions.dim() - 1)))
        return self.tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE

    def prefill(self, ids: Tensor) -> Tensor:
        """Prompts ``ids [B, S]`` from position 0; the last position's logits ``[B, V]``."""
        B, S = ids.shape
        positions = torch.arange(S, device=ids.device).expand(B, S)
        return prefill(self.lm.model, self.cache, ids, positions, self._slots(positions),
                       torch.full((B,), S, device=ids.device), None)

    def decode(self, tokens: Tensor, positions: Tensor, attend: int) -> Tensor:
        """One token per row at ``positions [B]``, reading ``attend`` positions of each row."""
        B = tokens.shape[0]
        tables = self.tables[:B, : -(-attend // BLOCK_SIZE)]
        return decode_step(self.lm.model, self.cache, tokens, positions, self._slots(positions), tables)
