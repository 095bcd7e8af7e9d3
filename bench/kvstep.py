"""The raw forward steps over a paged KV cache, for benchmarks that time a step, not the engine,
and the model loaded for them as a generator loads it (:func:`load_as_generator`).

Each row owns a contiguous run of blocks (a fixed block table), so a step costs what the engine's
does at the same batch and context: the writes through slot indices, the gather through tables.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

from bench.common import cpu_summary
from generator.model.forward import decode_step, prefill
from generator.model.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from generator.model.loader import LoadedModel, load_model, resolve_threads
from tokenpipe.settings import Settings

__all__ = ["RawSteps", "add_model_args", "load_as_generator"]


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """``--model`` and ``--data-dir``, overriding the settings :func:`load_as_generator` reads."""
    ap.add_argument("--model", default=None, help="default: TOKENPIPE_MODEL")
    ap.add_argument("--data-dir", default=None, help="where converted models are cached (default: TOKENPIPE_DATA_DIR)")


def load_as_generator(args: argparse.Namespace, bench: str) -> tuple[LoadedModel, dict[str, Any]]:
    """The default model (or ``args.model``) loaded as a generator loads it, on the generator's
    thread count, after a line naming the machine; with :func:`~bench.ceilings.cpu_summary`."""
    s = Settings.load(**{k: v for k, v in (("model", args.model), ("data_dir", args.data_dir)) if v is not None})
    torch.set_num_threads(resolve_threads(s.threads))
    cpu = cpu_summary()
    print(f"{bench} {args.label}: {cpu['line']}; {torch.get_num_threads()} threads; torch {torch.__version__} "
          "(the machine may be shared: compare ratios)", flush=True)
    lm = load_model(s.model, path=s.model_path, device="cpu", dtype=s.dtype, quant=s.quant, data_dir=s.data_dir,
                    kernels=s.kernels, max_batch=s.max_batch, float_weights=s.float_weights)
    return lm, cpu


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
